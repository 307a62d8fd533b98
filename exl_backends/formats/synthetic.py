"""Random weights in the real EXL2 and GPTQ layouts, packed with reference.pack_bits (so they are valid files):
for tests and benchmarks of the quantized matmul. Codes, scales and zero points are random; the layout, group
tables, permutations and scale magnitudes are the formats' own (shared/design/exl2-format.md, gptq-format.md)."""
from __future__ import annotations

import math
import re

import torch

from ..model import reference
from .exl2 import Exl2Weight, padded
from .gptq import GptqWeight

_PART = re.compile(r"^\s*(?:([0-9.]+)\s*:\s*)?(\d)b_(\d+)g\s*$")


def parse_mix(mix: str) -> list[tuple[float, int, int]]:
    """A candidate in the converter's notation, e.g. "0.05:8b_32g/0.95:4b_128g" or "4b_128g" ->
    [(proportion, bits, group size)], widths non-increasing as the converter orders them."""
    parts = []
    for text in mix.split("/"):
        m = _PART.match(text)
        if not m:
            raise ValueError(f"bad EXL2 mix part {text!r} in {mix!r}; expected like 0.1:4b_128g")
        parts.append((float(m.group(1) or 1.0), int(m.group(2)), int(m.group(3))))
    if abs(sum(p for p, _, _ in parts) - 1) > 1e-6 or any(a[1] < b[1] for a, b in zip(parts, parts[1:])):
        raise ValueError(f"EXL2 mix {mix!r}: proportions must sum to 1 and widths must not increase")
    return parts


def exl2_group_rows(k: int, mix: list[tuple[float, int, int]]) -> list[tuple[int, int]]:
    """(bits, rows) per group as the converter splits K rows (spec §3): n_i = ceil(min(K p_i, remaining) / gs_i)
    groups per part, the matrix's last group clamped to end at row K."""
    groups, remaining = [], k
    for prop, bits, gs in mix:
        count = math.ceil(min(k * prop, remaining) / gs) if remaining > 0 else 0
        groups += [(bits, gs)] * count
        remaining -= count * gs
    bits, _ = groups[-1]
    groups[-1] = (bits, k - sum(r for _, r in groups[:-1]))
    return groups


def random_exl2(k: int, n: int, mix: str, seed: int = 0, act_order: bool = True) -> Exl2Weight:
    """An EXL2 layer [k -> n] with the row split of `mix` (converter notation); columns past n (padding to a
    multiple of 32) hold zero weights, as ExLlamaV2 writes them."""
    gen = torch.Generator().manual_seed(seed)
    np_ = padded(n)
    words, q_groups, qrow = [], [], 0
    for bits, rows in exl2_group_rows(k, parse_mix(mix)):
        codes = torch.randint(0, 2**bits, (rows, np_), generator=gen)
        codes[:, n:] = 2 ** (bits - 1)
        words.append(reference.pack_bits(codes, bits))
        q_groups += [bits, qrow]
        qrow += rows * bits // 32
    g = len(q_groups) // 2
    nibbles = torch.randint(0, 16, (g, np_), generator=gen)
    q_scale = reference.pack_bits(nibbles.T.contiguous(), 4).T.contiguous()            # [G, Np/8]
    # group maxima like the converter's (|w| ~ 0.02-0.1 over 2^(b-1) steps); 8-bit groups reach fp16 subnormal bases
    widths = torch.tensor(q_groups[0::2], dtype=torch.float32)
    q_scale_max = (0.02 + 0.08 * torch.rand(g, generator=gen)) / 2 ** (widths - 1)
    q_invperm = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
    return Exl2Weight(q_weight=torch.cat(words), q_scale=q_scale, q_scale_max=q_scale_max.half(),
                      q_groups=torch.tensor(q_groups, dtype=torch.int16), q_invperm=q_invperm.to(torch.int32),
                      in_features=k, out_features=n)


def gptq_g_idx(k: int, group_size: int, act_order: bool, gen: torch.Generator) -> torch.Tensor:
    """Group of each input row: k // group_size, or act-order's scattered groups g_idx[perm[j]] = j // group_size."""
    size = k if group_size == -1 else group_size
    if not act_order:
        return (torch.arange(k) // size).to(torch.int32)
    perm = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // size).to(torch.int32)
    return g_idx


def random_gptq(k: int, n: int, bits: int, group_size: int, act_order: bool, sym: bool, seed: int = 0,
                v2: bool = False) -> GptqWeight:
    """A GPTQ layer [k -> n]: group_size -1 means one group; asym zero points are 1..maxq in v1 (v1 cannot store
    zero 0 cleanly) and 0..maxq in v2."""
    gen = torch.Generator().manual_seed(seed)
    maxq = 2**bits - 1
    g_idx = gptq_g_idx(k, group_size, act_order, gen)
    groups = int(g_idx.max()) + 1
    codes = torch.randint(0, maxq + 1, (k, n), generator=gen)
    if sym:
        zeros = torch.full((groups, n), 2 ** (bits - 1))
    else:
        zeros = torch.randint(0 if v2 else 1, maxq + 1, (groups, n), generator=gen)
    if v2:
        qzeros = reference.pack_bits(zeros.T.contiguous(), bits).T
    elif bits in reference.GPTQ_V1_WORD_OFFSET:              # GPTQModel's v1 writer: subtract word-wise
        words = (reference.pack_bits(zeros.T.contiguous(), bits).T.to(torch.int64) & 0xFFFFFFFF)
        words = (words - reference.GPTQ_V1_WORD_OFFSET[bits]) & 0xFFFFFFFF
        qzeros = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    else:                                                    # 3-bit v1: each field zero - 1
        qzeros = reference.pack_bits((zeros - 1).T.contiguous(), bits).T
    scales = (0.002 + 0.02 * torch.rand(groups, n, generator=gen)).half()
    return GptqWeight(qweight=reference.pack_bits(codes, bits), qzeros=qzeros.contiguous(), scales=scales,
                      g_idx=g_idx, bits=bits, v2=v2, in_features=k, out_features=n)

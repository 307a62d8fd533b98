"""The kernels' lane layout of a quantized weight (described at the top of dequant.cuh), made once per layer when it
is placed on a GPU: `layout_for(weight, device)` -> LaneLayout. The repack is plain torch functions (lane_words,
the specification, which run and are tested on CPU too); on CUDA an EXL2 weight's codes are repacked by
lane_layout.cu (exl2_lane_words), word for word lane_words' result. quant_matmul.py plans and launches the kernels
that read it."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

from ..errors import UnsupportedFormatError
from ..formats.exl2 import Exl2Weight
from ..formats.gptq import GptqWeight
from ..model import reference
from .loader import launch
from .planning import CHUNK, WARPS

STRIP = 32                      # columns per strip (one warp)
THREADS = WARPS * 32
WIDTHS = (8, 6, 5, 4, 3, 2)     # the stored order of widths (qmm.cuh width_of)
SLAB_CODES = 1 << 22            # codes unpacked at once while repacking (int64 temporaries of 32 MB)


class Format(Enum):
    EXL2 = "exl2"
    GPTQ = "gptq"


def _pair_bits(bits: int) -> list[list[int]]:
    """Bit positions (32 * word + bit) of the low code of each pair p = 0..15 in a lane's words; the pair's high
    code sits 16 bits above. The same table as pair_bits<B> in dequant.cuh (tests check they agree)."""
    per_word = {2: 8, 3: 5, 4: 4, 5: 3, 6: 2, 8: 2}[bits]
    direct = {2: 16, 3: 15, 4: 16, 5: 15, 6: 12, 8: 16}[bits]
    table = []
    for p in range(16):
        if p < direct:
            first = 32 * (p // per_word) + bits * (p % per_word)
            table.append([first + k for k in range(bits)])
        elif bits == 6:          # bits 12-15 of the six words: code p-12 bit k is spare bit 6(p-12)+k
            spare = [6 * (p - 12) + k for k in range(6)]
            table.append([32 * (s // 4) + 12 + s % 4 for s in spare])
        else:                    # bit 15 of each word, code bit k in word k
            table.append([32 * k + 15 for k in range(bits)])
    return table


PAIR_BITS = {b: _pair_bits(b) for b in WIDTHS}


def plane_words(bits: int) -> list[int]:
    """A lane's words of one chunk, split in loads of 16, 8 and 4 bytes."""
    return [4] * (bits // 4) + [2] * (bits % 4 // 2) + [1] * (bits % 2)


def _int32(words: Tensor) -> Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_codes(words: Tensor, bits: int, rows: int) -> Tensor:
    """reference.unpack_bits as uint8."""
    return reference.unpack_bits(words, bits, rows).to(torch.uint8)


def lane_words(codes: Tensor, bits: int) -> Tensor:
    """codes [32 C, 32 S] of one width (stored rows x padded columns) -> int32 [S, C * 32 * bits]: per strip, its
    chunks in the lane layout (lane 4g + q: columns 16(j//2) + 8(j%2) + g, rows 16s + 4q + 2h + e, pair
    p = 4j + 2s + h; words in planes). The first `direct` pairs lie whole in a word each (PAIR_BITS), per_word
    to a word, so they are shifted in place at once; only the spare pairs' bits are scattered one by one."""
    rows, cols = codes.shape
    c, s = rows // CHUNK, cols // STRIP
    x = codes.to(torch.uint8).reshape(c, 2, 4, 2, 2, s, 2, 2, 8)       # [c, s_, q, h, e, strip, t, u, g]
    x = x.permute(5, 0, 8, 2, 6, 7, 1, 3, 4).reshape(s, c, 32, 16, 2)   # [strip, c, lane, pair, e]
    per_word = 32 // bits // 2 if bits in (2, 4, 8) else 16 // bits
    direct = per_word * bits
    shift = bits * torch.arange(per_word, device=codes.device)[:, None] + torch.arange(0, 32, 16, device=codes.device)
    words = (x[:, :, :, :direct].reshape(s, c, 32, bits, per_word, 2).long() << shift).sum((4, 5))
    if direct < 16:                           # spare code bits: bit k of pair p to PAIR_BITS[bits][p][k]
        pos = _spare_bits(bits, direct, codes.device)                                            # [spare, bits]
        bit = x[:, :, :, direct:, :, None].long() >> torch.arange(bits, device=codes.device) & 1  # [.., spare, e, bits]
        spread = (bit[..., 0, :] | bit[..., 1, :] << 16) << pos % 32
        words.index_add_(3, (pos // 32).reshape(-1), spread.reshape(s, c, 32, -1))
    planes = torch.split(_int32(words), plane_words(bits), dim=3)        # each [S, C, 32, w]
    return torch.cat([p.reshape(s, c, -1) for p in planes], dim=2).reshape(s, -1)


@functools.cache
def _spare_bits(bits: int, direct: int, device: torch.device) -> Tensor:
    """PAIR_BITS[bits][direct:] on the device, made once (a copy from host memory waits for the device's queue)."""
    return torch.tensor(PAIR_BITS[bits][direct:], dtype=torch.int64, device=device)


def lane_order(values: Tensor) -> Tensor:
    """Per-column values [G, Np] -> [G, strips, 8, 4]: entry [.., g, j] is column 16(j//2) + 8(j%2) + g."""
    g, np_ = values.shape
    return values.reshape(g, np_ // STRIP, 2, 2, 8).permute(0, 1, 4, 2, 3).reshape(g, np_ // STRIP, 8, 4)


def exl2_scale_codes(q_scale: Tensor) -> Tensor:
    """q_scale int32 [G, Np/8] -> int32 [G, strips, 4]: lane g's 4 codes in 16 bits at word g/2, half g%2, as
    bytes (c_j0 | c_j2 << 4, c_j1 | c_j3 << 4), c_j the code of column 16(j//2) + 8(j%2) + g."""
    nibbles = reference.unpack_bits(q_scale.T.contiguous(), 4, q_scale.shape[1] * 8).T          # [G, Np]
    c = lane_order(nibbles)                                                                # [G, strips, 8, 4]
    lane16 = c[..., 0] | c[..., 2] << 4 | c[..., 1] << 8 | c[..., 3] << 12               # [G, strips, 8]
    return _int32(lane16[..., 0::2] | lane16[..., 1::2] << 16).contiguous()


@dataclass
class LaneLayout:
    """A weight in the kernels' lane layout, on the weight's device (dequant.cuh: LANE LAYOUT)."""
    fmt: Format
    k: int
    n: int
    np_: int
    words: Tensor            # int32 [strips * words_per_strip]
    chunk_bits: list[int]    # width of each chunk (host copy, for planning)
    chunk_group: list[int]   # group of each chunk (host copy)
    chunk_meta: Tensor       # int32 [chunks, 2]: (group, EXL2 scale base | 0)
    meta0: Tensor            # EXL2: int32 [strips, G, 4] scale codes; GPTQ: fp16 [strips, G, 8, 4] scales
    meta1: Tensor | None     # GPTQ: uint8 [strips, G, 8, 4] zero points; EXL2: None
    perm: Tensor | None      # int32 [K]: stored row k' is original row perm[k']; None for the identity

    @property
    def strips(self) -> int:
        return self.np_ // STRIP

    @property
    def n_groups(self) -> int:
        return self.meta0.shape[1]

    @property
    def words_per_strip(self) -> int:
        return 32 * sum(self.chunk_bits)

    @property
    def run_start(self) -> list[int]:
        """Chunks of width WIDTHS[i] are run_start[i]..run_start[i+1]."""
        bounds = [0]
        for width in WIDTHS:
            bounds.append(bounds[-1] + self.chunk_bits.count(width))
        return bounds

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.chunk_meta, self.meta0, self.meta1,
                                                           self.perm) if t is not None)


def _slab_rows(np_: int) -> int:
    return max(CHUNK, SLAB_CODES // np_ // CHUNK * CHUNK)


def _is_identity(perm: Tensor) -> bool:
    return torch.equal(perm.to(torch.int32).cpu(), torch.arange(perm.numel(), dtype=torch.int32))


def _identity_or(perm: Tensor) -> Tensor | None:
    return None if _is_identity(perm) else perm.to(torch.int32).contiguous()


def _moved(t: Tensor | None, device: torch.device) -> Tensor | None:
    """t on the device; from host memory through pinned memory without waiting for the device's queue (a copy from
    pageable memory waits for everything queued before it)."""
    if t is None or t.device == device:
        return t
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)


def _strip_major(meta: Tensor) -> Tensor:
    """[G, strips, ...] -> [strips, G, ...]: a strip's group records contiguous."""
    return meta.transpose(0, 1).contiguous()


def exl2_layout(w: Exl2Weight, device: torch.device | None = None) -> LaneLayout:
    """EXL2 tensors -> lane layout on `device` (default: the weight's). Groups must be whole chunks (the converter
    only writes 32/64/128-row groups). What the host must read (the groups, whether the permutation is the
    identity) is read where the weight is, the CPU when a model loads: each read of a device tensor from the host
    waits for the device's whole queue, and with those reads made there every layer's repack waited for the one
    before. What the host need not read (scale codes, the permutation) is made on the device, no read back."""
    k = w.in_features
    device = w.q_weight.device if device is None else device
    np_ = w.q_weight.shape[1]
    groups = reference.exl2_groups(w.q_groups.cpu(), k)
    if any(rows % CHUNK for _, _, rows in groups):
        raise UnsupportedFormatError(f"EXL2 layer [{k} -> {w.out_features}] has groups of "
                                     f"{sorted({r for _, _, r in groups})} rows; the CUDA kernels need multiples of "
                                     f"{CHUNK} (run it on CPU, or re-convert with group sizes 32/64/128)")
    chunk_bits = [b for b, _, rows in groups for _ in range(rows // CHUNK)]
    chunk_group = [i for i, (_, _, rows) in enumerate(groups) for _ in range(rows // CHUNK)]
    if any(a < b for a, b in zip(chunk_bits, chunk_bits[1:])):
        raise UnsupportedFormatError(f"EXL2 layer [{k} -> {w.out_features}]: q_groups widths are not in "
                                     f"non-increasing order; the checkpoint is corrupt")
    # one run a width (whole chunks end on word boundaries): (width, first word row, rows), a bit stream each
    runs = [(bits, qrow, sum(rows for _, rows in members)) for bits, qrow, members in reference.exl2_runs(groups)]
    words = exl2_lane_words(w.q_weight.to(device), runs, np_)
    base = (w.q_scale_max.float() * 2.0**-8).half().view(torch.int16).to(torch.int64) & 0xFFFF   # fp16 bits of m
    group = torch.tensor(chunk_group, dtype=torch.int64, device=base.device)
    chunk_meta = torch.stack((group, _int32((base | base << 16)[group]).long()), dim=1)
    # the scale codes and the permutation are made on the device (a few launches, no host read) from the small
    # tensors: on the host they were ~0.4 s of the Llama-3-8B shape's 225 linears (the H100's load profile)
    invperm = w.q_invperm.to(torch.int32)
    perm = None if _is_identity(invperm) else torch.argsort(_moved(invperm, device).long()).to(torch.int32)
    return LaneLayout(Format.EXL2, k, w.out_features, np_, words, chunk_bits,
                      chunk_group, _moved(chunk_meta.to(torch.int32).contiguous(), device),
                      _strip_major(exl2_scale_codes(_moved(w.q_scale, device))), None, perm)


def exl2_lane_words(q_weight: Tensor, runs: list[tuple[int, int, int]], np_: int) -> Tensor:
    """An EXL2 weight's codes in the lane layout, int32 [strips * words per strip]: each run (width, its first word
    row in q_weight, its rows; one a width, each a continuous bit stream) after the ones before. On CUDA one launch a
    run (lane_layout.cu); else lane_words over slabs of rows (the specification)."""
    strips = np_ // STRIP
    per_strip = sum(width * rows for width, _, rows in runs)            # 32 * width words a chunk of 32 rows
    if q_weight.is_cuda:
        out = torch.empty(strips * per_strip, dtype=torch.int32, device=q_weight.device)
        q_weight, run_word = q_weight.contiguous(), 0
        with torch.cuda.device(q_weight.device):           # launches go to the current device's stream
            for width, qrow0, rows in runs:
                chunks = rows // CHUNK
                launch("lane_layout", "exl2_lane_words", (-(-chunks // WARPS), strips), (THREADS,),
                       (q_weight, np_, qrow0, width, chunks, out, per_strip, run_word))
                run_word += 32 * width * chunks
        return out
    parts = []
    for width, qrow0, rows in runs:
        step = _slab_rows(np_)
        for r in range(0, rows, step):
            n_rows = min(step, rows - r)
            words = q_weight[qrow0 + r * width // 32: qrow0 + (r + n_rows) * width // 32]
            parts.append(lane_words(unpack_codes(words, width, n_rows), width))
    return torch.cat(parts, dim=1).reshape(-1)


def gptq_layout(w: GptqWeight) -> LaneLayout:
    """GPTQ tensors -> lane layout: rows sorted by group (stable), so each group is a run of whole chunks."""
    k, n, bits, device = w.in_features, w.out_features, w.bits, w.qweight.device
    np_ = -(-n // STRIP) * STRIP
    n_groups = w.scales.shape[0]
    perm = torch.sort(w.g_idx.long(), stable=True).indices                        # stored row -> original row
    counts = torch.bincount(w.g_idx.long(), minlength=n_groups).tolist()
    if k % CHUNK or any(c % CHUNK for c in counts):
        raise UnsupportedFormatError(f"GPTQ layer [{k} -> {n}] has groups of {sorted(set(counts) - {0})} rows; the "
                                     f"CUDA kernels need multiples of {CHUNK} (run it on CPU)")
    codes = torch.zeros(k, np_, dtype=torch.uint8, device=device)               # original row order
    step = _slab_rows(np_)
    for r in range(0, k, step):
        n_rows = min(step, k - r)
        codes[r: r + n_rows, :n] = unpack_codes(w.qweight[r * bits // 32: (r + n_rows) * bits // 32], bits, n_rows)
    codes = codes[perm]
    parts = [lane_words(codes[r: r + step], bits) for r in range(0, k, step)]
    group = w.g_idx.long()[perm][::CHUNK]
    chunk_meta = torch.stack((group, torch.zeros_like(group)), dim=1).to(torch.int32)
    pad = (0, np_ - n)
    zeros = torch.nn.functional.pad(reference.gptq_zeros(w.qzeros.cpu(), bits, n, w.v2), pad).to(device, torch.uint8)
    scales = torch.nn.functional.pad(w.scales.half(), pad)
    return LaneLayout(Format.GPTQ, k, n, np_, torch.cat(parts, dim=1).reshape(-1), [bits] * (k // CHUNK),
                      group.tolist(), chunk_meta.contiguous(), _strip_major(lane_order(scales)),
                      _strip_major(lane_order(zeros)), _identity_or(perm))


def layout_for(weight: Exl2Weight | GptqWeight, device: torch.device | None = None) -> LaneLayout:
    """The weight's lane layout on `device` (default: the weight's own)."""
    if isinstance(weight, Exl2Weight):
        return exl2_layout(weight, device)
    if isinstance(weight, GptqWeight):
        return gptq_layout(weight if device is None else weight.to(device))
    raise TypeError(f"no CUDA quantized matmul for {type(weight).__name__}")

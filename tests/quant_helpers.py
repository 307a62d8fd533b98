"""Test-side EXL2 and GPTQ packers, written from the format specs (shared/design/exl2-format.md, gptq-format.md)
without using exl_backends: bit streams are built by expanding codes into bits, and the expected weights are
computed with numpy float16 arithmetic (each product of two fp16 values is exact in f32, so numpy's one
rounding to fp16 is the format's one rounding)."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def pack_stream(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [R, N] (unsigned, < 2^bits) -> int32 words [R*bits/32, N]: each column a little-endian bit stream,
    code r at stream bits [r*bits, r*bits + bits)."""
    rows, n = codes.shape
    assert rows * bits % 32 == 0
    stream = (codes.astype(np.uint64)[:, None, :] >> np.arange(bits, dtype=np.uint64)[None, :, None]) & 1
    stream = stream.reshape(rows * bits // 32, 32, n)                       # [words, bit, N]
    words = (stream << np.arange(32, dtype=np.uint64)[None, :, None]).sum(axis=1)
    return words.astype(np.uint32).view(np.int32)


def t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


@dataclass
class Layer:
    tensors: dict[str, torch.Tensor]    # the file's tensors, without the "<key>." prefix
    weight: torch.Tensor                # expected dequantized weight, fp16 [N, K] (HF layout)


# ----------------------------------------------------------------------------------------------- EXL2


def make_exl2(k: int, n: int, groups: list[tuple[int, int]], rng: np.random.Generator,
              weight: np.ndarray | None = None) -> Layer:
    """An EXL2 layer with groups (bits, rows) in stored order and a random act-order permutation: random codes
    and scales, or round-to-nearest codes of `weight` [N, K] with the converter's quadratic scale scheme."""
    assert sum(r for _, r in groups) == k
    np_ = (n + 31) // 32 * 32
    perm = rng.permutation(k)                                   # stored row k' holds original row perm[k']
    stored_w = None if weight is None else weight.T[perm]       # [K, N] in stored order
    words, q_groups, qs_rows, qsm, stored = [], [], [], [], []
    row = qrow = 0
    for bits, rows in groups:
        zero, maxq = 2 ** (bits - 1), 2 ** bits - 1
        if stored_w is None:
            codes = rng.integers(0, maxq + 1, (rows, n))
            qs = rng.integers(1, 17, n)
            m = np.float16(rng.choice([0.05, 0.3, 1e-3, 6e-4]) * rng.uniform(0.5, 2))   # some deep subnormal
        else:
            w = stored_w[row: row + rows]
            base = (np.abs(w).max(axis=0) + 1e-12) / zero
            qs = np.clip(np.rint(16 * np.sqrt(base / base.max())), 1, 16).astype(np.int64)
            m = np.float16(base.max())
        scale = np.float16(qs.astype(np.float16) ** 2) * (np.float16(m) * np.float16(2.0 ** -8))   # [N] fp16
        if stored_w is not None:
            codes = np.clip(np.rint(w / scale.astype(np.float32)) + zero, 0, maxq).astype(np.int64)
        stored.append((codes - zero).astype(np.float16) * scale[None, :])
        padded_codes = np.full((rows, np_), zero, dtype=np.int64)
        padded_codes[:, :n] = codes
        words.append(pack_stream(padded_codes, bits))
        qs_row = np.ones(np_, dtype=np.int64)
        qs_row[:n] = qs
        qs_rows.append(qs_row)
        qsm.append(m)
        q_groups += [bits, qrow]
        row, qrow = row + rows, qrow + rows * bits // 32
    w_stored = np.concatenate(stored)                           # [K, N] fp16, stored order
    w = np.empty_like(w_stored)
    w[perm] = w_stored
    nibbles = np.stack(qs_rows) - 1                             # [G, Np]
    q_scale = pack_stream(nibbles.T, 4).T                       # column n at bits 4*(n%8) of word n//8
    tensors = {"q_weight": t(np.concatenate(words)), "q_scale": t(q_scale),
               "q_scale_max": t(np.array(qsm, dtype=np.float16)),
               "q_groups": t(np.array(q_groups, dtype=np.int16)),
               "q_invperm": t(np.argsort(perm).astype(np.int32))}
    return Layer(tensors, t(w.T))


def exl2_groups(k: int, scheme: int) -> list[tuple[int, int]]:
    """One of a few mixes of widths and group sizes (non-increasing widths) for a K-row matrix, K % 32 == 0."""
    mixes = [[(8, 32), (5, 32), (3, k - 64)], [(6, 32), (4, k - 64), (2, 32)], [(8, 32), (2, k - 32)],
             [(4, k)], [(3, k)]]
    valid = [m for m in mixes if all(rows > 0 for _, rows in m)]
    return valid[scheme % len(valid)]


# ----------------------------------------------------------------------------------------------- GPTQ


def make_gptq(k: int, n: int, bits: int, group_size: int, rng: np.random.Generator, sym: bool = True,
              act_order: bool = False, v2: bool = False, weight: np.ndarray | None = None) -> Layer:
    """A GPTQ layer: random codes/zeros/scales (true zeros >= 1, where every tool agrees on v1), or
    round-to-nearest codes of `weight` [N, K] as GPTQ's quantizer chooses scale and zero."""
    maxq = 2 ** bits - 1
    gs = k if group_size == -1 else group_size
    n_groups = -(-k // gs)
    order = rng.permutation(k) if act_order else np.arange(k)
    g_idx = np.empty(k, dtype=np.int64)
    g_idx[order] = np.arange(k) // gs                            # act-order: groups follow the permutation
    if weight is None:
        q = rng.integers(0, maxq + 1, (k, n))
        zero = np.full((n_groups, n), 2 ** (bits - 1)) if sym else rng.integers(1, maxq + 1, (n_groups, n))
        scales = np.float16(rng.uniform(1e-3, 2e-2, (n_groups, n)))
    else:
        w = weight.T.astype(np.float32)                          # [K, N]
        scales = np.empty((n_groups, n), dtype=np.float16)
        zero = np.empty((n_groups, n), dtype=np.int64)
        q = np.empty((k, n), dtype=np.int64)
        for g in range(n_groups):
            rows = g_idx == g
            lo, hi = np.minimum(w[rows].min(0), 0), np.maximum(w[rows].max(0), 0)
            if sym:
                s, z = 2 * np.maximum(-lo, hi) / maxq, np.full(n, 2 ** (bits - 1))
            else:
                s = (hi - lo) / maxq
                z = np.clip(np.rint(-lo / s), 1, maxq)           # >= 1: avoid the v1 zero-0 ambiguity
            scales[g], zero[g] = s, z
            q[rows] = np.clip(np.rint(w[rows] / scales[g].astype(np.float32)) + z, 0, maxq)
    stored_zero = zero if v2 else zero - 1
    w_hf = ((q - zero[g_idx]).astype(np.float16) * scales[g_idx]).T
    tensors = {"qweight": t(pack_stream(q, bits)), "qzeros": t(pack_stream(stored_zero.T, bits).T),
               "scales": t(scales.astype(np.float16)), "g_idx": t(g_idx.astype(np.int32))}
    return Layer(tensors, t(w_hf))


# ----------------------------------------------------------------------------------------------- model dirs


def quantize_dir(src: Path, dst: Path, fmt: str, seed: int = 0, quant_config: dict | None = None,
                 keep_dense: tuple[str, ...] = (), head: bool = False, **opts) -> dict[str, torch.Tensor]:
    """Writes a quantized copy of the HF directory src (one model.safetensors) to dst, with round-to-nearest
    codes of its weights. fmt "exl2" (mixed widths per layer) or "gptq" (opts: bits, group_size, sym,
    act_order, v2). Linears whose key ends with one of keep_dense stay as they are; head: quantize lm_head.
    quant_config goes into config.json as quantization_config (None: no block). Returns the expected
    dequantized fp16 weight [N, K] of every quantized linear, by HF weight name."""
    rng = np.random.default_rng(seed)
    tensors = load_file(src / "model.safetensors")
    keys = sorted({name.rsplit(".", 1)[0] for name in tensors if name.rsplit(".", 1)[0].endswith(LINEARS)})
    if head:
        keys.append("lm_head")
    expected, out = {}, dict(tensors)
    for i, key in enumerate(keys):
        if key.endswith(keep_dense):
            continue
        w = tensors[f"{key}.weight"].float().numpy()
        n, k = w.shape
        if fmt == "exl2":
            layer = make_exl2(k, n, exl2_groups(k, i), rng, weight=w)
        else:
            layer = make_gptq(k, n, rng=rng, weight=w, **opts)
        del out[f"{key}.weight"]
        out.update({f"{key}.{name}": v for name, v in layer.tensors.items()})
        expected[f"{key}.weight"] = layer.weight
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quant_config is not None:
        config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, dst / f.name)
    return expected


def hf_with_weights(src: Path, weights: dict[str, torch.Tensor]):
    """transformers' f32 model of src with the given weights (by name) put in place."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    state = hf.state_dict()
    with torch.no_grad():
        for name, w in weights.items():
            state[name].copy_(w.float())
    return hf


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

"""Launchers for kv_cache.cu: writing K/V rows into the paged cache (fp16, or quantized as reference.quantize_kv
does), the same fused with RoPE on q and k (one launch per layer), and reading slots back dequantized to fp16 (the
prefill attention path)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .loader import aligned, launch

THREADS = 128
WARPS = THREADS // 32   # kv_write_quant / kv_dequantize / rope_kv_write: one warp per 64 elements


def writer(bits: tuple[int, int] | None) -> Callable[[object, Tensor, Tensor, Tensor], None]:
    """The CUDA KVCache.write for a cache of (K bits, V bits) (None: fp16): f(layer_cache, k, v, slots) with
    k, v [T, Hkv, Dh] fp16 and slots [T] int64."""
    if bits is None:
        return _write_fp16
    k_bits, v_bits = bits

    def write_quantized(c, k: Tensor, v: Tensor, slots: Tensor) -> None:
        rows = k.shape[0]
        k, v = _rows(k), _rows(v)
        width = k.shape[1]
        jobs = rows * (width // 64)
        if jobs:
            launch("kv_cache", "kv_write_quant", grid=(-(-jobs // WARPS), 2), block=(THREADS,),
                   args=(k, v, c.k, c.v, c.k_scales, c.v_scales, slots.to(torch.int64).contiguous(), rows, width,
                         k_bits, v_bits))
    return write_quantized


def _write_fp16(c, k: Tensor, v: Tensor, slots: Tensor) -> None:
    k, v = _rows(k), _rows(v)
    if k.shape[0]:
        launch("kv_cache", "kv_write_f16", grid=(k.shape[0], 2), block=(THREADS,),
               args=(k, v, c.k, c.v, slots.to(torch.int64).contiguous(), k.shape[1]))


def rope_write(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, cache, layer: int,
               slots: Tensor) -> Tensor:
    """ops.rope_write on CUDA, one launch: RoPE on q [T, H, Dh] and k [T, Hkv, Dh] (cos, sin [T, Dh]), k and v into
    the cache's slots [T] (int64; quantized on the way in for q modes); returns the rotated q [T, H, Dh] fp16.
    Bit-identical to reference.apply_rope followed by KVCache.write."""
    tokens, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    if head_dim % 4:
        raise ValueError(f"rope_write needs head_dim % 4 == 0 (got {head_dim})")
    q, k, v, cos, sin = (half_pairs(x) for x in (q, k, v, cos, sin))
    q_out = torch.empty_like(q)
    warps = -(-n_heads * head_dim // 64) + 2 * -(-n_kv * head_dim // 64)      # per token: q, then k, then v
    if tokens:
        c = cache.layers[layer]
        slots = slots.to(torch.int64).contiguous()
        if cache.bits is None:
            launch("kv_cache", "rope_kv_write_f16", grid=(-(-tokens * warps // WARPS),), block=(THREADS,),
                   args=(q, k, v, cos, sin, q_out, c.k, c.v, slots, tokens, n_heads, n_kv, head_dim))
        else:
            launch("kv_cache", "rope_kv_write_quant", grid=(-(-tokens * warps // WARPS),), block=(THREADS,),
                   args=(q, k, v, cos, sin, q_out, c.k, c.v, c.k_scales, c.v_scales, slots, tokens, n_heads, n_kv,
                         head_dim, *cache.bits))
    return q_out


def half_pairs(x: Tensor) -> Tensor:
    """Contiguous fp16 with 4-byte aligned rows (rope_kv_write moves element pairs)."""
    return aligned(x.to(torch.float16).contiguous(), 4)


def _rows(x: Tensor) -> Tensor:
    """[T, Hkv, Dh] -> contiguous, 16-byte aligned fp16 [T, E] (the kernels move 16-byte vectors)."""
    return aligned(x.reshape(x.shape[0], -1).to(torch.float16).contiguous())


def read(cache, layer: int, slots: Tensor) -> tuple[Tensor, Tensor]:
    """The K, V stored at slots [L] (int64) as fp16 [L, Hkv, Dh]: KVCache.read, on the GPU (bit-identical)."""
    c = cache.layers[layer]
    rows, hkv, dh = slots.shape[0], cache.config.n_kv_heads, cache.config.head_dim
    k = torch.empty(rows, hkv, dh, dtype=torch.float16, device=slots.device)
    v = torch.empty_like(k)
    if cache.bits is None:
        if rows:
            launch("kv_cache", "kv_read_f16", grid=(rows, 2), block=(THREADS,),
                   args=(c.k, c.v, slots.to(torch.int64).contiguous(), k, v, hkv * dh))
        return k, v
    jobs = rows * (hkv * dh // 64)
    if jobs:
        launch("kv_cache", "kv_dequantize", grid=(-(-jobs // WARPS), 2), block=(THREADS,),
               args=(c.k, c.v, c.k_scales, c.v_scales, slots.to(torch.int64).contiguous(), k, v, rows, hkv * dh,
                     *cache.bits))
    return k, v

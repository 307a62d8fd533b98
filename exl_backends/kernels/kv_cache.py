"""Launchers for kv_cache.cu: writing K/V rows into the paged cache (fp16, or quantized as reference.quantize_kv
does) and reading slots back dequantized to fp16 (the prefill attention path)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .loader import launch

THREADS = 128
WARPS = THREADS // 32   # kv_write_quant / kv_dequantize: one warp per 64-element chunk


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


def _rows(x: Tensor) -> Tensor:
    """[T, Hkv, Dh] -> contiguous, 16-byte aligned fp16 [T, E] (the kernels move 16-byte vectors)."""
    x = x.reshape(x.shape[0], -1).to(torch.float16).contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def read(cache, layer: int, slots: Tensor) -> tuple[Tensor, Tensor]:
    """The K, V stored at slots [L] (int64) as fp16 [L, Hkv, Dh]: KVCache.read, on the GPU (bit-identical)."""
    c = cache.layers[layer]
    if cache.bits is None:
        return c.k[slots], c.v[slots]
    rows, hkv, dh = slots.shape[0], cache.config.n_kv_heads, cache.config.head_dim
    k = torch.empty(rows, hkv, dh, dtype=torch.float16, device=slots.device)
    v = torch.empty_like(k)
    jobs = rows * (hkv * dh // 64)
    if jobs:
        launch("kv_cache", "kv_dequantize", grid=(-(-jobs // WARPS), 2), block=(THREADS,),
               args=(c.k, c.v, c.k_scales, c.v_scales, slots.to(torch.int64).contiguous(), k, v, rows, hkv * dh,
                     *cache.bits))
    return k, v

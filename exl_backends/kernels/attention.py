"""Paged attention on CUDA (ops.paged_attention): the split-K decode kernels of attention.cu for query rows that are
alone (or nearly) in their sequence, and torch's scaled_dot_product_attention over gathered fp16 K/V for prompts.

Decode batches (one new token per sequence, the case captured in a CUDA graph) go to the decode kernel with no host
reads: the grid depends only on the batch size and the block table's width. Mixed batches (eager) read the
sequence lengths on the host once per call and send each sequence its own way."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from ..errors import ConfigError
from . import kv_cache
from .loader import compute_capability, launch, module

LOG2E = 1.4426950408889634      # the kernel's softmax works in base 2
THREADS = 256                   # attention.cu: 8 warps per block
HEADS_PER_BLOCK = 8             # query heads per block (the mma's n); larger groups span blocks
PAGE_ALIGN = 32                 # a 32-key tile of the kernel must not cross a page
HEAD_DIMS = {"fp16": (16, 32, 64, 128), "q8": (64, 128), "q6": (64, 128), "q4": (64, 128)}
REGISTERS_PER_SM = 65536
MIN_SPLIT_KEYS = 256            # attention.cu's MIN_SPLIT: no more splits than a full block table fills
COUNTERS = 4096                 # initial size of the per-device split counters (grown on demand)
ROW_KERNEL_MAX_NEW = 8          # mixed batches: sequences with at most this many new tokens use the decode kernel
QUERY_CHUNK = 4096              # prefill: query rows per scaled_dot_product_attention call

DECODE_KERNELS = {(mode, dh): f"paged_decode_{mode}_d{dh}" for mode, dims in HEAD_DIMS.items() for dh in dims}


def check_cache(cache) -> None:
    """Raises ConfigError unless the kernels can serve this (CUDA) KVCache."""
    dims = HEAD_DIMS[cache.mode]
    if cache.dtype != torch.float16:
        raise ConfigError(f"the CUDA kernels compute in float16; this cache holds {cache.dtype} "
                          f"(load the model with dtype=torch.float16)")
    if cache.config.head_dim not in dims:
        raise ConfigError(f"head_dim {cache.config.head_dim} is not supported by the CUDA attention kernels with "
                          f"cache mode {cache.mode!r} (supported: {', '.join(map(str, dims))}); run on CPU")
    if cache.page_size % PAGE_ALIGN:
        raise ConfigError(f"page_size {cache.page_size} is not a multiple of {PAGE_ALIGN}, which the CUDA "
                          f"attention kernels need")


def paged_attention(q: Tensor, cache, layer: int, batch, scale: float) -> Tensor:
    """q [T, H, Dh] fp16 of a packed batch -> [T, H, Dh] fp16, as reference.paged_attention."""
    if batch.page_size % PAGE_ALIGN:
        raise ValueError(f"page_size {batch.page_size} is not a multiple of {PAGE_ALIGN}")
    if q.shape[0] == batch.n_seqs:     # every sequence has (at least, so exactly) one new token: decode
        return split_k(q, cache, layer, batch, batch.positions, None, scale)
    return _mixed(q, cache, layer, batch, scale)


def split_k(q: Tensor, cache, layer: int, batch, positions: Tensor, row_seq: Tensor | None,
            scale: float) -> Tensor:
    """Attention of single query rows: q [R, H, Dh] at positions [R] (int64), row r of sequence row_seq[r]
    (int32 [R]; None: r). One launch, no host reads, so CUDA-graph safe."""
    q = q.contiguous()
    if q.data_ptr() % 16:           # the kernel reads query rows in 16-byte pieces
        q = q.clone()
    rows, n_heads, head_dim = q.shape
    n_kv = cache.config.n_kv_heads
    head_blocks = -(-(n_heads // n_kv) // HEADS_PER_BLOCK)
    max_pages = batch.block_tables.shape[1]
    kernel = DECODE_KERNELS[cache.mode, head_dim]
    n_splits = _n_splits(kernel, rows * n_kv * head_blocks, max_pages * batch.page_size, q.device)
    out = torch.empty_like(q)
    part_acc = part_ml = counters = None
    if n_splits > 1:   # rows whose keys need several splits merge them in the kernel's last block
        part_acc = torch.empty(rows, n_heads, n_splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(rows, n_heads, n_splits, 2, dtype=torch.float32, device=q.device)   # (max, sum)
        counters = _counters(q.device, _size_class(rows * n_kv * head_blocks))
    c = cache.layers[layer]
    if rows:
        launch("attention", kernel, grid=(n_splits, n_kv * head_blocks, rows),
               block=(THREADS,),
               args=(q, c.k, c.v, c.k_scales, c.v_scales, batch.block_tables, batch.seq_lens,
                     positions, row_seq, out, part_acc, part_ml, counters, n_heads, n_kv, max_pages,
                     batch.page_size, n_splits, scale * LOG2E))
    return out


def _n_splits(kernel: str, blocks_per_split: int, max_keys: int, device: torch.device) -> int:
    """Splits per row: about one wave of resident blocks in all (never a second, partial one), fewer when the
    block table is short. Each row then cuts its actual keys into this many equal splits (on the device)."""
    want = _resident_blocks(kernel, device) // blocks_per_split
    return max(1, min(want, -(-max_keys // MIN_SPLIT_KEYS)))


@functools.cache
def _resident_blocks(kernel: str, device: torch.device) -> int:
    """Blocks of `kernel` the whole GPU holds at once: its registers decide (64K per SM; its shared memory
    allows more blocks)."""
    regs = module("attention", compute_capability(device)).get_function(kernel).num_regs
    per_sm = REGISTERS_PER_SM // (-(-regs // 8) * 8 * THREADS)     # registers are allocated in steps of 8
    return max(1, per_sm) * torch.cuda.get_device_properties(device).multi_processor_count


def _size_class(n: int) -> int:
    """n rounded up to COUNTERS times a power of two, so that few counter buffers exist per device."""
    size = COUNTERS
    while size < n:
        size *= 2
    return size


@functools.cache
def _counters(device: torch.device, size: int) -> Tensor:
    """int32 [size] zeros for the kernel's per-(row, head block) split counters. Each launch leaves them zero
    (the last block of a row resets its counter), so one buffer serves every launch on the device; launches on
    one device must not run concurrently on different streams."""
    return torch.zeros(size, dtype=torch.int32, device=device)


def _mixed(q: Tensor, cache, layer: int, batch, scale: float) -> Tensor:
    host = torch.cat((batch.cu_seqlens, batch.seq_lens)).tolist()     # eager path: one host read per call
    cu, n_keys = host[:batch.n_seqs + 1], host[batch.n_seqs + 1:]
    n_new = [cu[b + 1] - cu[b] for b in range(batch.n_seqs)]
    out = torch.empty_like(q)
    short = [b for b in range(batch.n_seqs) if n_new[b] <= ROW_KERNEL_MAX_NEW]
    if short:
        rows = torch.tensor([r for b in short for r in range(cu[b], cu[b + 1])], device=q.device)
        row_seq = torch.tensor([b for b in short for _ in range(n_new[b])], dtype=torch.int32, device=q.device)
        out[rows] = split_k(q[rows], cache, layer, batch, batch.positions[rows], row_seq, scale)
    for b in range(batch.n_seqs):
        if n_new[b] > ROW_KERNEL_MAX_NEW:
            out[cu[b]:cu[b + 1]] = _prefill(q[cu[b]:cu[b + 1]], cache, layer, batch, b, n_keys[b], scale)
    return out


def _prefill(q: Tensor, cache, layer: int, batch, b: int, n_keys: int, scale: float) -> Tensor:
    """q [n, H, Dh]: the new tokens of sequence b, at positions n_keys-n .. n_keys-1 (Batch.build's layout).
    Gathers the sequence's K/V (dequantized) into fp16 scratch [n_keys, Hkv, Dh] and runs SDPA with the causal mask
    aligned bottom-right (queries see their cached prefix), QUERY_CHUNK query rows at a time."""
    n = q.shape[0]
    ps = batch.page_size
    pos = torch.arange(n_keys, device=q.device)
    slots = batch.block_tables[b].long()[pos // ps] * ps + pos % ps
    k, v = kv_cache.read(cache, layer, slots)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))         # [1, heads, len, Dh]
    out = torch.empty_like(q)
    first = n_keys - n
    for a in range(0, n, QUERY_CHUNK):
        e = min(a + QUERY_CHUNK, n)
        keys = first + e
        if keys == e - a:
            mask, causal = None, True
        else:
            mask, causal = causal_lower_right(e - a, keys), False
        o = F.scaled_dot_product_attention(qh[:, :, a:e], kh[:, :, :keys], vh[:, :, :keys], attn_mask=mask,
                                           is_causal=causal, scale=scale, enable_gqa=True)
        out[a:e] = o[0].transpose(0, 1)
    return out

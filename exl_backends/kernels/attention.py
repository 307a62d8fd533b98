"""Paged attention on CUDA (ops.paged_attention): the split-K kernels of attention.cu for query rows that are
alone (or nearly) in their sequence, and torch's scaled_dot_product_attention over gathered fp16 K/V for prompts.

Decode batches (one new token per sequence, the case captured in a CUDA graph) go to the split-K kernels with no
host reads: the grid depends only on the batch size and the block table's width. Mixed batches (eager) read the
sequence lengths on the host once per call and send each sequence its own way."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from ..errors import ConfigError
from . import kv_cache
from .loader import launch

LOG2E = 1.4426950408889634      # the kernels' softmax works in base 2
WARPS = 4                       # warps per block of both kernels
PAGE_ALIGN = 32                 # a 32-key tile of the split kernel must not cross a page
HEAD_DIMS = {"fp16": (16, 32, 64, 128), "q8": (64, 128), "q6": (64, 128), "q4": (64, 128)}
GROUP_TILES = (2, 4, 8)         # query heads per split block (compiled variants); larger groups span blocks
BLOCKS_PER_SM = 4               # split-K: enough blocks for about one full wave of resident blocks
MIN_SPLIT_KEYS = 64             # attention.cu's MIN_SPLIT: no more splits than a full block table fills
ROW_KERNEL_MAX_NEW = 8          # mixed batches: sequences with at most this many new tokens use the split kernel
QUERY_CHUNK = 4096              # prefill: query rows per scaled_dot_product_attention call

SPLIT_KERNELS = {(mode, dh, tile): f"attention_split_{mode}_d{dh}_g{tile}"
                 for mode, dims in HEAD_DIMS.items() for dh in dims for tile in GROUP_TILES}
COMBINE_KERNELS = {   # (head_dim, V quantized) -> the combine kernel (quantized V is un-rotated there)
    (16, False): "attention_combine_d16", (32, False): "attention_combine_d32",
    (64, False): "attention_combine_d64", (128, False): "attention_combine_d128",
    (64, True): "attention_combine_d64_rotated", (128, True): "attention_combine_d128_rotated"}


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
    (int32 [R]; None: r). Two launches, no host reads, so CUDA-graph safe."""
    rows, n_heads, head_dim = q.shape
    n_kv = cache.config.n_kv_heads
    group = n_heads // n_kv
    tile = next(t for t in GROUP_TILES if t >= min(group, GROUP_TILES[-1]))
    head_blocks = -(-group // tile)
    max_pages = batch.block_tables.shape[1]
    n_splits = _n_splits(rows * n_kv * head_blocks, max_pages * batch.page_size, q.device)
    part_acc = torch.empty(rows, n_heads, n_splits, head_dim, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(rows, n_heads, n_splits, 2, dtype=torch.float32, device=q.device)   # (max, sum)
    c = cache.layers[layer]
    launch("attention", SPLIT_KERNELS[cache.mode, head_dim, tile], grid=(n_splits, n_kv * head_blocks, rows),
           block=(WARPS * 32,),
           args=(q.contiguous(), c.k, c.v, c.k_scales, c.v_scales, batch.block_tables, batch.seq_lens, positions,
                 row_seq, part_acc, part_ml, n_heads, n_kv, max_pages, batch.page_size, n_splits, scale * LOG2E))
    out = torch.empty_like(q)
    launch("attention", COMBINE_KERNELS[head_dim, cache.bits is not None], grid=(-(-rows * n_heads // WARPS),),
           block=(WARPS * 32,),
           args=(part_acc, part_ml, batch.seq_lens, positions, row_seq, out, rows, n_heads, n_splits))
    return out


def _n_splits(blocks_per_split: int, max_keys: int, device: torch.device) -> int:
    """Splits per row: about BLOCKS_PER_SM blocks per SM in all, fewer when the block table is short. Each row
    then cuts its actual keys into this many equal splits (on the device)."""
    n_sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-BLOCKS_PER_SM * n_sms // blocks_per_split)
    return max(1, min(want, -(-max_keys // MIN_SPLIT_KEYS)))


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

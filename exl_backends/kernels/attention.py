"""Paged attention on CUDA (ops.paged_attention): the split-K decode kernels of attention.cu for query rows that are
alone (or nearly) in their sequence, and for prompts torch's flash attention over gathered fp16 K/V: every prompt of
a batch in one varlen call (sm_80+; a single prompt without a window in one dense call, which splits long key
ranges over more blocks); per prompt through scaled_dot_product_attention on older GPUs and with an
attention-logit soft-cap, which flash attention lacks (plain torch matmuls and softmax in f32, in query chunks).
All take the sliding window and the soft-cap of reference.paged_attention; with a window, none reads the pages
of keys that no query of the pass can see.

Decode batches (one new token per sequence, the case captured in a CUDA graph) go to the decode kernel with no host
reads: the grid depends only on the batch size and the block table's width. From the projections (rope_attention)
that kernel also applies RoPE and writes the new keys and values, so a decode layer's attention is one launch.
Mixed batches (eager) read the sequence lengths on the host once per batch and send each sequence its own way; the
index tensors that takes are made once per batch, not per layer (batch.derived)."""
from __future__ import annotations

import dataclasses
import functools
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.backends.cuda import SDPAParams, can_use_flash_attention

from ..errors import ConfigError
from ..model.batch import upload
from . import kv_cache, loader
from .loader import aligned, compute_capability, launch, module

LOG2E = 1.4426950408889634      # the kernel's softmax works in base 2
THREADS = 256                   # attention.cu: 8 warps per block
HEADS_PER_BLOCK = 8             # query heads per block (the mma's n); larger groups span blocks
PAGE_ALIGN = 32                 # a 32-key tile of the kernel must not cross a page
HEAD_DIMS = {"fp16": (16, 32, 64, 96, 128, 256), "q8": (64, 128, 256), "q6": (64, 128, 256), "q4": (64, 128, 256)}
REGISTERS_PER_SM = 65536
MIN_SPLIT_KEYS = 256            # attention.cu's MIN_SPLIT: no more splits than a full block table fills
# sequences with at most this many new tokens run as rows of the split-K decode kernel, longer ones through flash
# attention, which gives each 128 queries and head one block: after a long prefix it leaves most of the GPU idle
# (H200, 8B heads, after 1792 keys: 16 new tokens 28 us as rows vs 67-76 us flash, 32: 42 vs 67, 64: 80 vs 68)
ROW_KERNEL_MAX_NEW = 32
QUERY_CHUNK = 4096              # prefill: query rows per scaled_dot_product_attention call
SOFTCAP_SCORES = 1 << 26        # prefill with a soft-cap: f32 scores materialised per chunk (256 MB)

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


def paged_attention(q: Tensor, cache, layer: int, batch, scale: float, window: int | None = None,
                    softcap: float | None = None, into: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """q [T, H, Dh] fp16 of a packed batch -> [T, H, Dh] fp16, as reference.paged_attention (window: keys
    p - window < t <= p only; softcap: scores capped to softcap * tanh(score / softcap)). into: (buffer, place) of
    a quantized o projection (QuantMatmul.stored_x) for a decode batch: the output written there, in its stored
    order, and the buffer returned."""
    if batch.page_size % PAGE_ALIGN:
        raise ValueError(f"page_size {batch.page_size} is not a multiple of {PAGE_ALIGN}")
    if q.shape[0] == batch.n_seqs:     # every sequence has (at least, so exactly) one new token: decode
        return split_k(q, cache, layer, batch, batch.positions, None, scale, window, softcap, into=into)
    if into is not None:
        raise ValueError("paged_attention writes into an o projection's stored order for decode batches only")
    if batch.row_seq is not None and q.shape[0] <= ROW_KERNEL_MAX_NEW * batch.n_seqs:    # alike and short: verify
        return split_k(q, cache, layer, batch, batch.positions, batch.row_seq, scale, window, softcap)
    return _mixed(q, cache, layer, batch, scale, window, softcap)


def rope_attention(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, cache, layer: int, batch,
                   scale: float, window: int | None = None, softcap: float | None = None,
                   into: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """ops.rope_attention on CUDA: RoPE on q [T, H, Dh] and k [T, Hkv, Dh] (cos, sin [T, Dh]), k and v into the
    cache at batch.slots, then paged_attention (into: as there). A decode batch whose kv heads have at most 8 query
    heads each (one block of the kernel: no two blocks write one key) takes one launch, the kernel writing each new
    key and value before it reads them; anything else rope_write's launch, then paged_attention."""
    if q.shape[0] != batch.n_seqs or q.shape[1] // k.shape[1] > HEADS_PER_BLOCK:
        q = kv_cache.rope_write(q, k, v, cos, sin, cache, layer, batch.slots)
        return paged_attention(q, cache, layer, batch, scale, window, softcap, into)
    if batch.page_size % PAGE_ALIGN:
        raise ValueError(f"page_size {batch.page_size} is not a multiple of {PAGE_ALIGN}")
    rows = tuple(aligned(x.to(torch.float16).contiguous()) for x in (k, v, cos, sin))   # read in 16-byte pieces
    new = rows + (batch.slots.to(torch.int64).contiguous(),)
    return split_k(q, cache, layer, batch, batch.positions, None, scale, window, softcap, new, into)


def split_k(q: Tensor, cache, layer: int, batch, positions: Tensor, row_seq: Tensor | None,
            scale: float, window: int | None = None, softcap: float | None = None,
            new: tuple[Tensor, ...] | None = None, into: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Attention of single query rows: q [R, H, Dh] at positions [R] (int64), row r of sequence row_seq[r]
    (int32 [R]; None: r). One launch, no host reads, so CUDA-graph safe. new: the rows' new tokens (k, v, cos, sin,
    slots) for the kernel to rotate q and k and write k and v itself (rope_attention's decode rows), q unrotated.
    into: (buffer, place): row r's element j goes to buffer[r * H * Dh + place[j]] as attention.cu's Out says
    (an o projection's stored order, QuantMatmul.stored_x); the buffer is returned."""
    q = aligned(q.contiguous())     # the kernel reads query rows in 16-byte pieces
    rows, n_heads, head_dim = q.shape
    n_kv = cache.config.n_kv_heads
    head_blocks = -(-(n_heads // n_kv) // HEADS_PER_BLOCK)
    max_pages = batch.block_tables.shape[1]
    kernel = DECODE_KERNELS[cache.mode, head_dim]
    max_keys = max_pages * batch.page_size
    if window is not None:      # a row reads at most its window, from a 32-aligned start
        max_keys = min(max_keys, window + PAGE_ALIGN)
    n_splits = _n_splits(kernel, rows * n_kv * head_blocks, max_keys, q.device)
    out, place = (torch.empty_like(q), None) if into is None else into
    part_acc = part_ml = counters = None
    if n_splits > 1:   # rows whose keys need several splits merge them in the kernel's last block
        part_acc = torch.empty(rows, n_heads, n_splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(rows, n_heads, n_splits, 2, dtype=torch.float32, device=q.device)   # (max, sum)
        counters = loader.counters("attention", q.device, rows * n_kv * head_blocks)
    c = cache.layers[layer]
    if rows:
        launch("attention", kernel, grid=(n_splits, n_kv * head_blocks, rows),
               block=(THREADS,),
               args=(q, c.k, c.v, c.k_scales, c.v_scales, *(new or (None,) * 5), batch.block_tables,
                     batch.seq_lens, positions, row_seq, out, place, part_acc, part_ml, counters, n_heads, n_kv,
                     max_pages, batch.page_size, n_splits, scale * LOG2E, window or 0,
                     scale / softcap if softcap else 0.0, softcap * LOG2E if softcap else 0.0))
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


def _mixed(q: Tensor, cache, layer: int, batch, scale: float, window: int | None, softcap: float | None) -> Tensor:
    short = _short_rows(batch)
    flash = softcap is None and _has_varlen_flash(q)
    prompts = _prompts(batch, window) if flash else None
    if short is None and prompts is not None:          # every sequence a long prompt: one call has every row
        return _varlen(q[prompts.rows], cache, layer, prompts, scale, window)
    out = torch.empty_like(q)
    if short is not None:
        rows, row_seq, positions = short
        out[rows] = split_k(q[rows], cache, layer, batch, positions, row_seq, scale, window, softcap)
    if flash:
        if prompts is not None:
            out[prompts.rows] = _varlen(q[prompts.rows], cache, layer, prompts, scale, window)
        return out
    cu, n_keys = batch.lengths_on_host()        # eager path: kept by Batch.build (else one host read per forward)
    for b in range(batch.n_seqs):
        if cu[b + 1] - cu[b] > ROW_KERNEL_MAX_NEW:
            out[cu[b]:cu[b + 1]] = _prefill(q[cu[b]:cu[b + 1]], cache, layer, batch, b, n_keys[b], scale, window,
                                            softcap)
    return out


@dataclasses.dataclass(frozen=True)
class Prompts:
    """The sequences of a mixed batch with more than ROW_KERNEL_MAX_NEW new tokens, as one varlen flash attention
    call takes them: their query rows (a slice when contiguous), the visible keys of each packed one after the other
    (their cache slots; from the first key in the window of the sequence's first query), and both cumulative
    lengths (int32 [n + 1], on the device)."""
    rows: slice | Tensor
    slots: Tensor
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int


def _prompts(batch, window: int | None) -> Prompts | None:
    """Made once per batch and window (batch.derived); None when no sequence is long."""
    key = ("prompts", window)
    if key not in batch.derived:
        cu, n_keys = batch.lengths_on_host()
        long = [b for b in range(batch.n_seqs) if cu[b + 1] - cu[b] > ROW_KERNEL_MAX_NEW]
        found = None
        if long:
            device = batch.positions.device
            starts = [0 if window is None else max(0, n_keys[b] - (cu[b + 1] - cu[b]) - window + 1) for b in long]
            slots = [_prefill_slots(batch, b, k0, n_keys[b]) for b, k0 in zip(long, starts)]
            q_lens = [cu[b + 1] - cu[b] for b in long]
            k_lens = [n_keys[b] - k0 for b, k0 in zip(long, starts)]
            lengths = upload(torch.tensor([list(accumulate(q_lens, initial=0)), list(accumulate(k_lens, initial=0))],
                                          dtype=torch.int32), device)
            if all(cu[a + 1] == cu[b] for a, b in zip(long, long[1:])):
                rows = slice(cu[long[0]], cu[long[-1] + 1])
            else:
                rows = upload(torch.tensor([r for b in long for r in range(cu[b], cu[b + 1])]), device)
            found = Prompts(rows, torch.cat(slots) if len(slots) > 1 else slots[0], lengths[0], lengths[1],
                            max(q_lens), max(k_lens))
        batch.derived[key] = found
    return batch.derived[key]


def _varlen(q: Tensor, cache, layer: int, prompts: Prompts, scale: float, window: int | None) -> Tensor:
    """Causal attention of every long sequence at once, aligned bottom-right (queries are the last of their keys):
    q [n, H, Dh] fp16 -> [n, H, Dh]. The keys are gathered (dequantized) from the cache into fp16 scratch. (Cutting
    long prefixes into more blocks, merged by log-sum-exp, was slower: docs/attention.md.) A single sequence
    without a window goes to the dense flash kernel, which splits long key ranges over more blocks where the queries
    are few (100 new tokens after 1,900: 25 us against the varlen kernel's 65 on the H200)."""
    k, v = kv_cache.read(cache, layer, prompts.slots)                         # [keys, Hkv, Dh]
    if window is None and prompts.cu_q.shape[0] == 2:
        o = _causal(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), scale)
        return o[0].transpose(0, 1)
    return torch.ops.aten._flash_attention_forward(
        q.contiguous(), k, v, prompts.cu_q, prompts.cu_k, prompts.max_q, prompts.max_k, 0.0, True, False,
        scale=scale, window_size_left=-1 if window is None else window - 1, window_size_right=0)[0]


@functools.cache
def _flash_capable(device: torch.device) -> bool:
    return compute_capability(device) >= (8, 0)


def _has_varlen_flash(q: Tensor) -> bool:
    """Whether torch's flash attention (sm_80+, fp16, head_dim a multiple of 8 up to 256) takes these queries."""
    return q.shape[-1] % 8 == 0 and q.shape[-1] <= 256 and _flash_capable(q.device)


def _short_rows(batch) -> tuple[Tensor, Tensor, Tensor] | None:
    """(rows, their sequences, their positions) of the sequences with at most ROW_KERNEL_MAX_NEW new tokens, which
    run as decode rows; None when there are none. Made once per batch (batch.derived)."""
    if "short" not in batch.derived:
        cu, _ = batch.lengths_on_host()
        short = [b for b in range(batch.n_seqs) if cu[b + 1] - cu[b] <= ROW_KERNEL_MAX_NEW]
        found = None
        if short:
            device = batch.positions.device
            rows = upload(torch.tensor([r for b in short for r in range(cu[b], cu[b + 1])]), device)
            row_seq = upload(torch.tensor([b for b in short for _ in range(cu[b], cu[b + 1])], dtype=torch.int32),
                             device)
            found = rows, row_seq, batch.positions[rows]
        batch.derived["short"] = found
    return batch.derived["short"]


def _prefill_slots(batch, b: int, k0: int, n_keys: int) -> Tensor:
    """Cache slots of sequence b's positions k0 .. n_keys - 1, made once per batch (every layer with the same
    window start reads the same ones)."""
    key = ("prefill", b, k0)
    if key not in batch.derived:
        batch.derived[key] = batch.kv_slots(b, k0, n_keys)
    return batch.derived[key]


def _prefill(q: Tensor, cache, layer: int, batch, b: int, n_keys: int, scale: float, window: int | None,
             softcap: float | None) -> Tensor:
    """q [n, H, Dh]: the new tokens of sequence b, at positions n_keys-n .. n_keys-1 (Batch.build's layout).
    Gathers the sequence's K/V (dequantized) into fp16 scratch and runs attention over it QUERY_CHUNK query rows at a
    time, each chunk over the keys it can see: all keys up to its last query (the causal mask aligned bottom-right,
    so queries see their cached prefix), from the first key in its first query's window on."""
    n = q.shape[0]
    first = n_keys - n                                  # position of q[0]
    k0 = 0 if window is None else max(0, first - window + 1)
    k, v = kv_cache.read(cache, layer, _prefill_slots(batch, b, k0, n_keys))  # [n_keys - k0, Hkv, Dh]
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))         # [1, heads, len, Dh]
    out = torch.empty_like(q)
    chunk = QUERY_CHUNK if softcap is None else max(1, min(QUERY_CHUNK, SOFTCAP_SCORES // (q.shape[1] * k.shape[0])))
    for a in range(0, n, chunk):
        e = min(a + chunk, n)
        lo = 0 if window is None else max(k0, first + a - window + 1) - k0     # the chunk's keys: [lo, hi)
        hi = first + e - k0
        qc, kc, vc = qh[:, :, a:e], kh[:, :, lo:hi], vh[:, :, lo:hi]
        if window is None and softcap is None:
            o = _causal(qc, kc, vc, scale)
        else:
            visible = _visible(first + a, e - a, k0 + lo, hi - lo, window, q.device)
            o = _softcapped(qc, kc, vc, visible, scale, softcap) if softcap is not None else \
                F.scaled_dot_product_attention(qc, kc, vc, attn_mask=visible, scale=scale, enable_gqa=True)
        out[a:e] = o[0].transpose(0, 1)
    return out


def _causal(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal attention aligned bottom-right (the queries are the last q.shape[2] of the keys' positions):
    q [1, H, n_q, Dh], k, v [1, Hkv, n_k, Dh]. Flash attention is called directly when it takes the inputs, as
    torch's lower-right CausalBias does after more host work of its own; F.scaled_dot_product_attention(
    is_causal=True) cost ~1.5 ms of host time per call on the H200 (torch 2.11; measured in the generator's
    prefill of uncached prompts, 32 layers x each sequence of a step; why, not known)."""
    if _takes_flash(q, k, v):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal=True, scale=scale)[0]
    if q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    # imported here, not at the top: with CUDA torch it imports torch._dynamo (~2-10 s on the H100 machine,
    # benchmarks/bench_first_run.py --profile), which a load or a flash-attention prompt never needs
    from torch.nn.attention.bias import causal_lower_right
    mask = causal_lower_right(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _takes_flash(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether torch's flash attention takes q, k, v for _causal. Asked with is_causal False, as torch's lower-right
    CausalBias asks: torch's is_causal means top-left alignment, which flash refuses for n_q != n_k, while flash's
    own causal mask is bottom-right (asked with True, every cached-prefix prompt fell back to the CausalBias route)."""
    return q.shape[-1] % 8 == 0 and can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True))


def _visible(q0: int, n_q: int, t0: int, n_k: int, window: int | None, device: torch.device) -> Tensor:
    """bool [n_q, n_k]: whether query at position q0 + i sees key t0 + j (causal, and within the window)."""
    p = torch.arange(q0, q0 + n_q, device=device)[:, None]
    t = torch.arange(t0, t0 + n_k, device=device)[None, :]
    visible = t <= p
    if window is not None:
        visible &= t > p - window
    return visible


def _softcapped(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float, softcap: float) -> Tensor:
    """Attention with soft-capped scores, reference.attention's arithmetic (f32): q [1, H, n_q, Dh] fp16, k, v
    [1, Hkv, n_k, Dh] fp16, visible [n_q, n_k] -> [1, H, n_q, Dh] fp16. Query heads h*G .. h*G+G-1 share kv head h,
    so the G heads' rows are stacked against one K instead of repeating K."""
    _, n_heads, n_q, dh = q.shape
    n_kv = k.shape[1]
    qg = q[0].float().reshape(n_kv, (n_heads // n_kv) * n_q, dh)             # [Hkv, G * n_q, Dh]
    scores = qg @ k[0].float().transpose(1, 2) * scale                       # [Hkv, G * n_q, n_k]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(n_kv, -1, n_q, scores.shape[-1]).masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, dim=-1).view(n_kv, -1, scores.shape[-1]) @ v[0].float()   # [Hkv, G * n_q, Dh]
    return out.view(1, n_heads, n_q, dh).to(q.dtype)

"""kernels.attention.paged_attention against reference.paged_attention on the same cache contents (the cache is
written once, by the kernels; the reference reads it back with torch ops), so the tests isolate the attention
arithmetic. Ragged lengths across page boundaries, shuffled page tables, decode-only and mixed batches, every
cache mode, GQA groups from 1 to 12; sliding windows (smaller than, equal to and larger than the context, ending on
and across page boundaries) and attention-logit soft-capping on every path; head_dim 256 (Gemma 2/3: the warp-pair
variants) in every mode with Gemma's attention scale, windows and soft-cap."""
import dataclasses
import re
from pathlib import Path

import pytest
import torch
from kernel_testing import attention_config, on_gpu, poison_allocator

from exl_backends.errors import ConfigError
from exl_backends.model import reference
from exl_backends.model.batch import Batch, SeqChunk
from exl_backends.model.cache import KVCache
from exl_backends.model.config import ModelConfig
from exl_backends.model.model import Model

MODES = ["fp16", "q8", "q6", "q4"]
# (Hkv, H/Hkv, Dh); a group of 12 spans two blocks of 8 query heads
# head_dim 256: Gemma 3 1B (1 kv head, 4 heads), Gemma 2 2B (4, 8), Gemma 2 9B (8, 16), groups of 1 and 12
GEMMA_SHAPES = [(1, 4, 256), (4, 2, 256), (8, 2, 256), (3, 1, 256), (2, 12, 256)]
SHAPES = [(hkv, group, dh) for hkv in (1, 2, 3, 8) for group in (1, 3, 4) for dh in (64, 128)] + [(2, 12, 64)] + \
    GEMMA_SHAPES
DECODE_LENS = [1, 255, 256, 257, 512, 513, 1000, 5000]   # one split up to 512 keys (attention.cu ONE_SPLIT)
# (tokens already cached, new tokens): prompts with and without a prefix, decode rows, short multi-token chunks
MIXED = [(0, 300), (700, 57), (4999, 1), (255, 1), (100, 5), (0, 1), (1500, 9), (31, 2), (0, 8)]


def filled_cache(shape, mode, n_pages, page_size, seed):
    """A one-layer cache whose every slot holds random K/V (written through the CUDA write path)."""
    hkv, group, dh = shape
    cache = KVCache(attention_config(hkv * group, hkv, dh), n_pages, page_size, mode, "cuda", torch.float16)
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(cache.max_tokens, hkv, dh, device="cuda", generator=g).half()
    v = (torch.randn(cache.max_tokens, hkv, dh, device="cuda", generator=g) + 0.2).half()
    cache.write(0, k, v, torch.arange(cache.max_tokens, device="cuda"))
    return cache, g


def shuffled_pages(specs, page_size, seed):
    """Page lists for sequences of (cached, new) tokens, drawn from a shuffled pool: (lists, pages in all)."""
    needed = [-(-(start + n) // page_size) for start, n in specs]
    order = torch.randperm(sum(needed) + 3, generator=torch.Generator().manual_seed(seed)).tolist()
    lists, at = [], 0
    for count in needed:
        lists.append(order[at:at + count])
        at += count
    return lists, len(order)


def run_case(shape, mode, specs, page_size, seed, window=None, softcap=None, scale=None):
    """scale: the attention scale (None: head_dim ** -0.5). Returns the batch."""
    from exl_backends.kernels import attention
    lists, n_pages = shuffled_pages(specs, page_size, seed)
    cache, g = filled_cache(shape, mode, n_pages, page_size, seed)
    chunks = [SeqChunk([1] * n, start, pages) for (start, n), pages in zip(specs, lists)]
    batch = Batch.build(chunks, page_size, "cuda")
    hkv, group, dh = shape
    q = (torch.randn(batch.input_ids.shape[0], hkv * group, dh, device="cuda", generator=g) * 1.5).half()
    scale = dh ** -0.5 if scale is None else scale
    poison_allocator()
    options = {name: value for name, value in (("window", window), ("softcap", softcap)) if value is not None}
    ours = attention.paged_attention(q, cache, 0, batch, scale, **options)
    assert_attention_close(ours, reference.paged_attention(q, cache, 0, batch, scale, **options))
    return batch


def assert_attention_close(ours, ref):
    """~2e-3 relative: to each element, and to the largest element of its (row, head) vector."""
    assert ours.dtype == torch.float16 and ours.shape == ref.shape
    assert torch.isfinite(ours).all()
    ref = ref.float()
    err = (ours.float() - ref).abs()
    limit = 2e-3 * (ref.abs() + ref.abs().amax(-1, keepdim=True))
    worst = (err / limit).max().item()
    assert worst <= 1, f"error up to {worst:.2f} x the tolerance; max abs error {err.max().item():.3g}"


@on_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_batch(mode, shape):
    run_case(shape, mode, [(n - 1, 1) for n in DECODE_LENS], 256, seed=sum(shape))


@on_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES)
def test_mixed_batch(mode, shape):
    run_case(shape, mode, MIXED, 256, seed=sum(shape) + 1)


@on_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [None, 100])
def test_prompts_side_by_side_and_alone(mode, window):
    """Prompts after decode rows (their rows one contiguous range), and a batch of prompts only (the varlen
    call's output is the result), with and without cached prefixes and a window."""
    run_case((2, 4, 128), mode, [(4999, 1), (0, 300), (700, 57), (1500, 9)], 256, seed=11, window=window)
    run_case((8, 4, 128), mode, [(0, 300), (700, 57), (256, 256)], 256, seed=12, window=window)


@on_gpu
@pytest.mark.parametrize("mode", MODES)
def test_prompts_after_long_prefixes(mode):
    """Prompts after long prefixes beside one without a prefix, and a decode row."""
    run_case((2, 4, 128), mode, [(1792, 208), (4000, 100), (5, 1), (0, 300)], 256, seed=13)


@on_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("shape", [(2, 4, 128), (8, 4, 128), (3, 1, 64), (2, 12, 64), (4, 2, 256)])
def test_one_prompt_after_a_prefix(mode, window, shape, monkeypatch):
    """One long sequence (the dense flash call without a window, varlen with one), alone and beside decode rows;
    the dense call goes to flash attention itself, after a prefix too (not torch's CausalBias fallback)."""
    from exl_backends.kernels import attention
    dense, causal = [], attention._causal
    flash, takes_flash = [], attention._takes_flash
    monkeypatch.setattr(attention, "_causal", lambda *a: dense.append(a) or causal(*a))
    monkeypatch.setattr(attention, "_takes_flash", lambda *a: flash.append(takes_flash(*a)) or flash[-1])
    run_case(shape, mode, [(1900, 100)], 256, seed=14, window=window)
    run_case(shape, mode, [(5, 1), (777, 33), (4000, 1)], 256, seed=15, window=window)
    run_case(shape, mode, [(0, 257)], 256, seed=16, window=window)
    assert len(dense) == (3 if window is None else 0)
    assert flash == [True] * len(dense)


@on_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("new", [2, 5, 8])
@pytest.mark.parametrize("window", [None, 7])
def test_verify_batch(mode, new, window):
    """Every sequence `new` tokens (a speculative verify step): Batch.row_seq sends them straight to the decode
    kernel, each row attending to its own prefix, the step's earlier tokens included."""
    specs = [(n - 1, new) for n in DECODE_LENS]
    lists, _ = shuffled_pages(specs, 256, new)
    assert Batch.build([SeqChunk([1] * k, s, p) for (s, k), p in zip(specs, lists)], 256, "cuda").row_seq is not None
    run_case((2, 3, 128), mode, specs, 256, seed=new, window=window)


@on_gpu
@pytest.mark.parametrize("shape", [(2, 2, 16), (2, 2, 32), (4, 2, 32)])
def test_small_head_dims_fp16(shape):
    run_case(shape, "fp16", [(n - 1, 1) for n in DECODE_LENS], 256, seed=3)
    run_case(shape, "fp16", MIXED, 256, seed=4)


@on_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("page_size", [32, 64])
def test_small_pages(mode, page_size):
    run_case((2, 3, 128), mode, [(n - 1, 1) for n in DECODE_LENS], page_size, seed=page_size)
    run_case((2, 3, 128), mode, MIXED, page_size, seed=page_size + 1)


@on_gpu
@pytest.mark.parametrize("mode", ["fp16", "q4"])
@pytest.mark.parametrize("shape", [(8, 4, 128), (4, 2, 256)])
def test_decode_replays_in_a_cuda_graph(mode, shape):
    """Captured once for a batch shape; replayed after the sequences grew (longer lengths, wider use of the same
    block table), with new queries: no host reads, grid fixed by the table width."""
    from exl_backends.kernels import attention
    page_size = 256
    hkv, group, dh = shape
    lists, n_pages = shuffled_pages([(0, 6000), (0, 6000)], page_size, seed=9)
    cache, g = filled_cache(shape, mode, n_pages, page_size, seed=9)

    def decode_batch(lengths):
        return Batch.build([SeqChunk([1], n - 1, pages) for n, pages in zip(lengths, lists)], page_size, "cuda")
    static = decode_batch([300, 40])
    q = torch.randn(2, hkv * group, dh, device="cuda", generator=g).half()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention.paged_attention(q, cache, 0, static, 0.1)           # compiles and settles allocations
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention.paged_attention(q, cache, 0, static, 0.1)
    for lengths in ([301, 41], [5000, 6000], [1, 257]):
        grown = decode_batch(lengths)
        static.seq_lens.copy_(grown.seq_lens)
        static.positions.copy_(grown.positions)
        q.copy_(torch.randn(2, hkv * group, dh, device="cuda", generator=g).half())
        out.fill_(float("nan"))
        graph.replay()
        assert_attention_close(out, reference.paged_attention(q, cache, 0, grown, 0.1))


@on_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(8, 4, 128), (8, 4, 64), (2, 8, 64), (3, 1, 128), (2, 12, 64), (4, 2, 256),
                                   (2, 2, 32)])
@pytest.mark.parametrize("window", [None, 100])
def test_rope_attention_is_rope_write_then_attention(mode, shape, window, attention_probe):
    """A decode batch from its projections (rope_attention: the kernel rotates q and k and writes the new keys and
    values itself; a group of 12 query heads takes rope_write's launch first): the cache after it bit for bit
    rope_write's, the output bit for bit the attention kernel's on that cache with rope_write's q. Rows of 1 to
    5,000 keys (one split and several: the writing block is the last split's; the new key in the first and a later
    round of a block's tiles, in several warps' tiles), the new key on and off page boundaries, random page tables.
    The cos / sin tables are random, each dim's entry its own (real tables repeat their first half), so a kernel
    that rotated a pair with the wrong dim's entry would fail. fp16 caches at head_dim 64 and 128 rotate in registers
    (attention.cu ROPE IN REGISTERS), the other head dims and the quantized caches through shared memory. Also with
    the probe that loads a warp's first tile of older keys before the kernel's wait (fp16: TILE BEFORE WAIT)."""
    from exl_backends.kernels import attention, kv_cache
    hkv, group, dh = shape
    if mode != "fp16" and dh % 64:
        pytest.skip("quantized caches need head_dim % 64 == 0")
    if attention_probe and mode != "fp16":
        pytest.skip("the probe changes the fp16 kernels only")
    specs = [(n - 1, 1) for n in DECODE_LENS + [100]]
    lists, n_pages = shuffled_pages(specs, 256, seed=dh + group)
    (ours, g), (theirs, _) = (filled_cache(shape, mode, n_pages, 256, seed=dh + group) for _ in range(2))
    batch = Batch.build([SeqChunk([1], start, pages) for (start, _), pages in zip(specs, lists)], 256, "cuda")
    rows = len(specs)
    q = (torch.randn(rows, hkv * group, dh, device="cuda", generator=g) * 1.5).half()
    k = torch.randn(rows, hkv, dh, device="cuda", generator=g).half()
    v = (torch.randn(rows, hkv, dh, device="cuda", generator=g) - 0.3).half()
    cos, sin = (torch.rand(2, rows, dh, device="cuda", generator=g) * 2 - 1).half().unbind()
    options = {} if window is None else {"window": window}
    poison_allocator()
    out = attention.rope_attention(q, k, v, cos, sin, ours, 0, batch, dh ** -0.5, **options)
    q_rot = kv_cache.rope_write(q, k, v, cos, sin, theirs, 0, batch.slots)
    a, b = ours.layers[0], theirs.layers[0]
    for x, y in ((a.k, b.k), (a.v, b.v), (a.k_scales, b.k_scales), (a.v_scales, b.v_scales)):
        if x is not None:
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    assert torch.equal(out, attention.paged_attention(q_rot, theirs, 0, batch, dh ** -0.5, **options))
    assert_attention_close(out, reference.paged_attention(q_rot, theirs, 0, batch, dh ** -0.5, **options))


@pytest.mark.parametrize("group, fused", [(4, True), (8, True), (12, False)])
@pytest.mark.parametrize("new_tokens", [1, 3])
def test_rope_attention_picks_one_launch_for_decode_batches(monkeypatch, group, new_tokens, fused):
    """CPU, launches recorded instead of run: a decode batch whose kv heads have at most 8 query heads is one launch
    of the decode kernel carrying the new tokens' k, v, cos, sin and slots; a larger group, or rows that are not
    alone in their sequence (verify rows), first launch rope_kv_write and give the kernel none of them."""
    from exl_backends.kernels import attention, kv_cache
    launches = []

    def record(family, kernel, grid, block, args):
        launches.append((kernel, args))
    monkeypatch.setattr(attention, "launch", record)
    monkeypatch.setattr(kv_cache, "launch", record)
    monkeypatch.setattr(attention, "_n_splits", lambda *_: 1)      # reads the compiled kernel's registers
    hkv, dh = 2, 64
    cache = KVCache(attention_config(hkv * group, hkv, dh), 4, 32, "q4", "cpu", torch.float16)
    batch = Batch.build([SeqChunk([1] * new_tokens, 40, [1, 0]), SeqChunk([1] * new_tokens, 5, [2])], 32, "cpu")
    t = 2 * new_tokens
    q, k, v = torch.randn(t, hkv * group, dh).half(), torch.randn(t, hkv, dh).half(), torch.randn(t, hkv, dh).half()
    cos, sin = torch.randn(t, dh).half(), torch.randn(t, dh).half()
    attention.rope_attention(q, k, v, cos, sin, cache, 0, batch, 0.125)
    kernels = [kernel for kernel, _ in launches]
    if fused and new_tokens == 1:
        assert kernels == ["paged_decode_q4_d64"]
        new_k, new_v, new_cos, new_sin, slots = launches[0][1][5:10]
        assert torch.equal(new_k, k) and torch.equal(new_v, v) and torch.equal(new_cos, cos)
        assert torch.equal(new_sin, sin) and torch.equal(slots, batch.slots)
    else:
        assert kernels == ["rope_kv_write_quant", "paged_decode_q4_d64"]
        assert launches[1][1][5:10] == (None,) * 5


@on_gpu
def test_wide_block_table_and_padding_rows():
    """The decode graph's batch: a table wider than any sequence needs (padded with a trash page) and padding rows
    that see one token of the trash page."""
    from exl_backends.kernels import attention
    shape, page_size = (8, 4, 128), 256
    lists, n_pages = shuffled_pages([(0, 1000), (0, 600), (0, 1)], page_size, seed=5)
    cache, g = filled_cache(shape, "q6", n_pages + 1, page_size, seed=5)
    trash = n_pages
    batch = Batch.build([SeqChunk([1], 999, lists[0]), SeqChunk([1], 599, lists[1]), SeqChunk([1], 0, [trash])],
                        page_size, "cuda")
    wide = torch.full((3, 32), trash, dtype=torch.int32, device="cuda")
    wide[:, :batch.block_tables.shape[1]] = batch.block_tables
    batch.block_tables = wide
    q = torch.randn(3, 32, 128, device="cuda", generator=g).half()
    poison_allocator()
    ours = attention.paged_attention(q, cache, 0, batch, 0.09)
    assert_attention_close(ours, reference.paged_attention(q, cache, 0, batch, 0.09))


def test_every_launched_kernel_is_defined():
    """The launcher's kernel names against the extern "C" entry points the .cu file's macro generates."""
    from exl_backends.kernels import attention
    source = (Path(attention.__file__).with_suffix(".cu")).read_text()
    defined = {f"paged_decode_{mode}_d{dh}" for mode, dh in re.findall(r"^PAGED_DECODE\((\w+), (\d+),", source, re.M)}
    assert set(attention.DECODE_KERNELS.values()) == defined


# windows against DECODE_LENS / MIXED contexts: 1 key, less than a 32-key tile, a tile, a tile and one, a page and
# around it, more than some contexts, more than every context
WINDOWS = [1, 7, 32, 33, 255, 256, 257, 1000, 4096, 10000]
OPTION_SHAPES = [(2, 4, 128), (1, 3, 64), (3, 12, 64)]


@on_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", WINDOWS)
def test_decode_batch_with_window(mode, window):
    for i, shape in enumerate(OPTION_SHAPES):
        run_case(shape, mode, [(n - 1, 1) for n in DECODE_LENS], 256, seed=window + i, window=window)


@on_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", WINDOWS)
def test_mixed_batch_with_window(mode, window):
    """Prompts (SDPA with a window mask over the pages the window touches), short chunks and decode rows."""
    run_case((2, 4, 128), mode, MIXED, 256, seed=window, window=window)


@on_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("page_size", [32, 64])
def test_window_on_small_pages(mode, page_size):
    """Windows that start mid-page, on a page boundary, and one page back, over many small pages."""
    for window in (31, 32, 64, 65, 97):
        run_case((2, 3, 128), mode, [(n - 1, 1) for n in DECODE_LENS], page_size, seed=window, window=window)
        run_case((2, 3, 128), mode, MIXED, page_size, seed=window + 1, window=window)


@on_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("softcap", [50.0, 0.7])      # Gemma 2's 50, and one that caps nearly every score
def test_softcap_decode_and_mixed(mode, softcap):
    for i, shape in enumerate(OPTION_SHAPES):
        run_case(shape, mode, [(n - 1, 1) for n in DECODE_LENS], 256, seed=i, softcap=softcap)
    run_case((2, 4, 128), mode, MIXED, 256, seed=9, softcap=softcap)


@on_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [7, 256, 4096])
def test_window_and_softcap_together(mode, window):
    """Gemma 2's sliding layers: both options at once."""
    run_case((2, 4, 128), mode, [(n - 1, 1) for n in DECODE_LENS], 256, seed=window, window=window, softcap=30.0)
    run_case((2, 4, 128), mode, MIXED, 64, seed=window + 1, window=window, softcap=30.0)


@on_gpu
@pytest.mark.parametrize("shape", [(2, 2, 16), (4, 2, 32), (2, 3, 96)])
def test_small_and_odd_head_dims_with_options(shape):
    run_case(shape, "fp16", [(n - 1, 1) for n in DECODE_LENS], 256, seed=5, window=33, softcap=20.0)
    run_case(shape, "fp16", MIXED, 256, seed=6, window=300)


@on_gpu
def test_head_dim_96_fp16():
    """Phi-3-mini's head_dim: 48-byte key and 24-byte value shares per lane (16- and 8-byte loads)."""
    run_case((4, 3, 96), "fp16", [(n - 1, 1) for n in DECODE_LENS], 256, seed=7)
    run_case((4, 3, 96), "fp16", MIXED, 64, seed=8)


# Gemma's attention scale is query_pre_attn_scalar ** -0.5 (Gemma 2 27B: 144; the head_dim 256 models use 256): a
# scale other than head_dim ** -0.5, so that a kernel ignoring it fails
GEMMA_SCALE = 144 ** -0.5


@on_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [None, 7, 33, 256, 4096])
@pytest.mark.parametrize("softcap", [None, 50.0])
def test_head_dim_256_with_gemma_options(mode, window, softcap):
    """Gemma 2's layers (soft-cap 50; window 4096 or none) and Gemma 3's (windows, no soft-cap) at head_dim 256,
    with Gemma's scale: decode rows past several splits, mixed batches on small pages."""
    for i, shape in enumerate([(4, 2, 256), (1, 4, 256)]):
        run_case(shape, mode, [(n - 1, 1) for n in DECODE_LENS], 256, seed=(window or 0) + i, window=window,
                 softcap=softcap, scale=GEMMA_SCALE)
    run_case((4, 2, 256), mode, MIXED, 32, seed=(window or 0) + 7, window=window, softcap=softcap,
             scale=GEMMA_SCALE)


@on_gpu
def test_windowed_decode_replays_in_a_cuda_graph():
    """The window moves with the positions copied into the captured batch; splits are fixed by the window."""
    from exl_backends.kernels import attention
    shape, page_size, window = (8, 4, 128), 64, 300
    lists, n_pages = shuffled_pages([(0, 3000), (0, 3000)], page_size, seed=11)
    cache, g = filled_cache(shape, "q4", n_pages, page_size, seed=11)

    def decode_batch(lengths):
        return Batch.build([SeqChunk([1], n - 1, pages) for n, pages in zip(lengths, lists)], page_size, "cuda")
    static = decode_batch([400, 40])
    q = torch.randn(2, 32, 128, device="cuda", generator=g).half()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention.paged_attention(q, cache, 0, static, 0.1, window=window, softcap=40.0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention.paged_attention(q, cache, 0, static, 0.1, window=window, softcap=40.0)
    for lengths in ([401, 41], [2999, 3000], [1, 301], [299, 300]):
        grown = decode_batch(lengths)
        static.seq_lens.copy_(grown.seq_lens)
        static.positions.copy_(grown.positions)
        q.copy_(torch.randn(2, 32, 128, device="cuda", generator=g).half())
        out.fill_(float("nan"))
        graph.replay()
        assert_attention_close(out, reference.paged_attention(q, cache, 0, grown, 0.1, window=window, softcap=40.0))


# ----------------------------------------------------------------------------------------------- on CPU


@pytest.mark.parametrize("window", [None, 1, 5, 40])
@pytest.mark.parametrize("group", [1, 3])
def test_softcapped_prefill_arithmetic_equals_reference(window, group):
    """attention._softcapped with attention._visible (the soft-capped prompt path; plain torch, so it runs here) on
    the keys a query chunk sees, against reference.attention over the whole sequence."""
    from exl_backends.kernels import attention
    gen = torch.Generator().manual_seed(group + (window or 0))
    n_kv, dh, n_keys, n_new = 2, 16, 53, 21
    q = torch.randn(n_new, n_kv * group, dh, generator=gen) * 2
    k, v = torch.randn(n_keys, n_kv, dh, generator=gen) * 2, torch.randn(n_keys, n_kv, dh, generator=gen)
    first = n_keys - n_new
    ref = reference.attention(q, k, v, torch.arange(first, n_keys), 0.3, window=window, softcap=1.5)
    lo = 0 if window is None else max(0, first - window + 1)
    visible = attention._visible(first, n_new, lo, n_keys - lo, window, torch.device("cpu"))
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k[lo:], v[lo:]))
    ours = attention._softcapped(qh, kh, vh, visible, 0.3, 1.5)[0].transpose(0, 1)
    torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("mode", MODES)
def test_cuda_kernels_accept_head_dim_256(mode):
    """attention.check_cache (what a CUDA KVCache calls) on the cache shapes alone: head_dim 256 in every mode;
    a head_dim without kernels is still refused."""
    from exl_backends.kernels import attention
    attention.check_cache(KVCache(attention_config(8, 4, 256), 1, 32, mode, "cpu", torch.float16))
    with pytest.raises(ConfigError, match="head_dim 80"):
        attention.check_cache(KVCache(attention_config(8, 4, 80), 1, 32, "fp16", "cpu", torch.float16))


@pytest.mark.parametrize("mode", ["fp16", "q4"])
def test_gemma_scale_softcap_and_window_reach_the_kernel(tmp_path, monkeypatch, mode):
    """A Gemma 2 checkpoint with head_dim 256, query_pre_attn_scalar 144 and its window and soft-cap, loaded on
    CPU with the CUDA paged_attention in its ops and the launches recorded instead of run: each layer's decode
    step launches the d256 kernel with scale 144^-0.5 (in log2 units), the soft-cap and that layer's window."""
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM

    from exl_backends.kernels import attention
    hf_config = tiny_config("gemma2", head_dim=256, query_pre_attn_scalar=144, attn_logit_softcapping=50.0,
                            sliding_window=8)
    AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path)
    config = ModelConfig.from_dir(tmp_path)
    model = Model.load(tmp_path, config, "cpu", torch.float32)
    model.ops = dataclasses.replace(model.ops, paged_attention=attention.paged_attention,
                                    attention_options=frozenset({"window", "softcap"}))
    launches = []
    monkeypatch.setattr(attention, "launch", lambda family, kernel, grid, block, args: launches.append((kernel, args)))
    monkeypatch.setattr(attention, "_n_splits", lambda *_: 1)      # reads the compiled kernel's registers
    cache = KVCache(config, 2, 32, mode, "cpu", torch.float32)
    model.forward(Batch.build([SeqChunk([5], 40, [1, 0])], 32, "cpu"), cache)      # one decode row
    assert config.layer_windows == (8, None)
    assert len(launches) == config.n_layers
    for (kernel, args), window in zip(launches, config.layer_windows):
        assert kernel == f"paged_decode_{mode}_d256"
        scale_log2, window_arg, cap_in, cap_out = args[-4:]
        assert scale_log2 == pytest.approx(144 ** -0.5 * attention.LOG2E, rel=1e-6)
        assert window_arg == (window or 0)
        assert cap_in == pytest.approx(144 ** -0.5 / 50.0, rel=1e-6)
        assert cap_out == pytest.approx(50.0 * attention.LOG2E, rel=1e-6)


def test_eager_index_tensors_are_made_once_per_batch():
    """CPU: the short rows and prefill slots the eager path derives are right, shared by every layer's call, and
    not carried over to a copy of the batch on another device."""
    from exl_backends.kernels import attention
    from exl_backends.model.model import batch_on
    chunks = [SeqChunk([5, 6, 7], 40, [3, 1, 4]), SeqChunk(list(range(40)), 9, [2, 0, 5, 6]),
              SeqChunk([8], 17, [7, 8])]
    batch = Batch.build(chunks, page_size=16)
    rows, row_seq, positions = attention._short_rows(batch)
    assert rows.tolist() == [0, 1, 2, 43] and row_seq.tolist() == [0, 0, 0, 2]
    assert positions.tolist() == [40, 41, 42, 17]
    assert attention._short_rows(batch)[0] is rows
    slots = attention._prefill_slots(batch, 1, 4, 49)
    assert torch.equal(slots, batch.kv_slots(1)[4:49])
    assert attention._prefill_slots(batch, 1, 4, 49) is slots
    prompts = attention._prompts(batch, None)
    assert prompts.rows == slice(3, 43)
    assert torch.equal(prompts.slots, batch.kv_slots(1)) and (prompts.max_q, prompts.max_k) == (40, 49)
    assert prompts.cu_q.tolist() == [0, 40] and prompts.cu_k.tolist() == [0, 49]
    windowed = attention._prompts(batch, 5)         # keys from the first query's window on: position 9 - 4
    assert torch.equal(windowed.slots, batch.kv_slots(1)[5:]) and windowed.cu_k.tolist() == [0, 44]
    assert attention._prompts(batch, None) is prompts
    apart = Batch.build([SeqChunk(list(range(40)), 0, [1, 2, 3]), chunks[2], SeqChunk(list(range(35)), 3, [0, 4, 5])],
                        16)
    prompts = attention._prompts(apart, None)        # two prompts with a decode row between them
    assert prompts.rows.tolist() == list(range(40)) + list(range(41, 76))
    assert torch.equal(prompts.slots, torch.cat((apart.kv_slots(0), apart.kv_slots(2))))
    assert prompts.cu_q.tolist() == [0, 40, 75] and prompts.cu_k.tolist() == [0, 40, 78]
    assert not batch_on(batch, torch.device("meta")).derived


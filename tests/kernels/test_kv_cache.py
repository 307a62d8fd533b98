"""kv_cache.cu against reference.quantize_kv / dequantize_kv, through KVCache.write on CUDA (which dispatches to the
kernels) and kernels.kv_cache.read; the fused RoPE + write against reference.apply_rope followed by KVCache.write.
head_dim 256 (Gemma 2/3) in every write, read and rope path."""
import pytest
import torch
from kernel_testing import attention_config, needs_gpu, poison_allocator

from exl_backends.errors import ConfigError
from exl_backends.model import ops, reference
from exl_backends.model.cache import KVCache

pytestmark = needs_gpu

SHAPES = [(1, 64), (2, 128), (3, 64), (8, 128), (1, 256), (4, 256)]      # (n_kv_heads, head_dim)
ROWS = (1, 3, 17, 333)
POISON_CODE = 0xA5


def make_cache(hkv, dh, mode, n_pages=6, page_size=64):
    cache = KVCache(attention_config(hkv * 2, hkv, dh), n_pages, page_size, mode, "cuda", torch.float16)
    for c in cache.layers:
        poison = float("nan") if cache.bits is None else POISON_CODE
        c.k.fill_(poison)
        c.v.fill_(poison)
        for scales in (c.k_scales, c.v_scales):
            if scales is not None:
                scales.fill_(float("nan"))
    return cache


def random_kv(rows, hkv, dh, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = (torch.randn(rows, hkv, dh, device="cuda", generator=g) * 2).half()
    v = (torch.randn(rows, hkv, dh, device="cuda", generator=g) + 0.5).half()
    # a few outliers, as real K has: they set the group scales
    k[:, :, 5] *= 8
    return k, v, g


def codes_of(packed, bits):
    """uint8 codes [T, E] of the stored bytes (4-bit: low nibble first)."""
    if bits == 8:
        return packed.long()
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).long()


@pytest.mark.parametrize("mode", ["q8", "q6", "q4"])
@pytest.mark.parametrize("hkv, dh", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_quantized_write_matches_reference(mode, hkv, dh, rows):
    cache = make_cache(hkv, dh, mode, n_pages=6, page_size=64)
    k, v, g = random_kv(rows, hkv, dh, seed=rows + 100 * hkv + dh)
    slots = torch.randperm(cache.max_tokens, device="cuda", generator=g)[:rows]
    cache.write(0, k, v, slots)
    c = cache.layers[0]
    for x, codes, scales, bits in ((k, c.k, c.k_scales, cache.bits[0]), (v, c.v, c.v_scales, cache.bits[1])):
        ref_codes, ref_scales = reference.quantize_kv(x.reshape(rows, -1), bits)
        assert torch.equal(scales[slots], ref_scales)
        ours, ref = codes_of(codes[slots], bits), codes_of(ref_codes, bits)
        diff = (ours - ref).abs()
        assert diff.max() <= 1, f"{bits}-bit codes differ by up to {diff.max().item()}"
        assert (diff == 0).float().mean() >= 0.999
        untouched = torch.ones(cache.max_tokens, dtype=torch.bool, device="cuda")
        untouched[slots] = False
        assert (codes[untouched] == POISON_CODE).all() and scales[untouched].isnan().all()


@pytest.mark.parametrize("hkv, dh", SHAPES + [(2, 16), (4, 32)])
@pytest.mark.parametrize("rows", ROWS)
def test_fp16_write(hkv, dh, rows):
    cache = make_cache(hkv, dh, "fp16", n_pages=6, page_size=64)
    k, v, g = random_kv(rows, hkv, dh, seed=rows + 7 * hkv + dh)
    slots = torch.randperm(cache.max_tokens, device="cuda", generator=g)[:rows]
    cache.write(0, k, v, slots)
    c = cache.layers[0]
    assert torch.equal(c.k[slots], k) and torch.equal(c.v[slots], v)
    untouched = torch.ones(cache.max_tokens, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert c.k[untouched].isnan().all() and c.v[untouched].isnan().all()


@pytest.mark.parametrize("mode", ["fp16", "q8", "q6", "q4"])
@pytest.mark.parametrize("hkv, dh", SHAPES)
def test_read_matches_reference_bit_for_bit(mode, hkv, dh):
    from exl_backends.kernels import kv_cache
    cache = make_cache(hkv, dh, mode, n_pages=8, page_size=32)
    k, v, g = random_kv(cache.max_tokens, hkv, dh, seed=hkv + dh)
    cache.write(0, k, v, torch.arange(cache.max_tokens, device="cuda"))
    slots = torch.randperm(cache.max_tokens, device="cuda", generator=g)[:201]
    poison_allocator()
    ours_k, ours_v = kv_cache.read(cache, 0, slots)
    ref_k, ref_v = cache.read(0, slots)                     # the reference path (torch ops)
    assert ours_k.shape == (201, hkv, dh) and ours_k.dtype == torch.float16
    assert torch.equal(ours_k, ref_k) and torch.equal(ours_v, ref_v)


def bits_of(t):
    """A tensor's raw bits (NaN poison compares equal to itself)."""
    return t.view(torch.int16) if t.dtype == torch.float16 else t


@pytest.mark.parametrize("mode", ["fp16", "q8", "q6", "q4"])
@pytest.mark.parametrize("heads, hkv, dh", [(32, 8, 128), (9, 3, 64), (6, 2, 128), (8, 4, 256), (4, 1, 256)])
@pytest.mark.parametrize("rows", ROWS)
def test_rope_write_matches_rope_then_write(mode, heads, hkv, dh, rows):
    from exl_backends.kernels import kv_cache
    ours, ref = make_cache(hkv, dh, mode), make_cache(hkv, dh, mode)
    k, v, g = random_kv(rows, hkv, dh, seed=rows + 13 * heads + dh)
    q = (torch.randn(rows, heads, dh, device="cuda", generator=g) * 3).half()
    positions = torch.randint(0, 40000, (rows,), device="cuda", generator=g)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, dh, 2, device="cuda").float() / dh))
    cos, sin = reference.rope_cos_sin(positions, inv_freq, 1.0, torch.float16)
    slots = torch.randperm(ours.max_tokens, device="cuda", generator=g)[:rows]
    poison_allocator()
    q_ours = kv_cache.rope_write(q, k, v, cos, sin, ours, 0, slots)
    q_ref = ops.rope_write(q, k, v, cos, sin, ref, 0, slots)       # reference.apply_rope, then KVCache.write
    assert q_ours.shape == q.shape and torch.equal(q_ours, q_ref)
    a, b = ours.layers[0], ref.layers[0]
    for x, y in ((a.k, b.k), (a.v, b.v), (a.k_scales, b.k_scales), (a.v_scales, b.v_scales)):
        if x is not None:
            assert torch.equal(bits_of(x), bits_of(y))          # written slots equal, the rest still poisoned


@pytest.mark.parametrize("heads, hkv, dh", [(4, 2, 16), (3, 1, 32)])
def test_rope_write_small_heads_fp16(heads, hkv, dh):
    """Rows shorter than a warp's 64 elements (q and k/v warps partly idle)."""
    from exl_backends.kernels import kv_cache
    ours, ref = make_cache(hkv, dh, "fp16"), make_cache(hkv, dh, "fp16")
    k, v, g = random_kv(5, hkv, dh, seed=dh)
    q = torch.randn(5, heads, dh, device="cuda", generator=g).half()
    cos = torch.randn(5, dh, device="cuda", generator=g).half()      # both halves differ: taken as given
    sin = torch.randn(5, dh, device="cuda", generator=g).half()
    slots = torch.randperm(ours.max_tokens, device="cuda", generator=g)[:5]
    poison_allocator()
    assert torch.equal(kv_cache.rope_write(q, k, v, cos, sin, ours, 0, slots),
                       ops.rope_write(q, k, v, cos, sin, ref, 0, slots))
    assert torch.equal(bits_of(ours.layers[0].k), bits_of(ref.layers[0].k))
    assert torch.equal(bits_of(ours.layers[0].v), bits_of(ref.layers[0].v))


def test_quantized_round_trip_is_close():
    """What the cache modes are for: q8 keeps K/V to ~1%, q4 to ~10% (relative L2)."""
    from exl_backends.kernels import kv_cache
    errors = {}
    for mode in ("q8", "q4"):
        cache = make_cache(8, 128, mode)
        k, v, _ = random_kv(100, 8, 128, seed=1)
        slots = torch.arange(100, device="cuda")
        cache.write(0, k, v, slots)
        back, _ = kv_cache.read(cache, 0, slots)
        errors[mode] = ((back.float() - k.float()).norm() / k.float().norm()).item()
    assert errors["q8"] < 0.015 and errors["q4"] < 0.15, errors


def test_cuda_cache_checks():
    with pytest.raises(ConfigError, match="head_dim 80"):
        KVCache(attention_config(8, 2, 80), 2, 256, "fp16", "cuda", torch.float16)
    with pytest.raises(ConfigError, match="head_dim 96"):                    # fp16 only
        KVCache(attention_config(8, 2, 96), 2, 256, "q4", "cuda", torch.float16)
    for mode in ("fp16", "q8", "q6", "q4"):                                   # Gemma 2/3
        assert KVCache(attention_config(8, 4, 256), 2, 256, mode, "cuda", torch.float16).config.head_dim == 256
    with pytest.raises(ConfigError, match="float16"):
        KVCache(attention_config(8, 2, 128), 2, 256, "fp16", "cuda", torch.float32)
    with pytest.raises(ConfigError, match="page_size 48"):
        KVCache(attention_config(8, 2, 128), 2, 48, "q4", "cuda", torch.float16)

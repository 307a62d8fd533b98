"""rope.cu against reference.apply_rope (with reference.rope_cos_sin tables): the same fp16 roundings, bit-exact."""
import pytest
import torch
from kernel_testing import needs_gpu, poison_allocator

from exl_backends.model import reference

pytestmark = needs_gpu


@pytest.mark.parametrize("rows", (1, 3, 17, 333))
@pytest.mark.parametrize("heads, head_dim", [(32, 128), (8, 128), (9, 64), (3, 64), (4, 16), (8, 256), (4, 256)])
def test_apply_rope(rows, heads, head_dim):
    from exl_backends.kernels import rope
    g = torch.Generator(device="cuda").manual_seed(rows * 13 + heads * head_dim)
    x = (torch.randn(rows, heads, head_dim, device="cuda", generator=g) * 3).half()
    positions = torch.randint(0, 40000, (rows,), device="cuda", generator=g)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    cos, sin = reference.rope_cos_sin(positions, inv_freq, 1.0, torch.float16)
    poison_allocator()
    ours = rope.apply_rope(x, cos, sin)
    ref = reference.apply_rope(x, cos, sin)
    assert ours.shape == ref.shape and ours.dtype == torch.float16
    assert torch.equal(ours, ref), f"max diff {(ours.float() - ref.float()).abs().max().item():.3g}"


def test_apply_rope_uses_both_halves_of_the_tables():
    """cos/sin are taken as given, not assumed to repeat across the two halves."""
    from exl_backends.kernels import rope
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(5, 4, 64, device="cuda", generator=g).half()
    cos = torch.randn(5, 64, device="cuda", generator=g).half()
    sin = torch.randn(5, 64, device="cuda", generator=g).half()
    poison_allocator()
    assert torch.equal(rope.apply_rope(x, cos, sin), reference.apply_rope(x, cos, sin))


@pytest.mark.parametrize("rows", (1, 5, 333))
@pytest.mark.parametrize("head_dim", (64, 128, 256, 96))
@pytest.mark.parametrize("scale", (1.0, 1.2247))
def test_rope_cos_sin_tables_are_torchs(rows, head_dim, scale):
    """The tables in one launch (rope_cos_sin_f16) are reference.rope_cos_sin's on torch's CUDA ops bit for bit:
    the same fp32 angle, the CUDA math library's cosf and sinf (the family compiles without fast math), the same
    fp32 scale and fp16 rounding; positions up to 131,071, where an angle's cos and sin are hardest to round."""
    from exl_backends.kernels import rope
    g = torch.Generator(device="cuda").manual_seed(rows + head_dim)
    positions = torch.randint(0, 131072, (rows,), device="cuda", generator=g)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    poison_allocator()
    cos, sin = rope.rope_cos_sin(positions, inv_freq, scale, torch.float16)
    ref_cos, ref_sin = reference.rope_cos_sin(positions, inv_freq, scale, torch.float16)
    assert cos.shape == (rows, head_dim) and cos.dtype == torch.float16
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin), \
        ((cos.float() - ref_cos.float()).abs().max().item(), (sin.float() - ref_sin.float()).abs().max().item())
    bf16 = rope.rope_cos_sin(positions, inv_freq, scale, torch.bfloat16)        # the reference's own ops
    assert all(torch.equal(a, b) for a, b in zip(bf16, reference.rope_cos_sin(positions, inv_freq, scale,
                                                                               torch.bfloat16)))

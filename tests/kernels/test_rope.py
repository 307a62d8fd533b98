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

"""activation.cu against reference.silu_mul: silu rounded to fp16, then an fp16 product. The kernel's exp is the
fast-math one, so now and then a result is one fp16 step from torch's."""
import pytest
import torch
from kernel_testing import needs_gpu, poison_allocator

from exl_backends import reference

pytestmark = needs_gpu


@pytest.mark.parametrize("rows", (1, 3, 17, 333))
@pytest.mark.parametrize("width", (1536, 14336, 4864, 1001))      # 1001: the element-by-element kernel
def test_silu_mul(rows, width):
    from exl_backends.kernels import activation
    g = torch.Generator(device="cuda").manual_seed(rows * 31 + width)
    gate = (torch.randn(rows, width, device="cuda", generator=g) * 4).half()
    up = (torch.randn(rows, width, device="cuda", generator=g) * 2 + 0.1).half()
    poison_allocator()
    ours = activation.silu_mul(gate, up)
    ref = reference.silu_mul(gate, up)
    assert ours.shape == ref.shape and ours.dtype == torch.float16
    diff = (ours.float() - ref.float()).abs()
    # two roundings in a row, each possibly one step off: allow two steps of the result's magnitude
    step = ref.float().abs().clamp_min(2**-14) * 2**-9
    assert (diff <= step).all(), f"max diff {diff.max().item():.3g}"
    assert (diff == 0).float().mean() > 0.99


def test_silu_mul_of_views():
    """gate and up as halves of one fused projection output (strided views)."""
    from exl_backends.kernels import activation
    g = torch.Generator(device="cuda").manual_seed(5)
    fused = torch.randn(7, 2 * 2048, device="cuda", generator=g).half()
    gate, up = fused[:, :2048], fused[:, 2048:]
    poison_allocator()
    ours = activation.silu_mul(gate, up)
    ref = reference.silu_mul(gate, up)
    assert ((ours.float() - ref.float()).abs() <= ref.float().abs().clamp_min(2**-14) * 2**-9).all()

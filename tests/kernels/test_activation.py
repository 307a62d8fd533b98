"""activation.cu against reference.silu_mul / gelu_tanh_mul (the activation rounded to fp16, then an fp16 product;
the kernel's exp and tanh may differ from torch's by f32 ulps, so now and then a result is one fp16 step off) and
reference.softcap (f32)."""
import pytest
import torch
from kernel_testing import needs_gpu, poison_allocator

from exl_backends.model import reference

pytestmark = needs_gpu


# Llama-3 / Qwen widths for silu, Gemma-2-2B's for GELU-tanh; 1001: the element-by-element kernel
WIDTHS = [("silu_mul", w) for w in (1536, 14336, 4864, 1001)] + [("gelu_tanh_mul", w) for w in (2304, 9216, 1001)]


@pytest.mark.parametrize("rows", (1, 3, 17, 333))
@pytest.mark.parametrize("name, width", WIDTHS)
def test_gated_activation(name, width, rows):
    from exl_backends.kernels import activation
    g = torch.Generator(device="cuda").manual_seed(rows * 31 + width)
    gate = (torch.randn(rows, width, device="cuda", generator=g) * 4).half()
    up = (torch.randn(rows, width, device="cuda", generator=g) * 2 + 0.1).half()
    poison_allocator()
    ours = getattr(activation, name)(gate, up)
    ref = getattr(reference, name)(gate, up)
    assert ours.shape == ref.shape and ours.dtype == torch.float16
    diff = (ours.float() - ref.float()).abs()
    # two roundings in a row, each possibly one step off: allow two steps of the result's magnitude
    step = ref.float().abs().clamp_min(2**-14) * 2**-9
    assert (diff <= step).all(), f"max diff {diff.max().item():.3g}"
    assert (diff == 0).float().mean() > 0.99


@pytest.mark.parametrize("name, half", [("silu_mul", 2048), ("gelu_tanh_mul", 1152)])
def test_gated_activation_of_views(name, half):
    """gate and up as halves of one fused projection output (strided views)."""
    from exl_backends.kernels import activation
    g = torch.Generator(device="cuda").manual_seed(half)
    fused = torch.randn(7, 2 * half, device="cuda", generator=g).half()
    gate, up = fused[:, :half], fused[:, half:]
    poison_allocator()
    ours = getattr(activation, name)(gate, up)
    ref = getattr(reference, name)(gate, up)
    assert ((ours.float() - ref.float()).abs() <= ref.float().abs().clamp_min(2**-14) * 2**-9).all()


@pytest.mark.parametrize("shape", ((1, 256000), (3, 262144), (7, 1001), (2, 3)))   # vec4 and element kernels
@pytest.mark.parametrize("cap", (30.0, 1.5))
def test_softcap(shape, cap):
    from exl_backends.kernels import activation
    g = torch.Generator(device="cuda").manual_seed(shape[1] + int(cap))
    x = torch.randn(*shape, device="cuda", generator=g) * 20 + 0.5
    poison_allocator()
    ours = activation.softcap(x, cap)
    ref = reference.softcap(x, cap)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=4e-6, atol=4e-6 * cap)
    assert ours.abs().max() <= cap


def test_softcap_of_a_strided_view():
    from exl_backends.kernels import activation
    x = torch.randn(6, 1003, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2)) * 9
    view = x[::2, 1:]
    torch.testing.assert_close(activation.softcap(view, 4.0), reference.softcap(view, 4.0), rtol=4e-6, atol=2e-5)

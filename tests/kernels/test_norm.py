"""norm.cu against reference.rmsnorm / add_rmsnorm: same roundings, so at most one fp16 step apart (the f32 sum of
squares is added in another order, and rsqrt may differ in the last f32 bit)."""
import pytest
import torch
from kernel_testing import needs_gpu, poison_allocator

from exl_backends.model import reference

pytestmark = needs_gpu

ROWS = (1, 3, 17, 333)
DIMS = (576, 4096, 5120, 16384, 1001)   # 1001: no 16-byte vectors


def random_row_data(rows, dim, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(rows, dim, device="cuda", generator=g) * 2 + 0.3).half()
    w = (1 + 0.2 * torch.randn(dim, device="cuda", generator=g)).half()
    return x, w, g


def assert_close_to_rounding(ours, ref):
    """Equal, or (rarely) one rounding step of the normalised value apart, which the fp16 product with w can turn
    into up to two steps of the result (relative 2^-9)."""
    diff = (ours.float() - ref.float()).abs()
    step = ref.float().abs().clamp_min(2**-14) * 2**-9
    assert torch.isfinite(ours).all()
    assert (diff <= step).all(), f"max diff {diff.max().item():.3g}"
    assert (diff == 0).float().mean() > 0.99


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", DIMS)
def test_rmsnorm(rows, dim):
    from exl_backends.kernels import norm
    x, w, _ = random_row_data(rows, dim, seed=rows * 7 + dim)
    poison_allocator()
    ours = norm.rmsnorm(x, w, 1e-5)
    assert ours.shape == x.shape and ours.dtype == torch.float16
    assert_close_to_rounding(ours, reference.rmsnorm(x, w, 1e-5))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", DIMS)
def test_add_rmsnorm(rows, dim):
    from exl_backends.kernels import norm
    x, w, g = random_row_data(rows, dim, seed=rows * 11 + dim)
    residual = (torch.randn(rows, dim, device="cuda", generator=g) * 5).half()
    x_before, residual_before = x.clone(), residual.clone()
    poison_allocator()
    normed, new_residual = norm.add_rmsnorm(x, residual, w, 1e-6)
    ref_normed, ref_residual = reference.add_rmsnorm(x, residual, w, 1e-6)
    assert torch.equal(new_residual, ref_residual)          # one fp16 add: exact
    assert_close_to_rounding(normed, ref_normed)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rmsnorm_of_a_strided_view():
    """A non-contiguous input (a column slice) is normalised like its contiguous copy."""
    from exl_backends.kernels import norm
    x, w, _ = random_row_data(5, 4096 + 8, seed=3)
    view = x[:, 8:]
    poison_allocator()
    assert_close_to_rounding(norm.rmsnorm(view, w[8:], 1e-5), reference.rmsnorm(view.contiguous(), w[8:], 1e-5))


def test_rows_longer_than_the_kernels_hold():
    from exl_backends.kernels import norm
    x, w, _ = random_row_data(1, 4097, seed=5)      # unaligned rows: at most 256 threads x 16 elements
    with pytest.raises(ValueError, match="4097"):
        norm.rmsnorm(x, w, 1e-5)

"""argmax.cu's row_argmax against torch.argmax(-1): the same indices, ties (the first), NaN (the first, above every
number), -inf rows, strided rows, sizes around the block span."""
import pytest
import torch
from kernel_testing import needs_gpu, poison_allocator

pytestmark = needs_gpu


@pytest.mark.parametrize("rows", (1, 3, 17))
@pytest.mark.parametrize("vocab", (1, 7, 2047, 2048, 2049, 6145, 49152, 128256, 151939))
def test_row_argmax_is_torch_argmax(rows, vocab):
    from exl_backends.kernels.argmax import row_argmax
    g = torch.Generator(device="cuda").manual_seed(rows * 1000 + vocab)
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * 4
    ties = torch.randint(0, 5, (rows, vocab), device="cuda", generator=g).float()    # few levels: many ties
    for x in (logits, ties, -ties):
        poison_allocator()
        assert torch.equal(row_argmax(x), x.argmax(-1))


def test_row_argmax_of_special_rows():
    """A row of -inf (index 0), NaN anywhere (the first NaN), +inf beside NaN, a single maximum at the last index,
    and rows read through a stride (a view of wider logits)."""
    from exl_backends.kernels.argmax import row_argmax
    vocab = 10_007
    x = torch.randn(7, vocab + 5, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7))
    x[0] = -torch.inf
    x[1, [17, 9000, 10_000]] = torch.nan
    x[2, 4000], x[2, 12] = torch.inf, torch.nan
    x[3, vocab - 1] = 1e30
    x[4, 3] = x[4, 9999] = 1e30
    x[5, :] = 0.0
    view = x[:, :vocab]                         # stride(0) = vocab + 5
    poison_allocator()
    got = row_argmax(view)
    assert torch.equal(got, view.argmax(-1))
    assert got.tolist()[:6] == [0, 17, 12, vocab - 1, 3, 0]


def test_row_argmax_leaves_its_counters_for_the_next_launch():
    """Each launch leaves its row counters zero: launches one after another, of more rows than the last, agree."""
    from exl_backends.kernels.argmax import row_argmax
    g = torch.Generator(device="cuda").manual_seed(3)
    for rows in (1, 5, 300, 2, 300):
        x = torch.randn(rows, 3001, device="cuda", generator=g)
        assert torch.equal(row_argmax(x), x.argmax(-1))


def test_greedy_takes_the_kernel_and_refuses_nothing_torch_takes():
    from exl_backends.engine.sampling import greedy
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(4, 5000, device="cuda", generator=g)
    assert torch.equal(greedy(x), x.argmax(-1))
    assert torch.equal(greedy(x.half()), x.half().argmax(-1))      # fp16 and column-strided logits: torch's own
    assert torch.equal(greedy(x.t().contiguous().t()), x.argmax(-1))

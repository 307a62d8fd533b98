"""The loader's host-side helpers (no GPU: nothing here compiles or launches)."""
from __future__ import annotations

import torch

from exl_backends.kernels.loader import aligned


def test_aligned_copies_only_a_view_off_the_boundary():
    base = torch.randn(41).half()
    assert base.data_ptr() % 16 == 0 and aligned(base) is base
    view = base[1:]                                     # 2 bytes past the boundary
    moved = aligned(view)
    assert moved is not view and moved.data_ptr() % 16 == 0 and torch.equal(moved, view)
    pairs = base[2:]                                    # 4 bytes past: enough for kernels moving element pairs
    assert aligned(pairs, 4) is pairs and aligned(pairs) is not pairs


def test_every_driver_function_called_has_its_argument_types_declared():
    # an undeclared ctypes argument is passed as a C int: a CUfunction pointer would arrive truncated and the
    # driver would crash the process (it did, for cuOccupancyMaxActiveClusters, on the first GPU run)
    import inspect
    import re

    from exl_backends.kernels import driver
    called = set(re.findall(r"lib\.(cu\w+)\(", inspect.getsource(driver)))
    assert called and called <= set(driver.SIGNATURES)

"""Launchers for norm.cu: rmsnorm and the fused add_rmsnorm (same signatures and roundings as reference.py)."""
from __future__ import annotations

import torch
from torch import Tensor

from .loader import launch

THREADS = 256
VECTORS_PER_THREAD = (1, 2, 4, 8, 16)     # norm.cu's NV variants: a row lives in registers, up to 16 vectors each


def _kernel(name: str, dim: int, *tensors: Tensor) -> str:
    """The variant of `name` for rows of dim elements: 16-byte vectors when every row allows them (whole vectors,
    16-byte aligned rows), and the fewest vectors per thread that hold a row."""
    vec = 8 if dim % 8 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors) else 1
    nv = next((n for n in VECTORS_PER_THREAD if THREADS * vec * n >= dim), None)
    if nv is None:
        raise ValueError(f"{name}: rows of {dim} elements are longer than the kernels hold "
                         f"({THREADS * vec * VECTORS_PER_THREAD[-1]} at most{'' if vec == 8 else ' unaligned'})")
    return f"{name}_f16_v{vec}_n{nv}"


def rmsnorm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """x [T, D] fp16, w [D] fp16 -> [T, D] fp16."""
    x = x.contiguous()
    rows, dim = x.shape
    out = torch.empty_like(x)
    if rows:
        launch("norm", _kernel("rmsnorm", dim, x, w, out), grid=(rows,), block=(THREADS,),
               args=(x, w, out, dim, float(eps)))
    return out


def add_rmsnorm(x: Tensor, residual: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """residual + x -> (rmsnorm of it, the new residual), both [T, D] fp16; the inputs are left unchanged."""
    x, residual = x.contiguous(), residual.contiguous()
    rows, dim = x.shape
    out, new_residual = torch.empty_like(x), torch.empty_like(x)
    if rows:
        launch("norm", _kernel("add_rmsnorm", dim, x, residual, w, out, new_residual), grid=(rows,),
               block=(THREADS,), args=(x, residual, w, out, new_residual, dim, float(eps)))
    return out, new_residual

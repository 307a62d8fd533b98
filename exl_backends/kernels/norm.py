"""Launchers for norm.cu: rmsnorm and the fused add_rmsnorm (same signatures and roundings as reference.py)."""
from __future__ import annotations

import torch
from torch import Tensor

from .loader import launch

THREADS = 256


def _vector_ok(dim: int, *tensors: Tensor) -> bool:
    """16-byte vectors need whole vectors per row and 16-byte aligned rows."""
    return dim % 8 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors)


def rmsnorm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """x [T, D] fp16, w [D] fp16 -> [T, D] fp16."""
    x = x.contiguous()
    rows, dim = x.shape
    out = torch.empty_like(x)
    kernel = "rmsnorm_f16_vec8" if _vector_ok(dim, x, w, out) else "rmsnorm_f16"
    if rows:
        launch("norm", kernel, grid=(rows,), block=(THREADS,), args=(x, w, out, dim, float(eps)))
    return out


def add_rmsnorm(x: Tensor, residual: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """residual + x -> (rmsnorm of it, the new residual), both [T, D] fp16; the inputs are left unchanged."""
    x, residual = x.contiguous(), residual.contiguous()
    rows, dim = x.shape
    out, new_residual = torch.empty_like(x), torch.empty_like(x)
    kernel = "add_rmsnorm_f16_vec8" if _vector_ok(dim, x, residual, w, out, new_residual) else "add_rmsnorm_f16"
    if rows:
        launch("norm", kernel, grid=(rows,), block=(THREADS,),
               args=(x, residual, w, out, new_residual, dim, float(eps)))
    return out, new_residual

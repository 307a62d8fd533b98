"""Launcher for rope.cu: apply_rope and rope_cos_sin (same signatures and roundings as reference's)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..model import reference
from .loader import launch

THREADS = 256


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, Dh] fp16; cos, sin [T, Dh] fp16 (reference.rope_cos_sin) -> [T, H, Dh] fp16."""
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    tokens, heads, head_dim = x.shape
    out = torch.empty_like(x)
    n = tokens * heads * (head_dim // 2)
    if n:
        launch("rope", "apply_rope_f16", grid=(-(-n // THREADS),), block=(THREADS,),
               args=(x, cos, sin, out, tokens, heads, head_dim))
    return out


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """reference.rope_cos_sin in one launch for fp16 tables (other dtypes: the reference's torch ops)."""
    if dtype != torch.float16 or positions.dtype != torch.int64 or inv_freq.dtype != torch.float32:
        return reference.rope_cos_sin(positions, inv_freq, scale, dtype)
    positions, inv_freq = positions.contiguous(), inv_freq.contiguous()
    tokens, head_dim = positions.shape[0], 2 * inv_freq.shape[0]
    cos = torch.empty(tokens, head_dim, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if tokens:
        launch("rope", "rope_cos_sin_f16", grid=(-(-tokens * head_dim // THREADS),), block=(THREADS,),
               args=(positions, inv_freq, float(scale), cos, sin, tokens, head_dim))
    return cos, sin

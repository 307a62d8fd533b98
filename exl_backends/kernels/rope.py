"""Launcher for rope.cu: apply_rope (same signature and roundings as reference.apply_rope)."""
from __future__ import annotations

import torch
from torch import Tensor

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

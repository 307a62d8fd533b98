"""Launcher for activation.cu: silu_mul (same signature and roundings as reference.silu_mul)."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .loader import launch

THREADS = 256


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, elementwise, fp16, any shape (both the same)."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    vec = 8 if n % 8 == 0 and all(t.data_ptr() % 16 == 0 for t in (gate, up, out)) else 1
    if n:
        launch("activation", "silu_mul_f16_vec8" if vec == 8 else "silu_mul_f16",
               grid=(-(-n // (THREADS * vec)),), block=(THREADS,), args=(gate, up, out, np.int64(n)))
    return out

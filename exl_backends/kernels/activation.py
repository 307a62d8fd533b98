"""Launcher for activation.cu: the gated MLP activations silu_mul and gelu_tanh_mul, and softcap (same signatures
and roundings as reference.silu_mul, reference.gelu_tanh_mul, reference.softcap).

softcap is a kernel rather than torch's tanh(x / cap) * cap because that is three launches (three CUDA-graph nodes
per decode step, ~1.5 us each on the H200) where one does; the logits it reads are a few MB at most either way."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .loader import launch

THREADS = 256


def _gated(name: str, gate: Tensor, up: Tensor) -> Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    vec = 8 if n % 8 == 0 and all(t.data_ptr() % 16 == 0 for t in (gate, up, out)) else 1
    if n:
        launch("activation", f"{name}_f16_vec8" if vec == 8 else f"{name}_f16",
               grid=(-(-n // (THREADS * vec)),), block=(THREADS,), args=(gate, up, out, np.int64(n)))
    return out


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, elementwise, fp16, any shape (both the same)."""
    return _gated("silu_mul", gate, up)


def gelu_tanh_mul(gate: Tensor, up: Tensor) -> Tensor:
    """gelu_tanh(gate) * up (Gemma's gated MLP), elementwise, fp16, any shape (both the same)."""
    return _gated("gelu_tanh_mul", gate, up)


def softcap(x: Tensor, cap: float) -> Tensor:
    """cap * tanh(x / cap) of f32 logits, any shape."""
    if x.dtype != torch.float32:
        raise ValueError(f"softcap takes f32 logits, got {x.dtype}")
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return out
    if n % 4 == 0 and x.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0:
        launch("activation", "softcap_f32_vec4", grid=(-(-n // (THREADS * 4)),), block=(THREADS,),
               args=(x, out, np.int64(n // 4), float(cap)))
    else:
        launch("activation", "softcap_f32", grid=(-(-n // THREADS),), block=(THREADS,),
               args=(x, out, np.int64(n), float(cap)))
    return out

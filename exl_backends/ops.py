"""The block's ops as one bundle, chosen once per device: the torch reference on CPU, kernels on CUDA."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import reference


@dataclass(frozen=True)
class Ops:
    embedding: Callable
    rmsnorm: Callable
    add_rmsnorm: Callable
    rope_cos_sin: Callable
    apply_rope: Callable
    silu_mul: Callable
    paged_attention: Callable


REFERENCE_OPS = Ops(
    embedding=reference.embedding,
    rmsnorm=reference.rmsnorm,
    add_rmsnorm=reference.add_rmsnorm,
    rope_cos_sin=reference.rope_cos_sin,
    apply_rope=reference.apply_rope,
    silu_mul=reference.silu_mul,
    paged_attention=reference.paged_attention,
)


def ops_for(device: torch.device) -> Ops:
    if device.type == "cuda":
        from .kernels import cuda_ops   # importing compiles nothing; kernels compile on first launch
        return cuda_ops.OPS
    return REFERENCE_OPS

"""The block's ops as one bundle, chosen once per device: the torch reference on CPU, kernels on CUDA."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from . import reference
from .config import Activation


def rope_write(q, k, v, cos, sin, cache, layer: int, slots):
    """RoPE on q [T, H, Dh] and k [T, Hkv, Dh], then k and v into the cache's slots [T]; returns the rotated q.
    The reference composition of apply_rope and KVCache.write (the CUDA bundle fuses them into one launch)."""
    cache.write(layer, reference.apply_rope(k, cos, sin), v, slots)
    return reference.apply_rope(q, cos, sin)


@dataclass(frozen=True)
class Ops:
    embedding: Callable
    rmsnorm: Callable
    add_rmsnorm: Callable
    rope_cos_sin: Callable
    apply_rope: Callable
    silu_mul: Callable
    paged_attention: Callable
    rope_write: Callable        # (q, k, v, cos, sin, cache, layer, slots) -> rotated q; k, v into the cache
    # What only some architectures need. A bundle without one (None here, or a keyword missing from
    # attention_options) cannot run those architectures yet, and Model refuses them when it is built.
    gelu_tanh_mul: Callable | None = None       # Gemma's MLP activation
    softcap: Callable | None = None             # Gemma's final-logit soft-capping
    moe: Callable | None = None                 # Mixtral / Qwen3-MoE: routed experts (reference.moe)
    attention_options: frozenset[str] = frozenset()   # paged_attention's optional keywords: "window", "softcap"
    # rope_attend in one op (the CUDA bundle's: a decode batch in one launch); None: rope_write, then paged_attention
    rope_attention: Callable | None = None
    # whether rope_attend takes into=(buffer, place): a decode row's output written where and as a quantized o
    # projection reads it (QuantMatmul.stored_x), so that o needs no launch to stage it (the CUDA bundle)
    attention_into: bool = False

    def rope_attend(self, q, k, v, cos, sin, cache, layer: int, batch, scale: float, **options):
        """The attention of a block's new tokens from their projections q [T, H, Dh], k and v [T, Hkv, Dh]:
        rope_write at batch.slots, then paged_attention."""
        if self.rope_attention is not None:
            return self.rope_attention(q, k, v, cos, sin, cache, layer, batch, scale, **options)
        q = self.rope_write(q, k, v, cos, sin, cache, layer, batch.slots)
        return self.paged_attention(q, cache, layer, batch, scale, **options)

    def norm_residual(self, h, residual, w, eps: float):
        """(rmsnorm(r) * w, r) for the residual stream r = residual + h, or r = h where the stream starts (residual
        None: the first block's input)."""
        if residual is None:
            return self.rmsnorm(h, w, eps), h
        return self.add_rmsnorm(h, residual, w, eps)

    def gated(self, activation: Activation) -> Callable:
        """The gated-MLP op act(gate) * up for an activation."""
        return {Activation.SILU: self.silu_mul, Activation.GELU_TANH: self.gelu_tanh_mul}[activation]


REFERENCE_OPS = Ops(
    embedding=reference.embedding,
    rmsnorm=reference.rmsnorm,
    add_rmsnorm=reference.add_rmsnorm,
    rope_cos_sin=reference.rope_cos_sin,
    apply_rope=reference.apply_rope,
    silu_mul=reference.silu_mul,
    paged_attention=reference.paged_attention,
    rope_write=rope_write,
    gelu_tanh_mul=reference.gelu_tanh_mul,
    softcap=reference.softcap,
    moe=reference.moe,
    attention_options=frozenset({"window", "softcap"}),
)


def ops_for(device: torch.device) -> Ops:
    if device.type == "cuda":
        return _cuda_ops()
    return REFERENCE_OPS


@functools.cache
def _cuda_ops() -> Ops:
    from ..kernels import cuda_ops   # importing compiles nothing; kernels compile on first launch
    return Ops(**cuda_ops.OPS)

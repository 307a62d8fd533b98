"""The MLP half of a block: a gated MLP, down(act(gate(x)) * up(x)), or a routed mixture of such experts."""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor

from .config import Activation
from .linear import FusedLinear, Linear, QuantLinear
from .ops import Ops, ops_for

CUDA = torch.device("cuda")


class Mlp:
    def __init__(self, gate: Linear | QuantLinear, up: Linear | QuantLinear, down: Linear | QuantLinear,
                 activation: Activation = Activation.SILU):
        self.gate, self.up, self.down, self.activation = gate, up, down, activation
        self.gate_up = FusedLinear([gate, up])          # one launch on CUDA for quantized gate/up
        # a quantized down projection on CUDA applies silu(gate) * up as it stages its input: one launch less
        kernel = getattr(down, "kernel", None)
        self.gated_down = kernel if kernel is not None and activation is Activation.SILU else None

    def __call__(self, x: Tensor, ops: Ops) -> Tensor:
        return self._down(*self.gate_up(x), ops)

    def after_norm(self, h: Tensor | None, residual: Tensor, w: Tensor, eps: float,
                   ops: Ops) -> tuple[Tensor | None, Tensor]:
        """(self(x), r) for x, r = ops.norm_residual(h, residual, w, eps): on CUDA the norm and the activation run
        inside the gate/up and down launches (FusedLinear.after_norm; h None: the launch before fed gate/up's x).
        If down feeds the next block's norm (QuantMatmul.feeds), (None, r + self(x)) instead. A fed gate/up that
        stages down's x itself (QuantMatmul.link_gating) goes straight on to down."""
        down = self.gated_down
        if h is None and self.gate_up.kernel.gating is not None:
            staged = self.gate_up.kernel.forward_gated()
        else:
            (gate, up), residual = self.gate_up.after_norm(h, residual, w, eps, ops)
            if down is None or not down.feeds(gate.shape[0]):
                return self._down(gate, up, ops), residual
            staged = down.stage_gated(gate, up)
        if down.feeds(1):
            return None, down.forward_feeding(staged, residual)
        return down.forward_stored(staged), residual

    def _down(self, gate: Tensor, up: Tensor, ops: Ops) -> Tensor:
        if self.gated_down is not None:
            return self.gated_down(gate, up)
        return self.down(ops.gated(self.activation)(gate, up))


class Experts(Sequence):
    """An MoE layer's experts as ops.moe takes them: experts[e](rows [t, D]) -> [t, D]. `kernel`: on CUDA with
    quantized experts, their expert-indexed launches (kernels.moe.MoeKernel), which the CUDA op uses instead of
    calling the experts one by one; None otherwise."""

    def __init__(self, mlps: list[Mlp], ops: Ops, kernel):
        self.mlps, self.ops, self.kernel = mlps, ops, kernel

    def __getitem__(self, e: int):
        return partial(self.mlps[e], ops=self.ops)

    def __len__(self) -> int:
        return len(self.mlps)


class MoeMlp:
    """Mixtral / Qwen3-MoE: the router scores every expert per token; the top_k experts' outputs are summed,
    weighted by their softmax probabilities (rescaled to sum to 1 when renormalize)."""

    def __init__(self, router: Linear | QuantLinear, experts: list[Mlp], top_k: int, renormalize: bool):
        self.router, self.experts, self.top_k, self.renormalize = router, experts, top_k, renormalize
        self.kernel = None
        if getattr(experts[0].down, "kernel", None) is not None:     # quantized experts placed on CUDA
            from ..kernels import moe
            act = ops_for(CUDA).gated(experts[0].activation)
            self.kernel = moe.prepare(experts, act, top_k)

    def __call__(self, x: Tensor, ops: Ops) -> Tensor:
        experts = Experts(self.experts, ops, self.kernel)
        return ops.moe(x, self.router(x), experts, self.top_k, self.renormalize)   # router(x): [T, E]

    def after_norm(self, h: Tensor, residual: Tensor, w: Tensor, eps: float, ops: Ops) -> tuple[Tensor, Tensor]:
        """(self(x), r) for x, r = ops.norm_residual(h, residual, w, eps) (the router reads x too)."""
        x, residual = ops.norm_residual(h, residual, w, eps)
        return self(x, ops), residual

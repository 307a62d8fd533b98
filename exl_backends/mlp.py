"""The MLP half of a block: a gated MLP, down(act(gate(x)) * up(x)), or a routed mixture of such experts."""
from __future__ import annotations

from functools import partial

from torch import Tensor

from .config import Activation
from .linear import FusedLinear, Linear, QuantLinear
from .ops import Ops


class Mlp:
    def __init__(self, gate: Linear | QuantLinear, up: Linear | QuantLinear, down: Linear | QuantLinear,
                 activation: Activation = Activation.SILU):
        self.gate, self.up, self.down, self.activation = gate, up, down, activation
        self.gate_up = FusedLinear([gate, up])          # one launch on CUDA for quantized gate/up

    def __call__(self, x: Tensor, ops: Ops) -> Tensor:
        return self.down(ops.gated(self.activation)(*self.gate_up(x)))


class MoeMlp:
    """Mixtral / Qwen3-MoE: the router scores every expert per token; the top_k experts' outputs are summed,
    weighted by their softmax probabilities (rescaled to sum to 1 when renormalize)."""

    def __init__(self, router: Linear | QuantLinear, experts: list[Mlp], top_k: int, renormalize: bool):
        self.router, self.experts, self.top_k, self.renormalize = router, experts, top_k, renormalize

    def __call__(self, x: Tensor, ops: Ops) -> Tensor:
        experts = [partial(e, ops=ops) for e in self.experts]
        return ops.moe(x, self.router(x), experts, self.top_k, self.renormalize)   # router(x): [T, E]

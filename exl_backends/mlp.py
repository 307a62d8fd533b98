"""The MLP half of a block: SwiGLU, down(silu(gate(x)) * up(x))."""
from __future__ import annotations

from torch import Tensor

from .linear import Linear, QuantLinear
from .ops import Ops


class Mlp:
    def __init__(self, gate: Linear | QuantLinear, up: Linear | QuantLinear, down: Linear | QuantLinear):
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x: Tensor, ops: Ops) -> Tensor:
        return self.down(ops.silu_mul(self.gate(x), self.up(x)))

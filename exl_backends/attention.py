"""The attention half of a block: q/k/v projections, RoPE, cache write, paged attention, o projection."""
from __future__ import annotations

import math

from torch import Tensor

from .batch import Batch
from .cache import KVCache
from .linear import Linear, QuantLinear
from .ops import Ops


class Attention:
    def __init__(self, layer: int, q: Linear | QuantLinear, k: Linear | QuantLinear, v: Linear | QuantLinear,
                 o: Linear | QuantLinear, n_heads: int, n_kv_heads: int, head_dim: int):
        self.layer, self.q, self.k, self.v, self.o = layer, q, k, v, o
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = 1.0 / math.sqrt(head_dim)

    def __call__(self, x: Tensor, batch: Batch, cache: KVCache, cos: Tensor, sin: Tensor, ops: Ops) -> Tensor:
        t = x.shape[0]
        q = self.q(x).view(t, self.n_heads, self.head_dim)                 # [T, H, Dh]
        k = self.k(x).view(t, self.n_kv_heads, self.head_dim)              # [T, Hkv, Dh]
        v = self.v(x).view(t, self.n_kv_heads, self.head_dim)
        q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
        cache.write(self.layer, k, v, batch.slots)
        out = ops.paged_attention(q, cache, self.layer, batch, self.scale)  # [T, H, Dh]
        return self.o(out.reshape(t, self.n_heads * self.head_dim))

"""The attention half of a block: q/k/v projections, optional q/k norms, RoPE, cache write, paged attention
(optionally windowed and soft-capped), o projection."""
from __future__ import annotations

from torch import Tensor

from .batch import Batch
from .cache import KVCache
from .linear import FusedLinear, Linear, QuantLinear
from .ops import Ops


class Attention:
    def __init__(self, layer: int, q: Linear | QuantLinear, k: Linear | QuantLinear, v: Linear | QuantLinear,
                 o: Linear | QuantLinear, n_heads: int, n_kv_heads: int, head_dim: int, scale: float | None = None,
                 q_norm: Tensor | None = None, k_norm: Tensor | None = None, norm_eps: float = 1e-6,
                 window: int | None = None, softcap: float | None = None):
        self.layer, self.q, self.k, self.v, self.o = layer, q, k, v, o
        self.qkv = FusedLinear([q, k, v])              # one launch on CUDA for quantized q/k/v
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.q_norm, self.k_norm, self.norm_eps = q_norm, k_norm, norm_eps      # [Dh] each, or None
        # paged_attention's optional keywords this layer needs (an Ops bundle lists those it implements)
        self.options = {name: value for name, value in (("window", window), ("softcap", softcap))
                        if value is not None}

    def __call__(self, x: Tensor, batch: Batch, cache: KVCache, cos: Tensor, sin: Tensor, ops: Ops) -> Tensor:
        return self.attend_project(self.qkv(x), batch, cache, cos, sin, ops)[0]

    def attend_project(self, qkv: list[Tensor], batch: Batch, cache: KVCache, cos: Tensor, sin: Tensor, ops: Ops,
                       residual: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
        """The outputs of self.qkv [T, *] -> (the o projection's output a [T, D], residual): rope_attend, then o.
        A decode row whose o can read the attention's output as it is written (o_input) takes one launch less; if
        o also feeds the norm after it (QuantMatmul.feeds), a is None and o returns the residual with a added,
        having left the MLP's normed input in place (QuantMatmul.forward_feeding)."""
        into = self.o_input(qkv[0].shape[0], ops)
        if into is None:
            return self.o(self.rope_attend(qkv, batch, cache, cos, sin, ops)), residual
        q, k, v = self.heads(qkv, ops)
        ops.rope_attend(q, k, v, cos, sin, cache, self.layer, batch, self.scale, into=into, **self.options)
        if residual is not None and self.o.kernel.feeds(q.shape[0]):
            return None, self.o.kernel.forward_feeding(into[0], residual)
        return self.o.kernel.forward_stored(into[0]), residual

    def o_input(self, rows: int, ops: Ops) -> tuple[Tensor, Tensor] | None:
        """Where the attention of a decode row can write its output for a quantized o projection to read it as is,
        without a launch that stages it (QuantMatmul.stored_x); None where the ops or o cannot."""
        if not ops.attention_into or not isinstance(self.o, QuantLinear) or self.o.kernel is None:
            return None
        return self.o.kernel.stored_x(rows)

    def rope_attend(self, qkv: list[Tensor], batch: Batch, cache: KVCache, cos: Tensor, sin: Tensor,
                    ops: Ops) -> Tensor:
        """The outputs of self.qkv [T, *] -> the attention output [T, H * Dh], the roped keys and the values
        written into cache at batch.slots: project, then attend (on CUDA one launch for a decode batch)."""
        q, k, v = self.heads(qkv, ops)
        out = ops.rope_attend(q, k, v, cos, sin, cache, self.layer, batch, self.scale, **self.options)
        return out.reshape(q.shape[0], self.n_heads * self.head_dim)

    def project(self, qkv: list[Tensor], slots: Tensor, cache: KVCache, cos: Tensor, sin: Tensor, ops: Ops) -> Tensor:
        """The outputs of self.qkv [T, *] -> the roped queries [T, H, Dh]; the roped keys and the values written
        into cache at slots. Row by row (a CUDA graph of many tokens captures it; attend, which mixes rows, runs
        between such graphs)."""
        q, k, v = self.heads(qkv, ops)
        return ops.rope_write(q, k, v, cos, sin, cache, self.layer, slots)   # k roped; k, v into the cache

    def heads(self, qkv: list[Tensor], ops: Ops) -> tuple[Tensor, Tensor, Tensor]:
        """The outputs of self.qkv [T, *] as q [T, H, Dh], k and v [T, Hkv, Dh], q and k normed where the
        architecture norms them."""
        q, k, v = qkv
        t = q.shape[0]
        q = q.view(t, self.n_heads, self.head_dim)
        k = k.view(t, self.n_kv_heads, self.head_dim)
        v = v.view(t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = ops.rmsnorm(q.reshape(-1, self.head_dim), self.q_norm, self.norm_eps).view(q.shape)
            k = ops.rmsnorm(k.reshape(-1, self.head_dim), self.k_norm, self.norm_eps).view(k.shape)
        return q, k, v

    def attend(self, q: Tensor, batch: Batch, cache: KVCache, ops: Ops) -> Tensor:
        """q [T, H, Dh] -> the attention output [T, H * Dh], ahead of the o projection."""
        out = ops.paged_attention(q, cache, self.layer, batch, self.scale, **self.options)   # [T, H, Dh]
        return out.reshape(q.shape[0], self.n_heads * self.head_dim)

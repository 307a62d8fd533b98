"""The block's ops on CUDA, with the signatures of ops.REFERENCE_OPS: the kernels of this folder, plus one torch
op that needs no kernel of its own (the embedding gather).
A plain mapping of ops.Ops' fields: ops.py bundles it (kernels import nothing of the model above them)."""
from __future__ import annotations

from ..model import reference
from . import activation, attention, kv_cache, moe, norm, rope

OPS = dict(
    embedding=reference.embedding,
    rmsnorm=norm.rmsnorm,
    add_rmsnorm=norm.add_rmsnorm,
    rope_cos_sin=rope.rope_cos_sin,
    apply_rope=rope.apply_rope,
    silu_mul=activation.silu_mul,
    paged_attention=attention.paged_attention,
    rope_write=kv_cache.rope_write,
    gelu_tanh_mul=activation.gelu_tanh_mul,
    softcap=activation.softcap,
    moe=moe.moe,
    attention_options=frozenset({"window", "softcap"}),
    rope_attention=attention.rope_attention,
    attention_into=True,
)

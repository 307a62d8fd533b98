"""The decoder: embed -> blocks -> norm -> head. One class for every architecture; traits decide the rest."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from . import formats
from .attention import Attention
from .batch import Batch
from .cache import KVCache
from .config import ModelConfig
from .linear import Linear, QuantLinear
from .mlp import Mlp
from .ops import ops_for
from .tensors import FLOAT_DTYPES, TensorStore


@dataclass
class Block:
    input_norm: Tensor
    attention: Attention
    post_attn_norm: Tensor
    mlp: Mlp


class Model:
    def __init__(self, config: ModelConfig, embed: Tensor, blocks: list[Block], norm: Tensor,
                 lm_head: Linear | QuantLinear, device: torch.device, dtype: torch.dtype):
        self.config, self.embed, self.blocks, self.norm, self.lm_head = config, embed, blocks, norm, lm_head
        self.device, self.dtype = device, dtype
        self.ops = ops_for(device)
        self.inv_freq = config.rope.inv_freq(config.head_dim).to(device)
        self.rope_scale = config.rope.cos_sin_scale()

    @classmethod
    def load(cls, path: str | Path, config: ModelConfig | None = None, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32) -> "Model":
        config = config or ModelConfig.from_dir(path)
        ckpt = formats.open_checkpoint(path)
        device = torch.device(device)
        validate(ckpt, config)
        return cls(config, *_load_weights(ckpt, config, device, dtype), device, dtype)

    def forward(self, batch: Batch, cache: KVCache) -> Tensor:
        """Runs the batch's tokens, writing their K/V into cache. Returns f32 logits [R, vocab] for
        batch.logit_rows (every row when None)."""
        ops, eps = self.ops, self.config.rms_norm_eps
        cos, sin = ops.rope_cos_sin(batch.positions, self.inv_freq, self.rope_scale, self.dtype)
        residual = ops.embedding(batch.input_ids, self.embed)                      # [T, D]
        x = ops.rmsnorm(residual, self.blocks[0].input_norm, eps)
        for i, block in enumerate(self.blocks):
            a = block.attention(x, batch, cache, cos, sin, ops)
            x, residual = ops.add_rmsnorm(a, residual, block.post_attn_norm, eps)
            m = block.mlp(x, ops)
            next_norm = self.blocks[i + 1].input_norm if i + 1 < len(self.blocks) else self.norm
            x, residual = ops.add_rmsnorm(m, residual, next_norm, eps)
        if batch.logit_rows is not None:
            x = x[batch.logit_rows]
        return self.lm_head(x).float()


def _key(config: ModelConfig, i: int, name: str) -> str:
    return f"{config.traits.names.layer.format(i=i)}.{name}"


def linears(config: ModelConfig) -> list[tuple[str, int, int, bool]]:
    """(key, in_features, out_features, has_bias) of every linear layer, lm_head last."""
    n = config.traits.names
    d, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    qkv_bias = config.traits.qkv_bias
    out = []
    for i in range(config.n_layers):
        out += [(_key(config, i, n.q), d, config.n_heads * hd, qkv_bias),
                (_key(config, i, n.k), d, config.n_kv_heads * hd, qkv_bias),
                (_key(config, i, n.v), d, config.n_kv_heads * hd, qkv_bias),
                (_key(config, i, n.o), config.n_heads * hd, d, False),
                (_key(config, i, n.gate), d, inter, False),
                (_key(config, i, n.up), d, inter, False),
                (_key(config, i, n.down), inter, d, False)]
    return out


def head_is_tied(store: TensorStore, config: ModelConfig) -> bool:
    head = config.traits.names.lm_head
    return config.tie_word_embeddings and not any(f"{head}.{s}" in store for s in ("weight", "q_weight", "qweight"))


def validate(ckpt: formats.Checkpoint, config: ModelConfig) -> None:
    """Every tensor the model needs: present, right shape, right dtype; before anything is read."""
    n, d, store = config.traits.names, config.hidden_size, ckpt.store
    store.expect(f"{n.embed}.weight", (config.vocab_size, d), FLOAT_DTYPES)
    store.expect(f"{n.final_norm}.weight", (d,), FLOAT_DTYPES)
    for i in range(config.n_layers):
        for norm in (n.input_norm, n.post_attn_norm):
            store.expect(f"{_key(config, i, norm)}.weight", (d,), FLOAT_DTYPES)
    for key, k, m, bias in linears(config):
        formats.check_linear(ckpt, key, k, m, bias)
    if not head_is_tied(store, config):
        formats.check_linear(ckpt, n.lm_head, d, config.vocab_size, False)


def _load_weights(ckpt: formats.Checkpoint, config: ModelConfig, device: torch.device, dtype: torch.dtype):
    n, store = config.traits.names, ckpt.store

    def vec(name):
        return store.get(name).to(device, dtype)

    def lin(key, k, m, bias):
        return formats.load_linear(ckpt, key, k, m, bias, device, dtype)

    specs = iter(linears(config))
    blocks = []
    for i in range(config.n_layers):
        q, k, v, o, gate, up, down = (lin(*next(specs)) for _ in range(7))
        blocks.append(Block(
            input_norm=vec(f"{_key(config, i, n.input_norm)}.weight"),
            attention=Attention(i, q, k, v, o, config.n_heads, config.n_kv_heads, config.head_dim),
            post_attn_norm=vec(f"{_key(config, i, n.post_attn_norm)}.weight"),
            mlp=Mlp(gate, up, down)))
    embed = vec(f"{n.embed}.weight")
    if head_is_tied(store, config):
        lm_head = Linear(embed)
    else:
        lm_head = lin(n.lm_head, config.hidden_size, config.vocab_size, False)
    return embed, blocks, vec(f"{n.final_norm}.weight"), lm_head

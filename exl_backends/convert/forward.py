"""Decoder layers run one at a time over calibration rows, without a KV cache (causal attention over each whole
row), with the reference ops, for the architectures the converter handles (CONVERTIBLE: Llama-style layers,
Qwen2's q/k/v biases, Mistral/Qwen2 sliding windows). The converter and the quality receipt use it: only one layer's weights are on the
device at a time, and the hidden states of all rows stay on the CPU between layers."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import Tensor

from .. import formats, reference
from ..config import ModelConfig
from ..tensors import TensorStore
from .gptq import Hessian

CONVERTIBLE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ATTN = ("q", "k", "v", "o")        # TensorNames fields of the attention projections
MLP = ("gate", "up", "down")
CHUNK_TOKENS = 8192                # tokens per forward chunk (rows are never split)


@dataclass
class LayerWeights:
    """One decoder layer, dense, f32 on the compute device. weights: projection field -> [N, K]."""
    input_norm: Tensor
    post_attn_norm: Tensor
    weights: dict[str, Tensor]
    biases: dict[str, Tensor] = field(default_factory=dict)
    window: int | None = None           # sliding-window attention of this layer (Mistral, Qwen2), else None

    def with_weights(self, new: dict[str, Tensor]) -> "LayerWeights":
        return replace(self, weights={**self.weights, **new})


@dataclass
class Context:
    """What every layer's forward needs: the config, the device, and cos/sin for positions 0..length-1."""
    config: ModelConfig
    device: torch.device
    cos: Tensor
    sin: Tensor

    @classmethod
    def build(cls, config: ModelConfig, length: int, device: torch.device) -> "Context":
        positions = torch.arange(length, device=device)
        cos, sin = reference.rope_cos_sin(positions, config.rope.inv_freq(config.head_dim).to(device),
                                          config.rope.cos_sin_scale(), torch.float32)
        return cls(config, device, cos, sin)


def layer_key(config: ModelConfig, i: int, proj: str) -> str:
    """HF module key of projection field `proj` ('q', 'gate', ...) of layer i."""
    return f"{config.traits.names.layer.format(i=i)}.{getattr(config.traits.names, proj)}"


def projection_shape(config: ModelConfig, proj: str) -> tuple[int, int]:
    """(in_features, out_features) of a projection."""
    d, attn = config.hidden_size, config.n_heads * config.head_dim
    kv = config.n_kv_heads * config.head_dim
    return {"q": (d, attn), "k": (d, kv), "v": (d, kv), "o": (attn, d),
            "gate": (d, config.intermediate_size), "up": (d, config.intermediate_size),
            "down": (config.intermediate_size, d)}[proj]


def has_bias(config: ModelConfig, proj: str) -> bool:
    return config.traits.qkv_bias and proj in ("q", "k", "v")


def load_layer(ckpt: formats.Checkpoint, config: ModelConfig, i: int, device: torch.device,
               projections: tuple[str, ...] = ATTN + MLP) -> LayerWeights:
    """Layer i from any checkpoint our loader reads (fp16 source or quantized output), dequantized to f32."""
    names, store = config.traits.names, ckpt.store
    prefix = names.layer.format(i=i)
    weights, biases = {}, {}
    for proj in projections:
        k, n = projection_shape(config, proj)
        lin = formats.load_linear(ckpt, layer_key(config, i, proj), k, n, has_bias(config, proj), device,
                                  torch.float32)
        weights[proj] = lin.dense_weight().to(device, torch.float32)
        if lin.bias is not None:
            biases[proj] = lin.bias.to(device, torch.float32)
    return LayerWeights(store.get(f"{prefix}.{names.input_norm}.weight").to(device, torch.float32),
                        store.get(f"{prefix}.{names.post_attn_norm}.weight").to(device, torch.float32),
                        weights, biases, config.layer_windows[i])


def chunks(n_rows: int, length: int) -> list[slice]:
    per = max(1, CHUNK_TOKENS // length)
    return [slice(r, min(r + per, n_rows)) for r in range(0, n_rows, per)]


def attention_chunk(x: Tensor, lw: LayerWeights, ctx: Context) -> tuple[Tensor, Tensor, Tensor]:
    """x [R, L, D] on the device -> (output with residual [R, L, D], post-norm input of q/k/v [R*L, D],
    attention output = input of o [R*L, H*Dh])."""
    cfg = ctx.config
    rows, length, d = x.shape
    h = reference.rmsnorm(x.reshape(-1, d), lw.input_norm, cfg.rms_norm_eps)            # [R*L, D]
    q = reference.linear(h, lw.weights["q"], lw.biases.get("q")).view(rows, length, cfg.n_heads, cfg.head_dim)
    k = reference.linear(h, lw.weights["k"], lw.biases.get("k")).view(rows, length, cfg.n_kv_heads, cfg.head_dim)
    v = reference.linear(h, lw.weights["v"], lw.biases.get("v")).view(rows, length, cfg.n_kv_heads, cfg.head_dim)
    positions = torch.arange(length, device=x.device)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    out = torch.stack([reference.attention(reference.apply_rope(q[r], ctx.cos, ctx.sin),
                                           reference.apply_rope(k[r], ctx.cos, ctx.sin), v[r], positions, scale,
                                           lw.window)
                       for r in range(rows)])                                            # [R, L, H, Dh]
    a = out.reshape(rows * length, -1)
    y = x + reference.linear(a, lw.weights["o"]).view(rows, length, d)
    return y, h, a


def mlp_chunk(x: Tensor, lw: LayerWeights, ctx: Context) -> tuple[Tensor, Tensor, Tensor]:
    """x [R, L, D] -> (output with residual, post-norm input of gate/up [R*L, D], input of down [R*L, I])."""
    rows, length, d = x.shape
    h = reference.rmsnorm(x.reshape(-1, d), lw.post_attn_norm, ctx.config.rms_norm_eps)
    a = reference.silu_mul(reference.linear(h, lw.weights["gate"]), reference.linear(h, lw.weights["up"]))
    y = x + reference.linear(a, lw.weights["down"]).view(rows, length, d)
    return y, h, a


Sublayer = Callable[[Tensor, LayerWeights, Context], tuple[Tensor, Tensor, Tensor]]


def run(sublayer: Sublayer, states: Tensor, lw: LayerWeights, ctx: Context,
        hessians: tuple[Hessian, Hessian] | None = None) -> Tensor:
    """Runs a sub-layer over all rows (states [R, L, D] f32 on the CPU), chunk by chunk on the device;
    optionally accumulates the Hessians of its two linear inputs. Returns the outputs [R, L, D] on the CPU."""
    out = torch.empty_like(states)
    for rows in chunks(*states.shape[:2]):
        x = states[rows].to(ctx.device)
        y, first, second = sublayer(x, lw, ctx)
        if hessians is not None:
            hessians[0].add(first.view(x.shape[0], x.shape[1], -1))
            hessians[1].add(second.view(x.shape[0], x.shape[1], -1))
        out[rows] = y.to(states.device)
    return out


def relative_error(sublayer: Sublayer, states: Tensor, reference_out: Tensor, lw: LayerWeights,
                   ctx: Context) -> float:
    """Mean per-token relative error ||y_t - y_ref,t|| / ||y_ref,t|| of the sub-layer output with lw."""
    errors = []
    for rows in chunks(*states.shape[:2]):
        y = sublayer(states[rows].to(ctx.device), lw, ctx)[0]
        errors.append(token_errors(y, reference_out[rows].to(ctx.device)))
    return float(torch.cat(errors).mean())


def token_errors(y: Tensor, ref: Tensor) -> Tensor:
    """||y_t - ref_t|| / ||ref_t|| per token of [R, L, D] -> [R, L].

    Per token rather than ExLlamaV2's per row (§10.7): past the first layers the first token of every row
    carries massive activations (in SmolLM2-135M its hidden state is ~170x the norm of the others), so a
    row's Frobenius norm measures that one token and hides the error on all others; each token is normalised
    on its own by the next RMSNorm, so its own relative error is what reaches the rest of the model."""
    return torch.linalg.vector_norm(y - ref, dim=-1) / torch.linalg.vector_norm(ref, dim=-1)


def embed(store: TensorStore, config: ModelConfig, tokens: Tensor) -> Tensor:
    """tokens [R, L] -> hidden states [R, L, D] f32 on the CPU."""
    table = store.get(f"{config.traits.names.embed}.weight")
    return table[torch.where(tokens < table.shape[0], tokens, 0)].float()     # out-of-table ids -> 0 (§10.2)


def output_head(ckpt: formats.Checkpoint, config: ModelConfig, device: torch.device) -> Tensor:
    """lm_head of any checkpoint our loader reads, dense f32 [vocab, D] (quantized heads dequantized)."""
    names, store = config.traits.names, ckpt.store
    if not any(f"{names.lm_head}.{s}" in store for s in ("weight", "q_weight", "qweight")):
        return store.get(f"{names.embed}.weight").to(device, torch.float32)
    lin = formats.load_linear(ckpt, names.lm_head, config.hidden_size, config.vocab_size, False, device,
                              torch.float32)
    return lin.dense_weight().to(device, torch.float32)

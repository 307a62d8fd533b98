"""config.json -> a frozen ModelConfig; ARCHITECTURES: one row of traits per HF architecture."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import ConfigError, UnsupportedArchitectureError


@dataclass(frozen=True)
class TensorNames:
    """HF tensor-name templates; `{i}` is the layer index."""
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    layer: str = "model.layers.{i}"
    input_norm: str = "input_layernorm"
    post_attn_norm: str = "post_attention_layernorm"
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    o: str = "self_attn.o_proj"
    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"
    down: str = "mlp.down_proj"


LLAMA_NAMES = TensorNames()


@dataclass(frozen=True)
class ArchTraits:
    qkv_bias: bool = False          # Qwen2: q/k/v projections carry a bias
    names: TensorNames = LLAMA_NAMES


ARCHITECTURES: dict[str, ArchTraits] = {
    "LlamaForCausalLM": ArchTraits(),
    "MistralForCausalLM": ArchTraits(),
    "Qwen2ForCausalLM": ArchTraits(qkv_bias=True),
}

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0            # llama3
    high_freq_factor: float = 4.0           # llama3
    original_max_position: int = 8192       # llama3, yarn
    beta_fast: float = 32.0                 # yarn
    beta_slow: float = 1.0                  # yarn
    attention_factor: float | None = None   # yarn: scales cos/sin
    mscale: float | None = None             # yarn
    mscale_all_dim: float | None = None     # yarn
    truncate: bool = True                   # yarn

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """Inverse frequencies [head_dim/2] f32, as transformers computes them for this rope type."""
        base = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.type == "default":
            return base
        if self.type == "linear":
            return base / self.factor
        if self.type == "llama3":
            return self._llama3(base)
        return self._yarn(head_dim)

    def cos_sin_scale(self) -> float:
        """Factor applied to cos and sin (only yarn uses one)."""
        if self.type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if self.mscale and self.mscale_all_dim:
            return float(mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim))
        return mscale(self.factor)

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        low_wavelen = self.original_max_position / self.low_freq_factor
        high_wavelen = self.original_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)

    def _yarn(self, dim: int) -> torch.Tensor:
        def correction_dim(rotations):
            return dim * math.log(self.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))
        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        pos_freqs = self.theta ** (torch.arange(0, dim, 2).float() / dim)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


@dataclass(frozen=True)
class ModelConfig:
    """What the checkpoint's config.json says, resolved once."""
    architecture: str
    traits: ArchTraits
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ConfigError(f"{file} not found: a model directory needs the config.json of its Hugging Face "
                              f"checkpoint (for a GGUF file, run `exl import-gguf FILE OUT_DIR` first)")
        try:
            raw = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{file} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{file} must hold a JSON object")
        return cls.from_dict(raw, source=str(file))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"{source}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")

        def need(key, kind=int):
            if key not in raw or raw[key] is None:
                raise ConfigError(f"{source}: required field {key!r} is missing")
            try:
                value = kind(raw[key])
            except (TypeError, ValueError):
                raise ConfigError(f"{source}: field {key!r} = {raw[key]!r} is not a valid {kind.__name__}") from None
            if kind is int and value <= 0:
                raise ConfigError(f"{source}: field {key!r} must be positive, got {value}")
            return value

        hidden, n_heads = need("hidden_size"), need("num_attention_heads")
        n_kv_heads = need("num_key_value_heads") if raw.get("num_key_value_heads") else n_heads
        head_dim = need("head_dim") if raw.get("head_dim") else hidden // n_heads
        if n_heads % n_kv_heads:
            raise ConfigError(f"{source}: num_attention_heads ({n_heads}) is not a multiple of "
                              f"num_key_value_heads ({n_kv_heads})")
        if head_dim % 2:
            raise ConfigError(f"{source}: head_dim must be even for rotary embeddings, got {head_dim}")
        max_pos = need("max_position_embeddings")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            traits=ARCHITECTURES[arch],
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            n_layers=need("num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=need("rms_norm_eps", float),
            rope=_rope_from(raw, max_pos, source),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            raw=raw,
        )


def _rope_from(raw: dict, max_pos: int, source: str) -> RopeConfig:
    """Reads both layouts: transformers 5's `rope_parameters` and the classic `rope_theta` + `rope_scaling`."""
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{source}: partial rotary embeddings (partial_rotary_factor) are not supported")
    original = params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings") or max_pos
    factor = params.get("factor")
    if rope_type != "default" and factor is None:
        if rope_type != "yarn":
            raise ConfigError(f"{source}: rope type {rope_type!r} needs a 'factor'")
        factor = max_pos / original
    return RopeConfig(
        theta=float(theta), type=rope_type, factor=float(factor or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"), mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"), truncate=bool(params.get("truncate", True)),
    )

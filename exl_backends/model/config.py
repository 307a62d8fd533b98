"""config.json -> a frozen ModelConfig; ARCHITECTURES: one row of traits per HF architecture."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum, auto
from pathlib import Path

import torch

from ..errors import ConfigError, UnsupportedArchitectureError


@dataclass(frozen=True)
class TensorNames:
    """HF tensor-name templates; `{i}` is the layer index, `{e}` the expert index. A name left None is a tensor
    the architecture does not have."""
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    layer: str = "model.layers.{i}"
    input_norm: str = "input_layernorm"
    post_attn_norm: str = "post_attention_layernorm"    # the norm in front of the MLP
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    o: str = "self_attn.o_proj"
    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"
    down: str = "mlp.down_proj"
    q_norm: str | None = None          # Qwen3, Gemma 3: RMSNorm over each head of q (and k) before RoPE
    k_norm: str | None = None
    attn_out_norm: str | None = None   # Gemma 2/3: normalises the attention output before the residual add
    mlp_out_norm: str | None = None    # Gemma 2/3: normalises the MLP output before the residual add
    qkv: str | None = None             # Phi-3: q, k, v fused in one tensor (fp16 files; EXL2 writes them split)
    gate_up: str | None = None         # Phi-3: gate and up fused in one tensor
    router: str | None = None          # MoE: the router's linear, [n_experts, hidden]
    expert: str | None = None          # MoE: one expert's module, with expert_gate/up/down inside it
    expert_gate: str | None = None
    expert_up: str | None = None
    expert_down: str | None = None


LLAMA_NAMES = TensorNames()
QK_NORM_NAMES = TensorNames(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
GEMMA2_NAMES = TensorNames(post_attn_norm="pre_feedforward_layernorm", attn_out_norm="post_attention_layernorm",
                           mlp_out_norm="post_feedforward_layernorm")
GEMMA3_NAMES = TensorNames(post_attn_norm="pre_feedforward_layernorm", attn_out_norm="post_attention_layernorm",
                           mlp_out_norm="post_feedforward_layernorm", q_norm="self_attn.q_norm",
                           k_norm="self_attn.k_norm")
PHI3_NAMES = TensorNames(qkv="self_attn.qkv_proj", gate_up="mlp.gate_up_proj")
MIXTRAL_NAMES = TensorNames(router="block_sparse_moe.gate", expert="block_sparse_moe.experts.{e}",
                            expert_gate="w1", expert_up="w3", expert_down="w2")
QWEN3_MOE_NAMES = TensorNames(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", router="mlp.gate",
                              expert="mlp.experts.{e}", expert_gate="gate_proj", expert_up="up_proj",
                              expert_down="down_proj")


class Activation(Enum):
    """The gate activation of the gated MLP, as config.json names it."""
    SILU = "silu"
    GELU_TANH = "gelu_pytorch_tanh"


ACTIVATION_NAMES = {"silu": Activation.SILU, "swish": Activation.SILU,
                    "gelu_pytorch_tanh": Activation.GELU_TANH, "gelu_new": Activation.GELU_TANH}


class Windows(Enum):
    """Which layers use config.json's sliding_window (when it is set)."""
    NONE = auto()          # Llama: no sliding-window attention
    ALL_LAYERS = auto()    # Mistral, Mixtral, Phi-3, Qwen3-MoE: every layer
    LAYER_TYPES = auto()   # Qwen2/3, Gemma 2/3: the layers layer_types marks "sliding_attention"; without a
                           # layer_types list, derived as transformers does (window_pattern, or max_window_layers)


@dataclass(frozen=True)
class MoeTraits:
    """Where an MoE architecture keeps its numbers in config.json."""
    intermediate_key: str = "intermediate_size"   # each expert's intermediate size (Qwen3-MoE: moe_intermediate_size)
    renormalize_key: str | None = None            # config flag for renormalising the top-k weights; None: always


@dataclass(frozen=True)
class ArchTraits:
    qkv_bias: bool = False                  # Qwen2: q/k/v projections carry a bias
    activation: Activation = Activation.SILU    # the MLP's gate activation when config.json names none
    activation_key: str = "hidden_act"      # config.json's name for it (Gemma: hidden_activation)
    norm_offset: float = 0.0                # Gemma: RMSNorms scale by (1 + w)
    scale_embeddings: bool = False          # Gemma: embeddings times sqrt(hidden_size)
    tied_embeddings: bool = False           # Gemma: tie_word_embeddings defaults to true
    query_pre_attn_scalar: bool = False     # Gemma: attention scale is query_pre_attn_scalar^-0.5, not head_dim's
    attn_softcap: bool = False              # Gemma 2: attention scores soft-capped by attn_logit_softcapping
    final_softcap: bool = False             # Gemma 2/3: logits soft-capped by final_logit_softcapping
    local_rope: bool = False                # Gemma 3: sliding-window layers have their own rope base
    windows: Windows = Windows.NONE
    window_switch: str | None = None        # Qwen: sliding_window applies only when this config flag is true
    window_pattern: int | None = None       # Gemma: without layer_types, every n-th layer is global
    moe: MoeTraits | None = None            # Mixtral, Qwen3-MoE: MLPs are routed mixtures of experts
    names: TensorNames = LLAMA_NAMES


GEMMA = dict(activation=Activation.GELU_TANH, activation_key="hidden_activation", norm_offset=1.0,
             scale_embeddings=True, tied_embeddings=True, query_pre_attn_scalar=True, final_softcap=True,
             windows=Windows.LAYER_TYPES)

ARCHITECTURES: dict[str, ArchTraits] = {
    "LlamaForCausalLM": ArchTraits(),
    "MistralForCausalLM": ArchTraits(windows=Windows.ALL_LAYERS),
    "Qwen2ForCausalLM": ArchTraits(qkv_bias=True, windows=Windows.LAYER_TYPES, window_switch="use_sliding_window"),
    "Qwen3ForCausalLM": ArchTraits(windows=Windows.LAYER_TYPES, window_switch="use_sliding_window",
                                   names=QK_NORM_NAMES),
    "Gemma2ForCausalLM": ArchTraits(**GEMMA, attn_softcap=True, window_pattern=2, names=GEMMA2_NAMES),
    "Gemma3ForCausalLM": ArchTraits(**GEMMA, local_rope=True, window_pattern=6, names=GEMMA3_NAMES),
    "Phi3ForCausalLM": ArchTraits(windows=Windows.ALL_LAYERS, names=PHI3_NAMES),
    "MixtralForCausalLM": ArchTraits(windows=Windows.ALL_LAYERS, moe=MoeTraits(), names=MIXTRAL_NAMES),
    "Qwen3MoeForCausalLM": ArchTraits(windows=Windows.ALL_LAYERS, window_switch="use_sliding_window",
                                      moe=MoeTraits("moe_intermediate_size", "norm_topk_prob"),
                                      names=QWEN3_MOE_NAMES),
}
# architectures we know and refuse, with what to do instead
REFUSED = {
    "Gemma3ForConditionalGeneration": "multimodal Gemma 3 checkpoints (vision tower, weights under "
                                      "language_model.*) are not supported; use a text-only Gemma3ForCausalLM "
                                      "checkpoint (gemma-3-1b, or a text-only export of a larger Gemma 3)",
}

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0            # llama3
    high_freq_factor: float = 4.0           # llama3
    original_max_position: int = 8192       # llama3, yarn, longrope
    beta_fast: float = 32.0                 # yarn
    beta_slow: float = 1.0                  # yarn
    attention_factor: float | None = None   # yarn, longrope: scales cos/sin
    mscale: float | None = None             # yarn
    mscale_all_dim: float | None = None     # yarn
    truncate: bool = True                   # yarn
    short_factor: tuple[float, ...] = ()    # longrope: frequency divisors for sequences up to original_max_position
    long_factor: tuple[float, ...] = ()     # longrope: for longer sequences

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """Inverse frequencies [head_dim/2] f32, as transformers computes them for this rope type (longrope:
        the short factors)."""
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        base = 1.0 / (self.theta ** exponent)
        if self.type == "default":
            return base
        if self.type == "linear":
            return base / self.factor
        if self.type == "llama3":
            return self._llama3(base)
        if self.type == "longrope":
            return 1.0 / (torch.tensor(self.short_factor, dtype=torch.float32) * self.theta ** exponent)
        return self._yarn(head_dim)

    def long_inv_freq(self, head_dim: int) -> torch.Tensor | None:
        """longrope: the inverse frequencies of sequences longer than original_max_position; None otherwise."""
        if self.type != "longrope":
            return None
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (torch.tensor(self.long_factor, dtype=torch.float32) * self.theta ** exponent)

    def cos_sin_scale(self) -> float:
        """Factor applied to cos and sin (yarn and longrope use one)."""
        if self.type not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.type == "longrope":
            if self.factor <= 1.0:
                return 1.0
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position))

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
class MoeConfig:
    n_experts: int
    top_k: int                   # experts each token is routed to
    intermediate_size: int       # of each expert
    renormalize: bool            # the top-k routing weights are rescaled to sum to 1
    layers: tuple[bool, ...]     # per decoder layer: routed (True) or a dense MLP (Qwen3-MoE's mlp_only_layers)


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
    activation: Activation = Activation.SILU
    attn_scale: float = 0.0                     # multiplies q·k (head_dim^-0.5, Gemma: query_pre_attn_scalar^-0.5)
    attn_softcap: float | None = None           # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None          # Gemma 2/3: logits -> cap * tanh(logits / cap)
    layer_windows: tuple[int | None, ...] = ()  # per layer: sliding window (a query at p sees keys > p - window)
    local_rope: RopeConfig | None = None        # Gemma 3: the rope of the sliding-window layers
    moe: MoeConfig | None = None
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
        if arch in REFUSED:
            raise UnsupportedArchitectureError(f"{source}: {arch}: {REFUSED[arch]}")
        if arch not in ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"{source}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
        traits = ARCHITECTURES[arch]

        def need(key, kind=int):
            if key not in raw or raw[key] is None:
                raise ConfigError(f"{source}: required field {key!r} is missing")
            try:
                value = kind(raw[key])
            except (TypeError, ValueError):
                raise ConfigError(f"{source}: field {key!r} = {raw[key]!r} is not a valid {kind.__name__}") from None
            if value <= 0:
                raise ConfigError(f"{source}: field {key!r} must be positive, got {value}")
            return value

        def optional(key, kind=float):
            return need(key, kind) if raw.get(key) is not None else None

        hidden, n_heads = need("hidden_size"), need("num_attention_heads")
        n_kv_heads = need("num_key_value_heads") if raw.get("num_key_value_heads") else n_heads
        head_dim = need("head_dim") if raw.get("head_dim") else hidden // n_heads
        if n_heads % n_kv_heads:
            raise ConfigError(f"{source}: num_attention_heads ({n_heads}) is not a multiple of "
                              f"num_key_value_heads ({n_kv_heads})")
        if head_dim % 2:
            raise ConfigError(f"{source}: head_dim must be even for rotary embeddings, got {head_dim}")
        if raw.get("use_bidirectional_attention"):
            raise ConfigError(f"{source}: use_bidirectional_attention is set (an embedding model, not a causal "
                              f"language model); only causal checkpoints are supported")
        n_layers, max_pos = need("num_hidden_layers"), need("max_position_embeddings")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_params, local_params = _rope_parameters(raw, traits)
        rope = _rope_from(rope_params, raw, head_dim, max_pos, source)
        attn_scalar = need("query_pre_attn_scalar", float) if traits.query_pre_attn_scalar else head_dim
        return cls(
            architecture=arch,
            traits=traits,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=need("rms_norm_eps", float),
            rope=rope,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", traits.tied_embeddings)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            activation=_activation(raw, traits, source),
            attn_scale=attn_scalar ** -0.5,
            attn_softcap=optional("attn_logit_softcapping") if traits.attn_softcap else None,
            final_softcap=optional("final_logit_softcapping") if traits.final_softcap else None,
            layer_windows=_layer_windows(raw, traits, n_layers, source),
            local_rope=None if local_params is None else _rope_from(local_params, raw, head_dim, max_pos, source),
            moe=None if traits.moe is None else _moe_from(raw, traits.moe, n_layers, need, source),
            raw=raw,
        )


def _activation(raw: dict, traits: ArchTraits, source: str) -> Activation:
    name = raw.get(traits.activation_key) or traits.activation.value
    if name not in ACTIVATION_NAMES:
        raise ConfigError(f"{source}: MLP activation {traits.activation_key} = {name!r} is not supported; "
                          f"supported: {', '.join(ACTIVATION_NAMES)}")
    return ACTIVATION_NAMES[name]


def _layer_windows(raw: dict, traits: ArchTraits, n_layers: int, source: str) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full causal attention), as transformers decides it."""
    window = raw.get("sliding_window")
    switched_off = traits.window_switch is not None and not raw.get(traits.window_switch)
    if traits.windows is Windows.NONE or window is None or switched_off:
        return (None,) * n_layers
    if not isinstance(window, int) or window <= 0:
        raise ConfigError(f"{source}: sliding_window must be a positive integer or null, got {window!r}")
    if traits.windows is Windows.ALL_LAYERS:
        return (window,) * n_layers
    types = raw.get("layer_types")
    if types is None and traits.window_pattern:
        pattern = raw.get("sliding_window_pattern") or traits.window_pattern
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
    elif types is None:                              # Qwen: the layers from max_window_layers on slide
        first = raw.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    if len(types) != n_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ConfigError(f"{source}: layer_types must list 'sliding_attention' or 'full_attention' for each of "
                          f"the {n_layers} layers, got {types!r}")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _moe_from(raw: dict, traits: MoeTraits, n_layers: int, need, source: str) -> MoeConfig:
    n_experts = need("num_local_experts" if raw.get("num_local_experts") else "num_experts")
    top_k = need("num_experts_per_tok")
    if top_k > n_experts:
        raise ConfigError(f"{source}: num_experts_per_tok ({top_k}) is larger than the number of experts "
                          f"({n_experts})")
    step = raw.get("decoder_sparse_step") or 1
    dense = set(raw.get("mlp_only_layers") or ())
    return MoeConfig(
        n_experts=n_experts, top_k=top_k, intermediate_size=need(traits.intermediate_key),
        renormalize=True if traits.renormalize_key is None else bool(raw.get(traits.renormalize_key, False)),
        layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers)))


def _rope_parameters(raw: dict, traits: ArchTraits) -> tuple[dict, dict | None]:
    """(global rope parameters, the sliding layers' own or None) as flat dicts, from either layout:
    transformers 5's `rope_parameters` (per layer type for Gemma 3) or the classic `rope_theta` + `rope_scaling`
    (+ Gemma 3's `rope_local_base_freq`)."""
    params = dict(raw.get("rope_scaling") or {})
    nested = raw.get("rope_parameters") or {}
    local = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    if "full_attention" in nested or "sliding_attention" in nested:
        params.update(nested.get("full_attention") or {})
        local = dict(nested.get("sliding_attention") or local)
    else:
        params.update(nested)
    return params, local if traits.local_rope else None


def _rope_from(params: dict, raw: dict, head_dim: int, max_pos: int, source: str) -> RopeConfig:
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type          # Phi-3's first name for it
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"{source}: partial rotary embeddings (partial_rotary_factor) are not supported")
    original = params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings") or max_pos
    factor = params.get("factor")
    if rope_type != "default" and factor is None:
        if rope_type not in ("yarn", "longrope"):
            raise ConfigError(f"{source}: rope type {rope_type!r} needs a 'factor'")
        factor = max_pos / original
    short, long = tuple(params.get("short_factor") or ()), tuple(params.get("long_factor") or ())
    if rope_type == "longrope" and not len(short) == len(long) == head_dim // 2:
        raise ConfigError(f"{source}: longrope needs short_factor and long_factor of head_dim / 2 = "
                          f"{head_dim // 2} numbers each, got {len(short)} and {len(long)}")
    return RopeConfig(
        theta=float(theta), type=rope_type, factor=float(factor or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"), mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"), truncate=bool(params.get("truncate", True)),
        short_factor=tuple(float(f) for f in short), long_factor=tuple(float(f) for f in long),
    )

"""Decoder layers run one at a time over calibration rows, for the converter and its quality receipt.

A layer is the runtime's own block (model.py builds it, attention.Attention and mlp.Mlp / MoeMlp compute it,
with the reference ops), so every architecture the runtime runs converts with exactly the runtime's maths:
norm offsets, q/k norms, soft-caps, sliding windows, local ropes, GELU-tanh, post-sublayer norms, MoE routing.
Only the linears differ: each is a CalibLinear, dense f32, which can record the Hessian of its inputs and take
substituted (fake-quantized) weights. Rows run without a KV cache, each row one sequence attending over itself.
Only one layer's weights are on the device at a time; the hidden states of all rows stay on the device too when
they fit (states_device), else on the CPU, and a sub-layer runs over them chunk by chunk."""
from __future__ import annotations

import contextlib

from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import Tensor

from .. import formats
from ..formats.tensors import TensorStore
from ..model import model, reference
from ..model.batch import Batch, SeqChunk
from ..model.config import ModelConfig
from ..model.model import Block, LinearSpec, Rope, token_seq_lens
from ..model.ops import REFERENCE_OPS
from .gptq import Hessian
from .qparams import ATTN_CANDIDATES, MLP_CANDIDATES, QParams

CHUNK_TOKENS = 8192                # tokens per forward chunk (rows are never split)
STATE_COPIES = 4                   # states-sized tensors alive at once: a sub-layer's input, reference output and
                                   # trial output, and the previous layer's output being written to the job


# ----------------------------------------------------------------------------------------------- what a layer holds


class Kind(Enum):
    ATTENTION = "attention"
    MLP = "mlp"                    # a dense gated MLP or a routed mixture of experts


@dataclass(frozen=True)
class Role:
    """One projection of the candidate tables ('q_proj', ..., or an MoE layer's 'w1' for every expert's w1)."""
    name: str                               # its key inside a measurement entry
    linears: tuple[LinearSpec, ...]         # the linears the setting applies to (one, or one per expert)


@dataclass(frozen=True)
class InputGroup:
    """Linears that read the same input, so share one Hessian (q/k/v; gate/up; one expert's gate/up)."""
    keys: tuple[str, ...]
    stand_in: str | None = None     # MoE gate/up: the router's key; its input (every token) stands in for an
                                    # expert that no calibration token was routed to


@dataclass(frozen=True)
class Sublayer:
    """The attention or MLP half of a layer, as the measurement and the optimizer see it."""
    key: str                        # 'model.layers.3.self_attn', '.mlp', '.block_sparse_moe'
    kind: Kind
    roles: tuple[Role, ...]
    groups: tuple[InputGroup, ...]

    @property
    def candidates(self) -> list[tuple[QParams, ...]]:
        return ATTN_CANDIDATES if self.kind is Kind.ATTENTION else MLP_CANDIDATES

    def bits(self, candidate: tuple[QParams, ...]) -> int:
        """Bits of the packed sub-layer under one joint candidate (exl2-format.md §10.6), experts summed."""
        return sum(qp.total_bits(k, n, bias) for role, qp in zip(self.roles, candidate)
                   for _, k, n, bias in role.linears)

    @property
    def n_weights(self) -> int:
        return sum(k * n for role in self.roles for _, k, n, _ in role.linears)


def sublayers(config: ModelConfig, i: int) -> tuple[Sublayer, Sublayer]:
    """Layer i's attention and MLP halves, with the linears EXL2 quantizes (Phi-3's fused projections split,
    MoE routers left out: they stay fp16)."""
    names = config.traits.names
    q, k, v, o = model.attention_linears(config, i)
    attention = Sublayer(_module(config, i, names.q), Kind.ATTENTION, tuple(_role(s) for s in (q, k, v, o)),
                         (InputGroup((q[0], k[0], v[0])), InputGroup((o[0],))))
    specs = model.mlp_linears(config, i)
    if config.moe is not None and config.moe.layers[i]:
        router, experts = specs[0], [specs[e: e + 3] for e in range(1, len(specs), 3)]
        roles = tuple(Role(name, tuple(e[pos] for e in experts))
                      for pos, name in enumerate((names.expert_gate, names.expert_up, names.expert_down)))
        groups = tuple(g for gate, up, down in experts
                       for g in (InputGroup((gate[0], up[0]), stand_in=router[0]), InputGroup((down[0],))))
        return attention, Sublayer(_module(config, i, names.router), Kind.MLP, roles, groups)
    gate, up, down = specs
    return attention, Sublayer(_module(config, i, names.gate), Kind.MLP, tuple(_role(s) for s in (gate, up, down)),
                               (InputGroup((gate[0], up[0])), InputGroup((down[0],))))


def _module(config: ModelConfig, i: int, name: str) -> str:
    """'self_attn.q_proj' -> 'model.layers.{i}.self_attn': the sub-layer's module key."""
    return f"{config.traits.names.layer.format(i=i)}.{name.rsplit('.', 1)[0]}"


def _role(spec: LinearSpec) -> Role:
    return Role(spec[0].rsplit(".", 1)[-1], (spec,))


def quantized_linears(config: ModelConfig) -> list[LinearSpec]:
    """Every linear a conversion quantizes, in file order (lm_head not included)."""
    return [spec for i in range(config.n_layers) for sub in sublayers(config, i)
            for spec in _by_position(sub)]


def _by_position(sub: Sublayer) -> list[LinearSpec]:
    """A sub-layer's linears in module order (expert by expert for MoE)."""
    return [spec for specs in zip(*(role.linears for role in sub.roles)) for spec in specs]


# ----------------------------------------------------------------------------------------------- one layer


class CalibLinear:
    """A dense f32 linear the converter watches and changes: while `hessian` is set, every input it sees is
    added to it; `weight` is replaced to try fake-quantized weights."""

    def __init__(self, key: str, weight: Tensor, bias: Tensor | None):
        self.key, self.weight, self.bias = key, weight, bias       # weight [N, K] f32
        self.hessian: Hessian | None = None

    def __call__(self, x: Tensor) -> Tensor:
        if self.hessian is not None:
            self.hessian.add(x)             # in full f32, whatever the matmul below runs in
        if not x.is_cuda:
            return reference.linear(x, self.weight, self.bias)
        with _tf32():
            return reference.linear(x, self.weight, self.bias)


@contextlib.contextmanager
def _tf32():
    """TF32 tensor cores for the f32 matmuls inside (CUDA only; torch's flag is process-wide, so it is set for
    the call and restored). The sub-layer forwards of measurement and quantization are most of a conversion's
    GPU time. Emulated on the CPU (inputs and weights rounded to TF32's 10-bit mantissa), SmolLM2-135M at 4.0
    bpw moved each measured error by 0.12 % (median; max 4.4 %), kept the same bpw, and its held-out KL came out
    0.1158 against 0.1200 in f32: noise, not a loss."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


class _Loader(model.Loader):
    """model.py's loader (norm offsets folded in as the runtime folds them) with every linear a CalibLinear,
    dequantized when the checkpoint is quantized, kept by key."""

    def __init__(self, ckpt: formats.Checkpoint, config: ModelConfig, device: torch.device):
        super().__init__(ckpt, config, device, torch.float32)
        self.linears: dict[str, CalibLinear] = {}

    def linear(self, spec: LinearSpec) -> CalibLinear:
        weight, bias = self._dense(spec)
        return self._keep(CalibLinear(spec[0], weight, bias))

    def split(self, spec: LinearSpec, sizes: list[int]) -> list[CalibLinear]:
        """Phi-3's qkv_proj / gate_up_proj as their parts, under the parts' keys (EXL2 writes them split)."""
        names = self.config.traits.names
        fused = names.qkv if spec[0].endswith(f".{names.qkv}") else names.gate_up
        parts = (names.q, names.k, names.v) if fused == names.qkv else (names.gate, names.up)
        prefix = spec[0].removesuffix(fused)
        weight, bias = self._dense(spec)
        biases = [None] * len(sizes) if bias is None else bias.split(sizes)
        return [self._keep(CalibLinear(prefix + part, w, b))
                for part, w, b in zip(parts, weight.split(sizes), biases)]

    def _dense(self, spec: LinearSpec) -> tuple[Tensor, Tensor | None]:
        layer = formats.load_linear(self.ckpt, *spec, self.device, torch.float32)
        bias = None if layer.bias is None else layer.bias.to(self.device, torch.float32)
        return layer.dense_weight().to(self.device, torch.float32), bias

    def _keep(self, linear: CalibLinear) -> CalibLinear:
        self.linears[linear.key] = linear
        return linear


@dataclass
class Layer:
    """Decoder layer i on the device: the runtime's Block over CalibLinears."""
    block: Block
    linears: dict[str, CalibLinear]           # by HF key, routers included
    sublayers: tuple[Sublayer, Sublayer]

    def weights(self, keys) -> dict[str, Tensor]:
        return {key: self.linears[key].weight for key in keys}

    def set_weights(self, weights: dict[str, Tensor]) -> None:
        for key, w in weights.items():
            self.linears[key].weight = w


def load_layer(ckpt: formats.Checkpoint, config: ModelConfig, i: int, device: torch.device) -> Layer:
    """Layer i from any checkpoint the runtime reads (fp16 source, or quantized output: dequantized)."""
    loader = _Loader(ckpt, config, device)
    block = model.load_block(loader, config, i)
    return Layer(block, loader.linears, sublayers(config, i))


# ----------------------------------------------------------------------------------------------- running rows


class RowCache:
    """The KV cache Attention writes and reads, for one chunk of rows of one layer: the slots of a chunk are
    0..T-1 in order (each row its own page of one row's length), so K and V are kept as written."""

    def write(self, layer: int, k: Tensor, v: Tensor, slots: Tensor) -> None:
        self.k, self.v = k, v                                              # [T, Hkv, Dh]

    def read(self, layer: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        return self.k[slots], self.v[slots]


@dataclass
class Context:
    """What every layer's forward needs: the config, the device, the row length and the ropes (global, and
    Gemma 3's local one); the batch and cos/sin of a chunk of n rows are built once per n."""
    config: ModelConfig
    device: torch.device
    length: int
    ropes: dict[bool, Rope]                   # by Block.local_rope
    _chunks: dict[int, tuple] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, config: ModelConfig, length: int, device: torch.device) -> "Context":
        ropes = {False: Rope(config.rope, config.head_dim, device)}
        if config.local_rope is not None:
            ropes[True] = Rope(config.local_rope, config.head_dim, device)
        return cls(config, device, length, ropes)

    def rows(self, n: int) -> tuple[Batch, dict[bool, tuple[Tensor, Tensor]]]:
        """The batch of n rows (row r: positions 0..length-1 in page r) and its cos/sin per rope."""
        if n not in self._chunks:
            seqs = [SeqChunk([0] * self.length, 0, [r]) for r in range(n)]
            batch = Batch.build(seqs, self.length, self.device, all_logits=True)
            lens = token_seq_lens(batch)
            self._chunks[n] = batch, {local: rope.cos_sin(batch.positions, lens, REFERENCE_OPS, torch.float32)
                                      for local, rope in self.ropes.items()}
        return self._chunks[n]


def _attention(x: Tensor, block: Block, ctx: Context) -> Tensor:
    """Model.forward's attention half: residual + attn_out_norm(attention(input_norm(x))). x [T, D]."""
    batch, cos_sin = ctx.rows(x.shape[0] // ctx.length)
    ops, eps = REFERENCE_OPS, ctx.config.rms_norm_eps
    a = block.attention(ops.rmsnorm(x, block.input_norm, eps), batch, RowCache(), *cos_sin[block.local_rope], ops)
    if block.attn_out_norm is not None:
        a = ops.rmsnorm(a, block.attn_out_norm, eps)
    return x + a


def _mlp(x: Tensor, block: Block, ctx: Context) -> Tensor:
    """Model.forward's MLP half: residual + mlp_out_norm(mlp(post_attn_norm(x)))."""
    return mlp_output(x, block.mlp(mlp_input(x, block, ctx), REFERENCE_OPS), block, ctx)


def mlp_input(x: Tensor, block: Block, ctx: Context) -> Tensor:
    """What the MLP reads: post_attn_norm(x). x [T, D]."""
    return REFERENCE_OPS.rmsnorm(x, block.post_attn_norm, ctx.config.rms_norm_eps)


def mlp_output(x: Tensor, m: Tensor, block: Block, ctx: Context) -> Tensor:
    """The MLP half's output from the MLP's output m [T, D]: residual + mlp_out_norm(m)."""
    if block.mlp_out_norm is not None:
        m = REFERENCE_OPS.rmsnorm(m, block.mlp_out_norm, ctx.config.rms_norm_eps)
    return x + m


FORWARD = {Kind.ATTENTION: _attention, Kind.MLP: _mlp}


def chunks(n_rows: int, length: int) -> list[slice]:
    per = max(1, CHUNK_TOKENS // length)
    return [slice(r, min(r + per, n_rows)) for r in range(0, n_rows, per)]


def states_device(states: Tensor, device: torch.device) -> torch.device:
    """Where the rows' states [R, L, D] live between sub-layers: on the conversion device when STATE_COPIES of
    them take at most half of its free memory (the rest is for the layer: weights, Hessians, GPTQ batches),
    which saves copying them to the device and back on every sub-layer run (8B, quantization pass: 3.4 GB each
    way); else on the CPU. Where they live does not change any result."""
    if device.type != "cuda":
        return torch.device("cpu")
    free, _ = torch.cuda.mem_get_info(device)
    return device if STATE_COPIES * states.numel() * 4 <= free // 2 else torch.device("cpu")


def run(sub: Sublayer, states: Tensor, layer: Layer, ctx: Context,
        hessians: dict[str, Hessian] | None = None) -> Tensor:
    """Runs a sub-layer over all rows (states [R, L, D] f32, on the CPU or the device), chunk by chunk on the
    device. hessians: linear key -> the Hessian that linear's inputs are added to during this run. Returns the
    outputs [R, L, D] where the states are."""
    hessians = hessians or {}
    for key, h in hessians.items():
        layer.linears[key].hessian = h
    try:
        out = torch.empty_like(states)
        for rows in chunks(*states.shape[:2]):
            x = states[rows].to(ctx.device)
            out[rows] = FORWARD[sub.kind](x.reshape(-1, x.shape[-1]), layer.block, ctx).view(x.shape).to(out.device)
        return out
    finally:
        for key in hessians:
            layer.linears[key].hessian = None


def input_hessians(sub: Sublayer, layer: Layer, device: torch.device) -> dict[str, Hessian]:
    """One Hessian per input group, recorded by the group's first linear, plus the MoE router's input (the
    stand-in for experts that receive no token)."""
    keys = {g.keys[0] for g in sub.groups} | {g.stand_in for g in sub.groups if g.stand_in}
    return {key: Hessian(layer.linears[key].weight.shape[1], device) for key in sorted(keys)}


def group_hessian(group: InputGroup, hessians: dict[str, Hessian]) -> Tensor:
    """The group's H. An expert no calibration token reached has none: its gate/up take the H of every token
    entering the MoE block (what ExLlamaV2 uses for all experts' w1/w3), its down projection the identity,
    which makes GPTQ plain round-to-nearest with the searched scales."""
    h = hessians[group.keys[0]]
    if h.tokens:
        return h.value()
    if group.stand_in is not None:
        return hessians[group.stand_in].value()
    return torch.eye(h.sum.shape[0], device=h.sum.device)


def relative_error(sub: Sublayer, states: Tensor, reference_out: Tensor, layer: Layer, ctx: Context) -> float:
    """Mean per-token relative error ||y_t - y_ref,t|| / ||y_ref,t|| of the sub-layer output with the layer's
    current weights."""
    return float(token_errors(run(sub, states, layer, ctx), reference_out).mean())


def token_errors(y: Tensor, ref: Tensor) -> Tensor:
    """||y_t - ref_t|| / ||ref_t|| per token of [R, L, D] -> [R, L].

    Per token rather than ExLlamaV2's per row (§10.7): past the first layers the first token of every row
    carries massive activations (in SmolLM2-135M its hidden state is ~170x the norm of the others), so a
    row's Frobenius norm measures that one token and hides the error on all others; each token is normalised
    on its own by the next RMSNorm, so its own relative error is what reaches the rest of the model."""
    return torch.linalg.vector_norm(y - ref, dim=-1) / torch.linalg.vector_norm(ref, dim=-1)


# ----------------------------------------------------------------------------------------------- ends of the model


def embed(store: TensorStore, config: ModelConfig, tokens: Tensor) -> Tensor:
    """tokens [R, L] -> hidden states [R, L, D] f32 on the CPU (Gemma: scaled by sqrt(hidden) as the runtime
    scales them)."""
    table = store.get(f"{config.traits.names.embed}.weight")
    states = table[torch.where(tokens < table.shape[0], tokens, 0)].float()    # out-of-table ids -> 0 (§10.2)
    if config.traits.scale_embeddings:
        states = states * torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32)
    return states


@dataclass
class Head:
    """Final norm (offset folded in), lm_head [vocab, D] dense f32, final soft-cap."""
    norm: Tensor
    weight: Tensor
    eps: float
    softcap: float | None

    def normed(self, x: Tensor) -> Tensor:
        return reference.rmsnorm(x, self.norm, self.eps)

    def __call__(self, x: Tensor) -> Tensor:
        """x [T, D] -> f32 logits [T, vocab], as Model.forward ends."""
        logits = reference.linear(self.normed(x), self.weight).float()
        return logits if self.softcap is None else reference.softcap(logits, self.softcap)


def load_head(ckpt: formats.Checkpoint, config: ModelConfig, device: torch.device) -> Head:
    """The head of any checkpoint the runtime reads: lm_head (quantized ones dequantized), or the embeddings
    when tied and no lm_head is stored."""
    names = config.traits.names
    loader = _Loader(ckpt, config, device)
    if model.head_is_tied(ckpt.store, config):
        weight = ckpt.store.get(f"{names.embed}.weight").to(device, torch.float32)
    else:
        weight = loader.linear((names.lm_head, config.hidden_size, config.vocab_size, False)).weight
    return Head(loader.norm(f"{names.final_norm}.weight"), weight, config.rms_norm_eps, config.final_softcap)

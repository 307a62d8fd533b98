"""The decoder: embed -> blocks -> norm -> head. One class for every architecture; traits decide the rest."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
from torch import Tensor

from .. import formats
from ..errors import CheckpointError, DeviceError
from ..formats.tensors import FLOAT_DTYPES, TensorStore
from ..kernels import megakernel
from ..kernels.norm import embed_feed
from .attention import Attention
from .batch import Batch
from .cache import KVCache
from .config import Activation, ModelConfig, RopeConfig
from .linear import Linear, QuantLinear, available_memory, cpu_quantized, keep_dense_weights
from .mlp import Mlp, MoeMlp
from .ops import Ops, ops_for

LinearSpec = tuple[str, int, int, bool]    # (key, in_features, out_features, has_bias)


@dataclass
class Block:
    input_norm: Tensor
    attention: Attention
    post_attn_norm: Tensor                  # the norm in front of the MLP
    mlp: Mlp | MoeMlp
    attn_out_norm: Tensor | None = None     # Gemma 2/3: the attention output is normed before the residual add
    mlp_out_norm: Tensor | None = None      # Gemma 2/3: so is the MLP output
    local_rope: bool = False                # Gemma 3: a sliding-window layer, with the local rope


class Rope:
    """One rope configuration on a device: its cos/sin tables for a batch's positions."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device):
        self.inv_freq = rope.inv_freq(head_dim).to(device)
        long = rope.long_inv_freq(head_dim)
        self.long_inv_freq = None if long is None else long.to(device)
        self.original_max_position = rope.original_max_position
        self.scale = rope.cos_sin_scale()

    def cos_sin(self, positions: Tensor, seq_lens: Tensor | None, ops: Ops,
                dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [T, Dh] of positions [T]; seq_lens [T]: each token's sequence length after this pass (only
        longrope reads it: token_seq_lens)."""
        cos, sin = ops.rope_cos_sin(positions, self.inv_freq, self.scale, dtype)
        if self.long_inv_freq is None:
            return cos, sin
        # longrope: every token of a sequence longer than the pretraining context takes the long factors, as
        # transformers does for a forward call whose positions run past it (decided on device: no host sync)
        long_cos, long_sin = ops.rope_cos_sin(positions, self.long_inv_freq, self.scale, dtype)
        is_long = (seq_lens > self.original_max_position)[:, None]
        return torch.where(is_long, long_cos, cos), torch.where(is_long, long_sin, sin)


def token_seq_lens(batch: Batch) -> Tensor:
    """[T]: for each token, the length its sequence has after this pass."""
    rows = torch.arange(batch.input_ids.shape[0], dtype=batch.cu_seqlens.dtype, device=batch.cu_seqlens.device)
    return batch.seq_lens[torch.searchsorted(batch.cu_seqlens[1:], rows, right=True)]


@dataclass(frozen=True)
class Stage:
    """A run of consecutive blocks on one device (a layer split has one stage per device)."""
    device: torch.device
    layers: range


def on_device(device: torch.device):
    """Makes device current: kernels launch on the current device's stream (the CPU needs nothing)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def batch_on(batch: Batch, device: torch.device) -> Batch:
    """The batch's index tensors on another device (a layer split's stages each read them)."""
    if batch.input_ids.device == device:
        return batch
    moved = {f.name: getattr(batch, f.name).to(device) for f in fields(batch)
             if isinstance(getattr(batch, f.name), Tensor)}
    return replace(batch, **moved)


class Model:
    def __init__(self, config: ModelConfig, embed: Tensor, blocks: list[Block], norm: Tensor,
                 lm_head: Linear | QuantLinear, device: torch.device, dtype: torch.dtype,
                 stages: list[Stage] | None = None):
        """device: where the embedding is (and every block, unless stages place them: a layer split, stages[0]
        on device, the norm and lm_head on the last stage's device)."""
        self.config, self.embed, self.blocks, self.norm, self.lm_head = config, embed, blocks, norm, lm_head
        self.device, self.dtype = device, dtype
        self.stages = list(stages) if stages is not None else [Stage(device, range(len(blocks)))]
        self.block_devices = [s.device for s in self.stages for _ in s.layers]     # the device of each block
        self.output_device = self.stages[-1].device
        self.ops = ops_for(device)              # one bundle: a split runs on one kind of device
        check_ops(config, self.ops, device)
        self.rope = Rope(config.rope, config.head_dim, device)
        self.local_rope = None if config.local_rope is None else Rope(config.local_rope, config.head_dim, device)
        self.stage_ropes = {s.device: self._ropes(s.device) for s in self.stages}
        # longrope's tables need each token's sequence length (token_seq_lens)
        self.long_rope = any(r is not None and r.long_inv_freq is not None for r in (self.rope, self.local_rope))
        # Gemma: sqrt(hidden_size), rounded to the compute dtype as transformers rounds it
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=dtype, device=device) \
            if config.traits.scale_embeddings else None
        self.link_norms()

    def link_norms(self) -> None:
        """Where a decode row's one-row launch does the work of the norm after it (QuantMatmul.norm_feed: no launch
        stages the next one's x): o into the MLP's gate/up, down into the next block's q/k/v on the same stage; and
        where a fed gate/up stages down's x itself (QuantMatmul.link_gating); the last block's down into a quantized
        head's final norm; the embedding's gather into the first block's q/k/v (embed_tokens). Not where an output
        norm (Gemma 2/3) or routed experts come between, nor into a dense or CPU layer."""
        eps = self.config.rms_norm_eps
        for stage in self.stages:
            for i in stage.layers:
                b = self.blocks[i]
                if b.attn_out_norm is not None or not isinstance(b.mlp, Mlp):
                    continue
                _link(getattr(b.attention.o, "kernel", None), b.mlp.gate_up.kernel, b.post_attn_norm, eps)
                if b.mlp.gated_down is not None and b.mlp.gate_up.kernel is not None:
                    b.mlp.gate_up.kernel.link_gating(b.mlp.gated_down)
                if b.mlp_out_norm is not None:
                    continue
                if i + 1 in stage.layers:
                    after = self.blocks[i + 1]
                    _link(b.mlp.gated_down, after.attention.qkv.kernel, after.input_norm, eps)
                elif i == len(self.blocks) - 1:
                    _link(b.mlp.gated_down, getattr(self.lm_head, "kernel", None), self.norm, eps)
        first = self.blocks[self.stages[0].layers[0]]
        qkv = first.attention.qkv.kernel
        if qkv is not None and self.embed_scale is None and self.embed.dtype == torch.float16 \
                and self.embed.device == first.input_norm.device:
            qkv.fed_by = qkv.norm_feed(first.input_norm, eps)      # by the embedding's launch (embed_tokens)

    def _ropes(self, device: torch.device) -> tuple[Rope, Rope | None]:
        if device == self.device:
            return self.rope, self.local_rope
        c = self.config
        return Rope(c.rope, c.head_dim, device), None if c.local_rope is None else Rope(c.local_rope, c.head_dim, device)

    def copy_slots(self, cache: KVCache, source: int, target: int, n: int) -> None:
        """cache.copy(source, target, n) (under tensor parallelism also on the other ranks' mirrors of cache)."""
        cache.copy(source, target, n)

    def chainable(self) -> bool:
        """Whether a one-row decode step may run under megakernel.chaining: between two attention calls, nothing but
        one-row quantized matmuls with their staging (norm, silu * up) reads what those matmuls write (the
        Llama-family block on one GPU: no Gemma output norms, no routed experts, no other activation)."""
        return len(self.stages) == 1 and all(
            b.attn_out_norm is None and b.mlp_out_norm is None and isinstance(b.mlp, Mlp)
            and b.mlp.gated_down is not None and getattr(b.attention.o, "kernel", None) is not None
            for b in self.blocks)

    @classmethod
    def load(cls, path: str | Path, config: ModelConfig | None = None, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32, stages: list[Stage] | None = None) -> "Model":
        """stages: a layer split, each stage's layers on its device (placement.plan makes them)."""
        config = config or ModelConfig.from_dir(path)
        ckpt = formats.open_checkpoint(path)
        device = torch.device(device)
        stages = stages or [Stage(device, range(config.n_layers))]
        if [i for s in stages for i in s.layers] != list(range(config.n_layers)) or stages[0].device != device:
            raise ValueError(f"stages must cover layers 0-{config.n_layers - 1} in order, the first on {device}")
        check_ops(config, ops_for(device), device)         # before reading any weights
        validate(ckpt, config)
        weights = _load_weights(ckpt, config, [s.device for s in stages for _ in s.layers], dtype)
        model = cls(config, *weights, device, dtype, stages)
        keep_dense_weights(cpu_quantized(model.linears()), dtype, available_memory())
        return model

    def linears(self) -> list:
        """Every linear unit the forward calls (FusedLinear for q/k/v and gate/up), lm_head last."""
        units = []
        for b in self.blocks:
            units += [b.attention.qkv, b.attention.o]
            mlps = b.mlp.experts if isinstance(b.mlp, MoeMlp) else [b.mlp]
            units += [b.mlp.router] if isinstance(b.mlp, MoeMlp) else []
            units += [unit for m in mlps for unit in (m.gate_up, m.down)]
        return units + [self.lm_head]

    def forward(self, batch: Batch, cache: KVCache) -> Tensor:
        """Runs the batch's tokens, writing their K/V into cache. Returns f32 logits [R, vocab] for
        batch.logit_rows (every row when None), on the last block's device."""
        out = None
        for k, stage in enumerate(self.stages):
            with on_device(stage.device):
                out = self.stage_forward(k, batch_on(batch, stage.device), cache, out)
        return out

    def stage_forward(self, k: int, batch: Batch, cache: KVCache, carry: tuple[Tensor, Tensor] | None):
        """Stage k's blocks, on its device (the current one; batch there too), from the embedding (k = 0) or from
        the stage before's (h, residual), moved here at a device boundary. Between blocks the stream is carried as
        (h, residual): the last block's output and the residual before it, which the next block's input norm adds
        (so that its q/k/v launch can apply that norm: FusedLinear.after_norm; h None where the launch before
        did the norm's work already: link_norms). Returns (h, residual) for the next
        stage, or after the last one the f32 logits [R, vocab] for batch.logit_rows (None: every row)."""
        stage = self.stages[k]
        ropes = self.cos_sin(batch.positions, token_seq_lens(batch) if self.long_rope else None, stage.device)
        if carry is None:
            h, residual = self.embed_tokens(batch.input_ids)
        else:
            h, residual = (t.to(stage.device) for t in carry)
        for i in stage.layers:
            block = self.blocks[i]
            qkv, residual = self.qkv(i, h, residual)
            a, residual = block.attention.attend_project(qkv, batch, cache, *ropes[block.local_rope], self.ops,
                                                         residual)
            h, residual = self.after_o(i, a, residual)
        megakernel.flush()                      # (inside megakernel.chaining: the last block's matmuls)
        if k + 1 < len(self.stages):
            return h, residual
        return self.logits(h, residual, batch)

    def cos_sin(self, positions: Tensor, seq_lens: Tensor | None,
                device: torch.device) -> dict[bool, tuple[Tensor, Tensor]]:
        """The rope tables of positions [T] on a stage's device, by Block.local_rope (Rope.cos_sin)."""
        rope, local = self.stage_ropes[device]
        ropes = {False: rope.cos_sin(positions, seq_lens, self.ops, self.dtype)}
        if local is not None:
            ropes[True] = local.cos_sin(positions, seq_lens, self.ops, self.dtype)
        return ropes

    def embed_tokens(self, input_ids: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """(h, residual) in front of the first block: the embedding [T, D], and no residual yet. For one token
        whose first q/k/v launch is fed (link_norms), (None, the embedding [1, D]): the gather's launch also leaves
        that launch's x with the norm half done (kernels.norm.embed_feed), so no launch stages it."""
        qkv = self.blocks[self.stages[0].layers[0]].attention.qkv.kernel
        if qkv is not None and qkv.fed_by is not None and input_ids.shape[0] == 1 and megakernel.active() is None:
            return None, embed_feed(input_ids, self.embed, qkv.fed_by)
        h = self.ops.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        return h, None

    def qkv(self, i: int, h: Tensor, residual: Tensor | None) -> tuple[list[Tensor], Tensor]:
        """Block i's q/k/v projections of the stream (h, residual): (their outputs, the residual with h added)."""
        block = self.blocks[i]
        qkv, residual = block.attention.qkv.after_norm(h, residual, block.input_norm, self.config.rms_norm_eps,
                                                       self.ops)
        megakernel.flush()      # inside megakernel.chaining, the matmuls since the last attention run now
        return qkv, residual

    def project(self, i: int, h: Tensor, residual: Tensor | None, slots: Tensor, cache: KVCache,
                ropes: dict[bool, tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """Block i up to its attention, from the stream (h, residual): (the roped queries [T, H, Dh], the residual
        with h added); keys and values written into cache at slots."""
        qkv, residual = self.qkv(i, h, residual)
        block = self.blocks[i]
        return block.attention.project(qkv, slots, cache, *ropes[block.local_rope], self.ops), residual

    def after_attention(self, i: int, attn: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """Block i from its attention output [T, H * Dh] on: the stream (h, residual) after it, h the MLP's output.
        Row by row: no row depends on another."""
        return self.after_o(i, self.blocks[i].attention.o(attn), residual)

    def after_o(self, i: int, a: Tensor | None, residual: Tensor) -> tuple[Tensor | None, Tensor]:
        """Block i from its o projection's output a [T, D] on, as after_attention (a None: o fed the MLP's norm,
        link_norms; h None: down fed the next block's)."""
        ops, eps, block = self.ops, self.config.rms_norm_eps, self.blocks[i]
        if block.attn_out_norm is not None:
            a = ops.rmsnorm(a, block.attn_out_norm, eps)
        m, residual = block.mlp.after_norm(a, residual, block.post_attn_norm, eps, ops)
        if block.mlp_out_norm is not None:
            m = ops.rmsnorm(m, block.mlp_out_norm, eps)
        return m, residual

    def logits(self, h: Tensor | None, residual: Tensor | None, batch: Batch) -> Tensor:
        """f32 logits [R, vocab] of the stream (h, residual) [T, D] after the final norm, for batch.logit_rows
        (None: every row). h None: the last down fed a quantized head's norm (link_norms), one row. A quantized head
        on CUDA applies the norm as it stages x (QuantMatmul.forward_normed: the same bits, no launch of its own)."""
        head, eps = getattr(self.lm_head, "kernel", None), self.config.rms_norm_eps
        if h is None:
            (logits,) = head.forward_fed()
            if batch.logit_rows is not None and batch.logit_rows.shape[0] != 1:    # (a draft's step wants none)
                logits = logits[batch.logit_rows]
        else:
            if batch.logit_rows is not None:
                h = h[batch.logit_rows]
                residual = None if residual is None else residual[batch.logit_rows]
            if head is not None:
                (logits,), _ = head.forward_normed(h, residual, self.norm, eps)
            else:
                logits = self.lm_head(self.ops.norm_residual(h, residual, self.norm, eps)[0])
        megakernel.flush()      # inside megakernel.chaining, a quantized head's launch runs now, before it is read
        logits = logits.float()
        if self.config.final_softcap is not None:
            logits = self.ops.softcap(logits, self.config.final_softcap)
        return logits


def _link(producer, consumer, w: Tensor, eps: float) -> None:
    """producer's one output feeds consumer's norm (weight w) where both are one-row quantized launches that can."""
    if producer is None or consumer is None or len(producer.layouts) != 1 or producer.layouts[0].n != consumer.k:
        return
    producer.feeding = consumer.fed_by = consumer.norm_feed(w, eps)


def missing_ops(config: ModelConfig, ops: Ops) -> list[str]:
    """What this model needs that the ops bundle does not implement, in words (empty: it can run)."""
    missing = []
    if config.activation is Activation.GELU_TANH and ops.gelu_tanh_mul is None:
        missing.append("the GELU-tanh gated MLP (ops.gelu_tanh_mul)")
    if config.final_softcap is not None and ops.softcap is None:
        missing.append("final logit soft-capping (ops.softcap)")
    if config.moe is not None and any(config.moe.layers) and ops.moe is None:
        missing.append("mixture-of-experts MLPs (ops.moe)")
    windowed = [i for i, w in enumerate(config.layer_windows) if w is not None]
    if windowed and "window" not in ops.attention_options:
        missing.append(f"sliding-window attention (window {config.layer_windows[windowed[0]]} in layers "
                       f"{_ranges(windowed)}; paged_attention's `window`)")
    if config.attn_softcap is not None and "softcap" not in ops.attention_options:
        missing.append("attention logit soft-capping (paged_attention's `softcap`)")
    return missing


def check_ops(config: ModelConfig, ops: Ops, device: torch.device) -> None:
    missing = missing_ops(config, ops)
    if missing:
        raise DeviceError(f"{config.architecture} cannot run on {device} yet: its kernels lack "
                          f"{'; '.join(missing)}. Load the model with device='cpu' (the reference path runs "
                          f"every supported architecture)")


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            spans.append(f"{start}-{a}" if a > start else str(a))
            start = b
    return ", ".join(spans)


# ----------------------------------------------------------------------------------------------- tensor layout


def _key(config: ModelConfig, i: int, name: str) -> str:
    return f"{config.traits.names.layer.format(i=i)}.{name}"


def _has_linear(store: TensorStore, key: str) -> bool:
    return any(f"{key}.{s}" in store for s in ("weight", "q_weight", "qweight"))


def _is_fused(store: TensorStore | None, config: ModelConfig, i: int, fused: str | None, first: str) -> bool:
    """Phi-3: the layer stores `fused` (qkv_proj / gate_up_proj) instead of its parts (fp16 files do)."""
    return (fused is not None and store is not None and _has_linear(store, _key(config, i, fused))
            and not _has_linear(store, _key(config, i, first)))


def attention_linears(config: ModelConfig, i: int, store: TensorStore | None = None) -> list[LinearSpec]:
    """q, k, v, o of layer i (q/k/v as one fused spec when store holds them fused)."""
    n, d, hd = config.traits.names, config.hidden_size, config.head_dim
    bias = config.traits.qkv_bias
    sizes = (config.n_heads * hd, config.n_kv_heads * hd, config.n_kv_heads * hd)
    if _is_fused(store, config, i, n.qkv, n.q):
        qkv = [(_key(config, i, n.qkv), d, sum(sizes), bias)]
    else:
        qkv = [(_key(config, i, name), d, size, bias) for name, size in zip((n.q, n.k, n.v), sizes)]
    return qkv + [(_key(config, i, n.o), sizes[0], d, False)]


def mlp_linears(config: ModelConfig, i: int, store: TensorStore | None = None) -> list[LinearSpec]:
    """Layer i's MLP: gate, up, down (gate/up fused when store holds them fused), or for a routed layer the
    router, then w1 (gate), w3 (up), w2 (down) of each expert."""
    n, d, inter = config.traits.names, config.hidden_size, config.intermediate_size
    if config.moe is not None and config.moe.layers[i]:
        moe, out = config.moe, [(_key(config, i, n.router), d, config.moe.n_experts, False)]
        for e in range(moe.n_experts):
            expert = _key(config, i, n.expert.format(e=e))
            out += [(f"{expert}.{n.expert_gate}", d, moe.intermediate_size, False),
                    (f"{expert}.{n.expert_up}", d, moe.intermediate_size, False),
                    (f"{expert}.{n.expert_down}", moe.intermediate_size, d, False)]
        return out
    if _is_fused(store, config, i, n.gate_up, n.gate):
        gate_up = [(_key(config, i, n.gate_up), d, 2 * inter, False)]
    else:
        gate_up = [(_key(config, i, n.gate), d, inter, False), (_key(config, i, n.up), d, inter, False)]
    return gate_up + [(_key(config, i, n.down), inter, d, False)]


def linears(config: ModelConfig, store: TensorStore | None = None) -> list[LinearSpec]:
    """Every linear layer of the decoder (lm_head not included), as the checkpoint in store lays them out
    (without a store: Phi-3's projections split, as EXL2 writes them)."""
    return [spec for i in range(config.n_layers)
            for spec in attention_linears(config, i, store) + mlp_linears(config, i, store)]


def head_is_tied(store: TensorStore, config: ModelConfig) -> bool:
    return config.tie_word_embeddings and not _has_linear(store, config.traits.names.lm_head)


def norm_names(config: ModelConfig, i: int) -> list[tuple[str, int]]:
    """(tensor name, length) of every norm weight of layer i."""
    n, d = config.traits.names, config.hidden_size
    names = [(n.input_norm, d), (n.post_attn_norm, d), (n.attn_out_norm, d), (n.mlp_out_norm, d),
             (n.q_norm, config.head_dim), (n.k_norm, config.head_dim)]
    return [(f"{_key(config, i, name)}.weight", size) for name, size in names if name is not None]


def validate(ckpt: formats.Checkpoint, config: ModelConfig) -> None:
    """Every tensor the model needs: present, right shape, right dtype; before anything is read."""
    n, d, store = config.traits.names, config.hidden_size, ckpt.store
    store.expect(f"{n.embed}.weight", (config.vocab_size, d), FLOAT_DTYPES)
    store.expect(f"{n.final_norm}.weight", (d,), FLOAT_DTYPES)
    for i in range(config.n_layers):
        for name, size in norm_names(config, i):
            store.expect(name, (size,), FLOAT_DTYPES)
    for key, k, m, bias in linears(config, store):
        formats.check_linear(ckpt, key, k, m, bias)
    if not head_is_tied(store, config):
        formats.check_linear(ckpt, n.lm_head, d, config.vocab_size, False)


# ----------------------------------------------------------------------------------------------- loading


class Loader:
    """Reads one checkpoint's tensors onto the device, in the compute dtype."""

    def __init__(self, ckpt: formats.Checkpoint, config: ModelConfig, device: torch.device, dtype: torch.dtype):
        self.ckpt, self.config, self.device, self.dtype = ckpt, config, device, dtype

    def norm(self, name: str) -> Tensor:
        # Gemma's (1 + w) folded into the weight once, in f32 (exact there; one rounding in fp16)
        return (self.ckpt.store.get(name).float() + self.config.traits.norm_offset).to(self.device, self.dtype)

    def linear(self, spec: LinearSpec) -> Linear | QuantLinear:
        return formats.load_linear(self.ckpt, *spec, self.device, self.dtype)

    def split(self, spec: LinearSpec, sizes: list[int]) -> list[Linear]:
        """A fused projection (Phi-3's qkv_proj, gate_up_proj) as one dense layer per part, split by rows."""
        layer = self.linear(spec)
        if not isinstance(layer, Linear):
            raise CheckpointError(f"{spec[0]}: a quantized fused projection cannot be split into its parts; use "
                                  f"the fp16 checkpoint, or an EXL2 quant (EXL2 stores the projections split)")
        biases = [None] * len(sizes) if layer.bias is None else layer.bias.split(sizes)
        return [Linear(w, b) for w, b in zip(layer.weight.split(sizes), biases)]


def _load_weights(ckpt: formats.Checkpoint, config: ModelConfig, block_devices: list[torch.device],
                  dtype: torch.dtype):
    """embedding (on the first device), blocks (each on its device), final norm and lm_head (on the last)."""
    n, store = config.traits.names, ckpt.store
    first, last = block_devices[0], block_devices[-1]
    blocks = []
    for i, device in enumerate(block_devices):
        with on_device(device):                 # the kernels' prepare() runs on the weights' device
            blocks.append(load_block(Loader(ckpt, config, device, dtype), config, i))
    embed = store.get(f"{n.embed}.weight").to(first, dtype)
    with on_device(last):
        if head_is_tied(store, config):
            lm_head = Linear(embed.to(last))        # a copy when the head is on another device
        else:
            lm_head = formats.load_linear(ckpt, n.lm_head, config.hidden_size, config.vocab_size, False, last, dtype)
        norm = Loader(ckpt, config, last, dtype).norm(f"{n.final_norm}.weight")
    return embed, blocks, norm, lm_head


def load_block(load: Loader, config: ModelConfig, i: int) -> Block:
    n, hd = config.traits.names, config.head_dim
    *qkv, o = attention_linears(config, i, load.ckpt.store)
    if _is_fused(load.ckpt.store, config, i, n.qkv, n.q):
        q, k, v = load.split(qkv[0], [config.n_heads * hd, config.n_kv_heads * hd, config.n_kv_heads * hd])
    else:
        q, k, v = map(load.linear, qkv)

    def norm(name):
        return None if name is None else load.norm(f"{_key(config, i, name)}.weight")
    window = config.layer_windows[i]
    attention = Attention(i, q, k, v, load.linear(o), config.n_heads, config.n_kv_heads, hd,
                          scale=config.attn_scale, q_norm=norm(n.q_norm), k_norm=norm(n.k_norm),
                          norm_eps=config.rms_norm_eps, window=window, softcap=config.attn_softcap)
    return Block(norm(n.input_norm), attention, norm(n.post_attn_norm), _load_mlp(load, config, i),
                 attn_out_norm=norm(n.attn_out_norm), mlp_out_norm=norm(n.mlp_out_norm),
                 local_rope=config.local_rope is not None and window is not None)


def _load_mlp(load: Loader, config: ModelConfig, i: int) -> Mlp | MoeMlp:
    n, store = config.traits.names, load.ckpt.store
    specs = mlp_linears(config, i, store)
    if config.moe is not None and config.moe.layers[i]:
        router, *layers = map(load.linear, specs)
        experts = [Mlp(*layers[e: e + 3], config.activation) for e in range(0, len(layers), 3)]
        return MoeMlp(router, experts, config.moe.top_k, config.moe.renormalize)
    *gate_up, down = specs
    if _is_fused(store, config, i, n.gate_up, n.gate):
        gate, up = load.split(gate_up[0], [config.intermediate_size] * 2)
    else:
        gate, up = map(load.linear, gate_up)
    return Mlp(gate, up, load.linear(down), config.activation)

"""Tensor parallelism: every decoder layer sharded over N processes, one per GPU, through torch.distributed (NCCL
on GPUs, gloo on CPU). Rank 0 runs the generator or server; the other ranks run the same forward calls on their
shards, told what to run over a gloo control channel.

Sharding (Megatron's scheme, one all-reduce per sublayer):
  attention  q/k/v column-split by heads (rank r: a contiguous run of kv heads and the query heads of their GQA
             groups; its KV cache holds only those kv heads); o_proj row-split over the same heads' rows, the
             partial outputs summed by an all-reduce.
  MLP        gate/up column-split, down_proj row-split over the same intermediate rows, then an all-reduce.
  lm_head    column-split over the vocabulary, the logits all-gathered. Embedding and norms are replicated.

The act-order catch. A row-split layer must read, on each rank, exactly the activations that rank produced. EXL2
stores the rows of a layer permuted (stored row j is input row perm[j]) and packs them in groups of 32..128 rows
sharing one scale row, so a contiguous range of input rows is scattered over all groups. Two remedies, both exact:
  - down_proj (the row-split side decides): the stored rows are cut at group boundaries into N near-equal runs, and
    rank r's gate/up columns are the input rows of its run, perm[run], in stored order. The shard is a plain EXL2
    layer of whole groups with the identity permutation: no padding, no extra communication.
  - o_proj (heads decide: a rank must hold whole heads): each stored group is cut to the rows of the rank's heads
    and padded with zero-weight rows to a multiple of 32 rows (the packing unit); the attention output is padded
    with as many zeros. Cost: at most 31 padding rows per group per rank (with 128-row groups, about 12% more
    o_proj bytes, ~1% of a Llama layer); still one all-reduce.
GPTQ keeps rows in input order (g_idx only names each row's group), so any row subset is a gather of codes; shards
store their zero points in the v2 convention (the true zeros; the v1 "zero - 1" words borrow across fields, so
their fields cannot be moved one by one). EXL2 q_scale packs 8 columns per int32: column shards unpack the
nibbles, gather and repack them (for 8-aligned runs this equals slicing the words).

Each rank's shards are ordinary Linear / QuantLinear layers, so its kernels are the single-GPU ones. NVLink
multicast (NVLS) is turned off before NCCL starts. Decode steps replay CUDA graphs on every rank: rank 0's
runner announces each replay (the step's batch size and inputs) over the control channel, outside any graph;
each rank copies the inputs into its own graph's static tensors and replays it, the NCCL all-reduces inside.
A size's first replay is captured on all ranks at once, so the captured collectives pair up.

Memory: before loading, every rank reports its GPU's free memory and all plan rank 0's share (rank_footprint:
its weight shards, its kv heads' cache for the context, scratch, reserve) against the smallest, refusing with
each GPU's numbers, or fitting the context when none was asked for."""
from __future__ import annotations

import logging
import math
import os
import socket
import weakref
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from . import cache as kv_cache
from . import formats, model, planner, reference
from .batch import Batch
from .cache import CACHE_MODES, KVCache, check_mode
from .config import ModelConfig
from .errors import ConfigError, OutOfMemoryPlanError
from .formats.exl2 import Exl2Weight, padded
from .formats.gptq import GptqWeight
from .linear import Linear, QuantLinear
from .runner import DecodeGraphs

CONTROL_IDLE = timedelta(days=30)       # followers wait this long for rank 0's next call (a server may idle)
COLLECTIVE_TIMEOUT = timedelta(minutes=10)

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- partitions


def even_cuts(n: int, parts: int, align: int = 1) -> list[range]:
    """0..n-1 in `parts` contiguous runs of near-equal size, each boundary a multiple of align."""
    units = n // align
    bounds = [round(units * r / parts) * align for r in range(parts)] + [n]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def head_runs(config: ModelConfig, world: int) -> tuple[list[range], list[range]]:
    """(query heads, kv heads) of each rank: whole GQA groups, so a rank's query heads read only its kv heads."""
    if config.n_kv_heads % world:
        raise ConfigError(f"tensor_parallel={world} must divide the model's {config.n_kv_heads} kv heads (each rank "
                          f"holds whole kv heads); use {_divisors(config.n_kv_heads)} or gpu_split")
    kv = even_cuts(config.n_kv_heads, world)
    group = config.n_heads // config.n_kv_heads
    return [range(r.start * group, r.stop * group) for r in kv], kv


def _divisors(n: int) -> str:
    return "tensor_parallel=" + " or ".join(str(d) for d in range(2, n + 1) if n % d == 0)


def head_rows(heads: range, head_dim: int) -> Tensor:
    """The features of a run of heads in a [T, H * Dh] activation."""
    return torch.arange(heads.start * head_dim, heads.stop * head_dim)


def input_partition(layer: Linear | QuantLinear, world: int) -> list[Tensor]:
    """The input rows of a row-split layer that each rank holds, in the rank's order. EXL2: the stored rows cut at
    group boundaries into near-equal runs, each rank's rows perm[run] in stored order (its shard keeps whole
    groups). Otherwise contiguous runs, boundaries at multiples of 32 rows (whole packed GPTQ words)."""
    w = getattr(layer, "weight", None)
    if not isinstance(w, Exl2Weight):
        return [torch.arange(r.start, r.stop) for r in even_cuts(layer.in_features, world, 32)]
    starts = [0]
    for _, _, rows in w.groups():
        starts.append(starts[-1] + rows)
    cuts = [0] + [min(starts, key=lambda s: abs(s - w.in_features * r / world)) for r in range(1, world)] + \
        [w.in_features]
    if any(a >= b for a, b in zip(cuts, cuts[1:])):
        raise ConfigError(f"an EXL2 layer of {len(starts) - 1} groups cannot be cut into {world} row runs at group "
                          f"boundaries; use a smaller tensor_parallel or gpu_split")
    perm = torch.argsort(w.q_invperm.long())            # stored row j holds input row perm[j]
    return [perm[a:b] for a, b in zip(cuts, cuts[1:])]


# ----------------------------------------------------------------------------------------------- EXL2 shards


def _zero_words(bits: int, rows: int, columns: int) -> Tensor:
    """Packed words of `rows` x `columns` zero-weight codes (2^(bits-1), the format's zero point)."""
    return reference.pack_bits(torch.full((rows, columns), 2 ** (bits - 1), dtype=torch.int64), bits)


def exl2_columns(w: Exl2Weight, cols: Tensor) -> Exl2Weight:
    """The output features `cols` of w, in that order (padding columns of zero weight up to a multiple of 32)."""
    n = cols.numel()
    pad = padded(n) - n
    words = [w.q_weight[:, cols]]                                             # columns pack independently
    if pad:
        words.append(torch.cat([_zero_words(b, rows, pad) for b, _, rows in w.groups()]))
    nibbles = reference.unpack_bits(w.q_scale.T.contiguous(), 4, w.q_scale.shape[1] * 8).T   # [G, Np]
    nibbles = F.pad(nibbles[:, cols], (0, pad))
    return Exl2Weight(torch.cat(words, dim=1).contiguous(), reference.pack_bits(nibbles.T.contiguous(), 4).T.contiguous(),
                      w.q_scale_max.clone(), w.q_groups.clone(), w.q_invperm.clone(), w.in_features, n)


def exl2_rows(w: Exl2Weight, rows: Tensor) -> tuple[Exl2Weight, int]:
    """The input rows `rows` of w: a layer whose input i is the original input rows[i] (then `pad` zero inputs),
    and pad. Each stored group keeps its rows that are in `rows`, in stored order; a group cut short is padded
    with zero-weight rows to a multiple of 32 rows; groups with none are dropped (with their scale rows)."""
    n = rows.numel()
    local = torch.full((w.in_features,), -1, dtype=torch.int64)
    local[rows.long()] = torch.arange(n)
    stored_input = local[torch.argsort(w.q_invperm.long())]       # stored row j -> local input index (-1: not ours)
    words, q_groups, kept, order, qrow, pad, start = [], [], [], [], 0, 0, 0
    for g, (bits, group_qrow, count) in enumerate(w.groups()):
        mine = stored_input[start: start + count]
        keep = (mine >= 0).nonzero().flatten()
        start += count
        if keep.numel() == 0:
            continue
        group_words = w.q_weight[group_qrow: group_qrow + count * bits // 32]
        if keep.numel() == count:                                  # a whole group: its words as stored
            block, extra = group_words, 0
        else:
            codes = reference.unpack_bits(group_words, bits, count)[keep]
            extra = -keep.numel() % 32
            codes = torch.cat([codes, torch.full((extra, codes.shape[1]), 2 ** (bits - 1), dtype=torch.int64)])
            block = reference.pack_bits(codes, bits)
        words.append(block)
        q_groups += [bits, qrow]
        qrow += block.shape[0]
        kept.append(g)
        order.append(torch.cat([mine[keep], torch.arange(n + pad, n + pad + extra)]))
        pad += extra
    q_invperm = torch.argsort(torch.cat(order)).to(torch.int32)    # local input i -> its local stored row
    shard = Exl2Weight(torch.cat(words).contiguous(), w.q_scale[kept].contiguous(), w.q_scale_max[kept].clone(),
                       torch.tensor(q_groups, dtype=torch.int16), q_invperm, n + pad, w.out_features)
    return shard, pad


# ----------------------------------------------------------------------------------------------- GPTQ shards


def _v2_zeros(w: GptqWeight) -> Tensor:
    """True zero points [G, N] (any convention)."""
    return reference.gptq_zeros(w.qzeros, w.bits, w.out_features, w.v2)


def _pack_zeros(zeros: Tensor, bits: int) -> Tensor:
    """[G, N] true zeros -> v2 qzeros [G, N*bits/32]."""
    if zeros.shape[1] * bits % 32:
        raise ConfigError(f"a GPTQ shard of {zeros.shape[1]} columns cannot be packed at {bits} bits (columns * "
                          f"bits must be a multiple of 32); use a smaller tensor_parallel or gpu_split")
    return reference.pack_bits(zeros.T.contiguous(), bits).T.contiguous()


def gptq_columns(w: GptqWeight, cols: Tensor) -> GptqWeight:
    return GptqWeight(w.qweight[:, cols].contiguous(), _pack_zeros(_v2_zeros(w)[:, cols], w.bits),
                      w.scales[:, cols].contiguous(), w.g_idx.clone(), w.bits, True, w.in_features, cols.numel())


def gptq_rows(w: GptqWeight, rows: Tensor) -> GptqWeight:
    """The input rows `rows` of w, in that order; only the groups they use are kept (g_idx renumbered)."""
    n, bits = rows.numel(), w.bits
    if n * bits % 32:
        raise ConfigError(f"a GPTQ shard of {n} input rows cannot be packed at {bits} bits; use a smaller "
                          f"tensor_parallel or gpu_split")
    first = int(rows[0])
    if torch.equal(rows, torch.arange(first, first + n)) and first * bits % 32 == 0:     # whole words: a slice
        qweight = w.qweight[first * bits // 32: (first + n) * bits // 32].contiguous()
    else:
        qweight = reference.pack_bits(reference.unpack_bits(w.qweight, bits, w.in_features)[rows], bits)
    groups = w.g_idx.long()[rows]
    used = torch.unique(groups)                                    # sorted
    return GptqWeight(qweight, w.qzeros[used].contiguous(), w.scales[used].contiguous(),
                      torch.searchsorted(used, groups).to(torch.int32), bits, w.v2, n, w.out_features)


# ----------------------------------------------------------------------------------------------- layers


def column_shard(layer: Linear | QuantLinear, cols: Tensor) -> Linear | QuantLinear:
    """Output features `cols` of a layer on the CPU (bias sliced alike)."""
    bias = None if layer.bias is None else layer.bias[cols]
    if isinstance(layer, Linear):
        return Linear(layer.weight[cols].contiguous(), bias)
    w = layer.weight
    return QuantLinear(exl2_columns(w, cols) if isinstance(w, Exl2Weight) else gptq_columns(w, cols), bias)


def row_shard(layer: Linear | QuantLinear, rows: Tensor, keep_bias: bool) -> tuple[Linear | QuantLinear, int]:
    """Input rows `rows` of a layer on the CPU, and the zero inputs its shard needs appended. The bias goes to one
    rank only (keep_bias), so that the all-reduce adds it once."""
    bias = layer.bias if keep_bias else None
    if isinstance(layer, Linear):
        return Linear(layer.weight[:, rows].contiguous(), bias), 0
    w = layer.weight
    if isinstance(w, Exl2Weight):
        shard, pad = exl2_rows(w, rows)
        return QuantLinear(shard, bias), pad
    return QuantLinear(gptq_rows(w, rows), bias), 0


class RowParallel:
    """A row-split layer: y = all_reduce(shard(x)). pad: zero inputs the shard's layout appends to x."""

    def __init__(self, layer: Linear | QuantLinear, pad: int, group):
        self.layer, self.pad, self.group = layer, pad, group
        self.in_features, self.out_features = layer.in_features - pad, layer.out_features

    def __call__(self, x: Tensor) -> Tensor:
        if self.pad:
            x = F.pad(x, (0, self.pad))
        y = self.layer(x)
        dist.all_reduce(y, group=self.group)
        return y

    def nbytes(self) -> int:
        return self.layer.nbytes()


class VocabParallelHead:
    """lm_head split over the vocabulary: each rank's logits [R, chunk] (the last rank's zero-padded to chunk),
    all-gathered into [R, vocab]."""

    def __init__(self, layer: Linear | QuantLinear, vocab: int, chunk: int, world: int, group):
        self.layer, self.vocab, self.chunk, self.world, self.group = layer, vocab, chunk, world, group

    def __call__(self, x: Tensor) -> Tensor:
        y = self.layer(x)
        y = F.pad(y, (0, self.chunk - y.shape[1])).contiguous()
        parts = [torch.empty_like(y) for _ in range(self.world)]
        dist.all_gather(parts, y, group=self.group)
        return torch.cat(parts, dim=1)[:, :self.vocab]

    def nbytes(self) -> int:
        return self.layer.nbytes()


# ----------------------------------------------------------------------------------------------- loading a shard


@dataclass(frozen=True)
class Rank:
    rank: int
    world: int
    device: torch.device
    group: object = None            # the collectives' process group (None: the default one)


def local_config(config: ModelConfig, world: int) -> ModelConfig:
    """A rank's view: its share of the heads (its KV cache holds only its kv heads)."""
    return replace(config, n_heads=config.n_heads // world, n_kv_heads=config.n_kv_heads // world)


def check_shardable(ckpt: formats.Checkpoint, config: ModelConfig, world: int) -> None:
    head_runs(config, world)
    names, store = config.traits.names, ckpt.store
    if config.moe is not None and any(config.moe.layers):
        raise ConfigError(f"{config.architecture}: tensor parallelism does not shard mixture-of-experts layers yet; "
                          f"use gpu_split")
    if any(model._is_fused(store, config, i, names.qkv, names.q) or model._is_fused(store, config, i, names.gate_up,
                                                                                    names.gate)
           for i in range(config.n_layers)):
        raise ConfigError("this checkpoint stores fused qkv_proj / gate_up_proj; tensor parallelism needs them "
                          "split (an EXL2 quant stores them split); use gpu_split")


class ShardLoader(model.Loader):
    """model.py's loader, each linear read on the CPU, cut to this rank's part, then placed on the device."""

    def __init__(self, ckpt: formats.Checkpoint, config: ModelConfig, rank: Rank, dtype: torch.dtype):
        super().__init__(ckpt, config, rank.device, dtype)
        self.rank = rank
        self.q_heads, self.kv_heads = (runs[rank.rank] for runs in head_runs(config, rank.world))
        self.roles: dict[str, tuple[int, str]] = {}
        for i in range(config.n_layers):
            (q, *_), (k, *_), (v, *_), (o, *_) = model.attention_linears(config, i, ckpt.store)
            (gate, *_), (up, *_), (down, *_) = model.mlp_linears(config, i, ckpt.store)
            self.roles.update({q: (i, "q"), k: (i, "kv"), v: (i, "kv"), o: (i, "o"), gate: (i, "mlp"),
                               up: (i, "mlp"), down: (i, "down")})
        self.specs = {spec[0]: spec for spec in model.linears(config, ckpt.store)}
        self._downs: dict[int, tuple[Linear | QuantLinear, Tensor]] = {}

    def _full(self, key: str) -> Linear | QuantLinear:
        return formats.load_linear(self.ckpt, *self.specs[key], torch.device("cpu"), self.dtype)

    def _mlp_rows(self, i: int) -> tuple[Linear | QuantLinear, Tensor]:
        """Layer i's down_proj (whole, on the CPU) and this rank's intermediate rows (down decides them)."""
        if i not in self._downs:
            key = next(k for k, (j, role) in self.roles.items() if j == i and role == "down")
            down = self._full(key)
            self._downs[i] = down, input_partition(down, self.rank.world)[self.rank.rank]
        return self._downs[i]

    def linear(self, spec: model.LinearSpec) -> Linear | QuantLinear | RowParallel:
        i, role = self.roles[spec[0]]
        hd, r = self.config.head_dim, self.rank
        if role == "down":
            down, rows = self._mlp_rows(i)
            del self._downs[i]                      # gate/up (loaded first) are done with it
            shard, pad = row_shard(down, rows, keep_bias=r.rank == 0)
            return RowParallel(self._place(shard), pad, r.group)
        full = self._full(spec[0])
        if role == "o":
            shard, pad = row_shard(full, head_rows(self.q_heads, hd), keep_bias=r.rank == 0)
            return RowParallel(self._place(shard), pad, r.group)
        cols = {"q": lambda: head_rows(self.q_heads, hd), "kv": lambda: head_rows(self.kv_heads, hd),
                "mlp": lambda: self._mlp_rows(i)[1]}[role]()
        return self._place(column_shard(full, cols))

    def _place(self, layer: Linear | QuantLinear) -> Linear | QuantLinear:
        return layer.to(self.device, self.dtype)

    def head(self) -> VocabParallelHead:
        c, store, names = self.config, self.ckpt.store, self.config.traits.names
        chunk = padded(-(-c.vocab_size // self.rank.world))
        cols = torch.arange(self.rank.rank * chunk, min((self.rank.rank + 1) * chunk, c.vocab_size))
        if model.head_is_tied(store, c):
            full = Linear(store.get(f"{names.embed}.weight"))
        else:
            full = formats.load_linear(self.ckpt, names.lm_head, c.hidden_size, c.vocab_size, False,
                                       torch.device("cpu"), self.dtype)
        return VocabParallelHead(self._place(column_shard(full, cols)), c.vocab_size, chunk, self.rank.world,
                                 self.rank.group)


def load_shard(path: str | Path, rank: Rank, dtype: torch.dtype, config: ModelConfig | None = None) -> model.Model:
    """This rank's part of the model: a Model over the local config whose o/down/head layers communicate."""
    config = config or ModelConfig.from_dir(path)
    ckpt = formats.open_checkpoint(path)
    model.check_ops(config, model.ops_for(rank.device), rank.device)
    model.validate(ckpt, config)
    check_shardable(ckpt, config, rank.world)
    load = ShardLoader(ckpt, config, rank, dtype)
    mine = local_config(config, rank.world)
    with model.on_device(rank.device):
        blocks = [model.load_block(load, mine, i) for i in range(config.n_layers)]
        head = load.head()
    embed = ckpt.store.get(f"{config.traits.names.embed}.weight").to(rank.device, dtype)
    norm = load.norm(f"{config.traits.names.final_norm}.weight")
    return model.Model(mine, embed, blocks, norm, head, rank.device, dtype)


# ----------------------------------------------------------------------------------------------- memory plan


def rank_footprint(ckpt: formats.Checkpoint, config: ModelConfig, world: int, cache_mode: str = "fp16",
                   dtype: torch.dtype = torch.float16) -> planner.Footprint:
    """One rank's share in planner.footprint's accounting, from the headers alone: the replicated embedding and
    norms; q/k/v, gate/up and the head cut by columns (its heads, 1/world of the MLP, its vocabulary chunk); o
    and down cut by rows, quantized ones with an allowance for the cut (EXL2 o_proj: up to 31 padding rows per
    group; down_proj: cut at group boundaries, up to one group more than 1/world); its kv heads' KV cache; the
    scratch of its part of a prefill chunk (the all-gathered logits whole). Rank 0's share is planned for every
    rank: its vocabulary chunk is the widest and it keeps the row-split biases. Quantized shards are bounded
    from above (_cut_allowance): their exact size needs the tensors, not just the headers."""
    kv_cache.check_mode(cache_mode, local_config(config, world))
    item, store, d = dtype.itemsize, ckpt.store, config.hidden_size
    q_heads, kv_heads = (runs[0] for runs in head_runs(config, world))
    q_share, kv_share, mlp_share = len(q_heads) / config.n_heads, len(kv_heads) / config.n_kv_heads, 1 / world
    tensor_bytes = (config.vocab_size * d + (2 * config.n_layers + 1) * d) * item       # embedding, norms
    prepare = dequant = decoder_bytes = decoder_weights = 0
    chunk = padded(-(-config.vocab_size // world))
    parts = []              # (spec, share, cut): cut None (by columns), "heads" or "groups" (by rows)
    for i in range(config.n_layers):
        q, k, v, o = model.attention_linears(config, i, store)
        gate, up, down = model.mlp_linears(config, i, store)
        parts += [(q, q_share, None), (k, kv_share, None), (v, kv_share, None), (o, q_share, "heads"),
                  (gate, mlp_share, None), (up, mlp_share, None), (down, mlp_share, "groups")]
    if not model.head_is_tied(store, config):
        parts.append(((config.traits.names.lm_head, d, config.vocab_size, False), chunk / config.vocab_size, None))
    else:
        tensor_bytes += chunk * d * item        # the head's columns of the embedding
    for (key, k, n, _), share, cut in parts:
        nbytes = formats.linear_nbytes(ckpt, key, k, n, dtype)
        mine = math.ceil(nbytes * share) + _cut_allowance(ckpt, key, k, n, nbytes, share, cut)
        tensor_bytes += mine
        k_mine, n_mine = (math.ceil(k * share), n) if cut else (k, math.ceil(n * share))
        if key != config.traits.names.lm_head:
            decoder_bytes, decoder_weights = decoder_bytes + mine, decoder_weights + k_mine * n_mine
        if formats.linear_kind(store, key) != "dense":
            prepare += planner.PREPARE_BYTES_PER_ROW * k_mine
            dequant = max(dequant, k_mine * padded(n_mine) * 2)
    view = replace(local_config(config, world), intermediate_size=math.ceil(config.intermediate_size / world))
    return planner.Footprint(view, cache_mode, dtype, tensor_bytes, prepare, dequant, decoder_bytes,
                             decoder_weights, kv_cache.bytes_per_token(view, cache_mode, item))


def _cut_allowance(ckpt: formats.Checkpoint, key: str, k: int, n: int, nbytes: int, share: float,
                   cut: str | None) -> int:
    """Bytes a shard of a quantized layer may hold beyond `share` of its bytes: the per-group and per-row tensors
    a shard may keep whole (EXL2 scale maxima, group map, permutation; GPTQ scales and zeros of every group its
    rows use, g_idx), and for EXL2 the cut's padding (exl2_columns, exl2_rows, input_partition)."""
    store, kind = ckpt.store, formats.linear_kind(ckpt.store, key)
    if kind == "dense":
        return 0

    def stored(name):
        info = store.info(f"{key}.{name}")
        return math.prod(info.shape) * info.dtype.itemsize
    if kind != "exl2":
        return stored("qzeros") + math.prod(store.info(f"{key}.scales").shape) * 2 + k * 4
    groups = store.info(f"{key}.q_groups").shape[0] // 2
    whole = stored("q_scale_max") + stored("q_groups") + stored("q_invperm")
    if cut is None:                             # columns padded to a multiple of 32
        cols = math.ceil(n * share)
        return whole + (padded(cols) - cols) * nbytes // n
    if cut == "heads":
        return whole + groups * 31 * nbytes // k        # up to 31 zero rows per group
    return whole + nbytes // groups             # cut at the group boundary nearest 1/world: up to a group more


@dataclass(frozen=True)
class RankMemory:
    """The plan every rank agreed on: rank 0's share, each GPU's free memory before loading, the context."""
    footprint: planner.Footprint
    budgets: tuple[int, ...]
    names: tuple[str, ...]
    tokens: int


def fit_context(fp: planner.Footprint, budgets: list[int], names: list[str], requested: int | None,
                max_position_embeddings: int) -> int:
    """planner.fit_context for tensor parallelism: `requested` if every GPU holds its share, else
    OutOfMemoryPlanError with each GPU's numbers; with no request, the longest context every GPU holds (up to
    max_position_embeddings)."""
    tokens = requested or max_position_embeddings
    tightest = min(budgets)
    if fp.plan(tokens).total <= tightest:
        return tokens
    fits = fp.max_tokens(tightest)
    if requested is None and fits >= min(tokens, planner.PAGE_SIZE):
        log.warning("tensor parallel: context shortened from %d to %d tokens to fit every GPU's share (pass "
                    "max_seq_len to choose)", tokens, fits)
        return fits
    p, gib = fp.plan(tokens), planner.gib
    lines = [f"{name}: {gib(budget)} free, {'fits' if p.total <= budget else f'short by {gib(p.total - budget)}'}"
             for name, budget in zip(names, budgets)]
    ways = [f"max_seq_len={fits} (the longest context every GPU holds)"] if fits else []
    if fp.cache_mode != "q4" and fp.bytes_per_token:
        ways.append("cache_mode='q4'")
    ways += ["a lower-bpw quant of this model", "more GPUs (a larger tensor_parallel, if the kv heads divide)"]
    raise OutOfMemoryPlanError(
        f"tensor_parallel={len(budgets)}: the model does not fit. Each GPU holds its share, {gib(p.total)} "
        f"({planner.breakdown(p)}; its kv heads only). Per GPU: {'; '.join(lines)}. Try: {'; '.join(ways)}")


def plan_memory(ckpt: formats.Checkpoint, config: ModelConfig, me: Rank, channel: "Channel",
                requested: int | None, cache_mode: str, dtype: torch.dtype) -> RankMemory:
    """Every rank calls this after joining and before loading: each reports its GPU's free memory, then all
    decide alike (so all refuse, or all load for the same context)."""
    from .placement import device_name
    reports = [None] * me.world
    dist.all_gather_object(reports, (planner.free_memory(me.device), device_name(me.device)), group=channel.group)
    budgets, names = [b for b, _ in reports], [n for _, n in reports]
    fp = rank_footprint(ckpt, config, me.world, cache_mode, dtype)
    tokens = fit_context(fp, budgets, names, requested, config.max_position_embeddings)
    return RankMemory(fp, tuple(budgets), tuple(names), tokens)


# ----------------------------------------------------------------------------------------------- rank 0 and the rest

FORWARD, REPLAY, STOP = 1, 2, 3
# the header: command; the cache (id, pages, page size, mode); the batch (tokens, sequences, page-table width,
# logit rows or -1: all); how many freed cache ids follow the batch; for REPLAY the graph (batch size, page-table
# width, trash page)
HEADER = 13
MODES = list(CACHE_MODES)


class Channel:
    """Rank 0 -> every rank: a fixed-size int64 header, then an int64 payload, broadcast over a gloo group (the
    followers wait on the CPU, however long rank 0 is idle)."""

    def __init__(self, group):
        self.group = group

    def send(self, header: list[int], payload: Tensor) -> None:
        dist.broadcast(torch.tensor(header, dtype=torch.int64), 0, group=self.group)
        if payload.numel():
            dist.broadcast(payload.cpu(), 0, group=self.group)

    def receive(self) -> tuple[list[int], Tensor]:
        header = torch.empty(HEADER, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group)
        h = header.tolist()
        payload = torch.empty(_payload_size(h), dtype=torch.int64)
        if payload.numel():
            dist.broadcast(payload, 0, group=self.group)
        return h, payload


def _payload_size(h: list[int]) -> int:
    cmd, _, _, _, _, t, b, width, rows, freed = h[:10]
    return 0 if cmd == STOP else 3 * t + 2 * b + 1 + b * width + max(rows, 0) + freed


def _pack(batch: Batch, freed: list[int]) -> Tensor:
    parts = [batch.input_ids, batch.positions, batch.slots, batch.cu_seqlens, batch.seq_lens,
             batch.block_tables.flatten()]
    if batch.logit_rows is not None:
        parts.append(batch.logit_rows)
    packed = torch.cat([p.to(torch.int64) for p in parts]).cpu()          # one copy to the host
    return torch.cat([packed, torch.tensor(freed, dtype=torch.int64)])


def _unpack(h: list[int], payload: Tensor, device: torch.device) -> tuple[Batch, list[int]]:
    _, _, _, page_size, _, t, b, width, rows, freed = h[:10]
    sizes = [t, t, t, b + 1, b, b * width, max(rows, 0)]
    inputs, free = payload.split([sum(sizes), freed])
    ids, pos, slots, cu, lens, tables, logit_rows = inputs.to(device).split(sizes)      # one copy over
    batch = Batch(ids, pos, slots, cu.to(torch.int32), lens.to(torch.int32), tables.view(b, width).to(torch.int32),
                  None if rows < 0 else logit_rows, page_size)
    return batch, free.tolist()


class TensorParallelModel:
    """Rank 0's model: a Model's interface; each forward (and each decode-graph replay) is announced to the other
    ranks, then run by all."""

    def __init__(self, local: model.Model, channel: Channel, processes: list = (), memory: RankMemory | None = None):
        """memory: the plan the ranks loaded by (None on the CPU, where nothing is planned)."""
        self.local, self.channel, self.memory = local, channel, memory
        self.config, self.device, self.dtype = local.config, local.device, local.dtype
        self.block_devices, self.output_device = local.block_devices, local.output_device
        self.can_capture_graphs = True          # every rank captures the same steps over its shard, in lockstep
        self._ids: weakref.WeakKeyDictionary[KVCache, int] = weakref.WeakKeyDictionary()
        self._next_id = 0
        self._freed: list[int] = []             # ids of rank 0's caches collected since the last announcement
        self._graphs: weakref.WeakSet[DecodeGraphs] = weakref.WeakSet()
        self._closer = weakref.finalize(self, _stop, channel, list(processes), self._graphs)

    def forward(self, batch: Batch, cache: KVCache) -> Tensor:
        self.announce(cache, batch)
        return self.local.forward(batch, cache)

    def decode_graphs(self, cache: KVCache, max_pages: int, trash_page: int) -> "AnnouncedGraphs":
        graphs = DecodeGraphs(self.local, cache, max_pages, trash_page)
        self._graphs.add(graphs)
        return AnnouncedGraphs(self, graphs)

    def announce(self, cache: KVCache, batch: Batch, graph: tuple[int, int, int] | None = None) -> None:
        """Tells the other ranks to run batch over their mirror of cache: eagerly, or (graph = (batch size,
        page-table width, trash page)) by replaying their graph of that step."""
        cid = self._ids.get(cache)
        if cid is None:
            self._next_id += 1
            cid = self._ids[cache] = self._next_id
            weakref.finalize(cache, self._freed.append, cid)      # the followers drop their mirror then
        freed = self._freed[:]
        self._freed.clear()
        rows = -1 if batch.logit_rows is None else batch.logit_rows.numel()
        header = [FORWARD if graph is None else REPLAY, cid, cache.pool.n_pages, cache.page_size,
                  MODES.index(cache.mode), batch.input_ids.numel(), batch.n_seqs, batch.block_tables.shape[1], rows,
                  len(freed), *(graph or (0, 0, 0))]
        self.channel.send(header, _pack(batch, freed))

    def close(self) -> None:
        """Lets the other ranks finish (also done when this object is collected, or at exit)."""
        self._closer()


class AnnouncedGraphs:
    """Rank 0's decode graphs: each replay is announced first, so every rank replays (or, at a size's first use,
    captures) the same step."""

    def __init__(self, model: TensorParallelModel, graphs: DecodeGraphs):
        self.model, self.graphs = model, graphs

    def run(self, size: int, batch: Batch) -> Tensor:
        g = self.graphs
        self.model.announce(g.cache, batch, (size, g.max_pages, g.trash_page))
        return g.run(size, batch)


def _reset(graphs) -> None:
    for g in list(graphs):
        for graph in g.by_size.values():
            graph.reset()


def _stop(channel: Channel, processes: list, graphs) -> None:
    _reset(graphs)          # captured collectives would keep NCCL's communicator from being destroyed
    channel.send([STOP] + [0] * (HEADER - 1), torch.empty(0, dtype=torch.int64))
    for p in processes:
        p.join(timeout=60)
    dist.destroy_process_group()


def follow(local: model.Model, channel: Channel) -> None:
    """A follower's loop: run every forward and replay every decode graph rank 0 announces, on a mirror of each
    of rank 0's caches (and of its graphs over it), until STOP."""
    caches: dict[int, KVCache] = {}
    graphs: dict[tuple[int, int, int], DecodeGraphs] = {}       # (cache id, page-table width, trash page)
    try:
        while True:
            h, payload = channel.receive()
            if h[0] == STOP:
                return
            batch, freed = _unpack(h, payload, local.device)
            for cid in freed:
                caches.pop(cid, None)
                for key in [key for key in graphs if key[0] == cid]:
                    _reset([graphs.pop(key)])
            cid, n_pages, page_size, mode = h[1:5]
            if cid not in caches:
                caches[cid] = KVCache(local.config, n_pages, page_size, MODES[mode], local.device, local.dtype)
            if h[0] == FORWARD:
                local.forward(batch, caches[cid])
                continue
            size, max_pages, trash_page = h[10:13]
            key = (cid, max_pages, trash_page)
            if key not in graphs:
                graphs[key] = DecodeGraphs(local, caches[cid], max_pages, trash_page)
            graphs[key].run(size, batch)
    finally:
        _reset(graphs.values())


# ----------------------------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_rank() -> int | None:
    """This process's rank when torchrun (or any launcher setting RANK) started it, else None."""
    return int(os.environ["RANK"]) if "RANK" in os.environ else None


def join_group(rank: int, world: int, device_type: str, init_method: str) -> tuple[Rank, Channel]:
    """Starts torch.distributed for this process: NCCL (multicast off) on GPUs, gloo on CPU, plus the gloo
    control channel. Rank r uses cuda:LOCAL_RANK (torchrun) or cuda:r. On GPUs the NCCL communicator is made
    and used once here: a collective captured in a CUDA graph needs it to exist already."""
    if device_type == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"        # never NVLink multicast (NVLS); must precede NCCL's start
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=COLLECTIVE_TIMEOUT,
                            device_id=device if device_type == "cuda" else None)
    if device_type == "cuda":
        dist.all_reduce(torch.zeros(1, device=device))
        torch.cuda.synchronize(device)
    control = dist.new_group(backend="gloo", timeout=CONTROL_IDLE)
    return Rank(rank, world, device), Channel(control)


def load_rank(path: Path, me: Rank, channel: Channel, dtype: torch.dtype, config: ModelConfig,
              requested: int | None, cache_mode: str) -> tuple[model.Model, RankMemory | None]:
    """Every rank: the memory plan (on GPUs; all ranks decide alike), then its shard."""
    memory = None
    if me.device.type == "cuda":
        memory = plan_memory(formats.open_checkpoint(path), config, me, channel, requested, cache_mode, dtype)
    return load_shard(path, me, dtype, config), memory


def follower_main(path: str, rank: int, world: int, device_type: str, init_method: str, dtype: torch.dtype,
                  requested: int | None, cache_mode: str) -> None:
    """A spawned rank's whole life: join, plan, load its shard, follow rank 0, leave. A plan that does not fit
    ends it quietly: rank 0 reached the same verdict and reports it."""
    me, channel = join_group(rank, world, device_type, init_method)
    try:
        local, _ = load_rank(Path(path), me, channel, dtype, ModelConfig.from_dir(path), requested, cache_mode)
        follow(local, channel)
    except OutOfMemoryPlanError:
        pass
    finally:
        dist.destroy_process_group()


def from_pretrained(cls, path, world: int, device, max_seq_len: int | None, cache_mode: str, dtype, **hf_kwargs):
    """ExlForCausalLM.from_pretrained(..., tensor_parallel=world). Under torchrun (RANK / WORLD_SIZE set) this
    process joins that group; otherwise it is rank 0 and starts ranks 1..world-1 itself. On GPUs every rank's
    share is planned against its GPU's free memory before anything is loaded."""
    from .hf import _hf_loading_arguments, default_dtype, load_tokenizer
    device, dtype = _hf_loading_arguments(device, dtype, hf_kwargs)
    dtype = dtype or default_dtype(device)
    path = Path(path)
    config = ModelConfig.from_dir(path)
    check_mode(cache_mode, local_config(config, world) if config.n_kv_heads % world == 0 else config)
    check_shardable(formats.open_checkpoint(path), config, world)
    if max_seq_len is not None and max_seq_len <= 0:
        raise ConfigError(f"max_seq_len must be positive, got {max_seq_len}")
    if device.type == "cuda" and torch.cuda.device_count() < world and launched_rank() is None:
        raise ConfigError(f"tensor_parallel={world} needs {world} GPUs; {torch.cuda.device_count()} are visible")
    processes = []
    rank = launched_rank()
    if rank is not None:
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ConfigError(f"tensor_parallel={world} but torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']} "
                              f"processes")
        init_method = "env://"
    else:
        rank, init_method = 0, f"tcp://127.0.0.1:{free_port()}"
        spawn = torch.multiprocessing.get_context("spawn")
        for r in range(1, world):
            p = spawn.Process(target=follower_main, args=(str(path), r, world, device.type, init_method, dtype,
                                                          max_seq_len, cache_mode), daemon=True)
            p.start()
            processes.append(p)
    me, channel = join_group(rank, world, device.type, init_method)
    try:
        local, memory = load_rank(path, me, channel, dtype, config, max_seq_len, cache_mode)
    except BaseException:
        dist.destroy_process_group()
        for p in processes:
            p.join(timeout=60)
        raise
    if rank != 0:
        try:
            follow(local, channel)
        finally:
            dist.destroy_process_group()
        raise SystemExit(0)
    tokens = memory.tokens if memory is not None else max_seq_len or config.max_position_embeddings
    return cls(TensorParallelModel(local, channel, processes, memory), load_tokenizer(path), path, tokens,
               cache_mode)

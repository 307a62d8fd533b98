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
multicast (NVLS) is turned off before NCCL starts. Decode steps run eagerly (no CUDA graph): the control message
that starts a step must reach the other ranks outside any graph."""
from __future__ import annotations

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

from . import formats, model, reference
from .batch import Batch
from .cache import CACHE_MODES, KVCache, check_mode
from .config import ModelConfig
from .errors import ConfigError
from .formats.exl2 import Exl2Weight, padded
from .formats.gptq import GptqWeight
from .linear import Linear, QuantLinear

CONTROL_IDLE = timedelta(days=30)       # followers wait this long for rank 0's next call (a server may idle)
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


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


class ShardLoader(model._Loader):
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
        blocks = [model._load_block(load, mine, i) for i in range(config.n_layers)]
        head = load.head()
    embed = ckpt.store.get(f"{config.traits.names.embed}.weight").to(rank.device, dtype)
    norm = load.norm(f"{config.traits.names.final_norm}.weight")
    return model.Model(mine, embed, blocks, norm, head, rank.device, dtype)


# ----------------------------------------------------------------------------------------------- rank 0 and the rest

FORWARD, STOP = 1, 2
HEADER = 10     # cmd, cache id, n_pages, page_size, cache mode, T, B, table width, logit rows (-1: all), freed ids
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
    cmd, _, _, _, _, t, b, width, rows, freed = h
    return 0 if cmd != FORWARD else 3 * t + 2 * b + 1 + b * width + max(rows, 0) + freed


def _pack(batch: Batch, freed: list[int]) -> Tensor:
    parts = [batch.input_ids, batch.positions, batch.slots, batch.cu_seqlens, batch.seq_lens,
             batch.block_tables.flatten()]
    if batch.logit_rows is not None:
        parts.append(batch.logit_rows)
    return torch.cat([p.to("cpu", torch.int64) for p in parts] + [torch.tensor(freed, dtype=torch.int64)])


def _unpack(h: list[int], payload: Tensor, device: torch.device) -> tuple[Batch, list[int]]:
    _, _, _, page_size, _, t, b, width, rows, freed = h
    sizes = [t, t, t, b + 1, b, b * width, max(rows, 0), freed]
    ids, pos, slots, cu, lens, tables, logit_rows, free = payload.split(sizes)
    batch = Batch(ids.to(device), pos.to(device), slots.to(device), cu.to(device, torch.int32),
                  lens.to(device, torch.int32), tables.view(b, width).to(device, torch.int32),
                  None if rows < 0 else logit_rows.to(device), page_size)
    return batch, free.tolist()


class TensorParallelModel:
    """Rank 0's model: a Model's interface; each forward is announced to the other ranks, then run by all."""

    def __init__(self, local: model.Model, channel: Channel, processes: list = ()):
        self.local, self.channel = local, channel
        self.config, self.device, self.dtype = local.config, local.device, local.dtype
        self.block_devices, self.output_device = local.block_devices, local.output_device
        self.can_capture_graphs = False
        self._ids: weakref.WeakKeyDictionary[KVCache, int] = weakref.WeakKeyDictionary()
        self._next_id = 0
        self._freed: list[int] = []         # ids of rank 0's caches collected since the last forward
        self._closer = weakref.finalize(self, _stop, channel, list(processes))

    def forward(self, batch: Batch, cache: KVCache) -> Tensor:
        cid = self._ids.get(cache)
        if cid is None:
            self._next_id += 1
            cid = self._ids[cache] = self._next_id
            weakref.finalize(cache, self._freed.append, cid)      # the followers drop their mirror then
        freed = self._freed[:]
        self._freed.clear()
        rows = -1 if batch.logit_rows is None else batch.logit_rows.numel()
        header = [FORWARD, cid, cache.pool.n_pages, cache.page_size, MODES.index(cache.mode),
                  batch.input_ids.numel(), batch.n_seqs, batch.block_tables.shape[1], rows, len(freed)]
        self.channel.send(header, _pack(batch, freed))
        return self.local.forward(batch, cache)

    def close(self) -> None:
        """Lets the other ranks finish (also done when this object is collected, or at exit)."""
        self._closer()


def _stop(channel: Channel, processes: list) -> None:
    channel.send([STOP] + [0] * (HEADER - 1), torch.empty(0, dtype=torch.int64))
    for p in processes:
        p.join(timeout=60)
    dist.destroy_process_group()


def follow(local: model.Model, channel: Channel) -> None:
    """A follower's loop: run every forward rank 0 announces, on a mirror of each of its caches, until STOP."""
    caches: dict[int, KVCache] = {}
    while True:
        h, payload = channel.receive()
        if h[0] == STOP:
            return
        batch, freed = _unpack(h, payload, local.device)
        for cid in freed:
            caches.pop(cid, None)
        cid, n_pages, page_size, mode = h[1:5]
        if cid not in caches:
            caches[cid] = KVCache(local.config, n_pages, page_size, MODES[mode], local.device, local.dtype)
        local.forward(batch, caches[cid])


# ----------------------------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(rank: int, world: int, device_type: str, init_method: str) -> tuple[Rank, Channel]:
    """Starts torch.distributed for this process: NCCL (multicast off) on GPUs, gloo on CPU, plus the gloo
    control channel. Rank r uses cuda:LOCAL_RANK (torchrun) or cuda:r."""
    if device_type == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"        # never NVLink multicast (NVLS); must precede NCCL's start
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=CONTROL_IDLE)
    return Rank(rank, world, device), Channel(control)


def follower_main(path: str, rank: int, world: int, device_type: str, init_method: str, dtype: torch.dtype) -> None:
    """A spawned rank's whole life: join, load its shard, follow rank 0, leave."""
    me, channel = join_group(rank, world, device_type, init_method)
    local = load_shard(path, me, dtype)
    try:
        follow(local, channel)
    finally:
        dist.destroy_process_group()


def from_pretrained(cls, path, world: int, device, max_seq_len: int | None, cache_mode: str, dtype, **hf_kwargs):
    """ExlForCausalLM.from_pretrained(..., tensor_parallel=world). Under torchrun (RANK / WORLD_SIZE set) this
    process joins that group; otherwise it is rank 0 and starts ranks 1..world-1 itself."""
    from .hf import _hf_loading_arguments, default_dtype, load_tokenizer
    device, dtype = _hf_loading_arguments(device, dtype, hf_kwargs)
    dtype = dtype or default_dtype(device)
    path = Path(path)
    config = ModelConfig.from_dir(path)
    check_mode(cache_mode, local_config(config, world) if config.n_kv_heads % world == 0 else config)
    check_shardable(formats.open_checkpoint(path), config, world)
    if device.type == "cuda" and torch.cuda.device_count() < world and "RANK" not in os.environ:
        raise ConfigError(f"tensor_parallel={world} needs {world} GPUs; {torch.cuda.device_count()} are visible")
    processes = []
    if "RANK" in os.environ:
        rank, launched = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if launched != world:
            raise ConfigError(f"tensor_parallel={world} but torchrun started WORLD_SIZE={launched} processes")
        init_method = "env://"
    else:
        rank, init_method = 0, f"tcp://127.0.0.1:{free_port()}"
        spawn = torch.multiprocessing.get_context("spawn")
        for r in range(1, world):
            p = spawn.Process(target=follower_main, args=(str(path), r, world, device.type, init_method, dtype),
                              daemon=True)
            p.start()
            processes.append(p)
    me, channel = join_group(rank, world, device.type, init_method)
    local = load_shard(path, me, dtype, config)
    if rank != 0:
        try:
            follow(local, channel)
        finally:
            dist.destroy_process_group()
        raise SystemExit(0)
    return cls(TensorParallelModel(local, channel, processes), load_tokenizer(path), path,
               max_seq_len or config.max_position_embeddings, cache_mode)

"""Weight shards: which rows and columns each rank holds, the EXL2 and GPTQ tensors of a shard, and the layers that
communicate (a row-split layer's all-reduce, the vocabulary-split head's all-gather).

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

Each rank's shards are ordinary Linear / QuantLinear layers, so its kernels are the single-GPU ones."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ..errors import ConfigError
from ..formats.exl2 import Exl2Weight, padded
from ..formats.gptq import GptqWeight
from ..model import reference
from ..model.config import ModelConfig
from ..model.linear import Linear, QuantLinear


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

"""The per-rank memory plan: before loading, every rank reports its GPU's free memory and all plan rank 0's share
(rank_footprint: its weight shards, its kv heads' cache for the context, scratch, reserve) against the smallest,
refusing with each GPU's numbers, or fitting the context when none was asked for."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .. import formats
from ..errors import OutOfMemoryPlanError
from ..formats.exl2 import padded
from ..model import cache as kv_cache
from ..model import model, planner
from ..model.config import ModelConfig
from .load import Rank, local_config
from .shards import head_runs


log = logging.getLogger(__name__)


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


def plan_memory(ckpt: formats.Checkpoint, config: ModelConfig, me: Rank, group,
                requested: int | None, cache_mode: str, dtype: torch.dtype) -> RankMemory:
    """Every rank calls this after joining and before loading: each reports its GPU's free memory, then all
    decide alike (so all refuse, or all load for the same context). group: the control channel's gloo group."""
    from ..model.placement import device_name
    reports = [None] * me.world
    dist.all_gather_object(reports, (planner.free_memory(me.device), device_name(me.device)), group=group)
    budgets, names = [b for b, _ in reports], [n for _, n in reports]
    fp = rank_footprint(ckpt, config, me.world, cache_mode, dtype)
    tokens = fit_context(fp, budgets, names, requested, config.max_position_embeddings)
    return RankMemory(fp, tuple(budgets), tuple(names), tokens)

"""Loading one rank's part of the model: model.py's loader with each linear cut to the rank's shard."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from .. import formats
from ..errors import ConfigError
from ..formats.exl2 import padded
from ..model import model
from ..model.config import ModelConfig
from ..model.linear import Linear, QuantLinear
from .shards import RowParallel, VocabParallelHead, column_shard, head_rows, head_runs, input_partition, row_shard


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

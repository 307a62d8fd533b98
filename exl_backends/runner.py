"""Runs the model for the generator: decode steps on CUDA replay a captured CUDA graph, everything else eager.

A decode step (every sequence adds one token) has fixed shapes for a given batch size, so it is captured once
per size of a ladder (1, 2, 4, 8, 16, 32, 64, ...) and replayed with the step's inputs copied into the graph's
static tensors; a batch is padded up to the next size. Padding rows write their K/V into a reserved page that no
sequence owns. Python and launch overhead thus leave the per-token path. `eager=True` turns graphs off (debug);
a model that cannot be captured as one graph (a layer split over several GPUs) runs eagerly.

The graphs come from model.decode_graphs: a Model's own, or under tensor parallelism rank 0's
(parallel.TensorParallelModel), which announce each replay to the other ranks; every rank captures the same
step over its shard at the same first use (the NCCL all-reduces captured with it) and replays it in lockstep."""
from __future__ import annotations

import torch
from torch import Tensor

from .batch import Batch
from .cache import KVCache
from .model import Model

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


class DecodeGraph:
    """One captured decode step for `size` sequences of up to `max_pages` pages each. On the CPU nothing is
    captured: run() fills the same static inputs and calls the model eagerly on them (a stand-in that lets tests
    drive the graph path, padding and tensor parallelism's protocol included, without a GPU)."""

    def __init__(self, model: Model, cache: KVCache, size: int, max_pages: int, trash_page: int,
                 pool) -> None:
        dev, ps = model.device, cache.page_size
        self.model, self.cache = model, cache
        self.size, self.trash_slot = size, trash_page * ps
        self.batch = Batch(
            input_ids=torch.zeros(size, dtype=torch.int64, device=dev),
            positions=torch.zeros(size, dtype=torch.int64, device=dev),
            slots=torch.full((size,), self.trash_slot, dtype=torch.int64, device=dev),
            cu_seqlens=torch.arange(size + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.ones(size, dtype=torch.int32, device=dev),
            block_tables=torch.full((size, max_pages), trash_page, dtype=torch.int32, device=dev),
            logit_rows=torch.arange(size, dtype=torch.int64, device=dev),
            page_size=ps)
        self.graph = None
        if dev.type != "cuda":
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):           # warm-up: compiles kernels, settles allocations
            model.forward(self.batch, cache)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = model.forward(self.batch, cache)

    def run(self, batch: Batch) -> Tensor:
        n, s = batch.n_seqs, self.batch
        s.input_ids[:n].copy_(batch.input_ids)
        s.positions[:n].copy_(batch.positions)
        s.slots[:n].copy_(batch.slots)
        s.seq_lens[:n].copy_(batch.seq_lens)
        width = batch.block_tables.shape[1]
        s.block_tables[:n, :width].copy_(batch.block_tables)
        # padding rows (and stale rows of a smaller batch) attend to one token of the trash page
        s.input_ids[n:].zero_()
        s.positions[n:].zero_()
        s.slots[n:].fill_(self.trash_slot)
        s.seq_lens[n:].fill_(1)
        if self.graph is None:
            self.logits = self.model.forward(s, self.cache)
        else:
            self.graph.replay()
        return self.logits[:n]

    def reset(self) -> None:
        """Frees the captured graph (before its NCCL communicator is destroyed)."""
        if self.graph is not None:
            self.graph.reset()


class DecodeGraphs:
    """A model's decode graphs over one cache, by batch size, each captured on first use."""

    def __init__(self, model: Model, cache: KVCache, max_pages: int, trash_page: int):
        self.model, self.cache, self.max_pages, self.trash_page = model, cache, max_pages, trash_page
        self.pool = torch.cuda.graph_pool_handle() if model.device.type == "cuda" else None
        self.by_size: dict[int, DecodeGraph] = {}

    def run(self, size: int, batch: Batch) -> Tensor:
        graph = self.by_size.get(size)
        if graph is None:
            graph = self.by_size[size] = DecodeGraph(self.model, self.cache, size, self.max_pages,
                                                     self.trash_page, self.pool)
        return graph.run(batch)


class Runner:
    """`forward(batch)` for the generator: graph replay for decode batches, eager otherwise."""

    def __init__(self, model: Model, cache: KVCache, max_batch: int, max_pages: int, eager: bool | None = None):
        """eager: None (default) replays graphs on CUDA only; True never (debug); False on the CPU too, where
        DecodeGraph is its eager stand-in (tests)."""
        self.model, self.cache, self.max_pages = model, cache, max_pages
        wanted = model.device.type == "cuda" if eager is None else not eager
        self.use_graphs = wanted and model.can_capture_graphs
        self.sizes = [s for s in BATCH_SIZES if s < max_batch] + [max_batch]
        self.graphs = model.decode_graphs(cache, max_pages, cache.pool.allocate(1)[0]) if self.use_graphs else None

    def forward(self, batch: Batch) -> Tensor:
        """The batch's logits rows; after a graph replay, a view of the graph's static output, valid until the
        next forward (copy it to keep it)."""
        n = batch.n_seqs     # a decode step: one token and one logits row per sequence (shapes only: no sync)
        is_decode = batch.input_ids.shape[0] == n and batch.logit_rows is not None and batch.logit_rows.numel() == n
        if not (self.use_graphs and is_decode and n <= self.sizes[-1]):
            return self.model.forward(batch, self.cache)
        return self.graphs.run(next(s for s in self.sizes if s >= n), batch)

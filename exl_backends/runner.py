"""Runs the model for the generator: decode steps on CUDA replay a captured CUDA graph, everything else eager.

A decode step (every sequence adds one token) has fixed shapes for a given batch size, so it is captured once
per size of a ladder (1, 2, 4, 8, 16, 32, 64, ...) and replayed with the step's inputs copied into the graph's
static tensors; a batch is padded up to the next size. Padding rows write their K/V into a reserved page that no
sequence owns. Python and launch overhead thus leave the per-token path. `eager=True` turns graphs off (debug);
a model that cannot be captured as one graph (a layer split over several GPUs) runs eagerly."""
from __future__ import annotations

import torch
from torch import Tensor

from .batch import Batch
from .cache import KVCache
from .model import Model

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


class DecodeGraph:
    """One captured decode step for `size` sequences of up to `max_pages` pages each."""

    def __init__(self, model: Model, cache: KVCache, size: int, max_pages: int, trash_page: int,
                 pool) -> None:
        dev, ps = model.device, cache.page_size
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
        self.graph.replay()
        return self.logits[:n]


class Runner:
    """`forward(batch)` for the generator: graph replay for decode batches on CUDA, eager otherwise."""

    def __init__(self, model: Model, cache: KVCache, max_batch: int, max_pages: int, eager: bool = False):
        self.model, self.cache, self.max_pages = model, cache, max_pages
        self.use_graphs = model.device.type == "cuda" and not eager and model.can_capture_graphs
        self.graphs: dict[int, DecodeGraph] = {}
        self.sizes = [s for s in BATCH_SIZES if s < max_batch] + [max_batch]
        if self.use_graphs:
            self.trash_page = cache.pool.allocate(1)[0]
            self.pool = torch.cuda.graph_pool_handle()

    def forward(self, batch: Batch) -> Tensor:
        n = batch.n_seqs     # a decode step: one token and one logits row per sequence (shapes only: no sync)
        is_decode = batch.input_ids.shape[0] == n and batch.logit_rows is not None and batch.logit_rows.numel() == n
        if not (self.use_graphs and is_decode and batch.n_seqs <= self.sizes[-1]):
            return self.model.forward(batch, self.cache)
        size = next(s for s in self.sizes if s >= batch.n_seqs)
        graph = self.graphs.get(size)
        if graph is None:
            graph = self.graphs[size] = DecodeGraph(self.model, self.cache, size, self.max_pages,
                                                    self.trash_page, self.pool)
        return graph.run(batch)

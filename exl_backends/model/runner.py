"""Runs the model for the generator: on CUDA, decode steps replay a captured CUDA graph and other steps graph
pieces around eager attention; eager only on the CPU, with eager=True, and for what no graph serves.

A decode step (every sequence adds one token) has fixed shapes for a given batch size, so it is captured once
per size of a ladder (1, 2, 4, 8, 16, 32, 64, ...) and replayed with the step's inputs copied into the graph's
static tensors; a batch is padded up to the next size. Padding rows write their K/V into a reserved page that no
sequence owns. Python and launch overhead thus leave the per-token path. A speculative verify step (every
sequence adds the same t <= 8 tokens: its newest and t - 1 drafted ones) is captured the same way, per (size, t),
so that checking drafted tokens costs about one decode step. `eager=True` turns graphs off (debug). A layer split
over several GPUs captures one graph per GPU, replayed one after the other.

Any other step of up to 2048 tokens (prompt chunks, decode rows beside a prompt) replays graphs too, one per block
boundary (PrefillGraphs): everything but attention works row by row, so it is captured once per size of a token
ladder and replayed for any batch padded up to that size, while attention runs eagerly between the graphs. On the
H200 a fully eager forward of the 8B shape cost ~12 ms of host time for 16 tokens and ~16-30 ms for 208 (after 1792
cached), on ~9 and ~17 ms of GPU time; as pieces ~2.4 ms in both.

The decode graphs are a Model's own DecodeGraphs, or under tensor parallelism rank 0's (a model with a
decode_graphs method: parallel.TensorParallelModel), which announce each replay to the other ranks; every rank captures the same
step over its shard at the same first use (the NCCL all-reduces captured with it) and replays it in lockstep."""
from __future__ import annotations

import contextlib
import gc
from dataclasses import fields

import numpy as np
import torch
from torch import Tensor

from ..kernels import megakernel
from .batch import Batch
from .cache import KVCache
from .model import Model, batch_on, on_device, token_seq_lens

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
# of PrefillGraphs: a step's padding (rows every kernel of it computes for nothing) at most an eighth of its size
# above 64 tokens: multiples of 8 up to 128, then eight sizes an octave. Each size's graphs are captured on its
# first step (~40 ms for the 8B shape), so finer sizes cost first steps, not later ones.
TOKEN_SIZES = tuple(range(8, 129, 8)) + tuple(s for octave in (128, 256, 512, 1024)
                                              for s in range(octave + octave // 8, 2 * octave + 1, octave // 8))
# per sequence in a captured step (decode; verify: 1 + up to 7 drafted): attention must run them as split-K rows,
# which reads nothing on the host (kernels.attention.ROW_KERNEL_MAX_NEW >= this)
MAX_TOKENS = 8
MAX_ROWS = 128                      # of a captured verify step (its f32 logits: rows x vocab x 4 bytes)


class DecodeGraph:
    """One captured step of `size` sequences of `tokens` new tokens each (1: decode; more: a speculative verify
    step), up to `max_pages` pages per sequence, with logits for every row. A layer split captures one graph per
    stage (a graph holds one device's work); between them the residual stream is copied to the next device's
    static input, and each stage reads its own copy of the step's inputs. On the CPU nothing is captured: run()
    fills the same static inputs and calls the model eagerly on them (a stand-in that lets tests drive the graph
    path, padding and tensor parallelism's protocol included, without a GPU)."""

    def __init__(self, model: Model, cache: KVCache, size: int, tokens: int, max_pages: int, trash_page: int,
                 pool) -> None:
        dev, ps, n_rows = model.device, cache.page_size, size * tokens
        self.model, self.cache = model, cache
        self.size, self.tokens, self.trash_page = size, tokens, trash_page
        rows = torch.arange(n_rows, device=dev)
        # padding sequences: `tokens` tokens at positions 0.. of the trash page (their K/V written there), each
        # attending to its own and the ones before
        self.pad_positions = rows % tokens
        self.pad_slots = trash_page * ps + self.pad_positions
        # The step's varying inputs are views of one buffer (int64 input_ids, positions, slots, then int32 seq_lens
        # and block_tables), with an image on the host: a step from Batch.build is written into the image and
        # copied over in one copy (separate copies of each input cost ~110 us of host time a step on the H200,
        # while the GPU waited).
        self.image = np.zeros(24 * n_rows + 4 * size * (1 + max_pages), dtype=np.uint8)
        longs, ints = self.image[:24 * n_rows].view(np.int64), self.image[24 * n_rows:].view(np.int32)
        self.host_ids, self.host_positions, self.host_slots = longs[:n_rows], longs[n_rows:-n_rows], longs[-n_rows:]
        self.host_lens, self.host_tables = ints[:size], ints[size:].reshape(size, max_pages)
        self.host_pad_positions = np.arange(n_rows) % tokens
        self.host_pad_slots = trash_page * ps + self.host_pad_positions
        self._pad_image(0)
        self.packed = torch.from_numpy(self.image).to(dev, copy=True)
        ids, positions, slots = self.packed[:24 * n_rows].view(torch.int64).split(n_rows)
        seq_lens, tables = self.packed[24 * n_rows:].view(torch.int32).split_with_sizes([size, size * max_pages])
        self.batch = Batch(
            input_ids=ids,
            positions=positions,
            slots=slots,
            cu_seqlens=torch.arange(size + 1, dtype=torch.int32, device=dev) * tokens,
            seq_lens=seq_lens,
            block_tables=tables.view(size, max_pages),
            logit_rows=None,            # every row, so Model.logits gathers none (two launches less a step)
            page_size=ps,
            row_seq=None if tokens == 1 else (rows // tokens).to(torch.int32))
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.stage_batches = [self.batch] + [batch_on(self.batch, stage.device) for stage in model.stages[1:]]
        self.inputs = [f.name for f in fields(Batch) if isinstance(getattr(self.batch, f.name), Tensor)]
        self.handoffs: list[tuple[tuple[Tensor, ...], tuple[Tensor, ...]]] = []    # (stage k's out, k+1's in)
        if dev.type != "cuda":
            return
        # one sequence's decode step: its runs of one-row matmuls between attention calls as megakernel launches
        self.segment_counters = None
        if n_rows == 1 and isinstance(model, Model) and megakernel.enabled(dev) and model.chainable():
            self.segment_counters = megakernel.counters(len(model.blocks), dev)
        carry = None
        for k, stage in enumerate(model.stages):
            with torch.cuda.device(stage.device):
                if carry is not None:
                    inputs = tuple(torch.zeros_like(t, device=stage.device) for t in carry)
                    self.handoffs.append((carry, inputs))
                    carry = inputs
                graph, carry = _capture(model, k, self.stage_batches[k], cache, carry, pool, self.segment_counters)
                self.graphs.append(graph)
        self.logits = carry

    def run(self, batch: Batch) -> Tensor:
        rows = batch.n_seqs * self.tokens
        if batch.host is not None:
            self._write_image(batch)
            self.packed.copy_(torch.from_numpy(self.image), non_blocking=True)   # pageable: staged before return
            if batch.fed:
                self.batch.input_ids[:rows].copy_(batch.input_ids)
        else:
            self._copy_inputs(batch)
        s = self.batch
        for other in self.stage_batches[1:]:
            if other is not s:                  # (stages on one device share the inputs)
                for name in self.inputs:
                    getattr(other, name).copy_(getattr(s, name))
        self.replay()
        return self.logits[:rows]

    def _pad_image(self, n: int) -> None:
        """Sequences n.. of the host image as padding (the trash page's first `tokens` slots)."""
        rows = n * self.tokens
        self.host_ids[rows:] = 0
        self.host_positions[rows:] = self.host_pad_positions[rows:]
        self.host_slots[rows:] = self.host_pad_slots[rows:]
        self.host_lens[n:] = self.tokens
        self.host_tables[n:] = self.trash_page

    def _write_image(self, batch: Batch) -> None:
        """batch's inputs into the host image, read from the bytes Batch.build packed (Batch.unpack's layout)."""
        n, t, width = batch.n_seqs, batch.input_ids.shape[0], batch.block_tables.shape[1]
        n_longs = 3 * t + (0 if batch.logit_rows is None else batch.logit_rows.shape[0])
        data = batch.host.numpy()
        longs, ints = data[:8 * n_longs].view(np.int64), data[8 * n_longs:].view(np.int32)
        self.host_ids[:t], self.host_positions[:t], self.host_slots[:t] = longs[:t], longs[t:2 * t], longs[2 * t:3 * t]
        self.host_lens[:n] = ints[n + 1:2 * n + 1]
        self.host_tables[:n, :width] = ints[2 * n + 1:2 * n + 1 + n * width].reshape(n, width)
        self.host_tables[:n, width:] = self.trash_page
        self._pad_image(n)

    def _copy_inputs(self, batch: Batch) -> None:
        """batch's inputs into the static ones, device to device (a batch without Batch.build's host bytes)."""
        n, s = batch.n_seqs, self.batch
        rows = n * self.tokens
        s.input_ids[:rows].copy_(batch.input_ids)
        s.positions[:rows].copy_(batch.positions)
        s.slots[:rows].copy_(batch.slots)
        s.seq_lens[:n].copy_(batch.seq_lens)
        width = batch.block_tables.shape[1]
        s.block_tables[:n, :width].copy_(batch.block_tables)
        if n < self.size:       # padding rows (and stale rows of a smaller batch) attend within the trash page
            s.input_ids[rows:].zero_()
            s.positions[rows:].copy_(self.pad_positions[rows:])
            s.slots[rows:].copy_(self.pad_slots[rows:])
            s.seq_lens[n:].fill_(self.tokens)

    def replay(self) -> None:
        """The captured step on the static inputs (on the CPU: the model, eagerly)."""
        if not self.graphs:
            self.logits = self.model.forward(self.batch, self.cache)
            return
        for k, graph in enumerate(self.graphs):
            with torch.cuda.device(self.model.stages[k].device):
                if k:
                    for out, into in zip(*self.handoffs[k - 1]):
                        into.copy_(out)         # across devices: ordered after both devices' current streams
                graph.replay()

    def reset(self) -> None:
        """Frees the captured graphs (before their NCCL communicator is destroyed)."""
        for graph in self.graphs:
            graph.reset()


def _capture(model: Model, k: int, batch: Batch, cache: KVCache, carry, pool,
             segment_counters: Tensor | None = None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Stage k's forward captured on its device (the current one): (the graph, its static output). With
    segment_counters (megakernel.counters), under megakernel.chaining."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), megakernel.chaining(segment_counters):   # warm-up: compiles, settles allocations
        model.stage_forward(k, batch, cache, carry)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capturing(graph, pool, side), megakernel.chaining(segment_counters):   # (side: torch's default capture
        out = model.stage_forward(k, batch, cache, carry)                      # stream is the first device's)
    return graph, out


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream):
    """torch.cuda.graph with the garbage collector paused: a collection could free a dropped generator's graphs,
    and resetting a graph while a capture runs invalidates that capture (CUDA: "operation not permitted when
    stream is capturing"); torch no longer collects before a capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            yield
    finally:
        if enabled:
            gc.enable()


class DecodeGraphs:
    """A model's captured steps over one cache, by (batch size, tokens per sequence), each captured on first use."""

    def __init__(self, model: Model, cache: KVCache, max_pages: int, trash_page: int):
        self.model, self.cache, self.max_pages, self.trash_page = model, cache, max_pages, trash_page
        self.pool = torch.cuda.graph_pool_handle() if model.device.type == "cuda" else None
        self.by_shape: dict[tuple[int, int], DecodeGraph] = {}

    def run(self, size: int, tokens: int, batch: Batch) -> Tensor:
        graph = self.by_shape.get((size, tokens))
        if graph is None:
            graph = self.by_shape[size, tokens] = DecodeGraph(self.model, self.cache, size, tokens, self.max_pages,
                                                              self.trash_page, self.pool)
        return graph.run(batch)


class PrefillGraphs:
    """Steps that no decode graph serves, of up to TOKEN_SIZES[-1] tokens, padded up to the next size of
    TOKEN_SIZES, as n_layers + 1 graphs per size between the blocks' attention calls: piece 0 from the embedding to
    block 0's queries, piece i from block i-1's attention output to block i's queries, the last one to the last
    block's output. Every op in them works row by row, so any batch fits; attention (which mixes rows and reads the
    batch's lengths on the host) and the final norm and head on the wanted rows run eagerly, on the graphs' static
    buffers. Padding rows write their K/V to the trash page. The static buffers are shared by all sizes (only one
    step runs at a time). Not for layer splits, tensor parallelism or MoE models (routing many tokens reads the
    host). On the CPU the pieces run eagerly on the same buffers (a stand-in for tests)."""

    def __init__(self, model: Model, cache: KVCache, trash_page: int, pool) -> None:
        dev, c, n = model.device, model.config, TOKEN_SIZES[-1]
        self.model, self.cache, self.pool = model, cache, pool
        self.pad_slots = trash_page * cache.page_size + torch.arange(n, device=dev) % cache.page_size
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev) if model.long_rope else None
        self.slots = self.pad_slots.clone()
        self.q = torch.zeros(n, c.n_heads, c.head_dim, dtype=model.dtype, device=dev)
        self.attn = torch.zeros(n, c.n_heads * c.head_dim, dtype=model.dtype, device=dev)
        self.residual = torch.zeros(n, c.hidden_size, dtype=model.dtype, device=dev)
        self.h = torch.zeros_like(self.residual)
        # static cos/sin, which piece 0 computes from the static positions (eager, they cost ~10 launches a step)
        self.ropes = {local: tuple(x.new_zeros(n, x.shape[1]) for x in pair)
                      for local, pair in model.cos_sin(self.positions[:1], self._seq_lens(1), dev).items()}
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    @staticmethod
    def size(tokens: int) -> int | None:
        """The padded size of a step of `tokens` tokens, or None when it is too long (eager)."""
        return next((s for s in TOKEN_SIZES if s >= tokens), None)

    def run(self, size: int, batch: Batch) -> Tensor:
        m, t = self.model, batch.input_ids.shape[0]
        if size not in self.graphs and m.device.type == "cuda":
            self.graphs[size] = self._capture(size)
        self.ids[:t].copy_(batch.input_ids)
        self.positions[:t].copy_(batch.positions)       # (padding rows keep stale positions: their K/V go to trash)
        self.slots[:t].copy_(batch.slots)
        self.slots[t:size].copy_(self.pad_slots[t:size])
        if self.seq_lens is not None:
            self.seq_lens[:t].copy_(token_seq_lens(batch))
        for i, block in enumerate(m.blocks):
            self._replay(i, size)
            self.attn[:t].copy_(block.attention.attend(self.q[:t], batch, self.cache, m.ops))
        self._replay(len(m.blocks), size)
        return m.logits(self.h[:t], self.residual[:t], batch)

    def _replay(self, i: int, size: int) -> None:
        if size in self.graphs:
            self.graphs[size][i].replay()
        else:
            self._piece(i, size)

    def _piece(self, i: int, n: int) -> None:
        """Piece i of a step of n rows, on the static buffers."""
        m = self.model
        if i == 0:
            h, residual = m.embed_tokens(self.ids[:n])
            for local, pair in m.cos_sin(self.positions[:n], self._seq_lens(n), m.device).items():
                for static, x in zip(self.ropes[local], pair):
                    static[:n].copy_(x)
        else:
            h, residual = m.after_attention(i - 1, self.attn[:n], self.residual[:n])
        if i == len(m.blocks):
            self.h[:n].copy_(h)
            self.residual[:n].copy_(residual)
            return
        ropes = {local: (cos[:n], sin[:n]) for local, (cos, sin) in self.ropes.items()}
        q, residual = m.project(i, h, residual, self.slots[:n], self.cache, ropes)
        self.q[:n].copy_(q)
        self.residual[:n].copy_(residual)

    def _seq_lens(self, n: int) -> Tensor | None:
        return None if self.seq_lens is None else self.seq_lens[:n]

    def _capture(self, size: int) -> list[torch.cuda.CUDAGraph]:
        self.slots.copy_(self.pad_slots)        # the warm-up writes K/V: to the trash page, not a sequence's slots
        pieces = range(len(self.model.blocks) + 1)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):           # warm-up: compiles kernels, settles allocations
            for i in pieces:
                self._piece(i, size)
        torch.cuda.current_stream().wait_stream(side)
        graphs = []
        for i in pieces:
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self.pool, side):
                self._piece(i, size)
            graphs.append(graph)
        return graphs


def decode_graphs(model, cache: KVCache, max_pages: int, trash_page: int):
    """The model's captured decode steps over cache, by batch size: its own decode_graphs where it has one (tensor
    parallelism's rank 0 announces each replay to the other ranks), else DecodeGraphs."""
    own = getattr(model, "decode_graphs", None)
    return own(cache, max_pages, trash_page) if own is not None else DecodeGraphs(model, cache, max_pages, trash_page)


class Runner:
    """`forward(batch)` for the generator: graph replay for decode and verify batches, graph pieces around eager
    attention for other steps up to TOKEN_SIZES[-1] tokens, eager otherwise."""

    def __init__(self, model: Model, cache: KVCache, max_batch: int, max_pages: int, eager: bool | None = None,
                 trash_page: int | None = None):
        """eager: None (default) replays graphs on CUDA only; True never (debug); False on the CPU too, where
        DecodeGraph is its eager stand-in (tests). trash_page: the page padding sequences write to (None: one taken
        from cache's pool; a draft model's cache, whose page numbers are the target's, passes the target's)."""
        self.model, self.cache, self.max_pages = model, cache, max_pages
        self.use_graphs = model.device.type == "cuda" if eager is None else not eager
        self.sizes = [s for s in BATCH_SIZES if s < max_batch] + [max_batch]
        self.trash_page = self.graphs = self.prefill = None
        if self.use_graphs:
            self.trash_page = cache.pool.allocate(1)[0] if trash_page is None else trash_page
            self.graphs = decode_graphs(model, cache, max_pages, self.trash_page)
            if isinstance(model, Model) and len(model.stages) == 1 and model.config.moe is None:
                self.prefill = PrefillGraphs(model, cache, self.trash_page, self.graphs.pool)

    def forward(self, batch: Batch) -> Tensor:
        """The batch's logits rows; after a graph replay, a view of the graph's static output, valid until the
        next forward (copy it to keep it)."""
        shape = self._graph_shape(batch)
        if shape is not None:
            return self.graphs.run(*shape, batch)
        size = self.prefill and self.prefill.size(batch.input_ids.shape[0])
        if size:
            with on_device(self.model.device):      # its kernels and captures go to the current device: the model's
                return self.prefill.run(size, batch)
        return self.model.forward(batch, self.cache)

    def _graph_shape(self, batch: Batch) -> tuple[int, int] | None:
        """(graph batch size, tokens per sequence) of a step a graph serves, else None. From shapes and row_seq
        only: no sync."""
        n, rows = batch.n_seqs, batch.input_ids.shape[0]
        tokens = rows // n
        alike = rows == n or batch.row_seq is not None          # row_seq: every sequence has `tokens` tokens
        every_row = batch.logit_rows is None or batch.logit_rows.numel() == rows       # None: every row
        if not (self.use_graphs and alike and every_row and tokens <= MAX_TOKENS and n <= self.sizes[-1]):
            return None
        size = next(s for s in self.sizes if s >= n)
        return None if tokens > 1 and size * tokens > MAX_ROWS else (size, tokens)

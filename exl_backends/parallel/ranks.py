"""Rank 0 and the other ranks. Rank 0 runs the generator or server; the other ranks run the same forward calls on
their shards, told what to run over a gloo control channel. Also here: starting the processes and torch.distributed
(NCCL on GPUs, gloo on CPU), and ExlForCausalLM.from_pretrained(tensor_parallel=N).

NVLink multicast (NVLS) is turned off before NCCL starts. Decode steps replay CUDA graphs on every rank: rank 0's
runner announces each replay (the step's batch size and inputs) over the control channel, outside any graph;
each rank copies the inputs into its own graph's static tensors and replays it, the NCCL all-reduces inside.
A size's first replay is captured on all ranks at once, so the captured collectives pair up."""
from __future__ import annotations

import faulthandler
import os
import signal
import socket
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from .. import formats
from ..errors import ConfigError, OutOfMemoryPlanError
from ..model import model
from ..model.batch import Batch, upload
from ..model.cache import CACHE_MODES, KVCache, check_mode
from ..model.config import ModelConfig
from ..model.loading import check_tokenizer_files, default_dtype, hf_loading_arguments
from ..model.runner import DecodeGraphs
from .load import Rank, check_shardable, load_shard, local_config
from .memory import RankMemory, plan_memory

CONTROL_IDLE = timedelta(days=30)       # followers wait this long for rank 0's next call (a server may idle)
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


# ----------------------------------------------------------------------------------------------- rank 0 and the rest

FORWARD, REPLAY, STOP, COPY = 1, 2, 3, 4
# the header: command; the cache (id, pages, page size, mode); the batch (tokens, sequences, page-table width,
# logit rows or -1: all, row_seq entries); how many freed cache ids come before the batch; for REPLAY the graph
# (batch size, tokens per sequence, page-table width, trash page); for COPY (source slot, target slot, slots), no batch
HEADER = 15
MODES = list(CACHE_MODES)


class Channel:
    """Rank 0 -> every rank: a fixed-size int64 header, then a byte payload, broadcast over a gloo group (the
    followers wait on the CPU, however long rank 0 is idle)."""

    def __init__(self, group):
        self.group = group

    def send(self, header: list[int], payload: Tensor) -> None:
        dist.broadcast(torch.tensor(header, dtype=torch.int64), 0, group=self.group)
        if payload.numel():
            dist.broadcast(payload, 0, group=self.group)

    def receive(self) -> tuple[list[int], Tensor]:
        header = torch.empty(HEADER, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group)
        h = header.tolist()
        payload = torch.empty(_payload_size(h), dtype=torch.uint8)
        if payload.numel():
            dist.broadcast(payload, 0, group=self.group)
        return h, payload


def _payload_size(h: list[int]) -> int:
    cmd, _, _, _, _, t, b, width, rows, freed, n_row_seq = h[:11]
    if cmd in (STOP, COPY):
        return 8 * freed
    return 8 * (freed + 3 * t + max(rows, 0)) + 4 * (2 * b + 1 + b * width + n_row_seq)


def _pack(batch: Batch, freed: list[int]) -> Tensor:
    """The freed cache ids (int64), then the batch's bytes as Batch.build packed them on the host: nothing is
    read back from the GPU, so announcing a step does not wait for the one before."""
    if batch.host is None or batch.fed:
        raise ValueError("a batch announced to the other ranks must come from Batch.build with its ids in its host "
                         "bytes (not fed on the device)")
    return torch.cat([torch.tensor(freed, dtype=torch.int64).view(torch.uint8), batch.host])


def _unpack(h: list[int], payload: Tensor, device: torch.device) -> tuple[Batch | None, list[int]]:
    cmd, _, _, page_size, _, t, b, width, rows, freed, n_row_seq = h[:11]
    free, data = payload.split([8 * freed, payload.numel() - 8 * freed])
    if cmd == COPY:
        return None, free.view(torch.int64).tolist()
    ints = data[8 * (3 * t + max(rows, 0)):].view(torch.int32)
    host_lengths = (ints[:b + 1].tolist(), ints[b + 1:2 * b + 1].tolist())
    batch = Batch.unpack(upload(data, device), t, b, width, None if rows < 0 else rows, n_row_seq, page_size,
                         host_lengths)
    return batch, free.view(torch.int64).tolist()


class TensorParallelModel:
    """Rank 0's model: a Model's interface; each forward (and each decode-graph replay) is announced to the other
    ranks, then run by all."""

    def __init__(self, local: model.Model, channel: Channel, processes: list = (), memory: RankMemory | None = None):
        """memory: the plan the ranks loaded by (None on the CPU, where nothing is planned)."""
        self.local, self.channel, self.memory = local, channel, memory
        self.config, self.device, self.dtype = local.config, local.device, local.dtype
        self.block_devices, self.output_device = local.block_devices, local.output_device
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

    def copy_slots(self, cache: KVCache, source: int, target: int, n: int) -> None:
        """cache.copy(source, target, n) on every rank's mirror of cache."""
        cid, freed = self._cache_id(cache)
        header = [COPY, cid, cache.pool.n_pages, cache.page_size, MODES.index(cache.mode), 0, 0, 0, 0, len(freed), 0,
                  source, target, n, 0]
        self.channel.send(header, torch.tensor(freed, dtype=torch.int64).view(torch.uint8))
        cache.copy(source, target, n)

    def announce(self, cache: KVCache, batch: Batch, graph: tuple[int, int, int, int] | None = None) -> None:
        """Tells the other ranks to run batch over their mirror of cache: eagerly, or (graph = (batch size, tokens
        per sequence, page-table width, trash page)) by replaying their graph of that step."""
        cid, freed = self._cache_id(cache)
        rows = -1 if batch.logit_rows is None else batch.logit_rows.numel()
        header = [FORWARD if graph is None else REPLAY, cid, cache.pool.n_pages, cache.page_size,
                  MODES.index(cache.mode), batch.input_ids.numel(), batch.n_seqs, batch.block_tables.shape[1], rows,
                  len(freed), 0 if batch.row_seq is None else batch.row_seq.numel(), *(graph or (0, 0, 0, 0))]
        self.channel.send(header, _pack(batch, freed))

    def _cache_id(self, cache: KVCache) -> tuple[int, list[int]]:
        """The id the followers know cache by, and the ids of caches collected since the last announcement."""
        cid = self._ids.get(cache)
        if cid is None:
            self._next_id += 1
            cid = self._ids[cache] = self._next_id
            weakref.finalize(cache, self._freed.append, cid)      # the followers drop their mirror then
        freed = self._freed[:]
        self._freed.clear()
        return cid, freed

    def close(self) -> None:
        """Lets the other ranks finish (also done when this object is collected, or at exit)."""
        self._closer()


class AnnouncedGraphs:
    """Rank 0's decode graphs: each replay is announced first, so every rank replays (or, at a size's first use,
    captures) the same step."""

    def __init__(self, model: TensorParallelModel, graphs: DecodeGraphs):
        self.model, self.graphs = model, graphs

    def run(self, size: int, tokens: int, batch: Batch) -> Tensor:
        g = self.graphs
        self.model.announce(g.cache, batch, (size, tokens, g.max_pages, g.trash_page))
        return g.run(size, tokens, batch)


def _reset(graphs) -> None:
    for g in list(graphs):
        for graph in g.by_shape.values():
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
            if h[0] == COPY:
                caches[cid].copy(*h[11:14])
                continue
            if h[0] == FORWARD:
                local.forward(batch, caches[cid])
                continue
            size, tokens, max_pages, trash_page = h[11:15]
            key = (cid, max_pages, trash_page)
            if key not in graphs:
                graphs[key] = DecodeGraphs(local, caches[cid], max_pages, trash_page)
            graphs[key].run(size, tokens, batch)
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
        memory = plan_memory(formats.open_checkpoint(path), config, me, channel.group, requested, cache_mode, dtype)
    return load_shard(path, me, dtype, config), memory


def follower_main(path: str, rank: int, world: int, device_type: str, init_method: str, dtype: torch.dtype,
                  requested: int | None, cache_mode: str) -> None:
    """A spawned rank's whole life: join, plan, load its shard, follow rank 0, leave. A plan that does not fit
    ends it quietly: rank 0 reached the same verdict and reports it."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)     # `kill -USR1 PID`: where a stalled rank waits
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
    device, dtype = hf_loading_arguments(device, dtype, hf_kwargs)
    dtype = dtype or default_dtype(device)
    path = Path(path)
    config = ModelConfig.from_dir(path)
    check_tokenizer_files(path)                         # the tokenizer itself loads when first used
    check_mode(cache_mode, local_config(config, world) if config.n_kv_heads % world == 0 else config)
    check_shardable(formats.open_checkpoint(path), config, world)
    if max_seq_len is not None and max_seq_len <= 0:
        raise ConfigError(f"max_seq_len must be positive, got {max_seq_len}")
    if device.type == "cuda" and torch.cuda.device_count() < world and launched_rank() is None:
        raise ConfigError(f"tensor_parallel={world} needs {world} GPUs; {torch.cuda.device_count()} are visible")
    if dist.is_initialized():       # torch.distributed has one default group per process
        raise ConfigError("a tensor-parallel model is already open in this process: close it first "
                          "(model.model.close()), or serve the two models from separate processes")
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
    return cls(TensorParallelModel(local, channel, processes, memory), None, path, tokens, cache_mode)

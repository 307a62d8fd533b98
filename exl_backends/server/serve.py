"""`exl serve`: bind the port (first: a busy port fails before minutes of loading), load the model, size the
shared KV cache, build the app, print the banner, run uvicorn until Ctrl-C.

Tensor parallel under torchrun: every process runs `exl serve --tensor-parallel N`; rank 0 serves as above, the
other ranks never bind the port (nor print a banner or touch the API key): they load their shard and run rank 0's
forward calls until rank 0 stops."""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from pathlib import Path

from .. import formats
from ..errors import ConfigError
from ..model import planner
from ..model.cache import bytes_per_token
from . import auth, banner

log = logging.getLogger(__name__)

GRAPH_MEMORY_SHARE = 0.1        # of the memory left after weights, kept free for CUDA graphs and fragmentation


@dataclass(frozen=True)
class ServeOptions:
    model: Path
    host: str = "127.0.0.1"
    port: int = 5000
    max_seq_len: int | None = None
    cache_mode: str = "fp16"
    draft_model: Path | None = None
    ngram_draft: bool = False
    api_key: str | None = None
    no_auth: bool = False
    device: str | None = None
    max_batch_size: int = 32
    cache_tokens: int | None = None
    max_queue: int | None = None    # jobs queued or running; default 4 x max_batch_size
    gpu_split: str | list[float] | None = None      # layer split over GPUs ("auto" or GiB per GPU)
    tensor_parallel: int | None = None              # shard over N GPUs, one process each


def listen(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it: without it Nagle's algorithm holds small writes (each streamed chunk)
        # until the client's delayed ACK, ~40 ms
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(address)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port} ({e}); choose another --port or --host") from None
    sock.set_inheritable(True)
    return sock


def default_cache_tokens(model, model_dir: Path, max_batch_size: int) -> int:
    """CUDA: what the free memory holds after the weights (less the prefill scratch, the reserve and a share for
    CUDA graphs), up to max_batch_size full contexts; CPU: one full context (pass --cache-tokens for more).
    Tensor parallel: what the tightest GPU holds after its share of the weights (each rank's cache holds its kv
    heads; model.exl_config is rank 0's view of them)."""
    if model.device.type != "cuda":
        return model.max_seq_len
    memory = getattr(model.model, "memory", None)       # parallel.RankMemory: the plan the ranks loaded by
    if memory is not None:
        fp, free = memory.footprint, min(memory.budgets) - memory.footprint.weights
    else:
        fp = planner.footprint(formats.open_checkpoint(model_dir), model.exl_config, model.cache_mode, model.dtype)
        free = planner.free_memory(model.device)
    free -= fp.scratch(planner.PREFILL_CHUNK) + planner.RESERVE_BYTES
    per_token = bytes_per_token(model.exl_config, model.cache_mode, model.dtype.itemsize)
    fits = int(free * (1 - GRAPH_MEMORY_SHARE)) // per_token
    return max(model.max_seq_len, min(fits, max_batch_size * model.max_seq_len))


def is_follower(o: ServeOptions) -> bool:
    """A tensor-parallel rank other than 0 started by torchrun: it must not bind the port."""
    from ..parallel import launched_rank
    return (o.tensor_parallel or 1) > 1 and (launched_rank() or 0) > 0


def serve(o: ServeOptions) -> None:
    import uvicorn

    from ..adapters.hf import ExlForCausalLM
    from ..engine.generator import Generator
    from .app import create_app
    if o.no_auth and o.api_key:
        raise ConfigError("--api-key and --no-auth contradict each other: give one")
    if is_follower(o):
        # loads this rank's shard and runs rank 0's calls until rank 0 stops, then exits the process
        ExlForCausalLM.from_pretrained(o.model, device=o.device, max_seq_len=o.max_seq_len, cache_mode=o.cache_mode,
                                       tensor_parallel=o.tensor_parallel)
        return
    key = None if o.no_auth else auth.ApiKey(o.api_key) if o.api_key else auth.load_or_create()
    sock = listen(o.host, o.port)
    model = ExlForCausalLM.from_pretrained(o.model, device=o.device, max_seq_len=o.max_seq_len,
                                           cache_mode=o.cache_mode, gpu_split=o.gpu_split,
                                           tensor_parallel=o.tensor_parallel)
    draft = None if o.draft_model is None else model.load_draft(o.draft_model)
    cache_tokens = o.cache_tokens or default_cache_tokens(model, o.model, o.max_batch_size)
    generator = Generator(model, draft_model=draft, ngram_draft=o.ngram_draft, max_batch_size=o.max_batch_size,
                          cache_tokens=cache_tokens)
    app = create_app(generator, Path(o.model).resolve().name, key, max_jobs=o.max_queue or 4 * o.max_batch_size)
    port = sock.getsockname()[1]
    print(banner.text(o.model, model, generator, banner.base_url(o.host, port), key, o.host, o.draft_model),
          flush=True)
    if key is None and not banner.is_loopback(o.host):
        log.warning("auth is OFF and the server listens on %s: anyone on the network can use it", o.host)
    config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])


"""Speed measurement for `exl bench` and benchmarks/: decode and prefill tokens/s next to the bandwidth bound.

A decode step at batch 1 reads every weight once plus the KV cache of its context, so
    bound (tokens/s) = measured copy bandwidth / (weight bytes + context x cache bytes per token)."""
from __future__ import annotations

import time

import torch

from .batch import Batch, SeqChunk
from .cache import KVCache, bytes_per_token
from .model import Model
from .runner import Runner


def copy_bandwidth(device: torch.device, nbytes: int = 2 * 1024**3) -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 10)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for i in range(13):
        _sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * nbytes / sorted(times)[len(times) // 2]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(model: Model) -> int:
    """Bytes one decode step reads from the weights: every linear and norm once (the embedding: one row)."""
    total = model.lm_head.nbytes() + model.norm.numel() * model.norm.element_size()
    for b in model.blocks:
        a, m = b.attention, b.mlp
        total += sum(x.nbytes() for x in (a.q, a.k, a.v, a.o, m.gate, m.up, m.down))
        total += sum(t.numel() * t.element_size() for t in (b.input_norm, b.post_attn_norm))
    return total


def fill_cache(cache: KVCache) -> None:
    """Random cache contents: speed does not depend on them, but zeros could take shortcuts."""
    for layer in cache.layers:
        for t in (layer.k, layer.v):
            t.random_(0, 256) if t.dtype == torch.uint8 else t.normal_(0, 0.5)
        for s in (layer.k_scales, layer.v_scales):
            if s is not None:
                s.uniform_(0.01, 0.05)


def decode_speed(model: Model, context: int, cache_mode: str = "fp16", steps: int = 64,
                 page_size: int = 256) -> dict:
    """Batch-1 decode at a given context (cache filled with random K/V): tokens/s with a host sync per token
    (as generation needs) and, on CUDA, graph replays alone."""
    n_pages = -(-(context + steps + 4) // page_size)
    cache = KVCache(model.config, n_pages + 1, page_size, cache_mode, model.device, model.dtype)
    fill_cache(cache)
    pages = cache.pool.allocate(n_pages)
    runner = Runner(model, cache, max_batch=1, max_pages=n_pages)
    token = 1

    def step(i):
        return runner.forward(Batch.build([SeqChunk([token], context + i, pages)], page_size, model.device))
    for i in range(3):
        token = int(step(i).argmax())
    t0 = time.perf_counter()
    for i in range(steps):
        token = int(step(i).argmax())
    result = dict(tok_s=steps / (time.perf_counter() - t0),
                  bytes=weight_bytes(model) + context * bytes_per_token(model.config, cache_mode))
    if runner.graphs:
        graph = runner.graphs[1].graph
        _sync(model.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            graph.replay()
        _sync(model.device)
        result["replay_tok_s"] = steps / (time.perf_counter() - t0)
    return result


def prefill_speed(model: Model, n_tokens: int, page_size: int = 256, reps: int = 3) -> float:
    """Tokens/s of one eager forward over an n_tokens prompt."""
    n_pages = -(-n_tokens // page_size)
    cache = KVCache(model.config, n_pages, page_size, "fp16", model.device, model.dtype)
    ids = torch.randint(0, model.config.vocab_size, (n_tokens,)).tolist()
    batch = Batch.build([SeqChunk(ids, 0, cache.pool.allocate(n_pages))], page_size, model.device)
    model.forward(batch, cache)
    _sync(model.device)
    t0 = time.perf_counter()
    for _ in range(reps):
        model.forward(batch, cache)
    _sync(model.device)
    return n_tokens * reps / (time.perf_counter() - t0)


def report(model: Model, contexts: list[int], cache_mode: str, prefill_tokens: list[int]) -> str:
    """The table `exl bench` prints."""
    bw = copy_bandwidth(model.device)
    lines = [f"device {model.device}, copy bandwidth {bw / 1e9:.0f} GB/s, weights {weight_bytes(model) / 1e9:.2f} GB",
             f"{'what':28} {'tokens/s':>10} {'bound':>10} {'% of bound':>11}"]
    for n in prefill_tokens:
        lines.append(f"{'prefill ' + str(n):28} {prefill_speed(model, n):10.1f}")
    for ctx in contexts:
        r = decode_speed(model, ctx, cache_mode)
        bound = bw / r["bytes"]
        lines.append(f"{f'decode ctx {ctx} ({cache_mode})':28} {r['tok_s']:10.1f} {bound:10.1f} "
                     f"{100 * r['tok_s'] / bound:10.1f}%")
    return "\n".join(lines)

"""Where an eager forward's host time goes (prefill chunks, speculative verify steps, TTFT with a cached prefix):
wall time per forward of T new tokens after a cached context, the host time alone (the same forwards with the GPU
left to run: no sync inside the loop, time until the last launch returns), and cProfile's top functions.

On the H200 (2026-11-30, before the launch-path changes) a 1-token eager forward of the 8B shape took 33 ms
against 3.5 ms graph-replayed: ~400 launches at ~75 us of Python each. A forward is launch-bound when its host
time is above its GPU time.

    python benchmarks/profile_host.py [--shape llama-3-8b] [--context 1024] [--tokens 1,5,128] [--device cuda]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import synthetic_model  # noqa: E402

from exl_backends.commands.bench import fill_cache  # noqa: E402
from exl_backends.model.batch import Batch, SeqChunk  # noqa: E402
from exl_backends.model.cache import KVCache  # noqa: E402
from exl_backends.model.runner import MAX_TOKENS, Runner  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(forward, reps: int, device: torch.device) -> tuple[float, float]:
    """(wall, host) seconds per call: host until the last launch returns, wall until the GPU is done."""
    forward()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        forward()
    host = (time.perf_counter() - t0) / reps           # launches returned; the GPU may still be busy
    sync(device)
    return (time.perf_counter() - t0) / reps, host


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", default="1,5,128")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    model = synthetic_model(args.shape, device=args.device)
    ps, counts = 256, [int(t) for t in args.tokens.split(",")]
    n_pages = -(-(args.context + max(counts)) // ps)
    cache = KVCache(model.config, n_pages + 1, ps, "fp16", device, model.dtype)
    fill_cache(cache)
    pages = cache.pool.allocate(n_pages)
    runner = Runner(model, cache, max_batch=1, max_pages=n_pages + 1)     # + its trash page
    print(f"{args.shape} on {device}, eager forwards after {args.context} cached tokens:")
    for t in counts:
        batch = Batch.build([SeqChunk(list(range(1, t + 1)), args.context, pages)], ps, device, all_logits=True)
        wall, host = timed(lambda: model.forward(batch, cache), args.reps, device)
        print(f"  {t:5d} tokens: {1000 * wall:7.2f} ms per forward, host {1000 * host:7.2f} ms")
        if device.type == "cuda" and t > MAX_TOKENS:      # the generator's path: graph pieces around attention
            wall, host = timed(lambda: runner.forward(batch), args.reps, device)
            print(f"  {t:5d} tokens: {1000 * wall:7.2f} ms per forward, host {1000 * host:7.2f} ms (graph pieces)")
    for t in (counts[0], counts[-1]):
        batch = Batch.build([SeqChunk(list(range(1, t + 1)), args.context, pages)], ps, device, all_logits=True)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.reps):
            model.forward(batch, cache)
        sync(device)
        profiler.disable()
        print(f"\n== host profile: {args.reps} forwards of {t} tokens ==")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
        if device.type == "cuda":       # where the GPU time goes, per kernel
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                model.forward(batch, cache)
                sync(device)
            print(f"== GPU time of one forward of {t} tokens ==")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))

if __name__ == "__main__":
    main()

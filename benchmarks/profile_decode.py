"""Where a decode step's GPU time goes: torch.profiler over eager decode steps of a synthetic model, kernels
grouped by name (sum of CUDA time per step). --tokens N: steps of N tokens each (a speculative verify step of
1 + k tokens), logits for every one.

    python benchmarks/profile_decode.py [--shape llama-3-8b] [--context 256] [--cache-mode fp16] [--tokens 5]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import synthetic_model  # noqa: E402

from exl_backends.commands.bench import fill_cache, weight_bytes  # noqa: E402
from exl_backends.model.batch import Batch, SeqChunk  # noqa: E402
from exl_backends.model.cache import KVCache  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--cache-mode", default="fp16")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=1, help="tokens per step")
    args = ap.parse_args()
    model = synthetic_model(args.shape)
    ps = 256
    n = args.tokens
    n_pages = -(-(args.context + (args.steps + 3) * n + 8) // ps)
    cache = KVCache(model.config, n_pages, ps, args.cache_mode, "cuda", torch.float16)
    fill_cache(cache)
    pages = cache.pool.allocate(n_pages)
    batches = [Batch.build([SeqChunk([7] * n, args.context + i * n, pages)], ps, "cuda", all_logits=True)
               for i in range(args.steps + 3)]
    for b in batches[:3]:
        model.forward(b, cache)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for b in batches[3:]:
            model.forward(b, cache)
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0:
            rows[e.key] = (e.self_device_time_total / args.steps, e.count / args.steps)
    total = sum(t for t, _ in rows.values())
    print(f"\n{args.shape} ctx {args.context} {args.cache_mode}, {n} tokens a step: weights {weight_bytes(model) / 1e9:.2f} GB; "
          f"GPU time per step {total / 1e3:.3f} ms")
    print(f"{'kernel':70} {'us/step':>9} {'calls':>6} {'%':>5}")
    for k, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"{k[:70]:70} {t:9.1f} {n:6.0f} {100 * t / total:5.1f}")


if __name__ == "__main__":
    main()

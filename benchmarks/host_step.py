"""Where a batch-1 decode step's host time goes between two tokens (the gap between decode_speed's "tok/s", one
host read per token, and its graph-replay-only figure): Batch.build, the runner's input copies, the graph
launch, and the token read, each timed on the host (synchronised before each part, so the parts are their own
host cost, not waits on the GPU; the read's time is the GPU step plus its latency).

    python benchmarks/host_step.py [--shapes llama-3.2-1b,llama-3-8b] [--context 256]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import synthetic_model  # noqa: E402

from exl_backends.commands.bench import _cache, fill_cache  # noqa: E402
from exl_backends.model.batch import Batch, SeqChunk  # noqa: E402
from exl_backends.model.runner import Runner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    ps = 256
    for shape in args.shapes.split(","):
        model = synthetic_model(shape)
        n_pages = -(-(args.context + args.steps + 8) // ps)
        cache = _cache(model, n_pages + 1, ps, "fp16")
        fill_cache(cache)
        pages = cache.pool.allocate(n_pages)
        runner = Runner(model, cache, max_batch=1, max_pages=n_pages)
        graph = None
        parts = {k: [] for k in ("build", "forward (copies + launch)", "replay call alone", "argmax + read",
                                 "whole step")}
        token = 1
        for i in range(args.steps + 3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            batch = Batch.build([SeqChunk([token], args.context + i, pages)], ps, model.device)
            t1 = time.perf_counter()
            logits = runner.forward(batch)
            t2 = time.perf_counter()
            token = int(logits.argmax())
            t3 = time.perf_counter()
            graph = graph or runner.graphs.by_shape[1, 1]
            torch.cuda.synchronize()
            t4 = time.perf_counter()
            graph.replay()
            t5 = time.perf_counter()
            if i >= 3:
                for k, v in zip(parts, (t1 - t0, t2 - t1, t5 - t4, t3 - t2, t3 - t0)):
                    parts[k].append(v * 1e6)
        torch.cuda.synchronize()
        print(f"\n{shape} ctx {args.context}: host microseconds per decode step (median of {args.steps})")
        for k, v in parts.items():
            print(f"  {k:28} {statistics.median(v):8.1f}")
        del model, runner, cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Where a batch-1 decode step's time goes between two tokens: why decode_speed's stepped "tok/s" (each step fed
the one before's argmax on the device and launched before the host reads that step's tokens) is below its
graph-replay-only figure (H100, c6aae6d: 8B 382.8 against 406.6 tok/s, 1B 1,216 against 1,348).

Three views, per shape, in one process:
1. Loops that add the stepped loop's pieces one at a time (tok/s, each loop twice, in order then reversed):
   replay alone; + torch's argmax, or instead + the engine's (sampling.greedy); + the token's copy to the host,
   read one step behind; + the runner's input copies (a batch built once); the whole stepped step (Batch.build
   each step), as decode_speed runs it.
2. The stepped loop's host time by part, not synchronised (a part that waits for the GPU shows its wait): if
   the host's step outlasts the GPU's, or a part takes a GPU step's time, the loop is host-bound there.
3. A profile (torch.profiler, CUPTI) of the stepped loop: the idle gaps between GPU activities a step, the largest
   by what ran before and after them (and the activities' summed time, which counts twice what overlaps under
   dependent launch).

    python benchmarks/host_step.py [--shapes llama-3.2-1b,llama-3-8b] [--context 256] [--json DIR]
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import synthetic_model  # noqa: E402

from exl_backends.commands.bench import _cache, fill_cache, run_info  # noqa: E402
from exl_backends.engine.generator import TokenCopies  # noqa: E402
from exl_backends.engine.sampling import greedy  # noqa: E402
from exl_backends.model.batch import Batch, SeqChunk  # noqa: E402
from exl_backends.model.runner import Runner  # noqa: E402

PS = 256


class Stepper:
    """decode_speed's stepped loop on one model, cut into its pieces."""

    def __init__(self, model, context: int, steps: int):
        self.context, self.steps = context, steps
        n_pages = -(-(context + 4 * steps + 64) // PS)
        self.cache = _cache(model, n_pages + 1, PS, "fp16")
        fill_cache(self.cache)
        self.pages = self.cache.pool.allocate(n_pages)
        self.runner = Runner(model, self.cache, max_batch=1, max_pages=n_pages)
        self.pos = context
        self.runner.forward(self.batch([1]))        # captures the graph
        torch.cuda.synchronize()
        self.graph = self.runner.graphs.by_shape[1, 1]
        self.copies = TokenCopies()

    def batch(self, ids: list[int]) -> Batch:
        self.pos += 1
        if self.pos >= self.context + 3 * self.steps:    # stay within the pages: the speed does not depend on it
            self.pos = self.context
        return Batch.build([SeqChunk(ids, self.pos, self.pages)], PS, "cuda")

    def loop(self, kind: str, times: dict | None = None) -> float:
        """tok/s of `steps` steps of one kind; times: host seconds by part (the stepped loop's)."""
        g, fixed = self.graph, self.batch([1])
        fixed.host = None
        pending, top = None, None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(self.steps):
            if kind == "replay":
                g.replay()
                continue
            if kind in ("replay + argmax", "replay + torch.argmax"):
                g.replay()
                greedy(g.logits) if kind == "replay + argmax" else g.logits.argmax(-1)
                continue
            marks = [time.perf_counter()]
            if kind == "stepped":
                b = self.batch([1])
                if top is not None:
                    b.feed(top)
                marks.append(time.perf_counter())
                logits = self.runner.forward(b)
            elif kind == "+ input copies":
                if top is not None:
                    fixed.input_ids.copy_(top)
                logits = self.runner.forward(fixed)
            else:                                       # "+ copy to host"
                g.replay()
                logits = g.logits
            marks.append(time.perf_counter())
            top = greedy(logits)
            copy = self.copies.start(top)
            marks.append(time.perf_counter())
            if pending is not None:
                host, done = pending
                done.synchronize()
                host.tolist()
            marks.append(time.perf_counter())
            pending = copy
            if times is not None:
                for name, a, b in zip(("build", "forward", "argmax + copy", "read (waits)"), marks, marks[1:]):
                    times[name].append(b - a)
        torch.cuda.synchronize()
        return self.steps / (time.perf_counter() - t0)


KINDS = ("replay", "replay + torch.argmax", "replay + argmax", "+ copy to host", "+ input copies", "stepped")


def gaps(stepper: Stepper, n: int = 16) -> dict:
    """GPU activity of n stepped steps under torch.profiler: idle gaps by their neighbours, summed activity time."""
    from torch.profiler import ProfilerActivity, profile
    stepper.loop("stepped")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        saved, stepper.steps = stepper.steps, n
        stepper.loop("stepped")
        stepper.steps = saved
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                     and e.device_resource_id is not None),
                    key=lambda e: e.time_range.start)
    if not events:
        return dict(note="the profiler recorded no GPU activity")
    busy = sum(e.time_range.elapsed_us() for e in events)
    span = events[-1].time_range.end - events[0].time_range.start
    by_pair, idle = collections.defaultdict(list), 0.0
    end, name = events[0].time_range.end, events[0].name
    for e in events[1:]:
        gap = e.time_range.start - end
        if gap > 0:
            idle += gap
            by_pair[f"{name[:50]} -> {e.name[:50]}"].append(gap)
        if e.time_range.end > end:
            end, name = e.time_range.end, e.name
    top = sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:12]
    return dict(steps=n, span_us_per_step=span / n, busy_us_per_step=busy / n, idle_us_per_step=idle / n,
                activities_per_step=len(events) / n,
                largest=[dict(between=k, count=len(v), total_us_per_step=sum(v) / n, max_us=max(v)) for k, v in top])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--json", default=None, help="folder for host_step.json")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        stepper = Stepper(synthetic_model(shape), args.context, args.steps)
        for kind in KINDS:
            stepper.loop(kind)                       # warm: each kind's first allocations and launches
        speeds = collections.defaultdict(list)
        for kind in KINDS + KINDS[::-1]:
            speeds[kind].append(stepper.loop(kind))
        times = collections.defaultdict(list)
        stepper.loop("stepped", times)
        row = dict(tok_s={k: v for k, v in speeds.items()},
                   host_us={k: statistics.median(v) * 1e6 for k, v in times.items()},
                   host_max_us={k: max(v) * 1e6 for k, v in times.items()})
        try:
            row["profile"] = gaps(stepper)
        except Exception as e:                      # a profiler that cannot trace here must not lose the rest
            row["profile"] = dict(note=f"{type(e).__name__}: {e}")
        rows.append(dict(shape=shape, context=args.context, steps=args.steps, **row))
        print(f"\n{shape} ctx {args.context}: tok/s (in order, then reversed)")
        for kind, v in speeds.items():
            print(f"  {kind:18} " + "  ".join(f"{x:8.1f}" for x in v))
        print("  stepped loop, host us a step (median / max): " + ", ".join(
            f"{k} {row['host_us'][k]:.1f} / {row['host_max_us'][k]:.1f}" for k in row["host_us"]))
        p = row["profile"]
        if "note" in p:
            print(f"  profile: {p['note']}")
        else:
            print(f"  profile of {p['steps']} stepped steps, us a step: span {p['span_us_per_step']:.1f}, activities "
                  f"summed {p['busy_us_per_step']:.1f}, idle {p['idle_us_per_step']:.1f} "
                  f"({p['activities_per_step']:.0f} activities a step); largest gaps:")
            for g in p["largest"]:
                print(f"    {g['total_us_per_step']:7.2f} us/step  x{g['count']:<4} max {g['max_us']:7.1f}  "
                      f"{g['between']}")
        del stepper
        torch.cuda.empty_cache()
    if args.json:
        info = run_info(torch.device("cuda"), 0.0, rows)
        Path(args.json, "host_step.json").write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()

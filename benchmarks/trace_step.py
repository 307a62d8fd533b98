"""Where a replayed decode step's time goes, launch by launch, from stamps the kernels write (qmm_rows.cuh TRACE in
the one-row matmuls, attention.cu TRACE in decode attention): per launch of a layer, its first warp's start, its
warps' passes through their wait (first .. last), the last walk's (attention: key loop's) end and its end, the gap
from the launch before's end to this one's first pass, and where its end comes from (its warps' longest tail after
their walk, the summing warps' median tail, the share and last end of warps whose block became resident only as
the launch before ended); for attention also its warps' phases (before the wait, staging the queries and the new
key, the key loop, the merge and the output). Times in us from the layer's first q/k/v pass, medians over the
middle half of the layers and over runs. The probes cost the step time of their own: the replay with and without
them is printed first. Attention is stamped only where a row's keys take one block (up to 512 keys: attention.cu
ONE_SPLIT); at longer contexts its launches are left out.

    python benchmarks/trace_step.py [--shapes llama-3.2-1b,llama-3-8b] [--context 256] [--mode fp16] [--runs 10]
        [--define NAME=VALUE]    (a kernel variant, both the plain and the traced step)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES, synthetic_model  # noqa: E402
from tune_matmul import use_define  # noqa: E402

from exl_backends.commands.bench import _cache, copy_bandwidth, fill_cache, run_info  # noqa: E402
from exl_backends.kernels import loader  # noqa: E402
from exl_backends.model.batch import Batch, SeqChunk  # noqa: E402
from exl_backends.model.runner import DecodeGraph, Runner  # noqa: E402

MATMUL_RECORDS, ATTENTION_RECORDS = 1 << 19, 1 << 13
DEFINE = f"QMM_TRACE={MATMUL_RECORDS}+ATT_TRACE={ATTENTION_RECORDS}"
FAMILIES = {"matmul_rows", "attention"}
RECORD = np.dtype([("t", "<u8", 5), ("op", "<u4"), ("where", "<u4")])    # TraceRecord / AttTraceRecord
BUFFERS = (("matmul_rows", "qmm_trace", MATMUL_RECORDS), ("attention", "att_trace", ATTENTION_RECORDS))
LAUNCH_GAP_US = 10.0    # two records of one kernel whose passes are further apart come from two launches
PAGE_SIZE = 256


def step_graph(model, context: int, mode: str) -> tuple[DecodeGraph, Runner]:
    """The decode step's graph at `context` keys (one row), captured with the kernels as loaded now, and its runner
    (which must outlive the graph)."""
    n_pages = -(-(context + 8) // PAGE_SIZE)
    cache = _cache(model, n_pages + 1, PAGE_SIZE, mode)
    fill_cache(cache)
    pages = cache.pool.allocate(n_pages)
    runner = Runner(model, cache, max_batch=1, max_pages=n_pages)
    runner.forward(Batch.build([SeqChunk([1], context, pages)], PAGE_SIZE, model.device))
    torch.cuda.synchronize()
    return runner.graphs.by_shape[1, 1], runner


def replay_us(graph: DecodeGraph, n: int = 100) -> float:
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def traced_records(graph: DecodeGraph) -> np.ndarray:
    """Every stamp record of one replay (after one untimed replay, so its weights come from DRAM as a step's do)."""
    import cupy as cp
    cc = loader.compute_capability()
    buffers = []
    for family, name, capacity in BUFFERS:
        mod = loader.module(family, cc)
        count = cp.ndarray((1,), cp.uint32, mod.get_global(f"{name}_n"))
        records = cp.ndarray((capacity * RECORD.itemsize // 8,), cp.uint64, mod.get_global(name))
        buffers.append((count, records, capacity))
    graph.replay()
    torch.cuda.synchronize()
    for count, _, _ in buffers:
        count.fill(0)
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    out = []
    for count, records, capacity in buffers:
        n = int(count.get()[0])
        if n > capacity:
            raise SystemExit(f"{n} trace records, room for {capacity}: raise the buffer")
        out.append(records[:n * RECORD.itemsize // 8].get().view(RECORD))
    return np.concatenate(out)


def launches(records: np.ndarray, names: dict) -> list[tuple[str, np.ndarray]]:
    """(name, records) of each launch, in the order of their first pass: a kernel's records split where their passes
    through the wait are more than LAUNCH_GAP_US apart (not their starts: a block that finds no free slot until the
    launch before it ends starts late, and still passes with the others)."""
    out = []
    for op in np.unique(records["op"]):
        mine = records[records["op"] == op]
        mine = mine[np.argsort(mine["t"][:, 1])]
        cuts = np.nonzero(np.diff(mine["t"][:, 1].astype(np.int64)) > LAUNCH_GAP_US * 1e3)[0] + 1
        name = "attention" if op == 2 else names.get((int(op >> 1 & 7), int(op >> 4) * 32), f"op {op}")
        if op & 1 == 0 and op != 2:
            name = "stage " + name
        out += [(name, part) for part in np.split(mine, cuts)]
    out.sort(key=lambda launch: launch[1]["t"][:, 1].min())
    if out and out[-1][0] == "o":         # the head: one weight of K = hidden size, after the last down
        out[-1] = ("head", out[-1][1])
    return out


COLUMNS = ("start", "pass first", "pass last", "work", "walked", "end", "gap", "tail max", "sum tail", "late %",
           "late end")


def launch_row(name: str, r: np.ndarray, t0: int, previous_end: float | None) -> dict:
    """A launch's columns (us from t0) and, for attention, its warps' phases (medians, us)."""
    t = (r["t"].astype(np.int64) - t0) / 1e3
    row = dict(name=name, start=t[:, 0].min(), **{"pass first": t[:, 1].min(), "pass last": t[:, 1].max()},
               walked=t[:, 2].max(), end=t[:, 3].max(), work=float(np.median(t[:, 2] - t[:, 1])))
    row["gap"] = row["pass first"] - previous_end if previous_end is not None else float("nan")
    # where a launch's end comes from: its warps' longest tail (walk's end to end), the median tail of the warps that
    # summed a strip (split-K's last arrival, or a cluster's summing warp), and the warps whose block became resident
    # only as the launch before ended (started within 1 us of this launch's first pass): their share, their last end
    tails, summed = t[:, 3] - t[:, 2], (r["where"] >> 15 & 1).astype(bool)
    late = t[:, 0] > row["pass first"] - 1.0
    row.update(**{"tail max": tails.max(), "sum tail": float(np.median(tails[summed])) if summed.any() else np.nan,
                  "late %": 100.0 * late.mean(), "late end": t[late, 3].max() if late.any() else np.nan})
    if name == "attention":
        row.update(before_wait=float(np.median(t[:, 1] - t[:, 0])), staging=float(np.median(t[:, 4] - t[:, 1])),
                   key_loop=float(np.median(t[:, 2] - t[:, 4])), merge_out=float(np.median(t[:, 3] - t[:, 2])))
    return row


def layer_rows(records: np.ndarray, names: dict) -> tuple[list[list[dict]], float]:
    """Per layer, its launches' rows (times from the layer's q/k/v first pass); and the step's span (us)."""
    ls = launches(records, names)
    starts = [i for i, (name, _) in enumerate(ls) if name == "qkv"]
    layers = []
    for j, i in enumerate(starts):
        stop = starts[j + 1] if j + 1 < len(starts) else len(ls)
        t0 = int(ls[i][1]["t"][:, 1].min())
        rows, previous_end = [], None
        for name, r in ls[i:stop]:
            rows.append(launch_row(name, r, t0, previous_end))
            previous_end = rows[-1]["end"]
        if j + 1 < len(starts):
            rows.append(dict(name="next qkv", **{"pass first": (int(ls[stop][1]["t"][:, 1].min()) - t0) / 1e3}))
        layers.append(rows)
    t = records["t"].astype(np.int64)
    return layers, (t[:, 3].max() - t[:, 0].min()) / 1e3


def medians(per_run: list[list[list[dict]]]) -> list[dict]:
    """The middle half of the layers (the first and last differ: embedding, head), medians over layers and runs of
    each launch of a layer (by name, in the order of the first such layer; a launch some layers lack is left out)."""
    n_layers = min(len(layers) for layers in per_run)
    pick = [layers[l] for layers in per_run for l in range(n_layers // 4, 3 * n_layers // 4)]
    keyed = [{(r["name"], sum(q["name"] == r["name"] for q in layer[:i])): r for i, r in enumerate(layer)}
             for layer in pick]
    out = []
    for key in keyed[0]:
        if all(key in layer for layer in keyed):
            rows = [layer[key] for layer in keyed]
            cols = [k for k in rows[0] if k != "name" and all(k in r for r in rows)]
            out.append(dict(name=key[0], **{k: statistics.median(r[k] for r in rows) for k in cols}))
    return out


def trace_shape(shape: str, context: int, mode: str, runs: int, define: str = "") -> dict:
    s = SHAPES[shape]
    d, hd = s["hidden_size"], s["hidden_size"] // s["num_attention_heads"]
    names = {(3, d): "qkv", (1, s["num_attention_heads"] * hd): "o", (2, d): "gate_up",
             (1, s["intermediate_size"]): "down"}
    model = synthetic_model(shape)
    use_define(define, FAMILIES)
    graph, runner = step_graph(model, context, mode)
    plain = replay_us(graph)
    del graph, runner
    use_define("+".join(filter(None, (DEFINE, define))), FAMILIES)
    graph, runner = step_graph(model, context, mode)
    traced = replay_us(graph)
    per_run, spans = [], []
    for _ in range(runs):
        layers, span = layer_rows(traced_records(graph), names)
        per_run.append(layers)
        spans.append(span)
    rows = medians(per_run)
    layer_us = next((r["pass first"] for r in rows if r["name"] == "next qkv"), float("nan"))
    print(f"\n{shape}, ctx {context}, {mode} cache: replayed step {plain:.1f} us, {traced:.1f} with the probes; "
          f"traced span {statistics.median(spans):.1f} us; a middle layer {layer_us:.2f} us (medians of {runs} runs)")
    print(f"{'launch':10s} " + " ".join(f"{c:>10s}" for c in COLUMNS))
    for r in rows:
        print(f"{r['name']:10s} " + " ".join(f"{r[c]:10.2f}" if c in r else f"{'':10s}" for c in COLUMNS))
    att = next((r for r in rows if r["name"] == "attention"), None)
    if att:
        print("attention warps (medians): before the wait {before_wait:.2f}, staging {staging:.2f}, key loop "
              "{key_loop:.2f}, merge and output {merge_out:.2f} us".format(**att))
    del graph, runner, model
    torch.cuda.empty_cache()
    return dict(shape=shape, context=context, cache_mode=mode, define=define, replay_us=plain,
                traced_replay_us=traced, layer_us=layer_us, launches=rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--mode", default="fp16")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--define", default="", help="a kernel variant traced, e.g. QMM_PREFETCH_BYTES=8192 ('+' between several)")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(0))
    results = [trace_shape(shape, args.context, args.mode, args.runs, args.define)
               for shape in args.shapes.split(",")]
    out = os.environ.get("OUT")
    if out:
        path = Path(out, "trace_step.json")
        info = run_info(torch.device("cuda"), copy_bandwidth(torch.device("cuda")), results)
        path.write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()

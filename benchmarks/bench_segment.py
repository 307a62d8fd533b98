"""What a one-row matmul costs inside a megakernel segment against its own launches (docs/megakernel.md).

Per matmul of a Llama block at 4.0 bpw EXL2 (q/k/v after the attention norm, o, gate/up after the MLP norm, down
after silu * up): the stage_xs + matmul launch pair (launch-per-op) against the same two ops as one segment launch;
then the whole block's 8 launches against one segment of its 8 ops, after checking that the segment's outputs and
launch-per-op's are the default build's bit for bit (so a --defines variant cannot pass by being wrong). Weights
rotate over copies of the block, so they come from DRAM; CUDA graph replay; GB/s counts packed weight bytes. Also
where the GPU puts a persistent grid's CTAs (which SM runs CTA c), since a segment's schedule assigns blocks by CTA
index.

    python benchmarks/bench_segment.py [--shapes llama-3-8b,llama-3.2-1b] [--defines ,MK_POLL_NS=0]
    python benchmarks/bench_segment.py --trace       # where each op's time goes in a block (qmm_rows.cuh TRACE)
    ncu --kernel-name regex:'decode_segment|matmul_m1|stage_xs' python benchmarks/bench_segment.py --eager \
        --shapes llama-3.2-1b        # each matmul's launches and its segment, twice (scripts/gpu-check segment)
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

import numpy as np

# QuantMatmul builds its segment ops only when the megakernel is on; EXL_MEGAKERNEL=ring (or ring-fold) measures
# and traces the ring segment instead
if os.environ.get("EXL_MEGAKERNEL", "0") == "0":
    os.environ["EXL_MEGAKERNEL"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_matmul import copies_for, time_calls  # noqa: E402
from shapes import BODY_MIX, SHAPES, random_exl2  # noqa: E402
from tune_matmul import use_define  # noqa: E402

from exl_backends.kernels import loader  # noqa: E402
from exl_backends.kernels import megakernel as mk  # noqa: E402
from exl_backends.kernels import quant_matmul as qm  # noqa: E402

EPS = 1e-5
FAMILIES = {"megakernel", "matmul_rows"}     # what --defines recompiles: both sides of each comparison


def block_weights(shape: str, gen: torch.Generator) -> dict:
    """One block's fused matmuls, as the model fuses them."""
    s = SHAPES[shape]
    d, inter, hd = s["hidden_size"], s["intermediate_size"], s["hidden_size"] // s["num_attention_heads"]

    def w(k, n):
        return qm.prepare(random_exl2(k, n, BODY_MIX, "cuda", gen), None)
    return {"qkv": qm.fuse([w(d, s["num_attention_heads"] * hd), w(d, s["num_key_value_heads"] * hd),
                            w(d, s["num_key_value_heads"] * hd)]),
            "o": w(s["num_attention_heads"] * hd, d), "gate_up": qm.fuse([w(d, inter), w(d, inter)]),
            "down": w(inter, d)}


def block_copies(shape: str) -> list[dict]:
    """Enough copies of one block's weights that a pass over them all comes from DRAM, not L2."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    first = block_weights(shape, gen)
    copies = copies_for(sum(f.nbytes() for f in first.values()))
    return [first] + [block_weights(shape, gen) for _ in range(copies - 1)]


def block_inputs(shape: str) -> dict:
    """One row of each input calls_of reads: x, residual, norm weight, attention output, gate and up."""
    s = SHAPES[shape]
    d, inter = s["hidden_size"], s["intermediate_size"]
    g = torch.Generator(device="cuda").manual_seed(1)
    inputs = {name: torch.randn(1, n, device="cuda", generator=g).half()
              for name, n in (("h", d), ("res", d), ("attn", d), ("gate", inter), ("up", inter))}
    inputs["norm_w"] = (1 + 0.05 * torch.randn(d, device="cuda", generator=g)).half()
    return inputs


def calls_of(block: dict, inputs: dict) -> dict:
    """Each matmul as launch-per-op runs it (its staging included), on inputs of its own; and "block": the four
    as a layer runs them, each reading the one before's outputs (o, norm + gate/up, silu * up + down, the next
    block's norm + q/k/v)."""
    h, res, norm_w, attn, gate, up = (inputs[n] for n in ("h", "res", "norm_w", "attn", "gate", "up"))

    def layer():
        y_o = block["o"].forward(attn)
        (g, u), r = block["gate_up"].forward_normed(y_o[0], res, norm_w, EPS)
        y_d = block["down"].forward(g, u)
        return y_o, g, u, y_d, block["qkv"].forward_normed(y_d[0], r, norm_w, EPS)
    return {"qkv": lambda: block["qkv"].forward_normed(h, res, norm_w, EPS),
            "o": lambda: block["o"].forward(attn),
            "gate_up": lambda: block["gate_up"].forward_normed(h, res, norm_w, EPS),
            "down": lambda: block["down"].forward(gate, up),
            "block": layer}


def chained(calls: list, done: torch.Tensor):
    """calls as one segment launch, counters from `done` (a call of its own per launch: mk.MAX_OPS + 1 of them)."""
    def run():
        with mk.chaining(done):
            outs = [f() for f in calls]
        return outs
    return run


def same(a, b) -> bool:
    """Outputs equal bit for bit (fp16 tensors, or lists / tuples of them; NaNs too)."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def sm_map(grid_per_sm: int = 2) -> list[int]:
    """The SM of each CTA of a grid of grid_per_sm CTAs per SM, all resident at once (each waits for all to
    arrive, as a segment's CTAs do), 256 threads each with shared memory that lets only grid_per_sm fit."""
    import cupy as cp
    kernel = cp.RawKernel(r"""
    extern "C" __global__ void where(int* sm, int* arrived, int n) {
        if (threadIdx.x == 0) {
            unsigned id; asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
            sm[blockIdx.x] = id;
            atomicAdd(arrived, 1);
            while (atomicAdd(arrived, 0) < n) __nanosleep(100);
        }
    }""", "where")
    props = torch.cuda.get_device_properties(0)
    n = grid_per_sm * props.multi_processor_count
    smem = (props.shared_memory_per_multiprocessor // grid_per_sm) - 2048
    kernel.max_dynamic_shared_size_bytes = smem
    sm, arrived = cp.zeros(n, dtype=cp.int32), cp.zeros(1, dtype=cp.int32)
    kernel((n,), (256,), (sm, arrived, cp.int32(n)), shared_mem=smem)
    return sm.get().tolist()


def report_sm_map() -> None:
    sm = sm_map()
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    pairs = sum(sm[c] == sm[c + 1] for c in range(len(sm) - 1))
    spans = [len(set(sm[c:c + n_sm])) for c in range(0, len(sm) - n_sm + 1, 16)]
    print(f"CTA -> SM, {len(sm)} CTAs: first 16 {sm[:16]}; neighbours on one SM: {pairs}; distinct SMs in "
          f"{n_sm} consecutive CTAs: {min(spans)}..{max(spans)} of {n_sm}")


def bench_shape(shape: str, eager: bool, defines: list[str]) -> None:
    blocks = block_copies(shape)
    nbytes = {name: f.nbytes() for name, f in blocks[0].items()}
    inputs = block_inputs(shape)
    per_block = [calls_of(b, inputs) for b in blocks]
    use_define("", FAMILIES)
    want = {name: f() for name, f in per_block[0].items()}      # launch-per-op's outputs as built
    for define in defines:
        use_define(define, FAMILIES)                # (both paths' kernels compiled with -D<define>; '' the default)
        for line in table(shape, blocks, per_block, nbytes, want, eager):
            print(f"{line}  {define or 'default'}")


def table(shape: str, blocks: list, per_block: list, nbytes: dict, want: dict, eager: bool) -> list[str]:
    """Each matmul's launches against its segment, then the whole block's, after checking both give `want` (the
    default build's outputs of the first copy) bit for bit; eager: only run them (for ncu)."""
    stride = mk.MAX_OPS + 1
    done = mk.counters(len(blocks) * 5, torch.device("cuda"))
    rows = []
    for i, name in enumerate(list(nbytes) + ["block"]):
        plain = [c[name] for c in per_block]
        seg = [chained([c[name]], done[(j * 5 + i) * stride:]) for j, c in enumerate(per_block)]
        for path, got in (("launch-per-op", plain[0]()), ("segment", seg[0]()[0])):
            if not same(got, want[name]):           # a variant (--defines) must keep the outputs
                raise SystemExit(f"{shape} {name}: {path}'s outputs differ from the default build's")
        if eager:                                   # for ncu: two launches of each on the first copy, no graph
            for f in plain[:1] * 2 + seg[:1] * 2:
                f()
            torch.cuda.synchronize()
            continue
        t_plain = time_calls(plain) * len(plain) / len(blocks)           # seconds per copy of the block
        t_seg = time_calls(seg) * len(seg) / len(blocks)
        rows.append((name, sum(nbytes.values()) if name == "block" else nbytes[name], t_plain, t_seg))
    return [f"{shape:13s} {name:8s} {b / 1e6:7.2f} MB  launch-per-op {t_plain * 1e6:7.2f} us "
            f"({b / t_plain / 1e9:5.0f} GB/s)  segment {t_seg * 1e6:7.2f} us ({b / t_seg / 1e9:5.0f} GB/s)  "
            f"segment / launch {t_seg / t_plain:5.3f}" for name, b, t_plain, t_seg in rows]


TRACE_RECORDS = 1 << 17
TRACE_DEFINE = f"QMM_TRACE={TRACE_RECORDS}"
RECORD = np.dtype([("t", "<u8", 5), ("op", "<u4"), ("where", "<u4")])       # qmm_rows.cuh TraceRecord


def trace_buffers(family: str):
    """(count, records) of the family's trace buffers as cupy arrays (its module compiled with TRACE_DEFINE)."""
    import cupy as cp
    mod = loader.module(family, loader.compute_capability())
    count = cp.ndarray((1,), cp.uint32, mod.get_global("qmm_trace_n"))
    records = cp.ndarray((TRACE_RECORDS * RECORD.itemsize // 8,), cp.uint64, mod.get_global("qmm_trace"))
    return count, records


def traced(run, flush, families: list[str], runs: int) -> list[np.ndarray]:
    """The records of `runs` replays of the graph of run(), each after a replay of flush's (the other weight
    copies: the traced block's weights come from DRAM, as in a decode step)."""
    graphs = []
    for f in (flush, run):
        f()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            f()
        graphs.append(graph)
    buffers = [trace_buffers(family) for family in families]
    out = []
    for _ in range(runs):
        graphs[0].replay()
        torch.cuda.synchronize()
        for count, _ in buffers:
            count.fill(0)
        torch.cuda.synchronize()
        graphs[1].replay()
        torch.cuda.synchronize()
        got = []
        for count, records in buffers:
            n = int(count.get()[0])
            if n > TRACE_RECORDS:
                raise SystemExit(f"{n} trace records, room for {TRACE_RECORDS}: raise TRACE_RECORDS")
            got.append(records[:n * RECORD.itemsize // 8].get().view(RECORD))
        out.append(np.concatenate(got))
    return out


def op_rows(records: np.ndarray, names: dict) -> list[tuple]:
    """Per op of one traced run, in the order they started: (name, start, first pass, last pass, median work,
    last walk end, end, arrival, sum), microseconds from the run's first stamp. Pass: a warp's wait over; work:
    from its pass to its walk's end (stage_xs: its end); arrival and sum (split matmuls, else nan): medians over
    the warps that summed a strip of their walk's end to their arrival at its counter, and of that to their end."""
    t = (records["t"] - records["t"][:, 0].min()).astype(np.float64) / 1e3
    summed = (records["where"] >> 15 & 1).astype(bool)
    rows = []
    for op in np.unique(records["op"]):
        at = records["op"] == op
        mine, last = t[at], t[at & summed]
        kind, parts, k = op & 1, op >> 1 & 7, (op >> 4) * 32
        name = ("matmul " if kind else "stage ") + names.get((int(parts), int(k)), f"{parts} parts K {k}")
        arrival, total = (float(np.median(last[:, 4] - last[:, 2])), float(np.median(last[:, 3] - last[:, 4]))) \
            if len(last) else (math.nan, math.nan)
        rows.append((name, mine[:, 0].min(), mine[:, 1].min(), mine[:, 1].max(),
                     float(np.median(mine[:, 2] - mine[:, 1])), mine[:, 2].max(), mine[:, 3].max(), arrival, total))
    return sorted(rows, key=lambda r: r[2])


def trace_shape(shape: str, define: str = "", runs: int = 20) -> None:
    """Where each op's time goes in one block (launch-per-op's 8 launches, then the same ops as one segment): per op,
    medians over runs of its first warp's start, its warps' passes through the wait (first .. last), a warp's work
    after its pass, the last walk's end and the op's end, for split matmuls the summing warp's arrival and sum; and
    the gap from the op before's end to this op's first pass (the dependency's latency). Kernels compiled with
    TRACE_DEFINE (the block's time under it is printed beside the build's without it, so the probe's own cost shows),
    and with define ('+' between several) if given."""
    s = SHAPES[shape]
    d, hd = s["hidden_size"], s["hidden_size"] // s["num_attention_heads"]
    names = {(3, d): "qkv", (1, s["num_attention_heads"] * hd): "o", (2, d): "gate_up",
             (1, s["intermediate_size"]): "down"}
    blocks, inputs = block_copies(shape), block_inputs(shape)
    layers = [calls_of(b, inputs)["block"] for b in blocks]
    done = mk.counters(len(blocks), torch.device("cuda"))
    segments = [chained([layer], done[j * (mk.MAX_OPS + 1):]) for j, layer in enumerate(layers)]
    paths = {"launch-per-op": (layers, 1, ["matmul_rows"]), "segment": (segments, 1, ["megakernel"])}
    for build in (define, "+".join(d for d in (define, TRACE_DEFINE) if d)):
        use_define(build, FAMILIES)
        for path, (calls, _, _) in paths.items():
            print(f"{shape} {path} block {time_calls(calls) * len(calls) / len(blocks) * 1e6:.2f} us replayed, "
                  f"weights from DRAM ({build or 'default build'})")
    for path, (calls, per_copy, families) in paths.items():
        def once(fs=calls[:per_copy]):
            return [f() for f in fs]

        def flush(fs=calls[per_copy:]):
            return [f() for f in fs]
        per_run = [op_rows(r, names) for r in traced(once, flush, families, runs)]
        print(f"\n{shape} {path}, us from the block's first stamp, medians of {runs} runs")
        print(f"{'op':16s} {'start':>7s} {'pass first':>10s} {'last':>7s} {'work':>7s} {'walked':>7s} {'end':>7s} "
              f"{'arrive':>7s} {'sum':>7s} {'gap':>6s}")
        previous_end = None
        for i, name in enumerate(r[0] for r in per_run[0]):
            cols = [statistics.median(rows[i][j] for rows in per_run) for j in range(1, 9)]
            gap = "" if previous_end is None else f"{cols[1] - previous_end:6.2f}"
            print(f"{name:16s} " + " ".join(f"{c:7.2f}" if j != 1 else f"{c:10.2f}" for j, c in enumerate(cols))
                  + f" {gap}")
            previous_end = cols[5]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3-8b,llama-3.2-1b")
    ap.add_argument("--eager", action="store_true", help="a few eager launches of each, for ncu")
    ap.add_argument("--defines", default="", help="megakernel.cu variants, comma-separated (-D, '+' between "
                                                   "several; empty: as it is); --trace: the one build traced")
    ap.add_argument("--trace", action="store_true", help="where each op's time goes in a block, by stamps")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(0))
    if args.trace:
        for shape in args.shapes.split(","):
            trace_shape(shape, args.defines)
        return
    if not args.eager:
        report_sm_map()
    for shape in args.shapes.split(","):
        bench_shape(shape, args.eager, args.defines.split(","))


if __name__ == "__main__":
    main()

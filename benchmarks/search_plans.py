"""Which one-row plans make a Llama block fastest when its launches are chained (docs/megakernel.md).

The planner rates each launch alone (planning._launch_seconds), but a launch's neighbours matter: the 8B shape's
q/k/v and o in 8 clustered splits are slower alone and make the block 5 % faster, their fewer blocks leaving SMs to
the next launch (H100, 2026-12-06). Here each matmul of a block (q/k/v, o, gate/up, down; 4.0 bpw EXL2, as
bench_segment builds them) is tried at every split count that fits one wave, through the counters and, where the
GPU runs all its clusters at once, in clusters; the others kept at their current plan, the fastest kept, two rounds.
Measured as launch-per-op runs a layer (stage + matmul, each reading the one before), CUDA graph replay, weights
from DRAM over copies of the block. Plans with other splits sum in another order, so outputs differ in the last
bits; only time is compared.

    python benchmarks/search_plans.py [--shapes llama-3.2-1b,llama-3-8b] [--rounds 2]   (rows to $OUT/search_plans.json)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_matmul import time_calls  # noqa: E402
from bench_segment import block_copies, block_inputs, calls_of  # noqa: E402

os.environ["EXL_MEGAKERNEL"] = "0"      # (bench_segment turns it on; these plans are launch-per-op's)

import torch  # noqa: E402

from exl_backends.commands.bench import run_info  # noqa: E402
from exl_backends.kernels import planning  # noqa: E402
from exl_backends.kernels import quant_matmul as qm  # noqa: E402

OPS = ("qkv", "o", "gate_up", "down")


def options(f: qm.QuantMatmul, slots: dict[int, int]) -> list[tuple[int, bool]]:
    """(splits, clustered) a one-row launch of f may take: every part split alike, within the kernels' limits
    (MIN_CHUNKS_PER_SPLIT, M1_MAX_SPLITS) and one wave; clustered where the GPU holds all its clusters at once."""
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    spb, _ = qm.small_blocks(f.layouts, 1, n_sm)
    col_blocks = sum(-(-lay.strips // spb) for lay in f.layouts)
    most = min(min(len(lay.chunk_bits) // planning.MIN_CHUNKS_PER_SPLIT, planning.M1_MAX_SPLITS)
               for lay in f.layouts)
    out = []
    for s in range(1, most + 1):
        if col_blocks * s > planning.RESIDENT_BLOCKS[1] * n_sm:
            break
        out.append((s, False))
        if s > 1 and slots.get(s, 0) >= col_blocks:
            out.append((s, True))
    return out


def plan_for(f: qm.QuantMatmul, splits: int, clustered: bool) -> qm.Plan:
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    spb, _ = qm.small_blocks(f.layouts, 1, n_sm)
    plan = qm.staged_plan(f.layouts, f.biases, f.counters, [splits] * len(f.layouts), 1, spb)
    return replace(plan, cluster=splits if clustered else 1)


def use(blocks: list[dict], op: str, choice: tuple[int, bool] | None) -> None:
    """Every copy's `op` at that (splits, clustered), or at the planner's plan (None)."""
    for block in blocks:
        f = block[op]
        f.plans.pop(1, None)
        if choice is not None:
            f.plans[1] = plan_for(f, *choice)
        f.ws1 = None                     # sized by the plan on first use


def described(f: qm.QuantMatmul) -> str:
    plan = f.plans[1]
    return f"{int(plan.params['part']['n_splits'][0])}{'c' if plan.cluster > 1 else ''}"


def search(shape: str, rounds: int) -> list[dict]:
    """The search's rows: each plan tried (op, splits, clustered, block us) and the planner's and the best."""
    blocks, inputs = block_copies(shape), block_inputs(shape)
    calls = [calls_of(b, inputs)["block"] for b in blocks]
    slots = qm.one_row_cluster_slots(torch.device("cuda", 0))
    planner = {op: described(blocks[0][op]) for op in OPS}
    base = time_calls(calls, reps=50) * 1e6
    print(f"{shape}: planner's plans {planner}: block {base:.2f} us")
    rows = [dict(shape=shape, what="planner", plans=planner, block_us=base)]
    chosen: dict[str, tuple[int, bool] | None] = dict.fromkeys(OPS)
    best_time = base
    for r in range(rounds):
        for op in OPS:
            tried = []
            for choice in options(blocks[0][op], slots):
                use(blocks, op, choice)
                tried.append((time_calls(calls, reps=50) * 1e6, choice))
            rows += [dict(shape=shape, what="tried", round=r + 1, op=op, splits=s, clustered=c, block_us=t)
                     for t, (s, c) in tried]
            t, choice = min(tried)
            if t < best_time:
                chosen[op], best_time = choice, t
            use(blocks, op, chosen[op])
            print(f"  round {r + 1} {op:8s} " + "  ".join(f"{s}{'c' if c else ''}:{t:.2f}" for t, (s, c) in tried))
    final = time_calls(calls, reps=50) * 1e6
    best = {op: described(blocks[0][op]) for op in OPS}
    print(f"{shape}: best {best}: block {final:.2f} us against {base:.2f} for the planner's "
          f"({(base / final - 1) * 100:+.1f} %)")
    return rows + [dict(shape=shape, what="best", plans=best, block_us=final)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(0))
    rows = [row for shape in args.shapes.split(",") for row in search(shape, args.rounds)]
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "search_plans.json").write_text(
            json.dumps(run_info(torch.device("cuda"), 0.0, rows), indent=1))


if __name__ == "__main__":
    main()

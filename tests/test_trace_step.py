"""benchmarks/trace_step.py's reading of the kernels' stamps (the GPU run itself is a benchmark): records of a
made-up step, laid out as the kernels write them, back into launches and layers."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import trace_step  # noqa: E402

D, INTER = 2048, 8192
NAMES = {(3, D): "qkv", (1, D): "o", (2, D): "gate_up", (1, INTER): "down"}
# each op of a layer: its op code (qmm_rows.cuh TraceRecord: kind | parts << 1 | K / 32 << 4; attention 2), warps,
# us from its pass to its end
LAYER = [(1 | 3 << 1 | D // 32 << 4, 24, 6.0), (2, 8, 7.0), (1 | 1 << 1 | D // 32 << 4, 16, 5.0),
         (1 | 2 << 1 | D // 32 << 4, 40, 10.0), (1 | 1 << 1 | INTER // 32 << 4, 32, 8.0)]
GAP_NS = 800


def made_up_step(n_layers: int, seed: int = 0) -> np.ndarray:
    """A step of n_layers layers and a head; every launch's warps pass their wait within 300 ns of each other and
    end within 200 ns of the launch's end, which is GAP_NS before the next launch's first pass. A quarter of each
    launch's warps start only 15 us after the others (their blocks found no free slot before), yet pass with them."""
    rng = np.random.default_rng(seed)
    rows, t = [], 5_000_000
    for op, warps, us in LAYER * n_layers + [(LAYER[2][0], 16, 20.0)]:
        for w in range(warps):
            passed = t + int(rng.integers(0, 300))
            end = t + int(us * 1000) - int(rng.integers(0, 200))
            start = passed - (2000 if w % 4 else 17000)
            rows.append(((start, passed, end - 300, end, passed + 150), op))
        t += int(us * 1000) + GAP_NS
    records = np.zeros(len(rows), trace_step.RECORD)
    for i, (stamps, op) in enumerate(rows):
        records[i]["t"], records[i]["op"] = stamps, op
    return records[np.random.default_rng(seed + 1).permutation(len(rows))]     # the buffers' order is the atomics'


def test_records_come_back_as_the_layers_launches_in_order():
    layers, span = trace_step.layer_rows(made_up_step(6), NAMES)
    assert len(layers) == 6
    assert [r["name"] for r in layers[0]] == ["qkv", "attention", "o", "gate_up", "down", "next qkv"]
    assert [r["name"] for r in layers[-1]] == ["qkv", "attention", "o", "gate_up", "down", "head"]
    assert all(abs(r["start"] - r["pass first"] + 17) < 0.31 for r in layers[2][:-1])    # the late blocks' start
    layer_us = sum(us for _, _, us in LAYER) + len(LAYER) * GAP_NS / 1e3
    assert abs(layers[0][-1]["pass first"] - layer_us) < 0.31
    assert 6 * layer_us + 36.5 < span < 6 * layer_us + 37.5      # from the first late start to the head's end


def test_medians_give_each_launch_its_gap_and_attention_its_phases():
    rows = trace_step.medians([trace_step.layer_rows(made_up_step(8, seed), NAMES)[0] for seed in range(3)])
    by_name = {r["name"]: r for r in rows}
    assert abs(by_name["qkv"]["pass first"]) < 1e-9
    for name in ("attention", "o", "gate_up", "down"):
        assert 0.8 - 0.21 < by_name[name]["gap"] < 0.8 + 0.31, name       # GAP_NS, give or take the spreads
    att = by_name["attention"]
    assert abs(att["before_wait"] - 2.0) < 1e-6 and abs(att["staging"] - 0.15) < 1e-6
    assert 6.4 < att["key_loop"] + att["merge_out"] + att["staging"] < 7.0

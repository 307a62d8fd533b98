"""Quantized matmul on the GPU: achieved bandwidth at M=1 against the device's copy bandwidth, and the M sweep that
picks kernels.quant_matmul.LARGE_M.

    python benchmarks/bench_matmul.py            # table on stdout; JSON to $OUT/bench_matmul.json if OUT is set
    python benchmarks/bench_matmul.py --gemm     # only the M > 16 paths side by side (GEMM_MAX_M); JSON to
                                                 # $OUT/bench_gemm.json

Bytes per call are what the kernel must read: packed words, scale codes/scales/zeros, the per-chunk table and the
permutation (x and y are negligible at M=1). Every call is timed inside a CUDA graph that cycles through enough
weight copies (>= 3x the 60 MB L2) that the weights come from DRAM, as in a real decode step.

Roofline at M=1 (bytes per call / 4.2 TB/s, the H200's measured copy bandwidth):

    K x N          EXL2 2.5 bpw        EXL2 4.0 bpw        EXL2 6.0 bpw        GPTQ 4-bit g128     fp16 (cuBLAS)
    4096 x 4096     5.2 MB  1.25 us     8.5 MB  2.02 us    12.7 MB  3.02 us     8.8 MB  2.10 us    33.6 MB   8.0 us
    4096 x 14336   18.3 MB  4.35 us    29.6 MB  7.05 us    44.3 MB 10.54 us    30.8 MB  7.32 us   117.4 MB  28.0 us
    14336 x 4096   18.2 MB  4.34 us    29.7 MB  7.06 us    44.3 MB 10.56 us    30.8 MB  7.33 us   117.4 MB  28.0 us
    8192 x 28672   72.6 MB 17.29 us   118.4 MB 28.19 us   177.1 MB 42.17 us   123.0 MB 29.28 us   469.8 MB 111.9 us

(EXL2 2.5 bpw is the converter's "0.05:6b_32g/0.2:3b_64g/0.75:2b_64g", 4.0 "4b_128g", 6.0 "6b_128g"; GPTQ with
act-order.) Target: >= 75 % of copy bandwidth on the large shapes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from exl_backends.formats.exl2 import Exl2Weight, padded
from exl_backends.formats.gptq import GptqWeight
from exl_backends.formats.synthetic import exl2_group_rows, gptq_g_idx, parse_mix
from exl_backends.kernels import quant_matmul as qm

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]
EXL2_MIXES = {"exl2 2.5bpw": "0.05:6b_32g/0.2:3b_64g/0.75:2b_64g", "exl2 4.0bpw": "4b_128g",
              "exl2 6.0bpw": "6b_128g"}
SWEEP_SHAPE, SWEEP_MIX, SWEEP_M = (4096, 14336), "4b_128g", [1, 4, 16, 32, 64, 512, 2048]
GEMM_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 6144)]
GEMM_ROWS = [16, 24, 32, 64, 128, 208, 256, 512]
L2_BYTES = 60 << 20


def random_words(*shape, gen) -> torch.Tensor:
    """Random 32-bit words: valid packed codes of any width, and the kernels' speed does not depend on values."""
    return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device="cuda", generator=gen)


def exl2_weight(k: int, n: int, mix: str, gen: torch.Generator) -> Exl2Weight:
    groups = exl2_group_rows(k, parse_mix(mix))
    q_groups, qrow = [], 0
    for bits, rows in groups:
        q_groups += [bits, qrow]
        qrow += rows * bits // 32
    np_ = padded(n)
    return Exl2Weight(q_weight=random_words(qrow, np_, gen=gen), q_scale=random_words(len(groups), np_ // 8, gen=gen),
                      q_scale_max=(0.005 + 0.01 * torch.rand(len(groups), device="cuda", generator=gen)).half(),
                      q_groups=torch.tensor(q_groups, dtype=torch.int16, device="cuda"),
                      q_invperm=torch.randperm(k, device="cuda", generator=gen).to(torch.int32),
                      in_features=k, out_features=n)


def gptq_weight(k: int, n: int, bits: int, group_size: int, gen: torch.Generator) -> GptqWeight:
    g_idx = gptq_g_idx(k, group_size, True, torch.Generator().manual_seed(0)).cuda()
    groups = int(g_idx.max()) + 1
    return GptqWeight(qweight=random_words(k * bits // 32, n, gen=gen), qzeros=random_words(groups, n * bits // 32,
                      gen=gen), scales=(0.002 + 0.02 * torch.rand(groups, n, device="cuda", generator=gen)).half(),
                      g_idx=g_idx, bits=bits, v2=False, in_features=k, out_features=n)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy (median of 10)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(11):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times[1:])


def time_calls(calls: list, reps: int = 20) -> float:
    """Seconds per call: the calls captured once in a CUDA graph, replayed; median over replays."""
    for f in calls:
        f()                                               # compile, load, warm the caching allocator
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times) / len(calls)


def copies_for(nbytes: int) -> int:
    return max(2, math.ceil(3 * L2_BYTES / nbytes))


def bench_format(k: int, n: int, make, m: int = 1) -> tuple[float, int]:
    """(seconds per call, packed bytes) of the quantized matmul at M = m, rotating over weight copies."""
    gen = torch.Generator(device="cuda").manual_seed(k + n)
    first = qm.prepare(make(gen), None)
    fs = [first] + [qm.prepare(make(gen), None) for _ in range(copies_for(first.nbytes()) - 1)]
    x = torch.randn(m, k, device="cuda").half()
    return time_calls([lambda f=f: f(x) for f in fs]), first.nbytes()


def bench_fp16(k: int, n: int, m: int = 1) -> tuple[float, int]:
    ws = [torch.randn(n, k, device="cuda").half() for _ in range(copies_for(2 * k * n))]
    x = torch.randn(m, k, device="cuda").half()
    return time_calls([lambda w=w: F.linear(x, w) for w in ws]), 2 * k * n


def gemm_table() -> None:
    """The three paths for M > 16 rows at 4.0 bpw EXL2 and GPTQ 4-bit g128 (act-order), weights from DRAM (copies
    rotated, graph replay, as above): tiled GEMM (_gemm, incl. permute_x and the split-K reduce), dequant + cuBLAS
    (_dequant_matmul), and 16-row passes of the small-M kernel (_small, up to 256 rows). Picks GEMM_MAX_M and
    LARGE_M."""
    props = torch.cuda.get_device_properties(0)
    makers = {"exl2 4.0bpw": lambda k, n: lambda gen: exl2_weight(k, n, "4b_128g", gen),
              "gptq 4bit g128": lambda k, n: lambda gen: gptq_weight(k, n, 4, 128, gen)}
    rows = []
    print(f"{props.name}: {props.multi_processor_count} SMs; LARGE_M = {qm.LARGE_M}, GEMM_MAX_M = {qm.GEMM_MAX_M}")
    for fmt, maker in makers.items():
        for k, n in GEMM_SHAPES:
            make = maker(k, n)
            gen = torch.Generator(device="cuda").manual_seed(k + n)
            first = qm.prepare(make(gen), None)
            fs = [first] + [qm.prepare(make(gen), None) for _ in range(copies_for(first.nbytes()) - 1)]
            for m in GEMM_ROWS:
                x = torch.randn(m, k, device="cuda").half()
                us = {"gemm": time_calls([lambda f=f: f._gemm(x) for f in fs]) * 1e6,
                      "dequant+mm": time_calls([lambda f=f: f._dequant_matmul(x) for f in fs]) * 1e6,
                      "16-row passes": time_calls([lambda f=f: f._small(x) for f in fs]) * 1e6 if m <= 256 else None}
                tflops = 2 * m * k * n / us["gemm"] / 1e6
                rows.append(dict(format=fmt, k=k, n=n, m=m, tflops_gemm=tflops, **us))
                print(f"{fmt:15} {k:>6} x {n:<6} M={m:<4} " + "  ".join(
                    f"{name} {'-' if v is None else f'{v:8.2f}'}" for name, v in us.items()) +
                    f"  (GEMM {tflops:5.0f} TFLOP/s)", flush=True)
            del fs, first
            torch.cuda.empty_cache()
    print("\n| format | K x N | M | GEMM us | dequant + cuBLAS us | 16-row passes us | GEMM TFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        small = "-" if r["16-row passes"] is None else f"{r['16-row passes']:.1f}"
        print(f"| {r['format']} | {r['k']} x {r['n']} | {r['m']} | {r['gemm']:.1f} | {r['dequant+mm']:.1f} | {small} "
              f"| {r['tflops_gemm']:.0f} |")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "bench_gemm.json"
        out.write_text(json.dumps(dict(device=props.name, rows=rows), indent=1))
        print(f"\nwrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemm", action="store_true", help="only the M > 16 paths (gemm_table)")
    if ap.parse_args().gemm:
        gemm_table()
        return
    props = torch.cuda.get_device_properties(0)
    copy_bw = copy_bandwidth()
    print(f"{props.name}: {props.multi_processor_count} SMs, copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)")
    rows = []

    def report(shape, fmt, seconds, nbytes, m=1):
        gbs = nbytes / seconds / 1e9
        rows.append(dict(k=shape[0], n=shape[1], format=fmt, m=m, us=seconds * 1e6, bytes=nbytes, gb_s=gbs,
                         pct_copy=100 * nbytes / seconds / copy_bw))
        print(f"{shape[0]:>6} x {shape[1]:<6} {fmt:<16} M={m:<5} {seconds * 1e6:9.2f} us {gbs:8.0f} GB/s "
              f"{100 * nbytes / seconds / copy_bw:6.1f} % of copy")

    print("\n== M = 1")
    for k, n in SHAPES:
        for name, mix in EXL2_MIXES.items():
            report((k, n), name, *bench_format(k, n, lambda gen, mix=mix: exl2_weight(k, n, mix, gen)))
        report((k, n), "gptq 4bit g128", *bench_format(k, n, lambda gen: gptq_weight(k, n, 4, 128, gen)))
        report((k, n), "fp16 cublas", *bench_fp16(k, n))
        torch.cuda.empty_cache()

    print(f"\n== M sweep, {SWEEP_SHAPE[0]} x {SWEEP_SHAPE[1]} {SWEEP_MIX} (LARGE_M = {qm.LARGE_M})")
    k, n = SWEEP_SHAPE
    gen = torch.Generator(device="cuda").manual_seed(1)
    fs = [qm.prepare(exl2_weight(k, n, SWEEP_MIX, gen), None) for _ in range(copies_for(k * n // 2))]
    nbytes = fs[0].nbytes()
    for m in SWEEP_M:
        x = torch.randn(m, k, device="cuda").half()
        if m <= 256:      # the small-M kernel re-reads the weight every 16 rows; past that it is clearly slower
            report((k, n), "exl2 small-M", time_calls([lambda f=f: f._small(x) for f in fs]), nbytes, m)
        report((k, n), "exl2 dequant+mm", time_calls([lambda f=f: f._dequant_matmul(x) for f in fs]), nbytes, m)
        report((k, n), "fp16 cublas", *bench_fp16(k, n, m), m)

    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "bench_matmul.json"
        out.write_text(json.dumps(dict(device=props.name, copy_gb_s=copy_bw / 1e9, rows=rows), indent=1))
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

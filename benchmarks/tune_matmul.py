"""Times compile-time variants of the quantized-matmul kernels (matmul_rows.cu, gemm.cu, wgmma.cu, ...) in one process (one device call), each after a quick correctness
check against the reference (fused parts, 1..130 rows): for choosing constants such as QMM_PREFETCH_BYTES (a
variant may also edit a constexpr into a macro first). Also a plain eager driver for ncu (--eager).

    python benchmarks/tune_matmul.py --defines QMM_PREFETCH_BYTES=2048,QMM_PREFETCH_BYTES=4096 --m 1,16
    python benchmarks/tune_matmul.py --defines QMM_GEMM_STAGES=3,QMM_GEMM_STAGES=4 --m 64,208   # the tiled GEMM
    python benchmarks/tune_matmul.py --set GEMM_RESIDENT=1,GEMM_RESIDENT=2 --m 64   # K splits
    python benchmarks/tune_matmul.py --gemm --formats "exl2 4.0bpw,gptq 4bit" --shapes 4096x14336,4096x4096 \
        --m 32,64,96,128,208   # the tiled GEMM beside dequant + cuBLAS (GEMM_MAX_M)
    ncu --kernel-name regex:exl2_matmul_m1 --launch-skip 4 --launch-count 1 python benchmarks/tune_matmul.py \
        --eager 4096x14336
    ncu --kernel-name exl2_gemm --launch-skip 4 --launch-count 1 --section WarpStateStats --section SourceCounters \
        python benchmarks/tune_matmul.py --eager 4096x14336 --m 208 --gemm     # the tiled GEMM's stalls
"""
from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_matmul import (SHAPES, bench_format, copies_for, copy_bandwidth, exl2_weight, gptq_weight,  # noqa: E402
                          time_calls)

from exl_backends.formats import synthetic  # noqa: E402
from exl_backends.kernels import loader, planning  # noqa: E402
from exl_backends.kernels import quant_matmul as qm  # noqa: E402


M1_BLOCKS = planning.RESIDENT_BLOCKS[1]         # the launcher's own value (the kernel's launch bounds)
GEMM_BLOCKS, GEMM_STAGES, GEMM_WARP_ROWS = qm.GEMM_RESIDENT, qm.GEMM_STAGES, qm.GEMM_WARP_ROWS
WGMMA_STAGES, WGMMA_DEPTH = qm.WGMMA_STAGES, qm.WGMMA_DEPTH


def owner(name: str):
    """The module a --set constant lives in: the planner's (planning.py) or the launcher's."""
    return planning if hasattr(planning, name) else qm


def use_define(define: str, families=qm.FAMILIES) -> None:
    """Makes the loader compile `families` (the quantized-matmul ones by default) with -D<define> ('+' between
    several; memoised per define). QMM_M1_BLOCKS=n also tells the launcher how many M1 blocks fit on an SM (its grid
    is one wave of them); QMM_GEMM_BLOCKS=n, QMM_GEMM_STAGES=n and QMM_GEMM_WARP_TILES=n set the GEMM plan's qm.GEMM_RESIDENT,
    qm.GEMM_STAGES (shared memory) and qm.GEMM_WARP_ROWS to match, QMM_WG_STAGES=n and QMM_WG_DEPTH=n the wgmma
    plan's qm.WGMMA_STAGES and qm.WGMMA_DEPTH (they take effect for weights prepared after this call)."""
    original = loader.module.__wrapped__
    value = {k: int(v) for k, _, v in (d.partition("=") for d in define.split("+")) if v.isdigit()}
    planning.RESIDENT_BLOCKS[1] = value.get("QMM_M1_BLOCKS", M1_BLOCKS)
    qm.GEMM_RESIDENT = value.get("QMM_GEMM_BLOCKS", GEMM_BLOCKS)
    qm.GEMM_STAGES = value.get("QMM_GEMM_STAGES", GEMM_STAGES)
    qm.GEMM_WARP_ROWS = 16 * value.get("QMM_GEMM_WARP_TILES", GEMM_WARP_ROWS // 16)
    qm.WGMMA_STAGES = value.get("QMM_WG_STAGES", WGMMA_STAGES)
    qm.WGMMA_DEPTH = value.get("QMM_WG_DEPTH", WGMMA_DEPTH)

    @functools.cache
    def module(family, cc):
        if family not in families or not define:
            return original(family, cc)
        return loader.compile_module(family, cc, tuple(define.split("+")))
    module.__wrapped__ = original
    loader.module = module
    loader._function.cache_clear()         # kernels are looked up once per process otherwise


def check() -> float:
    """Worst relative error over a few odd shapes and row counts (fused parts included; the last two call the
    GEMM whatever the row count)."""
    worst = 0.0
    cases = [(4128, (96, 416, 40), "0.05:8b_32g/0.95:4b_128g", 1), (416, (517,), "0.1:3b_64g/0.9:2b_64g", 3),
             (4128, (160, 96), "0.15:8b_128g/0.85:6b_128g", 16), (416, (96,), "5b_64g", 130),
             (4128, (517, 96), "0.05:8b_32g/0.95:4b_128g", 47), (4128, (517,), "0.1:3b_64g/0.9:2b_64g", 208)]
    for i, (k, ns, mix, m) in enumerate(cases):
        ws = [synthetic.random_exl2(k, n, mix, seed=n + m) for n in ns]
        x = torch.randn(m, k).half()
        f = qm.fuse([qm.prepare(w.to(torch.device("cuda")), None) for w in ws])
        for _ in range(2):
            for w, y in zip(ws, (f._gemm if i >= 4 else f.forward)(x.cuda())):
                ref = x.float() @ w.dequantize().float().T
                err = ((y.float().cpu() - ref).norm() / ref.norm()).item()
                worst = max(worst, err if math.isfinite(err) else math.inf)   # max() would drop a NaN
    return worst


def time_gemm(makers: dict, formats: list[str], shapes: list, ms: list[int], variant: str, baseline: dict) -> list:
    """Rows (variant, format, shape, M, GEMM us, TFLOP/s, wgmma us, dequant + cuBLAS us) of the GEMM path (_gemm;
    permute_x and the split-K reduce included) at every M, and of the GEMM by wgmma where the GPU has it (compute
    capability 9.0, up to WGMMA_ROWS rows; else nan), weights rotated from DRAM as bench_matmul does. Dequant +
    cuBLAS and wgmma do not depend on the variant: timed once per case (baseline)."""
    rows = []
    for fmt in formats:
        for k, n in shapes:
            gen = torch.Generator(device="cuda").manual_seed(k + n)
            make = makers[fmt](k, n)
            first = qm.prepare(make(gen), None)
            fs = [first] + [qm.prepare(make(gen), None) for _ in range(copies_for(first.nbytes()) - 1)]
            for m in ms:
                x = torch.randn(m, k, device="cuda").half()
                us = time_calls([lambda f=f: f._gemm(x) for f in fs]) * 1e6
                key = (fmt, k, n, m)
                if key not in baseline:
                    wg = (time_calls([lambda f=f: f._wgmma(x) for f in fs]) * 1e6
                          if first.wgmma_plan is not None and m <= qm.WGMMA_ROWS else float("nan"))
                    baseline[key] = (wg, time_calls([lambda f=f: f._dequant_matmul(x) for f in fs]) * 1e6)
                rows.append((variant, fmt, f"{k}x{n} M={m}", us, 2 * m * k * n / us / 1e6, *baseline[key]))
                print(*rows[-1], flush=True)
            del fs, first
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--defines", default="")
    ap.add_argument("--formats", default="exl2 4.0bpw")
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--m", default="1", help="rows of x to time, e.g. 1,16")
    ap.add_argument("--plan-blocks", default="", help="M1 blocks per SM the planner assumes, e.g. 1,2 (timed each)")
    ap.add_argument("--set", default="", help="planner constants of quant_matmul.py to time, e.g. "
                    "MAX_SPLIT_ROWS=64,MAX_SPLIT_ROWS=256 ('+' between several in one variant)")
    ap.add_argument("--eager", default="", help="KxN: only call the 4.0 bpw kernel eagerly a few times on the first "
                    "--m rows, the GEMM path with --gemm (for ncu)")
    ap.add_argument("--gemm", action="store_true", help="time the GEMM path (_gemm) at every --m, with dequant + "
                    "cuBLAS beside it (e.g. --set GEMM_ROW_GROUPS=1,GEMM_ROW_GROUPS=2)")
    args = ap.parse_args()
    if args.eager:
        use_define(args.defines)
        k, n = map(int, args.eager.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        fs = [qm.prepare(exl2_weight(k, n, "4b_128g", gen), None) for _ in range(4)]
        m = int(args.m.split(",")[0])
        x = torch.randn(m, k, device="cuda").half()
        for _ in range(3):
            for f in fs:
                f._gemm(x) if args.gemm else f(x)
        torch.cuda.synchronize()
        return
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    bw = copy_bandwidth()
    makers = {"exl2 2.5bpw": lambda k, n: lambda g: exl2_weight(k, n, "0.05:6b_32g/0.2:3b_64g/0.75:2b_64g", g),
              "exl2 4.0bpw": lambda k, n: lambda g: exl2_weight(k, n, "4b_128g", g),
              "exl2 6.0bpw": lambda k, n: lambda g: exl2_weight(k, n, "6b_128g", g),
              "gptq 4bit": lambda k, n: lambda g: gptq_weight(k, n, 4, 128, g)}
    rows, gemm_rows, baseline = [], [], {}
    defaults = {name: getattr(owner(name), name) for a in args.set.split(",") if a for name in
                [kv.split("=")[0] for kv in a.split("+")]}
    variants = [(d, b, a) for d in args.defines.split(",") for b in args.plan_blocks.split(",")
                for a in args.set.split(",")]
    for define, blocks, assignments in variants:
        use_define(define)
        if blocks:
            planning.RESIDENT_BLOCKS[1] = int(blocks)
            define = f"{define} plan {blocks}/SM"
        for name, value in defaults.items():
            setattr(owner(name), name, value)
        for kv in filter(None, assignments.split("+")):
            setattr(owner(kv.split("=")[0]), kv.split("=")[0], int(kv.split("=")[1]))
        planning._small_blocks.cache_clear()          # (memoised under the constants just set)
        define = f"{define} {assignments}".strip()
        err = check()
        if args.gemm:
            gemm_rows += [(*r, err) for r in time_gemm(makers, args.formats.split(","), shapes,
                                                        list(map(int, args.m.split(","))), define, baseline)]
            continue
        for fmt in args.formats.split(","):
            for k, n in shapes:
                for m in map(int, args.m.split(",")):
                    s, nbytes = bench_format(k, n, makers[fmt](k, n), m)
                    rows.append((define, fmt, f"{k}x{n} M={m}", s * 1e6, 100 * nbytes / s / bw, err))
                    print(*rows[-1], flush=True)
            torch.cuda.empty_cache()
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s")
    for r in rows:
        print(f"{r[0]:44} {r[1]:12} {r[2]:17} {r[3]:8.2f} us {r[4]:6.1f} %  err {r[5]:.1e}")
    if gemm_rows:
        print("\n| variant | format | shape | GEMM us | TFLOP/s | wgmma us | dequant + cuBLAS us | err |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in gemm_rows:
            print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.0f} | {r[5]:.1f} | {r[6]:.1f} | {r[7]:.1e} |")


if __name__ == "__main__":
    main()

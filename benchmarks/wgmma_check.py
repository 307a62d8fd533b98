"""The wgmma GEMM (wgmma.cu <fmt>_wgmma) against the reference under compile-time variants, with the pattern
of any wrong outputs (strips, 16-column tiles t and halves h, rows), and its time beside the mma.sync GEMM's.
On an H100/H200:

    PYTHONPATH=$PWD python3 benchmarks/wgmma_check.py ",QMM_WG_DEPTH=3+QMM_WG_STAGES=6"

("": the defaults; QMM_WG_DEPTH=3: three chunks of MMAs in
flight, QMM_WG_STAGES: x ring slots; QMM_WG_PIPELINE=0: a chunk's words load just before their decode.)"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, "benchmarks")
import tune_matmul as tm  # noqa: E402

from exl_backends.formats import synthetic  # noqa: E402
from exl_backends.kernels import quant_matmul as qm  # noqa: E402

TIMED = [(4096, 14336, 100), (14336, 4096, 100), (4096, 4096, 128)]                    # K, N, rows
CHECKED = [(416, (4128,), "4b_128g", 100, 1), (4128, (517,), "4b_128g", 47, 2), (1056, (96, 40), "6b_32g", 100, 3)]


def case(k: int, ns: tuple, mix: str, m: int, seed: int) -> list[str]:
    """Twice, per fused part: the share of wrong outputs, NaNs, and which strips, tiles (t, h) and rows hold them."""
    ws = [synthetic.random_exl2(k, n, mix, seed=seed + n) for n in ns]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).half()
    f = qm.fuse([qm.prepare(w.to(torch.device("cuda")), None) for w in ws])
    out = []
    for rep in range(2):
        ys = f._wgmma(x.cuda())
        torch.cuda.synchronize()
        for w, y in zip(ws, ys):
            y = y.float().cpu()
            ref = x.float() @ w.dequantize().float().T
            bad = ~torch.isfinite(y) | ((y - ref).abs() > 0.02 * ref.abs().max())
            badcols = bad.any(0).nonzero().view(-1)
            per_strip = sorted({int(c) // 32 for c in badcols})
            sub = sorted({(int(c) % 32) // 16 * 2 + (int(c) % 16) // 8 for c in badcols})   # tile t, half h
            rows = bad.any(1).nonzero().view(-1)
            out.append(f"rep{rep} n={w.out_features} badfrac={bad.float().mean():.3f} "
                       f"nan={int((~torch.isfinite(y)).sum())} strips={per_strip[:12]}"
                       f"{'...' if len(per_strip) > 12 else ''} (of {-(-w.out_features // 32)}) sub(t,h)={sub} "
                       f"rows={rows[:5].tolist()}..{rows[-3:].tolist()} nrows={len(rows)}")
    return out


def timing(k: int, n: int, m: int) -> list[float]:
    """us of _wgmma and _gemm at m rows of k x n (4.0 bpw), weights rotated from DRAM as bench_matmul does."""
    gen = torch.Generator(device="cuda").manual_seed(k + n)
    fs = [qm.prepare(tm.exl2_weight(k, n, "4b_128g", gen), None) for _ in range(4)]
    x = torch.randn(m, k, device="cuda").half()
    return [tm.time_calls([lambda f=f: getattr(f, path)(x) for f in fs]) * 1e6 for path in ("_wgmma", "_gemm")]


def main() -> None:
    for define in sys.argv[1].split(","):
        tm.use_define(define)
        print("==", define or "default", flush=True)
        for k, n, m in TIMED:
            wg, mma = timing(k, n, m)
            print(f"   {k}x{n} M={m}: wgmma {wg:.1f} us, mma.sync GEMM {mma:.1f} us", flush=True)
        for args in CHECKED:
            try:
                for line in case(*args):
                    print("  ", args[:4], line, flush=True)
            except Exception as e:          # a variant that fails to build or launch: say so, go on
                print("  ", args[:4], "ERROR", repr(e)[:300], flush=True)


if __name__ == "__main__":
    main()

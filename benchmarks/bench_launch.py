"""Host cost of one kernel launch through our loader (CuPy) vs a torch op, and whether CuPy launches on torch's
stream are captured by torch.cuda.CUDAGraph (they must be: the decode step is replayed as a graph).

    python benchmarks/bench_launch.py
"""
from __future__ import annotations

import time

import torch

from exl_backends.kernels import loader

SOURCE = r"""
extern "C" __global__ void add_one(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
"""


def main() -> None:
    path = loader.KERNEL_DIR / "_probe.cu"
    path.write_text(SOURCE)
    try:
        x = torch.zeros(1000, device="cuda")
        t0 = time.perf_counter()
        loader.launch("_probe", "add_one", (4,), (256,), (x, 1000))
        torch.cuda.synchronize()
        print(f"first launch (compile + load): {(time.perf_counter() - t0) * 1e3:.1f} ms")
        n = 2000
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            loader.launch("_probe", "add_one", (4,), (256,), (x, 1000))
        torch.cuda.synchronize()
        cupy_us = (time.perf_counter() - t0) / n * 1e6
        t0 = time.perf_counter()
        for _ in range(n):
            x.add_(1.0)
        torch.cuda.synchronize()
        torch_us = (time.perf_counter() - t0) / n * 1e6
        y = torch.zeros(1000, device="cuda")
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            loader.launch("_probe", "add_one", (4,), (256,), (y, 1000))
        torch.cuda.current_stream().wait_stream(s)
        y.zero_()
        with torch.cuda.graph(g):
            for _ in range(10):
                loader.launch("_probe", "add_one", (4,), (256,), (y, 1000))
        torch.cuda.synchronize()
        captured_untouched = float(y.sum()) == 0.0
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        ok = captured_untouched and float(y.min()) == 30.0 and float(y.max()) == 30.0
        print(f"launch host cost: cupy {cupy_us:.1f} us, torch add_ {torch_us:.1f} us")
        print(f"CuPy launches captured in a torch CUDA graph and replayed correctly: {ok}")
    finally:
        path.unlink()


if __name__ == "__main__":
    main()

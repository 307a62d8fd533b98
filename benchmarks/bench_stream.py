"""How fast warps can read weight-sized spans from DRAM, by access order: the question under the M1 matmul's
~2.6 TB/s (docs/decode-matmul.md). Each kernel reads BYTES (a slice of a buffer several times the L2, so every call
reads from DRAM) with 264 blocks x 8 warps (the M1 grid), each lane 16 bytes per load, U loads in flight:
  warp   each warp a contiguous span of its own (the lane layout's [strip][chunk] order: 8 warps of a block 64 KB+
         apart)
  block  each block a contiguous span; its 8 warps read adjacent 512-byte pieces of it ([block][chunk][warp])
  grid   grid-stride, like a copy kernel

    python benchmarks/bench_stream.py [--mb 29.4,117]
"""
from __future__ import annotations

import argparse

import cupy as cp

SOURCE = r"""
template <int U, int ORDER>
__global__ void __launch_bounds__(256, 2) stream(const uint4* __restrict__ src, size_t n16, unsigned* out)
{
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const size_t warps = (size_t)gridDim.x * 8, gw = (size_t)blockIdx.x * 8 + warp;
    const size_t steps = n16 / (warps * 32);              // 512-byte pieces per warp
    unsigned acc = 0;
    for (size_t s = 0; s < steps; s += U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const size_t step = s + u < steps ? s + u : steps - 1;
            size_t piece;
            if (ORDER == 0) piece = gw * steps + step;                                      // warp spans
            else if (ORDER == 1) piece = ((size_t)blockIdx.x * steps + step) * 8 + warp;     // block spans
            else piece = step * warps + gw;                                                 // grid stride
            v[u] = __ldcs(src + piece * 32 + lane);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x12345678u) out[0] = acc;
}
"""
ORDERS = {"warp": 0, "block": 1, "grid": 2}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", default="29.4,117")
    ap.add_argument("--unroll", default="1,3,6")
    args = ap.parse_args()
    names = [f"stream<{u},{o}>" for u in map(int, args.unroll.split(",")) for o in ORDERS.values()]
    mod = cp.RawModule(code=SOURCE, options=("-std=c++17",), name_expressions=names)
    pool = cp.zeros(1 << 30, dtype=cp.uint8)                 # 1 GB: slices rotate, so no call reads from L2
    out = cp.zeros(1, dtype=cp.uint32)
    grid = 2 * cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    print(f"{'MB':>6} {'order':6} {'U':>2} {'us':>8} {'TB/s':>6}")
    for mb in map(float, args.mb.split(",")):
        nbytes = int(mb * 1e6) // (grid * 8 * 512) * grid * 8 * 512
        slices = (1 << 30) // nbytes
        for name in names:
            fn = mod.get_function(name)
            calls = 40
            for i in range(calls + 5):
                if i == 5:
                    start.record()
                src = pool[(i % slices) * nbytes:(i % slices + 1) * nbytes]
                fn((grid,), (256,), (src, cp.uint64(nbytes // 16), out))
            stop.record()
            stop.synchronize()
            us = cp.cuda.get_elapsed_time(start, stop) * 1e3 / calls
            u, o = name[7:-1].split(",")
            order = [k for k, v in ORDERS.items() if v == int(o)][0]
            print(f"{nbytes / 1e6:6.1f} {order:6} {u:>2} {us:8.2f} {nbytes / us / 1e6:6.2f}", flush=True)


if __name__ == "__main__":
    main()

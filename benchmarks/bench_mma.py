"""The tensor pipe's ceiling for the tiled GEMM's instruction (mma.sync m16n8k16, fp16 in, fp32 accumulate) on
this GPU: the question under the GEMM's 140-190 TFLOP/s (docs/gemm.md). One kernel, every block resident
at once (one wave), each warp issuing MMAs on registers in a loop, T independent accumulators (the GEMM warp has
16); variants:
  warps   warps per SM (4, 8, 16: blocks of 128 or 256 threads, 1 or 2 per SM)
  alu     ALU instructions per MMA that make its B operand (a LOP3 and an HFMA2 per step, as the weight decode
          does: ~2 per MMA in the GEMM at 64 rows a warp)
  ldsm    each k step's A fragment by one ldmatrix.x4 from shared memory (as the GEMM), or kept in registers

    python benchmarks/bench_mma.py
"""
from __future__ import annotations

import argparse

import cupy as cp

SOURCE = r"""
#include <cuda_fp16.h>

__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned lop3(unsigned a, unsigned b, unsigned c)
{
    unsigned d;
    asm volatile("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));   // (a & b) | c
    return d;
}

template <int T, int ALU, bool LDSM>
__global__ void mma_loop(float* out, int iters)
{
    __shared__ __align__(16) half tile[32 * 40];
    const int lane = threadIdx.x % 32;
    for (int i = threadIdx.x; i < 32 * 40; i += blockDim.x) tile[i] = __float2half(0.001f * (i % 37));
    __syncthreads();
    unsigned a[4] = {0x3c003c00u ^ lane, 0x3c003c01u ^ lane, 0x3c003c02u ^ lane, 0x3c003c03u ^ lane};
    float acc[T][4] = {};
    const half2 scale = __float2half2_rn(0.5f), bias = __float2half2_rn(-0.25f);
    for (int it = 0; it < iters; ++it) {
        if (LDSM) {
            const half* row = tile + (lane % 16) * 40 + 8 * (lane / 16) + 16 * (it & 1);
            const unsigned p = (unsigned)__cvta_generic_to_shared(row);
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                         : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(p));
        }
#pragma unroll
        for (int t = 0; t < T; ++t) {
            unsigned b0 = 0x3c003c00u + it + t, b1 = 0x3c003c00u ^ (it + t);
#pragma unroll
            for (int k = 0; k < ALU / 2; ++k) {
                b0 = lop3(b0 >> (k % 4), 0x000f000fu, 0x64006400u);
                half2 h = __hfma2(*reinterpret_cast<half2*>(&b0), scale, bias);
                b0 = *reinterpret_cast<unsigned*>(&h);
            }
            mma(acc[t], a, b0, b1);
        }
    }
    float s = 0.f;
#pragma unroll
    for (int t = 0; t < T; ++t) s += acc[t][0] + acc[t][1] + acc[t][2] + acc[t][3];
    if (s == 1234.5f) out[0] = s;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=4096)
    args = ap.parse_args()
    variants = [(t, alu, ldsm) for t in (8, 16) for alu in (0, 2, 4) for ldsm in ("false", "true")]
    names = [f"mma_loop<{t},{alu},{ldsm}>" for t, alu, ldsm in variants]
    mod = cp.RawModule(code=SOURCE, options=("-std=c++17",), name_expressions=names)
    sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    out = cp.zeros(1, dtype=cp.float32)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    print(f"{'T':>3} {'alu':>3} {'ldsm':>5} {'warps/SM':>8} {'us':>8} {'TFLOP/s':>8}")
    for (t, alu, ldsm), name in zip(variants, names):
        fn = mod.get_function(name)
        for warps, per_sm in ((4, 1), (8, 1), (16, 2)):
            threads = 32 * warps // per_sm
            grid = sms * per_sm
            calls = 5
            for i in range(calls + 2):
                if i == 2:
                    start.record()
                fn((grid,), (threads,), (out, cp.int32(args.iters)))
            stop.record()
            stop.synchronize()
            us = cp.cuda.get_elapsed_time(start, stop) * 1e3 / calls
            flops = grid * (threads // 32) * args.iters * t * 4096
            print(f"{t:3} {alu:3} {ldsm:>5} {warps:8} {us:8.1f} {flops / us / 1e6:8.1f}", flush=True)


if __name__ == "__main__":
    main()

"""What one dependent step of a decode step costs by itself: a chain of kernel launches (each waiting for the one
before it, as every kernel of a decode step does) against one persistent kernel whose blocks meet at a grid-wide
barrier instead (what a single-kernel decode step would pay per dependency): one counter all blocks add to, or a
flag per block that every block reads. Each link reads what the one before
wrote (an L2 round trip), as a real step's kernels do. Then what a launch's parameter size costs: the same chain
with N bytes of __grid_constant__ parameters (a megakernel segment passes ~13.6 KB, a one-row matmul ~2 KB), each
block reading one word of them or every 64-byte line. Graph-captured, median of replays.

    python benchmarks/bench_chain.py
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_matmul import time_calls  # noqa: E402

from exl_backends.kernels import driver, loader  # noqa: E402

BLOB_BYTES = (256, 2048, 8192, 13824)       # the sizes SOURCE's blob_<N> kernels take
SOURCE = r"""
#include "common.cuh"

// One link: wait for the kernel before, read what it wrote, write what the next one reads.
extern "C" __global__ void link(const float* in, float* out)
{
    exl::pdl_trigger();
    exl::pdl_wait();
    if (threadIdx.x == 0) {
        const int i = blockIdx.x & 31;
        __stcg(out + i, __ldcg(in + i) + 1.f);
    }
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p)
{
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release(unsigned* p, unsigned v)
{
    asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// Sense-reversal barrier of the whole grid (every block resident): state[0] counts arrivals, state[1] is the
// generation the last block to arrive advances.
__device__ __forceinline__ void grid_barrier(unsigned* state)
{
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned gen = load_acquire(state + 1);   // cannot advance before this block arrives
        if (exl::arrive(reinterpret_cast<int*>(state)) == (int)gridDim.x - 1) {
            atomicExch(state, 0u);
            store_release(state + 1, gen + 1);
        } else {
            while (load_acquire(state + 1) == gen) {}
        }
    }
    __syncthreads();
}

// A link whose parameters are N bytes: thread 0 of each block reads `lines` of their 64-byte lines (1: one word).
template <int N>
struct Blob {
    unsigned w[N / 4];
};

template <int N>
__device__ void blob_link(const Blob<N>& p, const float* in, float* out, int lines)
{
    exl::pdl_trigger();
    exl::pdl_wait();
    if (threadIdx.x == 0) {
        unsigned sum = 0;
        for (int i = 0; i < lines; ++i) sum += p.w[(i * 16 + blockIdx.x) % (N / 4)];
        const int j = blockIdx.x & 31;
        __stcg(out + j, __ldcg(in + j) + (sum == 7u ? 1.f : 2.f));
    }
}

#define BLOB_LINK(N) \
    extern "C" __global__ void blob_##N(const __grid_constant__ Blob<N> p, const float* in, float* out, int lines) \
    { blob_link<N>(p, in, out, lines); }
BLOB_LINK(256)
BLOB_LINK(2048)
BLOB_LINK(8192)
BLOB_LINK(13824)

// The same barrier without a shared counter: each block publishes the links it has finished in a flag of its own
// (a release store, no atomic: no two blocks write one line), and warp 0 reads every block's flag, each lane a 32nd
// of them, until all have reached this link. Relaxed loads, all of a lane's issued together, then one acquire fence:
// an acquire load orders every later load after it, so a lane's flags read by acquire loads were one L2 round trip
// each, in a row (a segment's flags measured slower than its counter that way: docs/megakernel.md). Flags only grow
// (a block's first value is where the launch before left them all), so they need no reset between launches.
__device__ __forceinline__ unsigned load_relaxed(const unsigned* p)
{
    unsigned v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void flag_barrier(unsigned* flags, unsigned target)
{
    constexpr int PER_LANE = 16;                     // flags a lane reads: grids of up to 512 blocks
    __syncthreads();
    if (threadIdx.x < 32) {
        if (threadIdx.x == 0) store_release(flags + 32 * blockIdx.x, target);
        for (bool all = false; !all;) {
            unsigned v[PER_LANE];
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) {
                const int b = threadIdx.x + 32 * i;
                v[i] = b < (int)gridDim.x ? load_relaxed(flags + 32 * b) : target;
            }
            bool ok = true;
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) ok &= v[i] >= target;
            all = __all_sync(0xffffffffu, ok);
        }
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
    }
    __syncthreads();
}

extern "C" __global__ void persistent_flags(float* buf, unsigned* flags, int n)
{
    const unsigned base = flags[32 * blockIdx.x];    // every block's flag is here when a launch starts
    __syncthreads();                                 // (read before any block of this launch can raise it)
    for (int i = 0; i < n; ++i) {
        if (threadIdx.x == 0) {
            const int j = blockIdx.x & 31;
            __stcg(buf + 32 * ((i + 1) & 1) + j, __ldcg(buf + 32 * (i & 1) + j) + 1.f);
        }
        flag_barrier(flags, base + i + 1);
    }
}

// n links in one kernel: buffer halves alternate as the kernels' in / out do.
extern "C" __global__ void persistent(float* buf, unsigned* state, int n)
{
    for (int i = 0; i < n; ++i) {
        if (threadIdx.x == 0) {
            const int j = blockIdx.x & 31;
            __stcg(buf + 32 * ((i + 1) & 1) + j, __ldcg(buf + 32 * (i & 1) + j) + 1.f);
        }
        grid_barrier(state);
    }
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--links", type=int, default=256)
    args = ap.parse_args()
    cc = loader.compute_capability()
    cp = loader.cupy()
    mod = cp.RawModule(code=SOURCE, options=("-std=c++17", f"-I{loader.KERNEL_DIR}",
                                             f"--gpu-architecture={loader.arch(cc)}"), backend="nvrtc")
    link, persistent, flagged = (mod.get_function(k).kernel.ptr for k in ("link", "persistent", "persistent_flags"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    buf = torch.zeros(64, device="cuda")
    state = torch.zeros(2, dtype=torch.int32, device="cuda")
    n = args.links

    def chain(blocks: int, programmatic: bool):
        def run():
            stream = torch.cuda.current_stream().cuda_stream
            for i in range(n):
                driver.launch(link, (blocks,), (256,), (buf[32 * (i & 1):], buf[32 * ((i + 1) & 1):]), 0, stream,
                              programmatic)
        return run

    def one_kernel(blocks: int, kernel=persistent, sync=state):
        if kernel is flagged:       # flags of their own per grid: a block's base is its own flag, level across one grid
            sync = torch.zeros(32 * blocks, dtype=torch.int32, device="cuda")    # a 128-byte line per block

        def run():
            driver.launch(kernel, (blocks,), (256,), (buf, sync, n), 0, torch.cuda.current_stream().cuda_stream,
                          False)
        return run

    def blob_chain(nbytes: int, lines: int):
        blob = np.zeros((), dtype=[("w", np.uint32, (nbytes // 4,))])
        fn = mod.get_function(f"blob_{nbytes}").kernel.ptr

        def run():
            stream = torch.cuda.current_stream().cuda_stream
            for i in range(n):
                driver.launch(fn, (2 * sms,), (256,), (blob, buf[32 * (i & 1):], buf[32 * ((i + 1) & 1):], lines),
                              0, stream, cc >= loader.PDL_CC)
        return run

    print(f"{torch.cuda.get_device_name()}, {sms} SMs; {n} dependent steps, us per step")
    rows = []
    for blocks in (8, sms, 2 * sms):
        rows.append((f"kernel chain, dependent launch, {blocks} blocks", chain(blocks, cc >= loader.PDL_CC)))
        rows.append((f"kernel chain, plain launches, {blocks} blocks", chain(blocks, False)))
        rows.append((f"one kernel, grid barrier, {blocks} blocks", one_kernel(blocks)))
        rows.append((f"one kernel, a flag per block, {blocks} blocks", one_kernel(blocks, flagged)))
    for nbytes in BLOB_BYTES:
        rows.append((f"{nbytes:5d} parameter bytes, {2 * sms} blocks, one word", blob_chain(nbytes, 1)))
        rows.append((f"{nbytes:5d} parameter bytes, {2 * sms} blocks, every line", blob_chain(nbytes, nbytes // 64)))
    for name, run in rows:
        print(f"{name:<48} {time_calls([run]) / n * 1e6:8.2f}", flush=True)


if __name__ == "__main__":
    main()

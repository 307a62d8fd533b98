"""Can one persistent kernel keep DRAM streaming through a decode step's dependencies? The premise of the decode
megakernel (issue #35, docs/megakernel.md "The pipelined design's premise"), measured without the matmul's details:
a step of a Llama shape at 4.0 bpw (per layer q/k/v, attention's KV bytes at the given context, o, gate/up, down;
the 6-bit head last) as ops whose bytes are split evenly over one CTA per SM. In each CTA a producer warp copies its
shares, op after op, into a ring of shared-memory slots (cp.async.bulk, completion on an mbarrier per slot), and
8 consumer warps work through each slot (WORK x (LOP3 + HFMA2) per 16 bytes a lane: 32 is about the one-row EXL2
matmul's ~73 instructions per 512 bytes a warp), write their partials, and release it. Op k's work starts only
when every CTA has finished op k - 1 (one counter per op: a release add per CTA, an acquire poll), the all-to-all
dependency of a one-row matmul on the op before. Modes:
  ahead  the producer copies op k's weights while the consumers still wait for op k - 1 (the ring's depth ahead)
  after  the producer waits for op k - 1 too before copying op k (no weights across a dependency)
  free   no dependencies (the ceiling of this streaming with this work)
Each launch is one whole step; the median of the launches' times against the step's bytes over the GPU's copy
bandwidth (bound = bytes / copy bandwidth, as bench_decode's). Not modelled: the split-K sums, stages of x,
attention's own latency, the real inner loop.

    python benchmarks/bench_pipeline.py [--shapes llama-3.2-1b,llama-3-8b] [--work 0,32] [--slot-kb 16 --slots 12]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cupy as cp
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES  # noqa: E402

from exl_backends.commands.bench import result_path, run_info  # noqa: E402
from exl_backends.kernels import loader  # noqa: E402

SOURCE = r"""
#include <cuda_fp16.h>

constexpr int CONSUMERS = 8;                 // consumer warps; warp 0 is the producer
constexpr int MODE_AFTER = 1, MODE_FREE = 2;    // (0: ahead)

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void bar_wait(unsigned bar, unsigned parity)
{
    asm volatile("{\n.reg .pred done;\nWAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}

__device__ __forceinline__ int load_acquire(const int* p)
{
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void wait_counter(const int* counter, int target)
{
    while (load_acquire(counter) < target) __nanosleep(32);
}

// Shares: op k's CTA c reads share[k] bytes at w + offset[k] + c * share[k]; slots of slot_bytes, `slots` of them,
// in dynamic shared memory. counters[k] counts the CTAs done with op k over all launches so far (gen of them before
// this one), so a launch waits for gen * G + G.
template <int WORK>
__global__ void __launch_bounds__(32 * (CONSUMERS + 1), 1)
pipeline(const unsigned char* __restrict__ w, const long long* __restrict__ offset, const int* __restrict__ share,
         int n_ops, int slot_bytes, int slots, int* counters, int gen, int mode, float* out)
{
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ __align__(8) unsigned long long full[32], empty[32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, G = gridDim.x, c = blockIdx.x;
    const int target = (gen + 1) * G;
    if (threadIdx.x < slots) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(full + threadIdx.x)) : "memory");
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(empty + threadIdx.x)), "r"(CONSUMERS)
                     : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();

    if (warp == 0) {                                   // the producer: one lane issues every copy
        if (lane) return;
        int it = 0;
        for (int k = 0; k < n_ops; ++k) {
            if (mode == MODE_AFTER && k > 0) wait_counter(counters + k - 1, target);
            const unsigned char* src = w + offset[k] + (size_t)c * share[k];
            for (int off = 0; off < share[k]; off += slot_bytes, ++it) {
                const int slot = it % slots, n = min(slot_bytes, share[k] - off);
                bar_wait(smem_addr(empty + slot), ((it / slots) & 1) ^ 1);
                const unsigned f = smem_addr(full + slot);
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(f), "r"(n) : "memory");
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                             ::"r"(smem_addr(ring + (size_t)slot * slot_bytes)), "l"(src + off), "r"(n), "r"(f)
                             : "memory");
            }
        }
        return;
    }

    const int cw = warp - 1;                           // consumers
    unsigned acc[4] = {0u, 0u, 0u, 0u};                // half2 bits
    int it = 0;
    for (int k = 0; k < n_ops; ++k) {
        if (mode != MODE_FREE && k > 0) {              // every CTA done with op k - 1
            if (threadIdx.x == 32) wait_counter(counters + k - 1, target);
            asm volatile("bar.sync 1, %0;" ::"n"(32 * CONSUMERS) : "memory");
        }
        for (int off = 0; off < share[k]; off += slot_bytes, ++it) {
            const int slot = it % slots, n16 = min(slot_bytes, share[k] - off) / 16;
            bar_wait(smem_addr(full + slot), (it / slots) & 1);
            const uint4* v = reinterpret_cast<const uint4*>(ring + (size_t)slot * slot_bytes);
            for (int i = cw * 32 + lane; i < n16; i += 32 * CONSUMERS) {
                const uint4 x = v[i];
                const unsigned u[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
                for (int j = 0; j < (WORK ? WORK : 4); ++j)      // WORK 0: one add a word
                    asm("fma.rn.f16x2 %0, %1, %0, %2;" : "+r"(acc[j & 3]) : "r"(u[j & 3] ^ (unsigned)j),
                        "r"(WORK ? 0x3c003c00u : u[j & 3]));
            }
            __syncwarp();
            if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(empty + slot))
                                        : "memory");
        }
        // the op's partials (as a split-K matmul's), then this CTA's arrival
        out[((size_t)k * G + c) * 32 * CONSUMERS + cw * 32 + lane] = (float)(acc[0] ^ acc[1] ^ acc[2] ^ acc[3]);
        asm volatile("bar.sync 1, %0;" ::"n"(32 * CONSUMERS) : "memory");
        if (threadIdx.x == 32) asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counters + k) : "memory");
    }
}
"""

THREADS = 32 * 9
MODES = {"ahead": 0, "after": 1, "free": 2}


def step_ops(shape: str, context: int) -> list[tuple[str, int]]:
    """A decode step's byte streams in order: per layer q/k/v, attention's K and V, o, gate/up, down; the head."""
    s = SHAPES[shape]
    h, i, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    hd = h // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * hd

    def quant(k: int, n: int, bpw: float = 4.0) -> int:
        return int(k * n * bpw / 8)

    layer = [("qkv", quant(h, h + 2 * kv)), ("attention", context * kv * 2 * 2), ("o", quant(h, h)),
             ("gate/up", quant(h, 2 * i)), ("down", quant(i, h))]
    return layer * layers + [("head", quant(h, s["vocab_size"], 6.0))]


def copy_bandwidth() -> float:
    a = cp.empty(2 * 1024**3, dtype=cp.uint8)
    b = cp.empty_like(a)
    times = []
    for _ in range(13):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        b[...] = a
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    del a, b
    return 2 * 2 * 1024**3 / sorted(times[3:])[len(times[3:]) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--work", default="0,32", help="LOP3 + HFMA2 pairs per 16 bytes a lane, each timed")
    ap.add_argument("--modes", default="free,after,ahead")
    ap.add_argument("--slot-kb", type=int, default=16)
    ap.add_argument("--slots", type=int, default=12)
    ap.add_argument("--launches", type=int, default=30)
    ap.add_argument("--json", type=Path, help="write the rows here (a directory: benchmarks/results' file name)")
    args = ap.parse_args()
    if not 1 <= args.slots <= 32 or args.slots * args.slot_kb > 224:
        ap.error("--slots: 1 to 32 (the kernel's mbarriers), slots x slot-kb at most 224 KB (shared memory a CTA)")

    dev = cp.cuda.Device()
    G = dev.attributes["MultiProcessorCount"]
    works = [int(x) for x in args.work.split(",")]
    names = {work: f"pipeline<{work}>" for work in works}
    module = cp.RawModule(code=SOURCE, options=("-std=c++17", f"--gpu-architecture={loader.arch(loader.compute_capability())}"),
                          backend="nvrtc",
                          name_expressions=list(names.values()))
    slot_bytes = args.slot_kb * 1024
    smem = slot_bytes * args.slots
    kernels = {work: module.get_function(name) for work, name in names.items()}
    for kernel in kernels.values():
        kernel.max_dynamic_shared_size_bytes = smem
    bw = copy_bandwidth()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    print(f"{name}: {G} SMs, copy bandwidth {bw / 1e12:.2f} TB/s; ring {args.slots} x {args.slot_kb} KB a CTA")
    rows = []
    for shape in args.shapes.split(","):
        ops = step_ops(shape, args.context)
        shares = [-(-b // G + 15) // 16 * 16 for _, b in ops]      # per CTA, whole 16-byte pieces
        offsets = np.cumsum([0] + [s * G for s in shares[:-1]]).astype(np.int64)
        total = int(sum(s * G for s in shares))
        w = cp.arange(total // 4, dtype=cp.uint32).view(cp.uint8)
        d_off, d_share = cp.asarray(offsets), cp.asarray(np.array(shares, dtype=np.int32))
        out = cp.empty(len(ops) * G * 256, dtype=cp.float32)
        bound_us = total / bw * 1e6
        print(f"\n{shape}, ctx {args.context}: {len(ops)} ops, {total / 1e9:.3f} GB a step, bound {bound_us:.0f} us")
        print(f"{'mode':8} {'work':>5} {'us/step':>9} {'TB/s':>6} {'% of bound':>10}")
        for work, kernel in kernels.items():
            for mode in args.modes.split(","):
                counters = cp.zeros(len(ops), dtype=cp.int32)
                times = []
                for gen in range(args.launches):
                    start, end = cp.cuda.Event(), cp.cuda.Event()
                    start.record()
                    kernel((G,), (THREADS,), (w, d_off, d_share, np.int32(len(ops)), np.int32(slot_bytes),
                                              np.int32(args.slots), counters, np.int32(gen), np.int32(MODES[mode]),
                                              out), shared_mem=smem)
                    end.record()
                    end.synchronize()
                    times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
                us = float(np.median(times[3:]))
                row = dict(shape=shape, context=args.context, mode=mode, work=work, us=round(us, 1),
                           tb_s=round(total / us / 1e6, 3), share=round(bound_us / us, 3), bytes=total,
                           slots=args.slots, slot_kb=args.slot_kb)
                rows.append(row)
                print(f"{mode:8} {work:5} {us:9.1f} {total / us / 1e6:6.2f} {100 * bound_us / us:9.1f}%")
        del w
    if args.json:
        info = run_info(torch.device("cuda"), bw, rows, sms=G)
        Path(result_path(str(args.json), "pipeline", info)).write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()

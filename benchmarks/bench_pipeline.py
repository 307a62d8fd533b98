"""Can one persistent kernel keep DRAM streaming through a decode step's dependencies? The premise of the decode
megakernel (issue #35, docs/megakernel.md "The pipelined design's premise"), measured without the matmul's details:
a step of a Llama shape at 4.0 bpw (per layer q/k/v, attention's KV bytes at the given context, o, gate/up, down;
the 6-bit head last) as ops whose bytes are split evenly over one CTA per SM. In each CTA a producer warp copies its
shares, op after op, into a ring of shared-memory slots (cp.async.bulk, completion on an mbarrier per slot), and
the consumer warps work through each slot, write their partials, and release it. Op k's work starts only when every
CTA has finished op k - 1 (one counter per op: a release add per CTA, an acquire poll), the all-to-all dependency of
a one-row matmul on the op before. Modes:
  ahead  the producer copies op k's weights while the consumers still wait for op k - 1 (the ring's depth ahead)
  after  the producer waits for op k - 1 too before copying op k (no weights across a dependency)
  free   no dependencies (the ceiling of this streaming with this work)
  direct, direct-free  no producer: the consumers read the weights from global memory themselves, L2 prefetches
         two slots ahead (the first two before the wait), as the launch-per-op M1 kernel does; with and without the
         dependencies
Consumers (--consumers; @N: N consumer warps, default 8):
  w<WORK>  WORK x (LOP3 + HFMA2) per 16 bytes a lane (32: about the one-row EXL2 matmul's instruction count)
  exl2     the one-row EXL2 kernel's own chunk loop (qmm::MatmulSink: 4-bit decode, MMAs, group scales) on the slots'
           bytes, x read from global memory as the M1 kernel reads it (the corrections summed by MMA, as it does)
  exl2-xs  the same with x copied into shared memory first
  exl2-fma the same chunks by HFMA2 dot products (no MMA; fp16 sums over a group): a loop of short chains
Layouts (--layouts): 5, every op waits for the one before (today's all-to-all dependencies, 5 a layer); 3, o and
down do not wait (they would run in the CTA that computed their inputs) and end adding a hidden-size partial into
the residual by float atomics (op_flags). Each launch is one whole step; the median of the launches' times against the step's bytes over the GPU's copy
bandwidth (bound = bytes / copy bandwidth, as bench_decode's). Not modelled: the split-K sums, stages of x,
attention's own latency, widths other than 4 bits.

    python benchmarks/bench_pipeline.py [--shapes llama-3.2-1b,llama-3-8b] [--consumers w0,w32,exl2,exl2-xs]
        [--layouts 5,3] [--modes free,after,ahead] [--slot-kb 16 --slots 12] [--json DIR]
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
#include "qmm_rows.cuh"

constexpr int MODE_AFTER = 1, MODE_FREE = 2, MODE_DIRECT = 3, MODE_DIRECT_FREE = 4;    // (0: ahead)
constexpr int WAITS = 1, ADDS = 2;
constexpr int DIRECT_AHEAD = 2;                  // slots a direct mode prefetches ahead (the M1 kernel: 4 KB a warp)               // op flags: waits for the op before; ends adding into the residual

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

// The lane's 16 bytes of 4-bit chunk j of a slot: from shared memory (the ring), or from global memory (the direct
// modes: the slot is the weights' own bytes).
__device__ __forceinline__ uint4 chunk_words(const unsigned char* data, int j, int lane)
{
    return reinterpret_cast<const uint4*>(data + 512 * j)[lane];
}

// The L2 prefetches of a direct mode: this consumer thread's share of the 128-byte lines of [p, p + bytes).
template <int CONSUMERS>
__device__ __forceinline__ void prefetch_slot(const unsigned char* p, int bytes, int cw, int lane)
{
    for (int l = cw * 32 + lane; l < bytes / 128; l += 32 * CONSUMERS)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + 128 * l));
}

// Calls f(w) with the lane's words of each 4-bit chunk of a slot that warp cw takes (piece j to warp j % CONSUMERS),
// the next chunk's words loaded before f runs on the current one.
template <int CONSUMERS, class F>
__device__ __forceinline__ void for_my_chunks(const unsigned char* data, int bytes, int cw, int lane, F f)
{
    const int chunks = bytes / 512;
    uint4 v = cw < chunks ? chunk_words(data, cw, lane) : uint4{};
    for (int j = cw; j < chunks; j += CONSUMERS) {
        const uint4 now = v;
        if (j + CONSUMERS < chunks) v = chunk_words(data, j + CONSUMERS, lane);
        const unsigned w[4] = {now.x, now.y, now.z, now.w};
        f(w);
    }
}

// The weight ring: `slots` slots of slot_bytes at the start of dynamic shared memory, a full and an empty mbarrier
// each. The producer fills slots in order and the consumers drain them in the same order (`it`: slots used so far).
struct Ring {
    unsigned char* data;
    unsigned long long* full;
    unsigned long long* empty;
    int slot_bytes, slots;

    __device__ void init(int consumers) const          // every thread; the caller then synchronises the block
    {
        if (threadIdx.x < slots) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(full + threadIdx.x)) : "memory");
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(empty + threadIdx.x)),
                         "r"(consumers) : "memory");
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }

    // The producer's lane: `bytes` at src into the next slots, each as soon as the consumers have released it.
    __device__ void fill(const unsigned char* src, int bytes, int& it) const
    {
        for (int off = 0; off < bytes; off += slot_bytes, ++it) {
            const int slot = it % slots, n = min(slot_bytes, bytes - off);
            bar_wait(smem_addr(empty + slot), ((it / slots) & 1) ^ 1);
            const unsigned f = smem_addr(full + slot);
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(f), "r"(n) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         ::"r"(smem_addr(data + (size_t)slot * slot_bytes)), "l"(src + off), "r"(n), "r"(f)
                         : "memory");
        }
    }

    // A consumer warp: the next slots holding `bytes`, each to f(its data, its bytes) once full, then released.
    template <class F>
    __device__ void drain(int bytes, int& it, int lane, F f) const
    {
        for (int off = 0; off < bytes; off += slot_bytes, ++it) {
            const int slot = it % slots;
            bar_wait(smem_addr(full + slot), (it / slots) & 1);
            f(data + (size_t)slot * slot_bytes, min(slot_bytes, bytes - off));
            __syncwarp();
            if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(empty + slot))
                                        : "memory");
        }
    }
};

// What the consumers read besides the ring (the EXL2 consumers' x and group records).
struct Inputs {
    const half* x;              // [K] in stored order (stage_xs's output for one row)
    const unsigned* records;    // [K / 128][4] scale-code records of one strip (every warp reads the same)
    int kchunks;                // K / 32
};

// WORK x (LOP3 + HFMA2) per 16 bytes a lane (32: about the one-row matmul's instruction count), all consumer warps
// sharing each slot's 16-byte pieces.
template <int WORK, int CONSUMERS>
struct Synthetic {
    unsigned acc[4] = {0u, 0u, 0u, 0u};                // half2 bits

    __device__ void start(const Inputs&, unsigned char*, int) {}

    __device__ void slot(const unsigned char* data, int bytes, int cw, int lane)
    {
        const uint4* v = reinterpret_cast<const uint4*>(data);
        for (int i = cw * 32 + lane; i < bytes / 16; i += 32 * CONSUMERS) {
            const uint4 x = v[i];
            const unsigned u[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int j = 0; j < (WORK ? WORK : 4); ++j)      // WORK 0: one add a word
                asm("fma.rn.f16x2 %0, %1, %0, %2;" : "+r"(acc[j & 3]) : "r"(u[j & 3] ^ (unsigned)j),
                    "r"(WORK ? 0x3c003c00u : u[j & 3]));
        }
    }

    __device__ float result() const { return (float)(acc[0] ^ acc[1] ^ acc[2] ^ acc[3]); }
};

// The one-row EXL2 kernel's own chunk loop (qmm::MatmulSink<Exl2, 1, true, true>: 4-bit folded decode, m16n8k16
// MMAs, per-group scales) on the ring's bytes: each 512-byte piece of a slot is one 4-bit chunk of a warp's strip
// (piece j to warp j % CONSUMERS), the warp's chunks consecutive along K (groups of 4 chunks, 128 rows), their x
// fragments from global memory as the M1 kernel reads them (XS: from a copy in shared memory), one chunk's loads
// ahead of its MMAs.
template <bool XS, int CONSUMERS>
struct Exl2Chunks {
    using Sink = qmm::MatmulSink<qmm::Exl2, 1, true, true>;
    Sink sink;
    qmm::Exl2::Cursor cur;
    const uint2* xb;            // the lane's x fragments of chunk 0 (global or shared)
    int kc = 0, kchunks = 1;    // the warp's next chunk along K
    Sink::Extra ex;             // the next chunk's x fragments, loaded ahead
    qmm::Exl2::Raw raw;         // and its group record

    __device__ void fetch()
    {
        ex.b[0][0] = xb[8 * kc];                       // rows 4q .. 4q + 3 of the chunk
        ex.b[0][1] = xb[8 * kc + 4];                   // rows 16 + 4q ..
        raw = qmm::Exl2::load(cur, make_int2(kc / 4, 0x20002000));
    }

    __device__ void start(const Inputs& in, unsigned char* extra, int lane)
    {
        kchunks = in.kchunks;
        cur = {in.records + (lane / 4 >> 1)};
        const half* x = in.x;
        if constexpr (XS) {                            // x copied once into shared memory
            half* xs = reinterpret_cast<half*>(extra);
            for (int i = threadIdx.x - 32; i < 32 * kchunks; i += 32 * CONSUMERS) xs[i] = x[i];
            asm volatile("bar.sync 1, %0;" ::"n"(32 * CONSUMERS) : "memory");
            x = xs;
        }
        xb = reinterpret_cast<const uint2*>(x) + lane % 4;
        fetch();
    }

    __device__ void slot(const unsigned char* data, int bytes, int cw, int lane)
    {
        for_my_chunks<CONSUMERS>(data, bytes, cw, lane, [&](const unsigned (&w)[4]) {
            const Sink::Extra now = ex;
            const qmm::Exl2::Raw now_raw = raw;
            const int c = kc;
            kc = kc + 1 == kchunks ? 0 : kc + 1;
            fetch();
            sink.template chunk<4>(w, c / 4, now_raw, c, now);
        });
    }

    __device__ float result()
    {
        sink.flush();
        return sink.acc[0][0][0] + sink.acc[1][0][2];
    }
};

// The same chunks by a loop without MMAs: each lane decodes its 32 codes to exact (code - z) halves (decode_pairs:
// LOP3 + HFMA2 a pair) and multiplies them with its x pairs by HFMA2 into a half2 sum per column (4 columns, two
// k rows each), which is scaled into fp32 when the group changes. Sums in fp16 over a group (16 products a column
// half): not the M1 kernel's arithmetic (fp32 MMA accumulators), a measure of what a loop of short independent
// chains runs at.
template <int CONSUMERS>
struct Exl2Fma {
    qmm::Exl2::Cursor cur;
    qmm::Exl2::State st;
    const uint2* xb;
    int kc = 0, kchunks = 1, group = -1;
    uint2 xn[2];                 // the next chunk's x pairs (k steps 0, 1), loaded ahead
    qmm::Exl2::Raw raw;
    half2 sum[4];                // the group's sums of columns col(0..3)
    float sf[4] = {}, acc[4] = {};

    __device__ void fetch()
    {
        xn[0] = xb[8 * kc];
        xn[1] = xb[8 * kc + 4];
        raw = qmm::Exl2::load(cur, make_int2(kc / 4, 0x20002000));
    }

    __device__ void flush()
    {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 f = __half22float2(sum[j]);
            acc[j] = fmaf(f.x + f.y, sf[j], acc[j]);
            sum[j] = __float2half2_rn(0.f);
        }
    }

    __device__ void start(const Inputs& in, unsigned char*, int lane)
    {
        kchunks = in.kchunks;
        cur = {in.records + (lane / 4 >> 1)};
        xb = reinterpret_cast<const uint2*>(in.x) + lane % 4;
#pragma unroll
        for (int j = 0; j < 4; ++j) sum[j] = __float2half2_rn(0.f);
        fetch();
    }

    __device__ void slot(const unsigned char* data, int bytes, int cw, int lane)
    {
        for_my_chunks<CONSUMERS>(data, bytes, cw, lane, [&](const unsigned (&w)[4]) {
            const uint2 xs[2] = {xn[0], xn[1]};
            const qmm::Exl2::Raw now_raw = raw;
            const int c = kc;
            kc = kc + 1 == kchunks ? 0 : kc + 1;
            fetch();
            if (c / 4 != group) {
                flush();
                qmm::Exl2::enter<4>(now_raw, lane / 4, st);
                sf[0] = __low2float(st.scale[0]); sf[1] = __high2float(st.scale[0]);
                sf[2] = __low2float(st.scale[1]); sf[3] = __high2float(st.scale[1]);
                group = c / 4;
            }
            half2 a[16];
            qmm::decode_pairs<4, qmm::Exl2>(w, st, a);
#pragma unroll
            for (int t = 0; t < 2; ++t)
#pragma unroll
                for (int s = 0; s < 2; ++s) {        // a[8t + 2s (+1)]: column g of tile t, a[8t + 4 + 2s (+1)]: g + 8
                    const half2 lo = exl::as_half2(xs[s].x), hi = exl::as_half2(xs[s].y);
                    sum[2 * t] = __hfma2(a[8 * t + 2 * s], lo, __hfma2(a[8 * t + 2 * s + 1], hi, sum[2 * t]));
                    sum[2 * t + 1] =
                        __hfma2(a[8 * t + 4 + 2 * s], lo, __hfma2(a[8 * t + 4 + 2 * s + 1], hi, sum[2 * t + 1]));
                }
        });
    }

    __device__ float result()
    {
        flush();
        return acc[0] + acc[1] + acc[2] + acc[3];
    }
};

// Shares: op k's CTA c reads share[k] bytes at w + offset[k] + c * share[k]; slots of slot_bytes, `slots` of them,
// in dynamic shared memory (then the consumer's own: EXL2 XS's x copy). counters[k] counts the CTAs done with op k
// over all launches so far (gen of them before this one), so a launch waits for gen * G + G. flags[k]: WAITS (op k
// waits for every CTA to finish op k - 1), ADDS (each CTA then adds its partial of `hidden` floats into resid by
// float atomics, as a K-split down or o projection would). Warp 0 is the producer, warps 1 .. CONSUMERS the
// consumers.
template <class Consumer, int CONSUMERS>
__global__ void __launch_bounds__(32 * (CONSUMERS + 1), 1)
pipeline(const unsigned char* __restrict__ w, const long long* __restrict__ offset, const int* __restrict__ share,
         const int* __restrict__ flags, int n_ops, int slot_bytes, int slots, int* counters, int gen, int mode,
         float* out, float* resid, int hidden, const half* x, const unsigned* records, int kchunks)
{
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long full[32], empty[32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, G = gridDim.x, c = blockIdx.x;
    const int target = (gen + 1) * G;
    const Ring ring{smem, full, empty, slot_bytes, slots};
    ring.init(CONSUMERS);
    __syncthreads();

    const bool direct = mode >= MODE_DIRECT;
    if (warp == 0) {                                   // the producer: one lane issues every copy
        if (lane || direct) return;
        int it = 0;
        for (int k = 0; k < n_ops; ++k) {
            if (mode == MODE_AFTER && k > 0 && (flags[k] & WAITS)) wait_counter(counters + k - 1, target);
            ring.fill(w + offset[k] + (size_t)c * share[k], share[k], it);
        }
        return;
    }

    const int cw = warp - 1;                           // consumers
    Consumer consumer;
    consumer.start({x, records, kchunks}, smem + (size_t)slots * slot_bytes, lane);
    int it = 0;
    for (int k = 0; k < n_ops; ++k) {
        const unsigned char* src = w + offset[k] + (size_t)c * share[k];
        if (direct)            // the op's first DIRECT_AHEAD slots into L2 before the wait (launch-per-op's prologue)
            for (int off = 0; off < min(share[k], DIRECT_AHEAD * slot_bytes); off += slot_bytes)
                prefetch_slot<CONSUMERS>(src + off, min(slot_bytes, share[k] - off), cw, lane);
        if (mode != MODE_FREE && mode != MODE_DIRECT_FREE && k > 0 && (flags[k] & WAITS)) {   // all done with k - 1
            if (threadIdx.x == 32) wait_counter(counters + k - 1, target);
            asm volatile("bar.sync 1, %0;" ::"n"(32 * CONSUMERS) : "memory");
        }
        if (direct)            // the weights straight from global memory, DIRECT_AHEAD slots prefetched ahead
            for (int off = 0; off < share[k]; off += slot_bytes) {
                const int ahead = off + DIRECT_AHEAD * slot_bytes;
                if (ahead < share[k]) prefetch_slot<CONSUMERS>(src + ahead, min(slot_bytes, share[k] - ahead), cw, lane);
                consumer.slot(src + off, min(slot_bytes, share[k] - off), cw, lane);
            }
        else
            ring.drain(share[k], it, lane, [&](const unsigned char* data, int n) { consumer.slot(data, n, cw, lane); });
        // the op's partials (as a split-K matmul's), then this CTA's arrival
        const float partial = consumer.result();
        out[((size_t)k * G + c) * 32 * CONSUMERS + cw * 32 + lane] = partial;
        if (flags[k] & ADDS)
            for (int i = cw * 32 + lane; i < hidden; i += 32 * CONSUMERS) atomicAdd(resid + i, partial);
        asm volatile("bar.sync 1, %0;" ::"n"(32 * CONSUMERS) : "memory");
        if (threadIdx.x == 32) asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counters + k) : "memory");
    }
}
"""

MODES = {"ahead": 0, "after": 1, "free": 2, "direct": 3, "direct-free": 4}
WAITS, ADDS = 1, 2              # the kernel's op flags
MAX_SMEM = 227 * 1024           # dynamic shared memory a CTA may have (sm_90)
CONSUMERS = "w0,w32,exl2,exl2-xs,exl2@16,exl2-xs@16,exl2-fma,exl2-fma@16"     # every kind, the default


def consumer_kernel(spec: str) -> tuple[str, int]:
    """A consumer spec -> (kernel name expression, consumer warps): w<WORK> (Synthetic), exl2 (the M1 chunk loop,
    x from global memory), exl2-xs (x in shared memory), exl2-fma (the chunks without MMAs); @N for N consumer warps
    (default 8)."""
    kind, _, warps = spec.partition("@")
    n = int(warps or 8)
    if kind.startswith("w") and kind[1:].isdigit():
        return f"pipeline<Synthetic<{int(kind[1:])}, {n}>, {n}>", n
    if kind in ("exl2", "exl2-xs"):
        return f"pipeline<Exl2Chunks<{str(kind == 'exl2-xs').lower()}, {n}>, {n}>", n
    if kind == "exl2-fma":
        return f"pipeline<Exl2Fma<{n}>, {n}>", n
    raise SystemExit(f"unknown consumer {spec!r}: w<WORK>, exl2, exl2-xs or exl2-fma, optionally @<warps>")


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


def op_flags(ops: list[tuple[str, int]], layout: int) -> list[int]:
    """Which ops wait for every CTA to finish the op before (the all-to-all dependencies) and which end adding their
    partial sums into the residual by float atomics. Layout 5 (dependencies a layer): every op waits, as the
    launch-per-op step does. Layout 3: o runs in the CTA that computed its heads' attention and down in the CTA that
    computed its rows' silu * up, so neither waits, and both, split along K, add into the residual (what that
    costs: docs/megakernel.md). Not modelled: o's work on fewer CTAs (one per head)."""
    if layout == 5:
        return [WAITS] * len(ops)
    if layout == 3:
        return [ADDS if name in ("o", "down") else WAITS for name, _ in ops]
    raise SystemExit(f"--layouts: 5 or 3, not {layout}")


def median_us(run, launches: int) -> float:
    """The median time of run(i) for i in range(launches), each between two events, the first 3 left out."""
    times = []
    for i in range(launches):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        run(i)
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    return float(np.median(times[3:]))


def copy_bandwidth() -> float:
    a = cp.empty(2 * 1024**3, dtype=cp.uint8)
    b = cp.empty_like(a)
    us = median_us(lambda _: b.__setitem__(Ellipsis, a), 13)
    return 2 * 2 * 1024**3 / us * 1e6


def compile_kernels(source: str, kernel: str, consumers: str) -> tuple[cp.RawModule, dict[str, tuple[str, int]]]:
    """source's `kernel` template for each consumer spec, compiled by NVRTC for this GPU: the module and, by spec,
    (its name expression, its consumer warps)."""
    specs = {}
    for spec in consumers.split(","):
        expression, warps = consumer_kernel(spec)
        specs[spec] = (expression.replace("pipeline<", f"{kernel}<", 1), warps)
    module = cp.RawModule(code=source, options=("-std=c++17", f"-I{loader.KERNEL_DIR}",
                                                f"--gpu-architecture={loader.arch(loader.compute_capability())}"),
                          backend="nvrtc", name_expressions=[name for name, _ in specs.values()])
    return module, specs


def consumer_inputs(hidden: int, rng: np.random.Generator) -> tuple:
    """The EXL2 consumers' inputs besides the ring (the kernel's Inputs), random: x [hidden] fp16, the group records;
    and K / 32."""
    kchunks = hidden // 32
    return (cp.asarray(rng.standard_normal(32 * kchunks).astype(np.float16)),
            cp.asarray(rng.integers(0, 2**32, kchunks + 8, dtype=np.uint32)), kchunks)


def shared_memory(kernel, spec: str, ring_bytes: int, kchunks: int) -> int | None:
    """The dynamic shared memory `kernel` gets for consumer `spec` (the ring, then exl2-xs's copy of x), set on it;
    None (and a line printed) where it does not fit."""
    smem = ring_bytes + (64 * kchunks if spec.startswith("exl2-xs") else 0)
    if smem > MAX_SMEM:
        print(f"{spec}: {smem} bytes of shared memory do not fit; skipped")
        return None
    kernel.max_dynamic_shared_size_bytes = smem
    return smem


def write_results(where: Path | None, what: str, bandwidth: float, rows: list[dict], sms: int) -> None:
    if where:
        info = run_info(torch.device("cuda"), bandwidth, rows, sms=sms)
        Path(result_path(str(where), what, info)).write_text(json.dumps(info, indent=1))


def ring_arguments(ap: argparse.ArgumentParser, consumers: str) -> None:
    """The options bench_pipeline and bench_step_table share: consumers, the ring's slots, launches timed, JSON."""
    ap.add_argument("--consumers", default=consumers,
                    help="w<WORK>: WORK x (LOP3 + HFMA2) per 16 bytes a lane; exl2: the one-row EXL2 chunk loop "
                         "(4-bit) with x from global memory, exl2-xs: from shared memory, exl2-fma: without MMAs; "
                         "@N: N consumer warps")
    ap.add_argument("--slot-kb", type=int, default=16)
    ap.add_argument("--slots", type=int, default=12)
    ap.add_argument("--launches", type=int, default=30)
    ap.add_argument("--json", type=Path, help="write the rows here (a directory: benchmarks/results' file name)")


def start(source: str, kernel: str, args: argparse.Namespace) -> tuple[cp.RawModule, dict, int, float]:
    """The kernels compiled for args.consumers, and (SMs, copy bandwidth) of this GPU, printed with the ring's size."""
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    module, specs = compile_kernels(source, kernel, args.consumers)
    bw = copy_bandwidth()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    print(f"{name}: {sms} SMs, copy bandwidth {bw / 1e12:.2f} TB/s; ring {args.slots} x {args.slot_kb} KB a CTA")
    return module, specs, sms, bw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--context", type=int, default=256)
    ring_arguments(ap, CONSUMERS)
    ap.add_argument("--modes", default="free,after,ahead,direct-free,direct")
    ap.add_argument("--layouts", default="5,3", help="all-to-all dependencies a layer: 5 (every op) or 3 (op_flags)")
    args = ap.parse_args()
    if not 1 <= args.slots <= 32 or args.slots * args.slot_kb * 1024 > MAX_SMEM:
        ap.error("--slots: 1 to 32 (the kernel's mbarriers), slots x slot-kb at most 227 KB (shared memory a CTA)")

    module, specs, G, bw = start(SOURCE, "pipeline", args)
    slot_bytes = args.slot_kb * 1024
    rows = []
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        ops = step_ops(shape, args.context)
        shares = [-(-b // G + 511) // 512 * 512 for _, b in ops]    # per CTA, whole 512-byte pieces (4-bit chunks)
        offsets = np.cumsum([0] + [s * G for s in shares[:-1]]).astype(np.int64)
        total = int(sum(s * G for s in shares))
        w = cp.arange(total // 4, dtype=cp.uint32).view(cp.uint8)
        d_off, d_share = cp.asarray(offsets), cp.asarray(np.array(shares, dtype=np.int32))
        x, records, kchunks = consumer_inputs(SHAPES[shape]["hidden_size"], rng)   # K: the hidden size
        resid = cp.zeros(SHAPES[shape]["hidden_size"], dtype=cp.float32)
        bound_us = total / bw * 1e6
        print(f"\n{shape}, ctx {args.context}: {len(ops)} ops, {total / 1e9:.3f} GB a step, bound {bound_us:.0f} us")
        print(f"{'layout':>6} {'mode':8} {'consumer':>12} {'us/step':>9} {'TB/s':>6} {'% of bound':>10}")
        for layout in (int(n) for n in args.layouts.split(",")):
            flags = cp.asarray(np.array(op_flags(ops, layout), dtype=np.int32))
            for spec, (expression, warps) in specs.items():
                kernel = module.get_function(expression)
                smem = shared_memory(kernel, spec, slot_bytes * args.slots, kchunks)
                if smem is None:
                    continue
                out = cp.empty(len(ops) * G * 32 * warps, dtype=cp.float32)
                for mode in args.modes.split(","):
                    counters = cp.zeros(len(ops), dtype=cp.int32)
                    us = median_us(lambda gen: kernel(
                        (G,), (32 * (warps + 1),),
                        (w, d_off, d_share, flags, np.int32(len(ops)), np.int32(slot_bytes), np.int32(args.slots),
                         counters, np.int32(gen), np.int32(MODES[mode]), out, resid, np.int32(resid.size), x, records,
                         np.int32(kchunks)), shared_mem=smem), args.launches)
                    row = dict(shape=shape, context=args.context, layout=layout, mode=mode, consumer=spec,
                               us=round(us, 1), tb_s=round(total / us / 1e6, 3), share=round(bound_us / us, 3),
                               bytes=total, slots=args.slots, slot_kb=args.slot_kb)
                    rows.append(row)
                    print(f"{layout:6} {mode:8} {spec:>12} {us:9.1f} {total / us / 1e6:6.2f} {100 * bound_us / us:9.1f}%")
    write_results(args.json, "pipeline", bw, rows, G)


if __name__ == "__main__":
    main()

// megakernel.cu: a run of a decode step's one-row quantized matmuls and the x staging in front of each
// (matmul_rows.cu's stage_xs and <fmt>_matmul_m1 launches, in their stream order) as ONE persistent launch. The
// launcher is megakernel.py; the run is everything between two attention calls (o projection, post-attention norm,
// gate/up, silu * up, down, the next block's norm and q/k/v), which launch-per-op took 8 launches for.
//
// SEGMENT<N> (the kernel's one argument, by value: CUDA 12.1+ takes up to 32 KB of kernel parameters): the
//   matmuls' Params (params[0 .. n_params), N / 2 slots, each in the constant bank as launch-per-op's own argument
//   is), then ops[0 .. n_ops), N slots, each the blocks of one launch it replaces. One kernel per N (2, 4, 8, 12:
//   decode_segment_exl2_<N>), the launcher taking the smallest that holds its ops: ~2.3 KB for a stage + matmul
//   pair, ~13.6 KB at N = 12 (benchmarks/bench_chain.py times what parameter bytes cost a launch).
//   STAGE    stage_xs's grid (grid_x, parts, 1) flattened to `blocks` virtual blocks v = part * grid_x + bx;
//   MATMUL   the one-row matmul's `blocks` blocks, each of strips_per_block strips (launch-per-op's own plan: a CTA
//            here is 8 warps, those past strips_per_block idle), reading what the STAGE before it staged at xs.
//            EXL2 only for now: a GPTQ instance (qmm::Gptq) spills ~370 bytes at the 128 registers of two CTAs
//            per SM (ptxas -v), where gptq_matmul_m1 spills none; GPTQ models keep launch-per-op.
//   Virtual block v of op k runs on CTA (op.first + v) % gridDim.x: megakernel.py's schedule picks `first` (and
//   prints it). done[k] counts op k's finished blocks; done[n_ops] the CTAs that finished the segment.
//
// ORDER. Before a block of op k reads any op's output, each of its warps waits until done[k - 1] ==
//   ops[k - 1].blocks (CounterWait, where launch-per-op has its dependent-launch wait: what reads only weights comes
//   first): op k - 1 is complete, and so (its blocks waited in turn) is every op before, so each op reads finished
//   outputs and no op overwrites what an earlier one still reads, exactly as the launches' stream order guaranteed.
//   The wait is one acquire load per CTA (which also invalidates the SM's L1: no stale line of a buffer another
//   CTA wrote is read), passed on to its warps by an mbarrier they wait on suspended; the signal is a block barrier
//   and one release add. The last CTA to finish resets done[] for the next launch (every other CTA is past its
//   last wait by then).
//
// WEIGHTS BEFORE THE WAIT. What reads only weights (in the blocks, their chunk metadata and first L2 prefetches)
//   comes before the wait, as launch-per-op does before its dependent-launch wait. (Measured slower, both in
//   docs/megakernel.md: bulk L2 prefetches of the next matmul's whole weight spans before each wait; each warp's
//   whole span copied into shared memory before the wait, QMM_SLOT_BYTES until 01c8965.)
//
// DEADLOCK FREEDOM. Every CTA must be resident at once: megakernel.py sizes the grid by the occupancy the driver
//   reports for this kernel and shared memory. pdl_trigger comes first, so a kernel launched after this one with
//   programmatic dependent launch starts only once every CTA of this grid runs. Ops only wait for earlier ops, and
//   every CTA walks the ops in order, so some unfinished block can always run.
//
// sm_90+ only (megakernel.py uses launch-per-op elsewhere).
#include "qmm_rows.cuh"

// The poller's sleep between two reads of the counter, and the time a waiting warp may stay suspended on the
// mbarrier before it looks again (a hint; the phase's completion wakes it) (benchmarks/bench_segment.py --defines).
#ifndef MK_POLL_NS
#define MK_POLL_NS 32
#endif
#ifndef MK_SUSPEND_NS
#define MK_SUSPEND_NS 1000000
#endif

namespace mk {

enum Kind { STAGE = 0, MATMUL = 1 };

// Field order: pointers, then 4-byte values (megakernel.OP_DTYPE mirrors it; a host test compares the offsets).
struct Op {
    const half* x;               // STAGE: stage_xs's x, up, residual, norm_w, new_residual (null where unused)
    const half* up;
    const half* residual;
    const half* norm_w;
    half* new_residual;
    half* xs;                    // STAGE writes it, the matmul after it reads it
    half* y0;                    // matmul outputs (null past its parts) and split partials
    half* y1;
    half* y2;
    float* ws;
    float eps;
    int kind;
    int blocks;
    int grid_x;                  // STAGE: blocks per part
    int first;                   // the CTA that runs virtual block 0
    int strips_per_block;        // MATMUL: the plan's (<= 8)
    int params;                  // index into Segment::params: the weights' M1 plan (STAGE: the matmul's it feeds)
    int pad;
};

template <int N>
struct Segment {
    qmm::Params params[N / 2];           // a matmul and the stage in front of it share one
    Op op[N];
    int* done;                   // [n_ops + 1], zero between launches
    int n_ops;
};

__device__ __forceinline__ int load_acquire(const int* p)
{
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void release_add(int* p, int v)
{
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The first virtual block of op that CTA c runs (blocks past op.blocks: none).
__device__ __forceinline__ int first_block(const Op& op, int c, int G) { return ((c - op.first) % G + G) % G; }

// The wait of op k's blocks (qmm::PdlWait's place): the launch before, then op k - 1's blocks (counter null: op 0).
// Called per warp (a block's warps may have returned already), but one lane of the CTA polls the counter in device
// memory (the first to take `poller`) and then arrives on the op's mbarrier in shared memory; every other warp waits
// on that mbarrier, suspended: a warp spinning on a shared-memory flag issued instructions all the while, taking
// issue slots from the other CTA's working warps on the same SM (ncu, 2026-12-06: the 1B block's segment executed
// 1.49x the instructions of its launches; branch-resolving stalls 3.1 against 0.2). Each op has an mbarrier of its
// own, used for one phase (parity 0), so a CTA's later blocks of the same op pass at once. The poller's acquire
// (which also invalidates the SM's L1) and the mbarrier's CTA-scope release/acquire order the op before's writes
// before every warp's reads.
struct CounterWait {
    const int* counter;
    int target;
    int* poller;                 // shared memory, zero at the op's start
    unsigned barrier;            // shared-memory address of the op's mbarrier (arrival count 1)

    __device__ __forceinline__ void operator()() const
    {
        exl::pdl_wait();
        if (counter == nullptr) return;
        if (threadIdx.x % 32 == 0) {
            if (atomicCAS(poller, 0, 1) == 0) {
                while (load_acquire(counter) < target)
                    if (MK_POLL_NS) __nanosleep(MK_POLL_NS);
                asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(barrier) : "memory");
            }
            asm volatile(
                "{\n"
                ".reg .pred done;\n"
                "WAIT:\n"
                "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], 0, %1;\n"
                "@!done bra WAIT;\n"
                "}\n" ::"r"(barrier), "n"(MK_SUSPEND_NS)
                : "memory");
        }
        __syncwarp();
    }
};

__device__ __forceinline__ unsigned smem_address(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// p: the op's Params, in the constant bank (the Segment's): launch-per-op's matmul reads its Params there, as free
// operands and through the uniform datapath; a copy in shared memory made every field a load and its address
// arithmetic per-thread (SASS, 2026-12-06: twice the LEA / ISETP, +50 % MOV, no ULDC), ~4 K more warp instructions a
// block (ncu), and each op ~0.6 us slower than its own launch.
template <class Fmt>
__device__ __forceinline__ void run_block(const Op& op, const qmm::Params& p, int v, const CounterWait& wait)
{
    if (op.kind == STAGE)
        qmm::stage_xs(p, op.x, op.up, op.residual, op.norm_w, op.new_residual, op.eps, op.xs, v % op.grid_x,
                      v / op.grid_x, 0, 1, wait);
    else
        qmm::matmul<Fmt, 1, true>(p, op.xs, op.y0, op.y1, op.y2, op.ws, v, op.strips_per_block, wait);
}

template <class Fmt, int N>
__device__ void decode_segment(const Segment<N>& s)
{
    __shared__ int poller_s;                        // CounterWait's
    __shared__ unsigned long long barriers_s[N];
    const int c = blockIdx.x, G = gridDim.x;
    if (threadIdx.x < s.n_ops)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(barriers_s + threadIdx.x)) : "memory");
    for (int k = 0; k < s.n_ops; ++k) {
        const Op& op = s.op[k];
        const int v0 = first_block(op, c, G);
        if (v0 >= op.blocks) continue;
        // in the blocks, before the wait: everything that reads only weights (their metadata, the first L2
        // prefetches), as launch-per-op does before its dependent-launch wait
        if (threadIdx.x == 0) poller_s = 0;
        __syncthreads();                               // (also publishes the mbarriers' init, before op 0)
        const CounterWait wait{k > 0 ? s.done + k - 1 : nullptr, k > 0 ? s.op[k - 1].blocks : 0, &poller_s,
                               smem_address(barriers_s + k)};
        int ran = 0;
        for (int v = v0; v < op.blocks; v += G, ++ran) {
            run_block<Fmt>(op, s.params[op.params], v, wait);
            __syncthreads();                           // shared memory is the next block's
        }
        if (threadIdx.x == 0) release_add(s.done + k, ran);
    }
    __syncthreads();
    if (threadIdx.x == 0 && exl::arrive(s.done + s.n_ops) == G - 1)
        for (int k = 0; k <= s.n_ops; ++k) s.done[k] = 0;
}

}  // namespace mk

#define MK_SEGMENT(NAME, FMT, N)                                                                                      \
    extern "C" __global__ void __launch_bounds__(qmm::THREADS, 2) NAME(const __grid_constant__ mk::Segment<N> s)      \
    {                                                                                                                  \
        MK_BODY(FMT, N)                                                                                                \
    }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define MK_BODY(FMT, N) __trap();                         /* sm_90+ only (mbarriers' try_wait): never launched below */
#else
#define MK_BODY(FMT, N)                                                                                                \
    exl::pdl_trigger();                                                                                               \
    mk::decode_segment<FMT, N>(s);
#endif

MK_SEGMENT(decode_segment_exl2_2, qmm::Exl2, 2)
MK_SEGMENT(decode_segment_exl2_4, qmm::Exl2, 4)
MK_SEGMENT(decode_segment_exl2_8, qmm::Exl2, 8)
MK_SEGMENT(decode_segment_exl2_12, qmm::Exl2, 12)

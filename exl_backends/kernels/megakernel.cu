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
    int ring_slots;              // RING: slots of the weight ring
    int xs_smem;                 // RING: byte offsets in dynamic shared memory of a matmul block's x copy
    int ring_smem;               //       and of the ring
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


// ------------------------------------------------------------------------------------------- RING
// decode_ring_exl2_<N> (EXL_MEGAKERNEL=ring): the same segment, schedule, counters and arithmetic, with the weights
// streamed through shared memory by a producer warp (docs/megakernel.md, "The pipelined design's premise"): a CTA is
// the 8 warps above (the consumers: stages and matmul blocks as before, their barriers named barrier 1) plus warp 8,
// whose lanes copy each matmul block's weight spans into a ring of slots by cp.async.bulk, in the order the
// consumers read them, across op boundaries: the copies never wait for a counter, only for a free slot, so DRAM
// keeps streaming while the consumers wait for the op before.
//   A slot is RING_PIECE bytes a consumer warp, piece w holding warp w's next batch<B>() chunks of its strip (a
//   width run's last chunks: fewer): for each matmul block the walk's own sequence, width run by width run
//   (ring_slots: producer and consumers step through the same one). Warps without a strip in the block still wait
//   for each slot and release it (the empty barrier counts all 8), so a slot is reused only after every warp is done
//   with it; a warp releases its piece as soon as its words are in registers.
//   After the op's wait the block copies its split's staged x (stage_xs's output in global memory)
//   into shared memory (xs_smem): bench_pipeline measured x read from global memory after every wait at 50 % of the
//   bound against 71 % from shared memory (8B, H100).
// Dynamic shared memory: [0, xs_smem) as the kernel above (a stage's row, a matmul's chunk_meta), then x (64 bytes a
// chunk of the longest split), then the ring at ring_smem (ring_slots slots of RING_SLOT).
// Results are the launch-per-op kernel's bits: each warp still walks its strip's chunks in order with the same sums.
constexpr int RING_PIECE = 2048;              // >= batch<B>() * 128 * B for every width (2 KB at 8 bits)
constexpr int RING_SLOT = qmm::WARPS * RING_PIECE;
constexpr int RING_THREADS = qmm::THREADS + 32;

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(qmm::THREADS) : "memory"); }

__device__ __forceinline__ void bar_wait(unsigned bar, unsigned parity)
{
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(bar), "r"(parity)
        : "memory");
}

struct Ring {
    static constexpr int MAX_SLOTS = 8;
    unsigned char* data;
    unsigned long long* full;    // one arrival (the producer's expect_tx) and the slot's bytes
    unsigned long long* empty;   // the 8 consumer warps' releases
    int slots;

    // Where a warp is in the ring: the slot of its next use and that use's phase parity (stepped, not divided
    // out of a use count: `it % slots` and `it / slots` by the run-time slot count cost ~30 instructions a batch,
    // on the path to the slot's wait, in SASS).
    struct Pos {
        int slot = 0;
        unsigned phase = 0;
        __device__ void next(int slots)
        {
            if (++slot == slots) slot = 0, phase ^= 1;
        }
    };

    __device__ unsigned char* piece(int slot, int warp) const
    {
        return data + (size_t)slot * RING_SLOT + warp * RING_PIECE;
    }
    // A consumer warp: slot pos is full, then (release) it is free again.
    __device__ int wait_full(const Pos& pos) const
    {
        bar_wait(smem_address(full + pos.slot), pos.phase);
        return pos.slot;
    }
    __device__ void release(const Pos& pos, int lane) const
    {
        __syncwarp();
        if (lane == 0)
            asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_address(empty + pos.slot))
                         : "memory");
    }
};

// The strip-independent part of a matmul block: its part, split and chunk range.
struct RingBlock {
    const qmm::Part* pt;
    int pi, split, col_block, c0, c1;

    __device__ RingBlock(const qmm::Params& p, int b)
    {
        pi = qmm::part_of(p, b);
        pt = &p.part[pi];
        const int local = b - pt->block0;
        split = local / pt->col_blocks;
        col_block = local % pt->col_blocks;
        c0 = pt->split_chunk[split];
        c1 = pt->split_chunk[split + 1];
    }
    __device__ int strip(int warp, int strips_per_block) const { return col_block * strips_per_block + warp; }
    __device__ bool has(int warp, int strips_per_block) const
    {
        return warp < strips_per_block && strip(warp, strips_per_block) < pt->strips;
    }
};

// The producer's copies of width run I of a block: a slot a batch, lane w copying warp w's piece.
template <int I, class Fmt>
__device__ __forceinline__ void fill_width(const RingBlock& rb, int strips_per_block, const Ring& ring, Ring::Pos& pos,
                                           int lane)
{
    using namespace qmm;
    constexpr int B = width_of(I), U = batch<B>();
    if constexpr (Fmt::template has_width<B>()) {
        const Part& pt = *rb.pt;
        const int lo = max(rb.c0, pt.run_start[I]), hi = min(rb.c1, pt.run_start[I + 1]);
        int copies = 0;
        for (int w = 0; w < WARPS; ++w) copies += rb.has(w, strips_per_block);
        const bool mine = lane < WARPS && rb.has(lane, strips_per_block);
        const unsigned* src = pt.qw + (size_t)rb.strip(lane, strips_per_block) * pt.words_per_strip + pt.run_word[I];
        for (int c = lo; c < hi; c += U, pos.next(ring.slots)) {
            const int slot = pos.slot, bytes = min(U, hi - c) * 128 * B;
            bar_wait(smem_address(ring.empty + slot), pos.phase ^ 1);
            const unsigned full = smem_address(ring.full + slot);
            if (lane == 0)
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(full), "r"(copies * bytes)
                             : "memory");
            __syncwarp();
            if (mine)
                asm volatile(
                    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                        smem_address(ring.piece(slot, lane))),
                    "l"(src + 32 * B * (c - pt.run_start[I])), "r"(bytes), "r"(full)
                    : "memory");
        }
    }
}

// A consumer warp's chunks of width run I of its block from the ring (warps without a strip: the slots waited for
// and released).
template <int I, class Fmt, class Sink>
__device__ __forceinline__ void drain_width(const RingBlock& rb, const typename Fmt::Cursor& cur, const int2* meta_s,
                                            bool mine, const Ring& ring, Ring::Pos& pos, int warp, int lane,
                                            Sink& sink)
{
    using namespace qmm;
    constexpr int B = width_of(I), U = batch<B>();
    if constexpr (Fmt::template has_width<B>()) {
        const Part& pt = *rb.pt;
        const int lo = max(rb.c0, pt.run_start[I]), hi = min(rb.c1, pt.run_start[I + 1]);
        for (int c = lo; c < hi; c += U, pos.next(ring.slots)) {
            if (!mine) {
                ring.wait_full(pos);
                ring.release(pos, lane);
            } else if (c + U <= hi) {
                Batch<U, B, Fmt, Sink> now;
                now.fetch_unslotted(cur, meta_s + (c - rb.c0), c, sink);
                const unsigned char* piece = ring.piece(ring.wait_full(pos), warp);
                now.fetch_words_shared(piece, lane);
                ring.release(pos, lane);
                now.consume(c, sink);
            } else {                             // the run's last chunks: fewer than a batch
                const unsigned char* piece = ring.piece(ring.wait_full(pos), warp);
                for (int u = 0; u < hi - c; ++u) {
                    Batch<1, B, Fmt, Sink> one;
                    one.fetch_unslotted(cur, meta_s + (c + u - rb.c0), c + u, sink);
                    one.fetch_words_shared(piece + u * 128 * B, lane);
                    one.consume(c + u, sink);
                }
                ring.release(pos, lane);
            }
        }
    }
}

// Every slot of a matmul block, in the walk's order (width run by width run).
template <class Fmt>
__device__ __forceinline__ void fill_block(const RingBlock& rb, int strips_per_block, const Ring& ring, Ring::Pos& pos,
                                           int lane)
{
    fill_width<0, Fmt>(rb, strips_per_block, ring, pos, lane);
    fill_width<1, Fmt>(rb, strips_per_block, ring, pos, lane);
    fill_width<2, Fmt>(rb, strips_per_block, ring, pos, lane);
    fill_width<3, Fmt>(rb, strips_per_block, ring, pos, lane);
    fill_width<4, Fmt>(rb, strips_per_block, ring, pos, lane);
    fill_width<5, Fmt>(rb, strips_per_block, ring, pos, lane);
}

// FOLDED (op.x non-null): the stage that launch-per-op runs before the matmul, for this block's rows only: x's stored
// rows [32 c0, 32 c1) after the op's norm (the whole row's RMS: residual_row, r in shared memory at 0) or silu * up,
// scaled for the folded widths, stage_xs's arithmetic (the one-row sink sums the corrections itself); the part-0
// blocks of column block 0 write the new residual's elements [32 c0, 32 c1) (model order: the splits together
// write each once).
__device__ __forceinline__ void stage_block_x(const qmm::Params& p, const qmm::Part& pt, const Op& op, bool writer,
                                              int c0, int c1, half* xs_s)
{
    using namespace qmm;
    extern __shared__ __align__(16) half r_s[];
    const float inv_rms = op.norm_w ? residual_row(op.x, op.residual, p.K, 0, op.eps) : 0.f;
    for (int r = threadIdx.x; r < 32 * (c1 - c0); r += THREADS) {
        const int k = 32 * c0 + r, src = pt.perm ? __ldg(pt.perm + k) : k;
        half in = op.norm_w ? normalise(r_s[src], __ldg(op.norm_w + src), inv_rms) : op.x[src];
        if (op.up) in = silu_mul(in, op.up[src]);
        xs_s[r] = __float2half_rn(__half2float(in) * row_scale(width_at(pt, c0 + r / 32), r % 32));
        if (writer && op.norm_w && op.residual) op.new_residual[k] = r_s[k];
    }
}

// MK_RING_SLOTS (a probe, 0 by default: bench_decode --defines ,MK_RING_SLOTS=2): at most this many ring slots a CTA.
// Every byte the producers have in flight is queued ahead of the consumers' own loads (counter polls, x, records):
// 6 slots x 2 CTAs is 192 KB an SM, ~8 us at an SM's share of DRAM, where ~1 us of it keeps DRAM busy.
#ifndef MK_RING_SLOTS
#define MK_RING_SLOTS 0
#endif

// MK_RING_GX (a probe, 0 by default: bench_decode --defines ,MK_RING_GX=1): unfolded blocks read x from stage_xs's
// output in global memory with each batch, before the batch's slot wait (launch-per-op's GX sink), instead of
// copying it into shared memory after the op's wait.
#ifndef MK_RING_GX
#define MK_RING_GX 0
#endif

// A block's chunks from the ring into sink, then (warps with a strip) its result: y, or the split's partial and the
// strip's reduction by its last warp.
template <class Fmt, class Sink>
__device__ __forceinline__ void ring_walk(const qmm::Params& p, const Op& op, const RingBlock& rb, int b, bool mine,
                                          int strip, const int2* meta_s, const Ring& ring, Ring::Pos& pos,
                                          const qmm::Stamps& stamps, Sink& sink)
{
    using namespace qmm;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const typename Fmt::Cursor cur = Fmt::cursor(*rb.pt, mine ? strip : 0, lane / 4);
    drain_width<0, Fmt>(rb, cur, meta_s, mine, ring, pos, warp, lane, sink);
    drain_width<1, Fmt>(rb, cur, meta_s, mine, ring, pos, warp, lane, sink);
    drain_width<2, Fmt>(rb, cur, meta_s, mine, ring, pos, warp, lane, sink);
    drain_width<3, Fmt>(rb, cur, meta_s, mine, ring, pos, warp, lane, sink);
    drain_width<4, Fmt>(rb, cur, meta_s, mine, ring, pos, warp, lane, sink);
    drain_width<5, Fmt>(rb, cur, meta_s, mine, ring, pos, warp, lane, sink);
    if (!mine) return;
    sink.flush();
    stamps.at(2);
    half* y = rb.pi == 0 ? op.y0 : rb.pi == 1 ? op.y1 : op.y2;
    const Part& pt = *rb.pt;
    finish<1, true>(sink.acc, pt, rb.split, strip, 1, y, op.ws ? op.ws + pt.ws_offset : op.ws, 1, pt.counters,
                    stamps);
    stamps.at(3);
    stamps.emit(1, p.n_parts, p.K, b);
}

// Matmul block b of op (a consumer warp): as matmul_part_staged, with x in shared memory after the wait (copied from
// stage_xs's output, or FOLDED: staged here; MK_RING_GX: read from global memory instead) and the weights from the
// ring.
template <class Fmt>
__device__ __forceinline__ void ring_matmul(const qmm::Params& p, const Op& op, int b, const CounterWait& wait,
                                            const Ring& ring, Ring::Pos& pos, unsigned char* smem, int xs_smem)
{
    using namespace qmm;
    const RingBlock rb(p, b);
    const Part& pt = *rb.pt;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, strip = rb.strip(warp, op.strips_per_block);
    const int chunks = rb.c1 - rb.c0;
    const bool mine = rb.has(warp, op.strips_per_block);
    const Stamps stamps;                               // (TRACE: start, wait over, walk over, end, arrived)
    stamps.start();
    // FOLDED with a norm: the row r at 0, the chunk_meta entries after it
    int2* meta_s = reinterpret_cast<int2*>(smem + (op.x && op.norm_w ? 2 * p.K : p.meta_smem));
    half* xs_s = reinterpret_cast<half*>(smem + xs_smem);
    if (mine) prefetch_records<Fmt>(pt, strip, rb.split, lane);
    for (int c = threadIdx.x; c < chunks; c += THREADS) meta_s[c] = __ldg(pt.chunk_meta + rb.c0 + c);
    wait();                                            // x (stage_xs's, or FOLDED the op before's), ws, counters
    stamps.at(1);
    const half* xg = op.xs + (size_t)rb.pi * p.K;
    if (MK_RING_GX && !op.x) {
        consumers_sync();                              // (the chunk_meta entries)
        MatmulSink<Fmt, 1, true, true> sink;
        sink.xg = xg;
        sink.tile_step = 8 * (size_t)p.K;
        ring_walk<Fmt>(p, op, rb, b, mine, strip, meta_s, ring, pos, stamps, sink);
        return;
    }
    if (op.x) {
        stage_block_x(p, pt, op, rb.pi == 0 && rb.col_block == 0, rb.c0, rb.c1, xs_s);
    } else {
        for (int i = threadIdx.x; i < 4 * chunks; i += THREADS)       // 32 halves a chunk: 4 x 16 bytes
            reinterpret_cast<uint4*>(xs_s)[i] = reinterpret_cast<const uint4*>(xg + 32 * rb.c0)[i];
    }
    consumers_sync();
    MatmulSink<Fmt, 1, true> sink;
    sink.xc = xs_s + 4 * (lane % 4);
    sink.tile1 = 0;
    sink.c0 = rb.c0;
    sink.M = 1;
    ring_walk<Fmt>(p, op, rb, b, mine, strip, meta_s, ring, pos, stamps, sink);
}

template <class Fmt, int N>
__device__ void decode_ring(const Segment<N>& s)
{
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ int poller_s;
    __shared__ unsigned long long barriers_s[N];
    __shared__ __align__(8) unsigned long long full_s[Ring::MAX_SLOTS], empty_s[Ring::MAX_SLOTS];
    const int c = blockIdx.x, G = gridDim.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int slots = MK_RING_SLOTS ? min(s.ring_slots, MK_RING_SLOTS) : s.ring_slots;
    const Ring ring{smem + s.ring_smem, full_s, empty_s, slots};
    if (threadIdx.x < s.n_ops)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(barriers_s + threadIdx.x)) : "memory");
    if (threadIdx.x < ring.slots) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(full_s + threadIdx.x)) : "memory");
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(empty_s + threadIdx.x)),
                     "r"(qmm::WARPS) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();                                   // the only barrier with the producer: it never waits again
    Ring::Pos pos;                                     // the next slot this warp uses
    if (warp == qmm::WARPS) {
        for (int k = 0; k < s.n_ops; ++k) {
            const Op& op = s.op[k];
            if (op.kind != MATMUL) continue;
            for (int v = first_block(op, c, G); v < op.blocks; v += G)
                fill_block<Fmt>(RingBlock(s.params[op.params], v), op.strips_per_block, ring, pos, lane);
        }
        return;
    }
    for (int k = 0; k < s.n_ops; ++k) {
        const Op& op = s.op[k];
        const int v0 = first_block(op, c, G);
        if (v0 >= op.blocks) continue;
        if (threadIdx.x == 0) poller_s = 0;
        consumers_sync();
        const CounterWait wait{k > 0 ? s.done + k - 1 : nullptr, k > 0 ? s.op[k - 1].blocks : 0, &poller_s,
                               smem_address(barriers_s + k)};
        int ran = 0;
        for (int v = v0; v < op.blocks; v += G, ++ran) {
            const qmm::Params& p = s.params[op.params];
            if (op.kind == STAGE)
                qmm::stage_xs(p, op.x, op.up, op.residual, op.norm_w, op.new_residual, op.eps, op.xs, v % op.grid_x,
                              v / op.grid_x, 0, 1, wait);
            else
                ring_matmul<Fmt>(p, op, v, wait, ring, pos, smem, s.xs_smem);
            consumers_sync();                          // shared memory is the next block's
        }
        if (threadIdx.x == 0) release_add(s.done + k, ran);
    }
    consumers_sync();
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

#define MK_RING(NAME, FMT, N)                                                                                         \
    extern "C" __global__ void __launch_bounds__(mk::RING_THREADS, 2) NAME(const __grid_constant__ mk::Segment<N> s)   \
    {                                                                                                                  \
        MK_RING_BODY(FMT, N)                                                                                           \
    }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define MK_RING_BODY(FMT, N) __trap();
#else
#define MK_RING_BODY(FMT, N)                                                                                           \
    exl::pdl_trigger();                                                                                               \
    mk::decode_ring<FMT, N>(s);
#endif

MK_SEGMENT(decode_segment_exl2_2, qmm::Exl2, 2)
MK_SEGMENT(decode_segment_exl2_4, qmm::Exl2, 4)
MK_SEGMENT(decode_segment_exl2_8, qmm::Exl2, 8)
MK_SEGMENT(decode_segment_exl2_12, qmm::Exl2, 12)
MK_RING(decode_ring_exl2_2, qmm::Exl2, 2)
MK_RING(decode_ring_exl2_4, qmm::Exl2, 4)
MK_RING(decode_ring_exl2_8, qmm::Exl2, 8)
MK_RING(decode_ring_exl2_12, qmm::Exl2, 12)

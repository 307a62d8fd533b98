// qmm.cuh: what every quantized-matmul kernel family shares (matmul_rows.cu, matmul_moe.cu, gemm.cu, wgmma.cu,
// dequant.cu): the launch parameters, the weight stream, the two formats' group records, the walk over a strip's
// chunks, and the x staging arithmetic (norm, silu) that stage_xs and permute_x apply. The lane layout and its
// decode: dequant.cuh. The launchers: quant_matmul.py (routing, plans) and matmul_moe.py.
//
// LAUNCH PARAMETERS  One Params struct by value (__grid_constant__: read from the constant bank, so a block
//   knows its weights' addresses without a dependent load). It describes up to MAX_PARTS weights ("parts") that
//   share x and K (q/k/v, gate/up: one launch), each with its own layout, group tables, permutation, bias, output
//   and plan: blocks part.block0 .. + col_blocks * n_splits, block b of a part covering strips
//   S (b % col_blocks) .. + S - 1 (S strips per block: 8, or blockDim.x / 32 for the small-M kernels) and chunks
//   split_chunk[s] .. split_chunk[s + 1] with s = b / col_blocks.
//   quant_matmul.PARAMS_DTYPE mirrors the struct (a host test compares their offsets).
//
#pragma once
#include "common.cuh"
#include "dequant.cuh"
#include "norm.cuh"

namespace qmm {

using namespace exl;

constexpr int WARPS = 8;                 // strips per block
constexpr int THREADS = WARPS * 32;
constexpr int MAX_PARTS = 3;             // weights per launch (q, k, v)
constexpr int MAX_SPLITS = 64;           // K splits of one part
constexpr int N_WIDTHS = 6;
constexpr int TILE_STRIDE = 40;          // halves per row of a dequant tile: 32 + 8 pad, rows stay 16-byte aligned
#ifndef QMM_PREFETCH_BYTES                 // benchmarks/tune_matmul.py times other values
#define QMM_PREFETCH_BYTES 4096            // 2 KB and 8 KB measured slower (docs/decode-matmul.md)
#endif
constexpr unsigned PREFETCH_BYTES = QMM_PREFETCH_BYTES;   // L2 prefetch distance of a warp's weight stream
constexpr int STAGE_LOADS = 8;           // gathers of x per thread per x row in flight
constexpr int STAGE_ROWS = 4;            // x rows staged together (M8/M16): STAGE_ROWS * STAGE_LOADS gathers in flight
#ifndef QMM_REDUCE_ROWS                    // benchmarks/tune_matmul.py times other values
#define QMM_REDUCE_ROWS 2                  // 4 measured 4-30 % slower at 16 rows (docs/decode-matmul.md)
#endif
constexpr int REDUCE_LOADS = 16;         // split partials per lane in flight in the final reduction (M1)
constexpr int REDUCE_ROWS = QMM_REDUCE_ROWS;   // x rows reduced together (M8/M16), REDUCE_LOADS / 2 splits of each
#ifndef QMM_GEMM_STAGES                    // benchmarks/tune_matmul.py times other values (also QMM_GEMM_BATCH,
#define QMM_GEMM_STAGES 4                  // QMM_GEMM_BLOCKS below)
#endif
#ifndef QMM_GEMM_BATCH                     // chunks a GEMM warp loads per batch: 1 fits 2 blocks per SM (2: ~16 more
#define QMM_GEMM_BATCH 1                   // registers, spills at 128)
#endif
constexpr int GEMM_STAGES = QMM_GEMM_STAGES;   // x chunks in flight in a GEMM block's ring (quant_matmul.GEMM_STAGES)
constexpr int GEMM_XS = 40;              // halves per x row of a ring slot: 32 + 8 pad, ldmatrix conflict-free
                                         // (quant_matmul.GEMM_XS)
#ifndef QMM_GEMM_WARP_TILES                 // benchmarks/tune_matmul.py times 8 (with QMM_GEMM_BLOCKS=1)
#define QMM_GEMM_WARP_TILES 4
#endif
constexpr int GEMM_WARP_TILES = QMM_GEMM_WARP_TILES;   // m16 tiles of x per GEMM warp (quant_matmul.GEMM_WARP_ROWS)

// Chunks loaded into registers per batch: 8 to 16 words per lane (twice as many measured no faster, and spill).
template <int B>
EXL_HD constexpr int batch() { return B == 2 ? 4 : B == 3 ? 4 : B == 4 ? 3 : 2; }

// ------------------------------------------------------------------------------------------- parameters

// One weight of a launch (LAUNCH PARAMETERS above). Field order: pointers, ints, shorts (no padding inside).
struct Part {
    const unsigned* qw;          // [strips][words_per_strip]
    const int2* chunk_meta;      // [chunks]
    const void* meta0;           // strip-major group records
    const void* meta1;
    const int* perm;             // [K] stored row -> row of x, or null for the identity
    const half* bias;            // [n] or null
    int* counters;               // [strips] split-K arrivals, self-resetting
    int n, np, strips, words_per_strip;
    int n_groups, n_splits, block0, col_blocks;
    int ws_offset;               // floats into ws of this part's partials [n_splits][M][np]
    int run_start[N_WIDTHS + 1];
    int run_word[N_WIDTHS];      // word offset within a strip of run i's first chunk
    int split_word[MAX_SPLITS + 1];       // word offset within a strip of each split's first chunk (the last: total)
    short split_chunk[MAX_SPLITS + 1];
    short split_group[MAX_SPLITS + 1];    // group of each split's first chunk (the last: n_groups - 1)
};

struct Params {
    Part part[MAX_PARTS];
    int n_parts, M, K;
    int xs_stride;               // halves per row of the x tile
    int meta_smem;               // byte offset of the chunk_meta copy in dynamic shared memory
    int corr_smem;               // byte offset of the folded chunks' corrections (float2 [chunk][M])
    int row_groups, m_tiles;     // GEMM: warps per strip (R) and M tiles of a launch
    int ring_smem;               // GEMM: byte offset of the x ring in dynamic shared memory
};

// A one-row launch's last act besides y (qmm_rows.cuh STAGE-FREE NORM; all null: y alone). quant_matmul.CHAIN_DTYPE
// mirrors it.
struct Chain {
    half* x;                         // producer (non-null): the consumer's stage buffer, part i's row at x + i * N
    const int* places[MAX_PARTS];    // producer: the consumer's parts' places
    const half* residual;            // producer: the stream's residual [N]
    half* new_residual;              // producer: r [N]
    const half* w;                   // producer: w' [N]
    float* sums;                     // producer: [N / 32]
    const float* sums_in;            // consumer (non-null): the producer's sums, [dim / 32]
    float eps, unscale;              // consumer: the norm's epsilon, 2^e
    int n_places;                    // producer: the consumer's parts
    int dim;                         // consumer: K (the norm's dimension)
    int gated;                       // a gate/up launch writing fp16(silu(gate)) * up as down's x (PAIRED ENDS)
};

__device__ __forceinline__ unsigned smem_address(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// 16 bytes from global to shared memory without waiting (sm_80+: cp.async, L2 only); !valid: zeros. Before sm_80 a
// plain copy (the wait and commit below are then no-ops, and the block barrier orders it).
__device__ __forceinline__ void copy_async16(void* dst, const void* src, bool valid)
{
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0) : "memory");
#else
    *static_cast<uint4*>(dst) = valid ? *static_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
#endif
}

__device__ __forceinline__ void copy_async_commit()
{
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void copy_async_wait()
{
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

EXL_HD constexpr int width_of(int i) { return i == 0 ? 8 : i == 1 ? 6 : i == 2 ? 5 : i == 3 ? 4 : i == 4 ? 3 : 2; }

// The part of block b (parts are laid out in block order).
__device__ __forceinline__ int part_of(const Params& p, int b)
{
    int pi = 0;
#pragma unroll
    for (int i = 1; i < MAX_PARTS; ++i)
        if (i < p.n_parts && b >= p.part[i].block0) pi = i;
    return pi;
}

// Prefetches the 128-byte lines holding bytes [lo, hi) of p into L2, one line per lane and step.
__device__ __forceinline__ void prefetch_span(const void* p, unsigned lo, unsigned hi, int lane)
{
    const size_t base = reinterpret_cast<size_t>(p), end = base + hi;
    for (size_t a = ((base + lo) & ~size_t(127)) + 128 * lane; a < end; a += 128 * 32)
        prefetch_l2(reinterpret_cast<const void*>(a));
}

// ------------------------------------------------------------------------------------------- weight stream

// A warp's weight span (its strip's words of chunks [c0, c1): one contiguous range), read chunk by chunk in order
// straight from global memory, with L2 prefetches PREFETCH_BYTES ahead that hold no registers. (A bulk-copy ring in
// shared memory kept more bytes in flight but cost more instructions and ran slower: docs/decode-matmul.md.)
struct Stream {
    const unsigned char* src;    // the span in global memory
    unsigned span;               // its bytes (a multiple of 128)

    // The first PREFETCH_BYTES: a kernel's first work (only parameters are needed).
    __device__ void start(const void* p, unsigned bytes, int lane)
    {
        src = static_cast<const unsigned char*>(p);
        span = bytes;
        prefetch_span(src, 0, min(span, PREFETCH_BYTES), lane);
    }

    // Before reading bytes [off, end) (at most 32 lines): prefetch the same bytes PREFETCH_BYTES ahead.
    __device__ void ahead(unsigned off, unsigned end, int lane) const
    {
        const unsigned a = off + PREFETCH_BYTES + 128 * lane;
        if (a < min(span, end + PREFETCH_BYTES)) prefetch_l2(src + a);
    }

    // Lane's B words of the chunk at `chunk` (the span's start plus an offset): planes of 16, 8, then 4 bytes per
    // lane. A batch passes its first chunk's pointer plus constants, so the loads take immediate offsets.
    // SHARED: the chunk is a copy in shared memory (a megakernel's weight ring), read by plain loads.
    template <int B, bool SHARED = false>
    __device__ static void load(const unsigned char* chunk, int lane, unsigned (&w)[B])
    {
        constexpr int P16 = B / 4, P8 = B % 4 / 2, P4 = B % 2;
#pragma unroll
        for (int i = 0; i < P16; ++i) {
            const uint4 v = read<SHARED>(reinterpret_cast<const uint4*>(chunk + 512 * i) + lane);
            w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
        }
        if constexpr (P8 == 1) {
            const uint2 v = read<SHARED>(reinterpret_cast<const uint2*>(chunk + 512 * P16) + lane);
            w[4 * P16] = v.x; w[4 * P16 + 1] = v.y;
        }
        if constexpr (P4 == 1)
            w[B - 1] = read<SHARED>(reinterpret_cast<const unsigned*>(chunk + 512 * P16 + 256 * P8) + lane);
    }

    template <bool SHARED, class T>
    __device__ static T read(const T* p)
    {
        if constexpr (SHARED) return *p;
        else return load_stream(p);
    }
};

// EXL2: zero point 2^(B-1); per-column scale fp16((c+1)^2 * m) from a 4-bit code c and the group's base m.
struct Exl2 {
    static constexpr int REC0 = 16, REC1 = 0;    // bytes of a (strip, group) record in meta0, meta1
    static constexpr bool CLUSTERS = true;       // its one-row launch may sum in clusters (qmm_rows.cuh)
    struct Cursor { const unsigned* codes; };    // the lane's word of group 0's record
    struct Raw { unsigned codes, base; };
    struct State { half2 scale[2]; };            // (col(0), col(1)), (col(2), col(3))

    template <int B>
    EXL_HD static constexpr bool has_width() { return true; }

    __device__ static Cursor cursor(const Part& pt, int strip, int g)
    {
        return {static_cast<const unsigned*>(pt.meta0) + (size_t)strip * pt.n_groups * 4 + (g >> 1)};
    }

    __device__ static Raw load(const Cursor& cur, int2 meta)
    {
        return {__ldg(cur.codes + 4 * meta.x), (unsigned)meta.y};
    }

    // fp16((c+1)^2 * m) for a pair of codes: (1024 + c) - 1023 and its square are exact, the product with m is
    // the one rounding the spec has.
    __device__ static half2 scale(unsigned code_pair, unsigned base)
    {
        const half2 c1 = __hsub2(as_half2(code_pair), as_half2(dup16(half_bits_of_int(1023))));
        return __hmul2(__hmul2(c1, c1), as_half2(base));
    }

    template <int B>
    __device__ static void enter(const Raw& r, int g, State& st)
    {
        unsigned pairs[2];
        scale_code_pairs(r.codes, g, pairs);
        st.scale[0] = scale(pairs[0], r.base);
        st.scale[1] = scale(pairs[1], r.base);
    }

    template <int B>
    __device__ static half2 bias(const State&, int, int i)
    {
        return as_half2(dup16(half_bits_of_int(-(1024 >> i) - (1 << (B - 1)))));
    }

    template <int B>
    __device__ static float zero(const Raw&, int) { return float(1 << (B - 1)); }
};

// GPTQ: zero point and fp16 scale per (group, column), read as given (v1/v2 already resolved by prepare()).
struct Gptq {
    static constexpr int REC0 = 64, REC1 = 32;
    static constexpr bool CLUSTERS = false;      // with the cluster sums its one-row kernel spills ~320 bytes
    struct Cursor { const uint2* scales; const unsigned* zeros; };     // the lane's entries of group 0
    struct Raw { uint2 scales; unsigned zeros; };
    struct State { half2 scale[2]; half2 bias[4][5]; };    // bias[j][i / B] = -(1024 * 2^-i + z_j)

    template <int B>
    EXL_HD static constexpr bool has_width() { return B == 2 || B == 3 || B == 4 || B == 8; }

    __device__ static Cursor cursor(const Part& pt, int strip, int g)
    {
        const size_t rec = (size_t)strip * pt.n_groups * 8 + g;
        return {static_cast<const uint2*>(pt.meta0) + rec, static_cast<const unsigned*>(pt.meta1) + rec};
    }

    __device__ static Raw load(const Cursor& cur, int2 meta)
    {
        return {__ldg(cur.scales + 8 * meta.x), __ldg(cur.zeros + 8 * meta.x)};
    }

    template <int B>
    __device__ static void enter(const Raw& r, int, State& st)
    {
        st.scale[0] = as_half2(r.scales.x);
        st.scale[1] = as_half2(r.scales.y);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const half2 z = as_half2(zero_pair(r.zeros, j));
#pragma unroll
            for (int k = 0; k < n_shifts<B>(); ++k)
                st.bias[j][k] = __hsub2(as_half2(dup16(half_bits_of_int(1024 - (1024 >> (k * B))))), z);
        }
    }

    template <int B>
    __device__ static half2 bias(const State& st, int j, int i) { return st.bias[j][i / B]; }

    template <int B>
    __device__ static float zero(const Raw& r, int j) { return float(r.zeros >> 8 * j & 0xff); }
};

// ------------------------------------------------------------------------------------------- walking chunks

// Starts the DRAM reads of a warp's group records (all of its range) into L2: only parameters are read, so this
// can be a kernel's first work.
template <class Fmt>
__device__ __forceinline__ void prefetch_records(const Part& pt, int strip, int split, int lane)
{
    const unsigned g0 = pt.split_group[split], g1 = pt.split_group[split + 1] + 1u;
    prefetch_span(static_cast<const char*>(pt.meta0) + (size_t)strip * pt.n_groups * Fmt::REC0, g0 * Fmt::REC0,
                  g1 * Fmt::REC0, lane);
    if constexpr (Fmt::REC1 > 0)
        prefetch_span(static_cast<const char*>(pt.meta1) + (size_t)strip * pt.n_groups * Fmt::REC1, g0 * Fmt::REC1,
                      g1 * Fmt::REC1, lane);
}

// The weight stream of a warp's chunks of split s of its strip, started.
__device__ __forceinline__ void start_stream(Stream& st, const Part& pt, int strip, int split, int lane)
{
    const int w0 = pt.split_word[split];
    st.start(pt.qw + (size_t)strip * pt.words_per_strip + w0, 4u * (pt.split_word[split + 1] - w0), lane);
}

// U chunks' words, chunk_meta entries and group records, loaded together (fetch), then consumed in order.
// With them, whatever else the sink reads per chunk (Sink::Extra: the M1 matmul's x fragments and corrections).
template <int U, int B, class Fmt, class Sink>
struct Batch {
    unsigned w[U][B];
    int2 m[U];
    typename Fmt::Raw raw[U];
    typename Sink::Extra ex[U];

    // The chunks c, c + 1, ... from span offset off on; meta: their chunk_meta entries.
    __device__ __forceinline__ void fetch(const typename Fmt::Cursor& cur, const int2* meta, const Stream& st,
                                          unsigned off, int lane, int c, const Sink& sink)
    {
        const unsigned char* chunk = st.src + off;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            Stream::load<B>(chunk + u * 128 * B, lane, w[u]);
            m[u] = meta[u];
        }
        sink.template extras<B, U>(c, ex);
#pragma unroll
        for (int u = 0; u < U; ++u) raw[u] = Fmt::load(cur, m[u]);
    }

    // The same chunks from a copy in shared memory (a megakernel's weight ring), in two steps: first what does not
    // wait for the copy (their chunk_meta entries, group records and the sink's extras: L2 round trips that then
    // overlap the wait for the ring's slot), then, once the slot is full, the words from `chunk` on (back to back).
    __device__ __forceinline__ void fetch_unslotted(const typename Fmt::Cursor& cur, const int2* meta, int c,
                                                    const Sink& sink)
    {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            m[u] = meta[u];
            raw[u] = Fmt::load(cur, m[u]);
        }
        sink.template extras<B, U>(c, ex);
    }

    __device__ __forceinline__ void fetch_words_shared(const unsigned char* chunk, int lane)
    {
#pragma unroll
        for (int u = 0; u < U; ++u) Stream::load<B, true>(chunk + u * 128 * B, lane, w[u]);
    }

    __device__ __forceinline__ void consume(int c, Sink& sink) const
    {
#pragma unroll
        for (int u = 0; u < U; ++u) sink.template chunk<B>(w[u], m[u].x, raw[u], c + u, ex[u]);
    }
};

// A warp's current group for sinks that scale the decoded pairs themselves (dequant, GEMM, wgmma): its decode state
// and (s, s) of column col(j), entered when the group changes.
template <class Fmt>
struct GroupScales {
    int group = -1;
    typename Fmt::State st;
    half2 scale[4];

    template <int B>
    __device__ void enter(int group_key, const typename Fmt::Raw& raw, int g)
    {
        if (group_key == group) return;
        Fmt::template enter<B>(raw, g, st);
        scale[0] = __low2half2(st.scale[0]); scale[1] = __high2half2(st.scale[0]);
        scale[2] = __low2half2(st.scale[1]); scale[3] = __high2half2(st.scale[1]);
        group = group_key;
    }
};

// Sinks that read nothing else per chunk.
struct NoExtra {
    struct Extra {};

    template <int B, int U>
    __device__ void extras(int, Extra (&)[U]) const {}
};

// One width run [c, end) of a strip, from span offset off: batches of batch<B>() chunks (Sink::BATCH if set), then the
// run's last ones.
// Sinks with PIPELINE (the staged matmuls) issue the next batch's loads before consuming the current one, so a warp's
// demand loads stay in flight while it computes (the registers this takes cost one resident block per SM, and
// still measured 5-38 % faster at M = 1: docs/decode-matmul.md).
template <int B, class Fmt, class Sink>
__device__ __forceinline__ void walk_run(const typename Fmt::Cursor& cur, const int2* meta, const Stream& st,
                                         unsigned off, int c, int end, int lane, Sink& sink)
{
    constexpr int U = Sink::BATCH > 0 ? Sink::BATCH : batch<B>(), BYTES = 128 * B;
    if constexpr (Sink::PIPELINE) {
        if (c + U <= end) {
            Batch<U, B, Fmt, Sink> now;
            st.ahead(off, off + U * BYTES, lane);
            now.fetch(cur, meta, st, off, lane, c, sink);
            for (; c + 2 * U <= end; c += U, off += U * BYTES, meta += U) {
                Batch<U, B, Fmt, Sink> next;
                st.ahead(off + U * BYTES, off + 2 * U * BYTES, lane);
                next.fetch(cur, meta + U, st, off + U * BYTES, lane, c + U, sink);
                now.consume(c, sink);
                now = next;
            }
            now.consume(c, sink);
            c += U, off += U * BYTES, meta += U;
        }
    } else {
        for (; c + U <= end; c += U, off += U * BYTES, meta += U) {
            st.ahead(off, off + U * BYTES, lane);
            Batch<U, B, Fmt, Sink> now;
            now.fetch(cur, meta, st, off, lane, c, sink);
            now.consume(c, sink);
        }
    }
    for (; c < end; ++c, off += BYTES, ++meta) {                        // already prefetched by the batches
        Batch<1, B, Fmt, Sink> one;
        one.fetch(cur, meta, st, off, lane, c, sink);
        one.consume(c, sink);
    }
}

// The chunks of width B = width_of(I) within [c0, c1).
template <int I, class Fmt, class Sink>
__device__ __forceinline__ void walk_width(const Part& pt, const typename Fmt::Cursor& cur, const int2* meta_s,
                                           const Stream& st, int c0, int c1, int chunk_word0, int lane, Sink& sink)
{
    constexpr int B = width_of(I);
    if constexpr (Fmt::template has_width<B>()) {
        const int lo = max(c0, pt.run_start[I]), hi = min(c1, pt.run_start[I + 1]);
        if (lo < hi)
            walk_run<B, Fmt>(cur, meta_s + (lo - c0), st,
                             4u * (pt.run_word[I] + 32 * B * (lo - pt.run_start[I]) - chunk_word0), lo, hi, lane,
                             sink);
    }
}

// Chunks of split s = [c0, c1) of one strip (the stream st), width by width: straight-line code, so each width's
// loop keeps its own registers. meta_s: chunk_meta[c0..c1).
template <class Fmt, class Sink>
__device__ __forceinline__ void walk(const Part& pt, int strip, int split, const int2* meta_s, const Stream& st,
                                     int lane, Sink& sink)
{
    const typename Fmt::Cursor cur = Fmt::cursor(pt, strip, lane / 4);
    const int c0 = pt.split_chunk[split], c1 = pt.split_chunk[split + 1], w0 = pt.split_word[split];
    walk_width<0, Fmt>(pt, cur, meta_s, st, c0, c1, w0, lane, sink);
    walk_width<1, Fmt>(pt, cur, meta_s, st, c0, c1, w0, lane, sink);
    walk_width<2, Fmt>(pt, cur, meta_s, st, c0, c1, w0, lane, sink);
    walk_width<3, Fmt>(pt, cur, meta_s, st, c0, c1, w0, lane, sink);
    walk_width<4, Fmt>(pt, cur, meta_s, st, c0, c1, w0, lane, sink);
    walk_width<5, Fmt>(pt, cur, meta_s, st, c0, c1, w0, lane, sink);
}

// chunk_meta[c0..c1) into shared memory (every thread of the block takes part).
__device__ __forceinline__ void stage_meta(int2* meta_s, const int2* chunk_meta, int c0, int c1)
{
    for (int c = c0 + (int)threadIdx.x; c < c1; c += blockDim.x) meta_s[c - c0] = __ldg(chunk_meta + c);
}

// ------------------------------------------------------------------------------------------- staging x

__device__ __forceinline__ float bias_at(const half* bias, int col) { return bias ? __half2float(bias[col]) : 0.f; }

// r = fp16(x + residual) of the block's row of x (row: its offset in x; residual null: r = x) into shared memory
// (K halves, dynamic; x and residual 16-byte aligned, K % 8 == 0: the launchers check), and its inverse RMS, as
// norm.cu computes them (norm.cuh). Every thread of the block calls it (block_sum's barrier, which also publishes r).
__device__ __forceinline__ float residual_row(const half* x, const half* residual, int K, size_t row, float eps)
{
    static_assert(THREADS == NORM_THREADS, "norm.cuh sums a row over NORM_THREADS threads");
    extern __shared__ __align__(16) half r_s[];
    float sum_sq = 0.f;
    for (int i = threadIdx.x * 8; i < K; i += THREADS * 8) {
        uint4 xv = *reinterpret_cast<const uint4*>(x + row + i);
        half* r = reinterpret_cast<half*>(&xv);
        if (residual) {
            const uint4 bv = *reinterpret_cast<const uint4*>(residual + row + i);
            const half* b = reinterpret_cast<const half*>(&bv);
#pragma unroll
            for (int j = 0; j < 8; j++) r[j] = add_residual(r[j], b[j]);
        }
        *reinterpret_cast<uint4*>(r_s + i) = xv;
        sum_sq += sum_squares<8>(r);
    }
    return inverse_rms(block_sum(sum_sq), K, eps);
}

// The add_rmsnorm of the block's row of x (residual_row), fp16(w * fp16(r * inv_rms)) at the lane's src, w = the norm
// weight there; a writer block (part 0, row m < M) writes its 256 elements of r, 256 bx on, to new_residual.
__device__ __forceinline__ half stage_norm(const half* x, const half* residual, half w, half* new_residual, int K,
                                           size_t row, int src, float eps, bool writer, int bx)
{
    extern __shared__ __align__(16) half r_s[];
    const float inv_rms = residual_row(x, residual, K, row, eps);
    const int e = bx * THREADS + threadIdx.x;
    if (writer && residual && e < K) new_residual[row + e] = r_s[e];
    return normalise(r_s[src], w, inv_rms);
}

// The gated MLP's fp16(fp16(silu(gate)) * up), rounded as activation.cu's silu_mul.
__device__ __forceinline__ half silu_mul(half gate, half up)
{
    const half act = __float2half_rn(silu(__half2float(gate)));
    return __float2half_rn(__fmul_rn(__half2float(act), __half2float(up)));
}

}  // namespace qmm

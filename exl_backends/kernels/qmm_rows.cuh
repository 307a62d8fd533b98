// qmm_rows.cuh: the one- to sixteen-row matmul (matmul_part / matmul_part_staged, the split-K reduction),
// stage_xs, and the MoE variant (moe_matmul), shared by matmul_rows.cu and matmul_moe.cu.
//
// MATMUL KERNELS  <fmt>_matmul_m1 / _m8 / _m16 (M = rows of x: 1, <= 8, <= 16), each after stage_xs
//   stage_xs writes x (or the gated MLP's silu(x) * up) once per launch as the matmul reads it: each part's R = 1, 8 or
//   16 rows (rows past M repeat row M - 1) in stored order (x' = x * 2^-i for FOLDED rows), then (R > 1) each chunk's
//   corrections per row (float2 (sum_r 1024 x'_r, sum_r x_r) for FOLDED widths; m1 sums them itself). Grid (sum of
//   the parts' blocks), block S = 8 or 7 warps, one a strip, dynamic shared memory: the split's chunk_meta entries.
//   The launcher sizes the grid to one wave of resident blocks where it can. A warp first prefetches into L2 the start
//   of its weight span (PREFETCH_BYTES) and all group records of its range, and the block stages its chunk_meta
//   entries: all from the parameters, so this overlaps the kernel before (dependent launch, common.cuh). After
//   pdl_wait, warp w walks the chunks of strip S bx + w in batches (each batch prefetches into L2 the span
//   PREFETCH_BYTES ahead, so DRAM reads are in flight without holding registers), loading with each chunk's words its
//   B fragments of x and (m8, m16) its corrections (L2): per chunk each lane decodes its 32 codes into 16 half2
//   values (code - z; FOLDED: 1024 + code * 2^i) and issues m16n8k16 MMAs with A = 16 columns x 16 rows of them,
//   B = 16 rows x 8 rows of x, C = fp32 partial of the current group. At each group change the partial (minus the
//   FOLDED corrections) is scaled by the group's per-column scale (fp32) and added to the accumulator, so results are
//   exact products accumulated in fp32 (FOLDED: up to the fp32 rounding of the larger sums). The EXL2 scale is
//   computed exactly as fp16((c + 1)^2 * fp16(q_scale_max*2^-8)).
//   (docs/decode-matmul.md: a per-block prologue that gathered x into shared memory was ~35 % of the M1 warps' time.)
//   The MoE kernels stage x per block instead (matmul_part: x gather and corrections in shared memory after
//   pdl_wait; the perm reads of the gather's first round before it), since each block serves its expert's rows.
//   n_splits == 1: the warp adds bias and writes y (fp16). n_splits > 1: the warp writes its fp32 partial to ws
//   [part.ws_offset + (split * M + m) * Np + col], then counts itself in counters[strip]; the last warp of a strip
//   to finish sums the partials in split order (deterministic), adds bias, writes y, and resets the counter to 0
//   for the next launch.
//
#pragma once
#include "qmm.cuh"

// TRACE (a probe; QMM_TRACE=n, 0 by default, and then Stamps compiles to nothing): lane 0 of each working warp of a
//   stage_xs or one-row-class matmul block stamps %globaltimer (ns, one clock for all SMs) at its start, when its
//   wait is over (the kernel or op before is done), when its walk over the weights ends, and at its end (partials
//   written; for a strip's last warp, the reduction), a split's warps also after their arrival at the strip's
//   counter (the last to arrive flagged: it sums), then appends them as one TraceRecord to qmm_trace[0 .. n)
//   (qmm_trace_n counts, past n too). The stamps wait in shared memory, so the kernels' registers are as without.
//   benchmarks/bench_segment.py --trace reads them back and says where each op's time goes (trace_step.py: in the
//   whole replayed decode step, beside attention.cu's).
#ifndef QMM_TRACE
#define QMM_TRACE 0
#endif

struct TraceRecord {
    unsigned long long t[5];     // start, wait over, walk over, end (stage_xs: the last two are its end), arrived
                                 // (split warps; else 0)
    unsigned op;                 // kind (0 stage_xs, 1 matmul) | n_parts << 1 | K / 32 << 4
    unsigned where;              // SM << 16 | summed << 15 | warp << 12 | block % 4096
};

#if QMM_TRACE
extern "C" {
__device__ TraceRecord qmm_trace[QMM_TRACE];
__device__ unsigned qmm_trace_n;
}
#endif

namespace qmm {

using namespace exl;

struct Stamps {
#if QMM_TRACE
    __device__ __forceinline__ static unsigned long long* slot()
    {
        __shared__ unsigned long long stamps_s[32][6];        // the 5 stamps, whether the warp summed
        return stamps_s[threadIdx.x / 32];
    }
    __device__ __forceinline__ void at(int i) const
    {
        const unsigned long long t = globaltimer();
        if (threadIdx.x % 32 == 0) slot()[i] = t;
    }
    __device__ __forceinline__ void start() const
    {
        at(0);
        if (threadIdx.x % 32 == 0) slot()[4] = slot()[5] = 0;
    }
    __device__ __forceinline__ void summed() const
    {
        if (threadIdx.x % 32 == 0) slot()[5] = 1;
    }
    __device__ __forceinline__ void emit(int kind, int n_parts, int K, int block) const
    {
        if (threadIdx.x % 32) return;
        const unsigned i = atomicAdd(&qmm_trace_n, 1u);
        if (i >= QMM_TRACE) return;
        const unsigned sm = smid();
        TraceRecord& r = qmm_trace[i];
        for (int k = 0; k < 5; ++k) r.t[k] = slot()[k];
        r.op = kind | n_parts << 1 | K / 32 << 4;
        r.where = sm << 16 | (unsigned)slot()[5] << 15 | threadIdx.x / 32 << 12 | block % 4096;
    }
#else
    __device__ __forceinline__ void at(int) const {}
    __device__ __forceinline__ void start() const {}
    __device__ __forceinline__ void summed() const {}
    __device__ __forceinline__ void emit(int, int, int, int) const {}
#endif
};

// ------------------------------------------------------------------------------------------- matmul

template <bool C, class A, class B> struct Pick { using T = A; };
template <class A, class B> struct Pick<false, A, B> { using T = B; };

// x as stage_xs left it, read per chunk with the weights (GX sinks): the lane's B fragments of the two k16 steps
// for each x-row tile, and (several rows) the chunk's corrections of rows 2q, 2q + 1 of each tile as (x, y, z, w).
template <int N8, bool M1>
struct XChunk {
    uint2 b[N8][2];
    float4 corr[N8];
};
template <int N8>
struct XChunk<N8, true> {
    uint2 b[N8][2];
};

// Accumulates y^T for the warp's 32 columns: acc[t][n] is the C fragment of column tile t (columns 16t..16t+15
// of the strip) and x-row tile n (rows 8n..8n+7). M1: only x row 0, i.e. fragment entries 0 and 2.
// One row (M1) sums each FOLDED chunk's corrections itself, where more rows read stage_xs's: every B column of the
// MMA is x row 0 there, so two more MMAs a chunk with a constant A (rows 0-7 all 1024, rows 8-15 each k's 2^i)
// against the x fragments the chunk multiplies leave (sum 1024 x', sum x) in every lane's C, summed over the group
// in fp32 (2026-12-07: launch-per-op's step within 0.5 % of the loaded corrections, 14 fewer instructions a 4-bit
// batch; docs/megakernel.md).
// GX (the dense launches): x and the corrections come from global memory (stage_xs's output) in the batches, not
// from the block's shared memory (MoE stages them per block).
template <class Fmt, int N8, bool M1, bool GX = false>
struct MatmulSink {
    // Every staged kernel pipelines its batches (walk_run), the 8- and 16-row ones at one block per SM for the
    // registers (docs/decode-matmul.md); MoE's 16-row kernel (two blocks per SM, x in shared memory) does not.
    static constexpr bool PIPELINE = M1 || GX;
    static constexpr int BATCH = 0;            // chunks per batch: 0 for batch<B>() (walk_run)
    static constexpr int ROWS = M1 ? 1 : 8 * N8;       // GX: x rows staged (rows past M repeat row M - 1)
    using Extra = typename Pick<GX, XChunk<N8, M1>, NoExtra::Extra>::T;
    // B fragments come from x row min(g, M-1) (+ tile1 for row min(8+g, M-1)), columns 4q.. of the current chunk.
    // Clamping needs no zero fill: rows past M only feed the MMA columns of x rows >= M, which are never written.
    const half* xc;
    int tile1;
    const float2* corr;      // the split's corrections [chunk - c0][M] (FOLDED widths; not M1)
    int c0, M;
    const half* xg;          // GX: the part's x in stored order [ROWS][K], at row g (M1: row 0)
    size_t tile_step;        // GX: halves from row g to row 8 + g
    const float2* cg;        // GX: its corrections [chunk][ROWS], at row 2q (not M1)
    int group = -1;
    typename Fmt::State st;
    float sf[4] = {};        // scales of the current group's columns col(0..3), fp32
    float zf[4] = {};        // zero points of those columns (FOLDED widths)
    float s1[N8][2] = {}, s0[N8][2] = {};     // the group's sum of corrections of x rows 8n + 2q + e (not M1)
    float cs[4] = {};        // M1: the constant A's C: {sum 1024 x', the same, sum x, the same} over the group
    float part[2][N8][4] = {};
    float acc[2][N8][4] = {};

    __device__ void flush()
    {
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int n = 0; n < N8; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    if (!M1 || i % 2 == 0) {
                        const int j = 2 * t + i / 2;
                        const float offset = M1 ? fmaf(zf[j], cs[2], cs[0])
                                                : fmaf(zf[j], s0[n][i % 2], s1[n][i % 2]);
                        acc[t][n][i] = fmaf(part[t][n][i] - offset, sf[j], acc[t][n][i]);
                        part[t][n][i] = 0.f;
                    }
#pragma unroll
        for (int n = 0; n < N8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) s1[n][e] = s0[n][e] = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) cs[i] = 0.f;
    }

    // Chunks c .. c + U - 1: from one 64-bit pointer per batch, so every load takes an immediate offset (per-chunk
    // 32-bit indexes cost ~13 address instructions per chunk: ncu, docs/decode-matmul.md).
    template <int B, int U>
    __device__ void extras(int c, Extra (&ex)[U]) const
    {
        if constexpr (GX) {
            const float2* cb = cg + (ptrdiff_t)c * ROWS;
#pragma unroll
            for (int n = 0; n < N8; ++n) {
                const uint2* xb =
                    reinterpret_cast<const uint2*>(xg + n * tile_step + 32 * (ptrdiff_t)c) + threadIdx.x % 4;
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    ex[u].b[n][0] = __ldg(xb + 8 * u);        // rows 4q .. 4q + 3 of chunk c + u
                    ex[u].b[n][1] = __ldg(xb + 8 * u + 4);    // rows 16 + 4q ..
                    if constexpr (!M1)                        // rows 8n + 2q, + 1: 16-byte aligned
                        ex[u].corr[n] = folded<B>() ? __ldg(reinterpret_cast<const float4*>(cb + u * ROWS + 8 * n))
                                                    : make_float4(0.f, 0.f, 0.f, 0.f);
                }
            }
        }
    }

    template <int B>
    __device__ void chunk(const unsigned (&w)[B], int group_key, const typename Fmt::Raw& raw, int c, const Extra& ex)
    {
        if (group_key != group) {
            flush();
            Fmt::template enter<B>(raw, g(), st);
            sf[0] = __low2float(st.scale[0]); sf[1] = __high2float(st.scale[0]);
            sf[2] = __low2float(st.scale[1]); sf[3] = __high2float(st.scale[1]);
#pragma unroll
            for (int j = 0; j < 4; ++j) zf[j] = Fmt::template zero<B>(raw, j);
            group = group_key;
        }
        half2 a[16];
        if constexpr (folded<B>() && M1) {
            decode_raw<B>(w, a);
            // A: k < 8 are rows with (r >> 1) & 1 clear (2^i = 1), k >= 8 set (2^i = 16 at 4 bits)
            constexpr unsigned k1024 = 0x64006400u, one = 0x3c003c00u, hi = B == 4 ? 0x4c004c00u : one;
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                const uint2 v = x_fragment(ex, 0, s);
                mma_16816(cs, k1024, one, k1024, hi, v.x, v.y);
            }
        } else if constexpr (folded<B>() && GX) {
            decode_raw<B>(w, a);
#pragma unroll
            for (int n = 0; n < N8; ++n) {
                s1[n][0] += ex.corr[n].x;
                s0[n][0] += ex.corr[n].y;
                s1[n][1] += ex.corr[n].z;
                s0[n][1] += ex.corr[n].w;
            }
        } else if constexpr (folded<B>()) {
            decode_raw<B>(w, a);
            const float2* cc = corr + (c - c0) * M;
            const int q = threadIdx.x % 4;
#pragma unroll
            for (int n = 0; n < N8; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float2 v = cc[min(8 * n + 2 * q + e, M - 1)];
                    s1[n][e] += v.x;
                    s0[n][e] += v.y;
                }
        } else {
            decode_pairs<B, Fmt>(w, st, a);
        }
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            unsigned b[N8][2];
#pragma unroll
            for (int n = 0; n < N8; ++n) {
                const uint2 v = x_fragment(ex, n, s);
                b[n][0] = v.x;                         // rows 16s + 4q, +1  (MMA k = 2q, 2q+1)
                b[n][1] = v.y;                         // rows 16s + 4q + 2, +3  (MMA k = 2q+8, 2q+9)
            }
#pragma unroll
            for (int t = 0; t < 2; ++t)
#pragma unroll
                for (int n = 0; n < N8; ++n)           // A rows g / g+8 = columns col(2t) / col(2t+1)
                    mma_16816(part[t][n], as_bits(a[8 * t + 2 * s]), as_bits(a[8 * t + 4 + 2 * s]),
                              as_bits(a[8 * t + 2 * s + 1]), as_bits(a[8 * t + 4 + 2 * s + 1]), b[n][0], b[n][1]);
        }
        if constexpr (!GX) xc += 32;
    }

    // The lane's B fragment of x-row tile n for k16 step s of the current chunk.
    __device__ uint2 x_fragment(const Extra& ex, int n, int s) const
    {
        if constexpr (GX) return ex.b[n][s];
        else return *reinterpret_cast<const uint2*>(xc + n * tile1 + 16 * s);
    }

    __device__ static int g() { return threadIdx.x % 32 / 4; }
};

// Width of chunk c (from the part's runs).
__device__ __forceinline__ int width_at(const Part& pt, int c)
{
    int b = 2;
#pragma unroll
    for (int i = N_WIDTHS - 1; i >= 0; --i)
        if (c < pt.run_start[i + 1]) b = width_of(i);
    return b;
}

// 2^-i of row r of a chunk of width b (FOLDED widths; 1 otherwise).
__device__ __forceinline__ float row_scale(int b, int r) { return b == 4 && (r >> 1 & 1) ? 0.0625f : 1.f; }

// One round of the x gather: for rows base + u * THREADS of a split (u < STAGE_LOADS), the row of x each comes
// from (perm) and its FOLDED scale 2^-i. These depend on the weights only, so the first round is prepared before
// pdl_wait: the perm reads (an L2 round trip) overlap the kernel before this one.
struct GatherRound {
    int src[STAGE_LOADS];
    float scale[STAGE_LOADS];

    __device__ __forceinline__ void prepare(const Part& pt, int c0, int rows, int base)
    {
        const int r0 = 32 * c0;
#pragma unroll
        for (int u = 0; u < STAGE_LOADS; ++u) {
            const int r = max(0, min(base + u * THREADS, rows - 1));   // past the end: a repeat of the last row
            src[u] = pt.perm ? __ldg(pt.perm + r0 + r) : r0 + r;
            scale[u] = row_scale(width_at(pt, c0 + r / 32), r % 32);
        }
    }
};

// x rows [32 c0, 32 c1) of stored order into shared memory: xs[m][r] = x[m][perm[32 c0 + r]] (x' = x * 2^-i for
// FOLDED rows). first: the first round, prepared. Each thread has ROWS * STAGE_LOADS independent gathers in flight
// (they hit L2: x is shared by every block): a row at a time, 16 rows took 16 L2 round trips before the first MMA.
template <int ROWS>
__device__ __forceinline__ void stage_x(half* xs, const half* x, const Part& pt, int M, int K, int c0, int c1,
                                        int xs_stride, GatherRound round)
{
    const int rows = 32 * (c1 - c0);
    for (int base = threadIdx.x; base < rows; base += THREADS * STAGE_LOADS) {
        if (base != (int)threadIdx.x) round.prepare(pt, c0, rows, base);
        for (int m0 = 0; m0 < M; m0 += ROWS) {
            half v[ROWS][STAGE_LOADS];
#pragma unroll
            for (int i = 0; i < ROWS; ++i)                     // rows past M: a harmless repeat of row M - 1
#pragma unroll
                for (int u = 0; u < STAGE_LOADS; ++u)
                    v[i][u] = __ldg(x + (size_t)min(m0 + i, M - 1) * K + round.src[u]);
#pragma unroll
            for (int i = 0; i < ROWS; ++i)
#pragma unroll
                for (int u = 0; u < STAGE_LOADS; ++u) {
                    const int r = base + u * THREADS;
                    if (m0 + i < M && r < rows)
                        xs[(m0 + i) * xs_stride + r] = __float2half_rn(__half2float(v[i][u]) * round.scale[u]);
                }
        }
    }
}

// y (+ bias) for column col of a strip whose n_splits partials are in: each x row's partials added in split order
// (deterministic). ROWS x rows at a time with SPLITS partials each in flight per lane (one row at a time, 16 rows
// took 16 L2 round trips).
template <int ROWS, int SPLITS>
__device__ __forceinline__ void reduce_splits(const float* parts, half* y, const half* bias, int M, int N, int Np,
                                              int ws_rows, int n_splits, int col)
{
    for (int m0 = 0; m0 < M; m0 += ROWS) {
        float sum[ROWS] = {};
        for (int s0 = 0; s0 < n_splits; s0 += SPLITS) {
            float v[ROWS][SPLITS];
#pragma unroll
            for (int i = 0; i < ROWS; ++i)
#pragma unroll
                for (int u = 0; u < SPLITS; ++u)
                    v[i][u] = m0 + i < M && s0 + u < n_splits
                                  ? __ldcg(parts + ((size_t)(s0 + u) * ws_rows + m0 + i) * Np + col) : 0.f;
#pragma unroll
            for (int i = 0; i < ROWS; ++i)
#pragma unroll
                for (int u = 0; u < SPLITS; ++u) sum[i] += v[i][u];
        }
#pragma unroll
        for (int i = 0; i < ROWS; ++i)
            if (m0 + i < M && col < N) y[(size_t)(m0 + i) * N + col] = __float2half_rn(sum[i] + bias_at(bias, col));
    }
}

// Per chunk of the split and x row m: (sum_r 1024 x'_r, sum_r x_r) over its 32 rows for FOLDED widths ((0, 0)
// otherwise), x'_r as staged and x_r = x'_r * 2^i (what the MMA's products amount to). A warp takes a chunk at a
// time, P lanes per x row, each lane 32 / P rows of it.
__device__ __forceinline__ void stage_corrections(float2* corr, const half* xs, const Part& pt, int M, int c0, int c1,
                                                  int xs_stride)
{
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int P = M <= 1 ? 32 : M <= 2 ? 16 : M <= 4 ? 8 : M <= 8 ? 4 : 2, per = 32 / P;
    const int m = lane / P, r0 = lane % P * per;
    for (int c = warp; c < c1 - c0; c += WARPS) {
        const int b = width_at(pt, c0 + c);
        float lo = 0.f, hi = 0.f;                   // rows with (r >> 1) & 1 clear / set
        if (m < M)
            for (int r = r0; r < r0 + per; ++r) {
                const float v = __half2float(xs[m * xs_stride + 32 * c + r]);
                if (r >> 1 & 1) hi += v; else lo += v;
            }
        for (int span = P / 2; span >= 1; span /= 2) {
            lo += __shfl_xor_sync(FULL_MASK, lo, span);
            hi += __shfl_xor_sync(FULL_MASK, hi, span);
        }
        if (m < M && lane % P == 0)
            corr[c * M + m] = (b == 4 || b == 6 || b == 8)
                                  ? make_float2(1024.f * (lo + hi), lo + hi / row_scale(b, 2)) : make_float2(0.f, 0.f);
    }
}

// Calls f(value, m, col) for each of the warp's accumulators of its strip with x row m < M (acc[t][n][i]: column
// strip*32 + 16t + g + 8(i/2), x row 8n + 2q + i%2; M1: entries 0 and 2 only).
template <int N8, bool M1, class F>
__device__ __forceinline__ void for_each_acc(const float (&acc)[2][N8][4], int strip, int M, F f)
{
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int n = 0; n < N8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int m = 8 * n + 2 * q + i % 2;
                if ((!M1 || i % 2 == 0) && m < M) f(acc[t][n][i], m, strip * 32 + 16 * t + g + 8 * (i / 2));
            }
}

// STAGE-FREE NORM (one row; docs/megakernel.md "The norm stages"): the add + RMSNorm between two one-row launches
//   done at their two ends instead of by a stage_xs launch between them. The producer (o, down: one part of N
//   columns) writes no y: the lane that finishes column col forms the stream's new residual
//   r = fp16(fp16(y + bias) + residual) (norm.cuh add_residual, as add_rmsnorm), writes it to new_residual, writes the
//   next launch's x unnormalised, fp16(r * w') with w' = w * 2^-e (the norm's weight scaled so that |w'| <= 1, so
//   r * w' cannot overflow), into each of the consumer's parts as stage_xs would stage it (element col to
//   x[i * N + (place & 0x7fffffff)], times 2^-4 where bit 31 is set: QuantMatmul.stored_x), and its strip's sum of
//   r^2 (fp32, the 32 lanes by a fixed tree) to sums[strip]. The consumer (q/k/v, gate/up) multiplies each output
//   by 2^e / rms before its bias, rms from the N / 32 sums added in one fixed order by every finishing warp:
//   W (r w') 2^e / rms = W (r w / rms), the staged path's result up to rounding (the norm's scale comes after the
//   matmul, once, instead of before it). What a column's end reads comes into the warp's shared memory by cp.async
//   while it walks (fetch_end, EndLines: the kernel has no registers to hold it): read at the end from L2 it cost
//   ~0.5 us a launch (probe, e116559). Every Chain field is read from the kernel's parameters (the constant bank):
//   through a generic pointer each read was a memory round trip (+1-3 us a launch, 5b9f8eb). The Chain struct is
//   in qmm.cuh, with Params.

// Warp-wide sum by a fixed tree: the same bits in every lane and every warp.
__device__ __forceinline__ float warp_sum(float v)
{
    for (int span = 16; span >= 1; span /= 2) v += __shfl_xor_sync(FULL_MASK, v, span);
    return v;
}

// Whether a one-row launch's chain asks for more than y.
__device__ __forceinline__ bool chained(const Chain& ch) { return ch.x || ch.sums_in; }

// The lines a warp's column end reads (STAGE-FREE NORM, PAIRED ENDS), copied into its shared memory by cp.async
// while it walks (no registers held, no wait): a producer's places and w' before the wait, its residual after; a
// consumer's first END_SUMS sums after the wait (more are read at the end). A gated launch is both.
constexpr int END_SUMS = 128;
struct EndLines {
    struct {
        int place[MAX_PARTS][32];
        half w[32], residual[32];
    } out;
    float sums[END_SUMS];
};

// The warp's strip's lines into end (before the wait: after = false; after it: true); every lane calls it.
__device__ __forceinline__ void fetch_end(const Chain& ch, EndLines* end, int strip, bool after)
{
    const int lane = threadIdx.x % 32, c0 = strip * 32;
    if (ch.x && !after) {
        if (lane < 8 * ch.n_places)                  // 8 lanes a part's 32 places, 4 more the 32 weights
            copy_async16(&end->out.place[lane / 8][lane % 8 * 4], ch.places[lane / 8] + c0 + lane % 8 * 4, true);
        else if (lane >= 24 && lane < 28 && ch.w)
            copy_async16(&end->out.w[(lane - 24) * 8], ch.w + c0 + (lane - 24) * 8, true);
    }
    if (ch.residual && after && lane < 4)
        copy_async16(&end->out.residual[lane * 8], ch.residual + c0 + lane * 8, true);
    if (ch.sums_in && after)
        for (int j = lane * 4; j < min(ch.dim / 32, END_SUMS); j += 128)
            copy_async16(&end->sums[j], ch.sums_in + j, true);
    copy_async_commit();
}

// What a chained warp does as soon as its walk is over, ahead of the wait for the strip's other splits (the
// cluster barrier, the counter), where the strip's end would wait for it: fetch_end's lines in (every lane's), and
// the consumer's 2^e / rms (1 for others).
__device__ __forceinline__ float end_scale(const Chain& ch, const EndLines* end)
{
    copy_async_wait<0>();
    __syncwarp();
    if (!ch.sums_in) return 1.f;
    float sq = 0.f;
    for (int j = threadIdx.x % 32; j < ch.dim / 32; j += 32) sq += j < END_SUMS ? end->sums[j] : __ldg(ch.sums_in + j);
    return ch.unscale * inverse_rms(warp_sum(sq), ch.dim, ch.eps);
}

// Column col's y = fp16(v + bias) from its sum over K (v, every split's), a consumer's v first scaled (scale:
// end_scale's).
__device__ __forceinline__ half column_value(const Chain& ch, const Part& pt, int col, float v, float scale)
{
    if (ch.sums_in) v *= scale;
    return __float2half_rn(v + (col < pt.n ? bias_at(pt.bias, col) : 0.f));
}

// Column strip * 32 + lane of a one-row launch, its sum over K (v, every split's) in hand: y = fp16(v + bias), or
// as ch says (STAGE-FREE NORM; scale: end_scale's). Every lane of the warp calls it.
__device__ __forceinline__ void end_column(const Chain& ch, const EndLines* end, float scale, const Part& pt,
                                           int strip, float v, half* y)
{
    const int lane = threadIdx.x % 32, col = strip * 32 + lane;
    const bool in = col < pt.n;
    const half h = column_value(ch, pt, col, v, scale);
    if (!ch.x) {
        if (in) y[col] = h;
        return;
    }
    float sq = 0.f;
    if (in) {
        const half r = add_residual(h, end->out.residual[lane]);
        ch.new_residual[col] = r;
        const float rw = __half2float(r) * __half2float(end->out.w[lane]);   // exact in fp32 (11-bit significands)
        for (int i = 0; i < ch.n_places; ++i) {
            const int place = end->out.place[i][lane];
            ch.x[(size_t)i * pt.n + (place & 0x7fffffff)] = __float2half_rn(place < 0 ? rw * 0.0625f : rw);
        }
        sq = __half2float(r) * __half2float(r);
    }
    sq = warp_sum(sq);
    if (lane == 0) ch.sums[strip] = sq;
}

// PAIRED ENDS (one row; docs/megakernel.md "The down stage"): a gate/up launch fed by o (a consumer, STAGE-FREE
//   NORM) whose ends write down's x themselves, so that no stage_xs launch sits between gate/up and down. Gate's
//   strip s and up's strip s hold the same 32 intermediate columns; both parts count their arrivals on one counter
//   a strip (every split partial written, even unsplit), and the last of the strip's n_splits(gate) + n_splits(up)
//   warps sums both parts' partials in split order, forms gate and up as column_value would (fp16, bias), then
//   x = fp16(silu(gate)) * up as stage_xs does (silu_mul) and stores it at down's place (times 2^-4 where bit 31 is
//   set). Gate/up's own outputs are not written. The launch runs without clusters (a cluster holds one part's
//   splits); its down x is then the staged path's bit for bit.
template <int N8>
__device__ __forceinline__ void finish_pair(const float (&acc)[2][N8][4], const Params& p, const Part& pt, int split,
                                            int strip, float* ws, const Chain& ch, const EndLines* end, float scale)
{
    const int lane = threadIdx.x % 32, col = strip * 32 + lane;
    const Part &gate = p.part[0], &up = p.part[1];
    float* base = ws - pt.ws_offset;             // the launch's partials: part i's from part[i].ws_offset
    float* mine = ws + (size_t)split * pt.np;
    for_each_acc<N8, true>(acc, strip, 1, [&](float v, int, int c) { mine[c] = v; });
    __syncwarp();                                // the warp's partials, then its arrival (release)
    int done = 0;
    if (lane == 0) done = arrive(pt.counters + strip);
    done = __shfl_sync(FULL_MASK, done, 0);
    if (done != gate.n_splits + up.n_splits - 1) return;
    __syncwarp();                                // the strip's last warp: both parts' partials are in
    float g = 0.f, u = 0.f;                      // reduce_splits' order: split 0 first
    for (int s = 0; s < gate.n_splits; ++s) g += __ldcg(base + gate.ws_offset + (size_t)s * gate.np + col);
    for (int s = 0; s < up.n_splits; ++s) u += __ldcg(base + up.ws_offset + (size_t)s * up.np + col);
    const half x = silu_mul(column_value(ch, gate, col, g, scale), column_value(ch, up, col, u, scale));
    if (col < gate.n) {
        const int place = end->out.place[0][lane];
        ch.x[place & 0x7fffffff] = __float2half_rn(__half2float(x) * (place < 0 ? 0.0625f : 1.f));
    }
    if (lane == 0) pt.counters[strip] = 0;      // (one counter for both parts)
}

// The warp's accumulators of its strip: y (+ bias) without splits, else the split's partials, and the strip's last
// warp to arrive reduces them.
template <int N8, bool M1>
__device__ __forceinline__ void finish(const float (&acc)[2][N8][4], const Part& pt, int split, int strip, int M,
                                       half* y, float* ws, int ws_rows, int* counters, const Stamps& stamps = {},
                                       const Chain& ch = Chain{}, const EndLines* end = nullptr, float scale = 1.f)
{
    const int lane = threadIdx.x % 32;
    const int N = pt.n, Np = pt.np;
    if (M1 && chained(ch) && pt.n_splits == 1) {   // lane l takes column l from lane 4 (l % 8), which holds it
        const int from = 4 * (lane % 8);       // column 16 t + 8 h + g: acc[t][0][2 h] of lane 4 g
        const float v00 = __shfl_sync(FULL_MASK, acc[0][0][0], from), v02 = __shfl_sync(FULL_MASK, acc[0][0][2], from);
        const float v10 = __shfl_sync(FULL_MASK, acc[1][0][0], from), v12 = __shfl_sync(FULL_MASK, acc[1][0][2], from);
        const bool h = lane % 16 >= 8;
        end_column(ch, end, scale, pt, strip, lane < 16 ? (h ? v02 : v00) : (h ? v12 : v10), y);
        return;
    }
    if (pt.n_splits == 1) {
        for_each_acc<N8, M1>(acc, strip, M, [&](float v, int m, int col) {
            if (col < N) y[(size_t)m * N + col] = __float2half_rn(v + bias_at(pt.bias, col));
        });
        return;
    }
    float* part = ws + (size_t)split * ws_rows * Np;
    for_each_acc<N8, M1>(acc, strip, M, [&](float v, int m, int col) { part[(size_t)m * Np + col] = v; });
    __syncwarp();                                // the warp's partials, then its arrival (release)
    int done = 0;
    if (lane == 0) done = arrive(counters + strip);
    done = __shfl_sync(FULL_MASK, done, 0);
    stamps.at(4);
    if (done != pt.n_splits - 1) return;
    stamps.summed();
    __syncwarp();                                // the last warp of the strip: every other split's partial is in
    if constexpr (M1) {
        if (chained(ch)) {
            float sum = 0.f;                     // reduce_splits' order: split 0 first
            for (int s = 0; s < pt.n_splits; ++s) sum += __ldcg(ws + (size_t)s * ws_rows * Np + strip * 32 + lane);
            end_column(ch, end, scale, pt, strip, sum, y);
        } else {
            reduce_splits<1, REDUCE_LOADS>(ws, y, pt.bias, M, N, Np, ws_rows, pt.n_splits, strip * 32 + lane);
        }
    } else
        reduce_splits<REDUCE_ROWS, REDUCE_LOADS / 2>(ws, y, pt.bias, M, N, Np, ws_rows, pt.n_splits, strip * 32 + lane);
    if (lane == 0) counters[strip] = 0;
}

// Block `local` of part pt (of p): y [M, pt.n] = x [M, K] @ W^T (+ bias). Split partials go to
// ws[(split * ws_rows + m) * Np + col] (ws: this part's, row 0), arrivals to counters[strip] (this part's).
template <class Fmt, int N8, bool M1>
__device__ __forceinline__ void matmul_part(const Params& p, const Part& pt, int local, int M, const half* x, half* y,
                                            float* ws, int ws_rows, int* counters)
{
    extern __shared__ __align__(16) unsigned char smem[];
    half* xs = reinterpret_cast<half*>(smem);
    int2* meta_s = reinterpret_cast<int2*>(smem + p.meta_smem);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const int split = local / pt.col_blocks, strip = local % pt.col_blocks * WARPS + warp;
    const int c0 = pt.split_chunk[split], c1 = pt.split_chunk[split + 1];

    Stream st;
    if (strip < pt.strips) {                 // DRAM reads first; they overlap the staging below
        start_stream(st, pt, strip, split, lane);
        prefetch_records<Fmt>(pt, strip, split, lane);
    }
    GatherRound first;                                 // the weights' own metadata: no earlier kernel writes it
    first.prepare(pt, c0, 32 * (c1 - c0), threadIdx.x);
    stage_meta(meta_s, pt.chunk_meta, c0, c1);
    pdl_wait();                                        // x, ws and the counters belong to earlier kernels
    stage_x<M1 ? 1 : STAGE_ROWS>(xs, x, pt, M, p.K, c0, c1, p.xs_stride, first);
    __syncthreads();
    float2* corr = reinterpret_cast<float2*>(smem + p.corr_smem);
    if constexpr (!M1) {                               // (one row: the sink sums them)
        stage_corrections(corr, xs, pt, M, c0, c1, p.xs_stride);
        __syncthreads();
    }
    if (strip >= pt.strips) return;

    MatmulSink<Fmt, N8, M1> sink;
    sink.xc = xs + min(g, M - 1) * p.xs_stride + 4 * q;
    sink.tile1 = (min(8 + g, M - 1) - min(g, M - 1)) * p.xs_stride;
    sink.corr = corr;
    sink.c0 = c0;
    sink.M = M;
    walk<Fmt>(pt, strip, split, meta_s, st, lane, sink);
    sink.flush();
    finish<N8, M1>(sink.acc, pt, split, strip, M, y, ws, ws_rows, counters);
}

// What a block waits for before it reads another kernel's (or op's) output: launch-per-op, the kernel before
// (dependent launch); a megakernel passes a wait for the op before. Called by each warp that goes on (some return
// first), so it may synchronise a warp, never the block.
struct PdlWait {
    __device__ __forceinline__ void operator()() const { pdl_wait(); }
};

// CLUSTER SUMS (sm_90, EXL2; a one-row launch run in thread-block clusters of C = n_splits blocks, every part split
//   the same C ways: planning.cluster_size): the C splits of a column block are the C blocks of one cluster (block b:
//   column block b / C, split b % C, the cluster's rank), each warp leaves its strip's partials in its block's shared
//   memory (sums_s), and after one cluster barrier warp w of the block of rank w % C sums strip w's C partials in
//   split order through distributed shared memory (reduce_splits' arithmetic: the same bits), adds the bias and
//   writes y; a second barrier keeps each block's shared memory until the others have read it. No counter, no
//   workspace: the split-K reduction's two global round trips (~1 us for the arrival, ~0.7 for the sum) become a
//   cluster barrier and a shared-memory read; the launch's tail stays 1.6-1.9 us all the same (the wait for the
//   slowest split), and the gain is where fewer blocks let the next launch start sooner (docs/megakernel.md).
//   Without clusters (C = 1: other GPUs, plans whose parts split differently, the megakernel's persistent grid) the
//   counters' reduction (finish).
__device__ __forceinline__ unsigned cluster_blocks()
{
    unsigned n = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
    return n;
}

__device__ __forceinline__ void cluster_barrier()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ unsigned cluster_rank()
{
    unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}

// v at the same shared-memory address in block `rank` of the cluster.
__device__ __forceinline__ float cluster_load(const float* v, unsigned rank)
{
    float out = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(remote) : "r"((unsigned)__cvta_generic_to_shared(v)), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(out) : "r"(remote) : "memory");
#endif
    return out;
}

// The warp's strip of a clustered launch: its partials into sums_s, the barrier, the sum where this block sums
// strip `warp`, the barrier (CLUSTER SUMS). Every warp of every block calls it (idle warps with idle = true).
template <int N8>
__device__ __forceinline__ void cluster_finish(const float (&acc)[2][N8][4], const Part& pt, int strip, half* y,
                                               unsigned C, bool idle, const Chain& ch = Chain{},
                                               const EndLines* end = nullptr, float scale = 1.f)
{
    __shared__ float sums_s[WARPS][32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (!idle)
        for_each_acc<N8, true>(acc, strip, 1, [&](float v, int, int col) { sums_s[warp][col - strip * 32] = v; });
    __syncwarp();                                    // (the barrier's .aligned form: the warp converged)
    cluster_barrier();
    if (!idle && warp % C == cluster_rank()) {
        float sum = 0.f;                             // reduce_splits' order: split 0 first
        for (unsigned s = 0; s < C; ++s) sum += cluster_load(&sums_s[warp][lane], s);
        end_column(ch, end, scale, pt, strip, sum, y);
    }
    __syncwarp();
    cluster_barrier();
}

// Block `local` of part pt, M rows of x that stage_xs staged (xg: the part's x in stored order [ROWS][K], cg: its
// corrections [K / 32][ROWS]): no x tile and no barrier after the wait, so every warp starts on its weights at once
// and reads x with them. Shared memory: the split's chunk_meta entries (staged before the wait). A block has one
// warp per strip, strips_per_block <= 8 of them (the launcher picks the count that fills the wave best; launch-per-op
// launches that many warps, a megakernel's 8-warp CTA idles the warps past it).
template <class Fmt, int N8, bool M1, class Wait = PdlWait>
__device__ __forceinline__ void matmul_part_staged(const Params& p, const Part& pt, int local, int M, const half* xg,
                                                   const float2* cg, half* y, float* ws, int* counters,
                                                   int strips_per_block, const Wait& wait, const Chain& ch = Chain{},
                                                   EndLines* end_s = nullptr)
{
    extern __shared__ __align__(16) unsigned char smem[];
    int2* meta_s = reinterpret_cast<int2*>(smem + p.meta_smem);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned C = M1 && Fmt::CLUSTERS ? cluster_blocks() : 1;    // (CLUSTER SUMS: split = the cluster rank)
    const int split = C > 1 ? local % C : local / pt.col_blocks;
    const int strip = (C > 1 ? local / C : local % pt.col_blocks) * strips_per_block + warp;
    const bool mine = warp < strips_per_block && strip < pt.strips;
    const Stamps stamps;
    stamps.start();
    Stream st;
    if (mine) {
        start_stream(st, pt, strip, split, lane);
        prefetch_records<Fmt>(pt, strip, split, lane);
        if (chained(ch)) fetch_end(ch, end_s + warp, strip, false);
    }
    stage_meta(meta_s, pt.chunk_meta, pt.split_chunk[split], pt.split_chunk[split + 1]);
    __syncthreads();                                   // the weights' own metadata: overlaps the kernel before
    if (!mine) {
        if constexpr (M1 && Fmt::CLUSTERS)
            if (C > 1) cluster_finish<N8>({}, pt, strip, y, C, true);
        return;
    }
    wait();                                            // x (stage_xs's), ws and the counters
    stamps.at(1);
    if (chained(ch)) fetch_end(ch, end_s + warp, strip, true);
    MatmulSink<Fmt, N8, M1, true> sink;
    const int g = lane / 4, q = lane % 4;
    sink.xg = xg + (M1 ? 0 : g * (size_t)p.K);
    sink.tile_step = 8 * (size_t)p.K;
    if constexpr (!M1) sink.cg = cg + 2 * q;
    walk<Fmt>(pt, strip, split, meta_s, st, lane, sink);
    sink.flush();
    stamps.at(2);
    const float scale = chained(ch) ? end_scale(ch, end_s + warp) : 1.f;
    if constexpr (M1)
        if (ch.gated) {
            finish_pair<N8>(sink.acc, p, pt, split, strip, ws, ch, end_s + warp, scale);
            stamps.at(3);
            stamps.emit(1, p.n_parts, p.K, local);
            return;
        }
    if constexpr (M1 && Fmt::CLUSTERS)
        if (C > 1) {
            cluster_finish<N8>(sink.acc, pt, strip, y, C, false, ch, end_s + warp, scale);
            stamps.at(3);
            stamps.emit(1, p.n_parts, p.K, local);
            return;
        }
    finish<N8, M1>(sink.acc, pt, split, strip, M, y, ws, M, counters, stamps, ch, end_s + warp, scale);
    stamps.at(3);
    stamps.emit(1, p.n_parts, p.K, local);
}

// Block b of the launch of p (the parts laid out in block order; the kernel's blockIdx.x, or a megakernel's
// virtual block), of strips_per_block strips (the plan's). xs is stage_xs's output for R = 1 (M1), 8 or 16 (N8 = 1,
// 2) staged rows: the parts' x in stored order [n_parts][R][K], then their corrections [n_parts][K / 32][R] as float2.
template <class Fmt, int N8, bool M1, class Wait = PdlWait>
__device__ __forceinline__ void matmul(const Params& p, const half* xs, half* y0, half* y1, half* y2, float* ws,
                                       int b, int strips_per_block, const Wait& wait = Wait(),
                                       const Chain& ch = Chain{}, EndLines* end_s = nullptr)
{
    constexpr int R = M1 ? 1 : 8 * N8;
    const int pi = part_of(p, b);
    const Part& pt = p.part[pi];
    half* y = pi == 0 ? y0 : pi == 1 ? y1 : y2;
    const float2* corr =
        reinterpret_cast<const float2*>(xs + (size_t)p.n_parts * R * p.K) + (size_t)pi * (p.K / 32) * R;
    matmul_part_staged<Fmt, N8, M1>(p, pt, b - pt.block0, p.M, xs + (size_t)pi * R * p.K, corr, y,
                                    ws ? ws + pt.ws_offset : ws, pt.counters, strips_per_block, wait, ch, end_s);
}

// x [M, K] for the small-M launch of p, R staged rows (1, 8 or 16; row m >= M repeats row M - 1): block (bx, part,
// m) of the grid (ceil(K / 32 / WARPS), n_parts, R) stages chunk c = bx * WARPS + warp of the part and row m, by one
// warp, lane r taking stored
// row 32c + r: xs[part][m][k'] = x[m][perm[k']] (x' = x * 2^-i for FOLDED rows, as stage_x) and (R > 1) the chunk's
// correction corr[part][c][m] (as stage_corrections for one row: the same sums in the same order). What is staged
// in place of x, so that the op before needs no launch of its own:
//  - up non-null ([M, K] like x): the gated MLP's fp16(fp16(silu(x)) * up), rounded as activation.cu's silu_mul;
//  - norm_w non-null: the block's add_rmsnorm (residual non-null) or rmsnorm of x with weight norm_w (stage_norm),
//    the new residual written to new_residual.
template <class Wait = PdlWait>
__device__ __forceinline__ void stage_xs(const Params& p, const half* x, const half* up, const half* residual,
                                         const half* norm_w, half* new_residual, float eps, half* xs, int bx,
                                         int part, int m, int R, const Wait& wait = Wait())
{
    const int c = bx * WARPS + threadIdx.x / 32, lane = threadIdx.x % 32, chunks = p.K / 32;
    const bool active = c < chunks;                    // (the grid's y is n_parts)
    if (!active && !norm_w) return;                    // (with a norm, every thread takes part in its barrier)
    const Stamps stamps;
    stamps.start();
    const Part& pt = p.part[part];
    const int k = 32 * c + lane, b = active ? width_at(pt, c) : 0;
    const int src = !active ? 0 : pt.perm ? __ldg(pt.perm + k) : k;
    const half w = norm_w ? __ldg(norm_w + src) : half();
    wait();                                            // x comes from the kernel before
    stamps.at(1);
    const size_t row = (size_t)min(m, p.M - 1) * p.K;
    half in;
    if (norm_w) {
        in = stage_norm(x, residual, w, new_residual, p.K, row, src, eps, part == 0 && m < p.M, bx);
        if (!active) return;
    } else {
        in = x[row + src];
    }
    if (up) in = silu_mul(in, up[row + src]);
    const half v = __float2half_rn(__half2float(in) * row_scale(b, lane));
    xs[((size_t)part * R + m) * p.K + k] = v;
    if (R > 1) {                                       // (one row: the matmul sums its corrections)
        float lo = 0.f, hi = 0.f;                      // rows with (r >> 1) & 1 clear / set
        if (lane >> 1 & 1) hi = __half2float(v); else lo = __half2float(v);
        for (int span = 16; span >= 1; span /= 2) {
            lo += __shfl_xor_sync(FULL_MASK, lo, span);
            hi += __shfl_xor_sync(FULL_MASK, hi, span);
        }
        float2* corr = reinterpret_cast<float2*>(xs + (size_t)p.n_parts * R * p.K);
        if (lane == 0)
            corr[((size_t)part * chunks + c) * R + m] = (b == 4 || b == 6 || b == 8)
                                                  ? make_float2(1024.f * (lo + hi), lo + hi / row_scale(b, 2))
                                                  : make_float2(0.f, 0.f);
    }
    stamps.at(2);
    stamps.at(3);
    stamps.emit(0, p.n_parts, p.K, bx);
}

// MoE: the experts of one layer (experts[e], a Params in device memory, all with the same parts' shapes and block
// counts) applied to the rows of x routed to them, which the launcher has sorted by expert: rows offsets[e] ..
// offsets[e] + counts[e] - 1 of x [S, K] go through expert e into the same rows of y0 (and y1) [S, n]. Block
// (b, e, z) is block b of expert e for its rows 16z .. 16z + 15 (ROWS per pass: 1 for the m1 kernel, which the
// launcher uses when no expert has more than one row); experts without rows there exit at once, so only the routed
// experts' weights are read, and the launch reads no host value (CUDA-graph safe). Split partials of part i:
// ws[i * ws_part + (split * S + row) * np], arrivals: counters[((e * gridDim.z + z) * MAX_PARTS + i) * strips_max +
// strip] (zero before, zero after).
template <class Fmt, int N8, bool M1>
__device__ __forceinline__ void moe_matmul(const Params* experts, const int* offsets, const int* counts, int S,
                                           const half* x, half* y0, half* y1, float* ws, long long ws_part,
                                           int* counters, int strips_max)
{
    constexpr int ROWS = M1 ? 1 : 8 * N8;
    pdl_wait();                                        // the routing (offsets, counts) comes from earlier kernels
    const int e = blockIdx.y, z = blockIdx.z;
    const int M = min(ROWS, __ldg(counts + e) - ROWS * z);
    if (M <= 0) return;
    const int row0 = __ldg(offsets + e) + ROWS * z;
    const Params& p = experts[e];
    const int pi = part_of(p, blockIdx.x);
    const Part& pt = p.part[pi];
    const int local = blockIdx.x - pt.block0;
    if (local >= pt.col_blocks * pt.n_splits) return;
    matmul_part<Fmt, N8, M1>(p, pt, local, M, x + (size_t)row0 * p.K, (pi == 0 ? y0 : y1) + (size_t)row0 * pt.n,
                             ws ? ws + pi * ws_part + (size_t)row0 * pt.np : ws, S,
                             counters + ((size_t)(e * gridDim.z + z) * MAX_PARTS + pi) * strips_max);
}

}  // namespace qmm

// gemm.cu: the tiled GEMM by mma.sync for LARGE_M..GEMM_MAX_M rows of x, and the two kernels both GEMMs (this and
// wgmma.cu) launch around them: permute_x before (x in stored row order and MMA k order, with the norm or silu
// applied), gemm_reduce after (split-K partials summed in split order). Launcher: quant_matmul.py (QuantMatmul._gemm,
// _tiled, _stored_order). Shared code: qmm_tiled.cuh.
//
// GEMM KERNELS  <fmt>_gemm, permute_x, gemm_reduce (LARGE_M <= M <= GEMM_MAX_M rows of x; docs/gemm.md)
//   The lane layout's per-lane pairs are exactly the B fragments of m16n8k16 MMAs with x as A: pair (j, s, h) of
//   lane 4g + q is B[k = 2q + 8h + e][n = g] of n8 tile j (strip columns 8j..8j+7) at k16 step s, MMA k 2q + 8h + e
//   being chunk row 16s + 4q + 2h + e. So a warp decodes its strip's chunk straight into registers as
//   fp16((code - z) * scale), the dequant kernel's own instructions (bit-identical weights), and multiplies it by up
//   to GEMM_WARP_TILES m16 tiles of x (64 rows) from shared memory, accumulating in fp32: no W tile in shared memory.
//   Block 256 = 8 warps = (8 / R) strips x R row groups (Params.row_groups: R = 1 up to 64 rows of x, 2 above).
//   Block b of a part: column tile b % col_blocks (strips (8 / R) * that ..), M tile b / col_blocks % m_tiles,
//   split b / col_blocks / m_tiles; an M tile is ceil(M16 / m_tiles) m16 tiles of x (M16 = ceil(M / 16)), split
//   over its R row groups (at most 4 each, by the launcher's choice of R and m_tiles). Warps of strips past the
//   part's last decode the last one (every warp takes part in the block's barriers) but write nothing.
//   x: the part's x_i [M, K] in stored row order, its columns within each 16 in MMA k order (permute_x made it:
//   gemm_k_row), 16-byte aligned; chunk by chunk into a ring of GEMM_STAGES slots of the M tile's rows x GEMM_XS
//   halves (cp.async, rows past M zero), one __syncthreads per chunk; a warp's A fragments come from the ring by
//   one ldmatrix.x4 each, already in the registers the MMA reads (two 8-byte loads gave them in another order, and
//   the register moves that reordered them were a fifth of the kernel's instructions: docs/gemm.md).
//   Dynamic shared memory: the split's chunk_meta entries, then the ring at Params.ring_smem. Dependent launch:
//   weight and record prefetches and the chunk_meta copy before pdl_wait.
//   n_splits == 1: y = acc (+ bias). Otherwise fp32 partials ws[(part.ws_offset + split * Np) * M + m * Np + col]
//   (ws_offset: floats per x row before this part's), summed in split order by gemm_reduce (grid (ceil(M Np / 2 /
//   256), parts), one column pair per thread), which adds the bias: the "last block reduces" scheme of the small-M
//   kernels would leave one block reading splits x 64 x 256 x 4 bytes alone.
//   permute_x: grid (M, parts), block 256, dynamic shared memory 2K bytes: x_i[m][k] = x[m][perm_i[gemm_k_row(k)]]
//   (perm_i the identity for a part without one), through the row in shared memory (coalesced reads and writes;
//   the perm entries read before pdl_wait);
//   x replaced, as in stage_xs, by the block's norm of it or the gated MLP's silu_mul, which then take no launch.
//
#include "qmm_tiled.cuh"

namespace qmm {

using namespace exl;

// Multiplies x's rows of the block by the warp's strip, chunk by chunk (walk), staging x through the ring: chunk
// number k of the split is in slot k % GEMM_STAGES; before computing chunk k every thread waits for its own copies
// of it, the barrier makes them visible and frees chunk k - 1's slot, which then receives chunk k + GEMM_STAGES - 1.
template <class Fmt>
struct GemmSink : NoExtra {
    static constexpr bool PIPELINE = false;          // loading the next batch first: slower (docs/gemm.md)
    static constexpr int BATCH = QMM_GEMM_BATCH;     // chunks per batch (walk_run)
    half* ring;
    int slot_halves;
    const half* x;           // [M, K], stored row order
    int K, M, row0, rows, c0, c1;
    int a_offset;            // halves from a slot's start to the row whose address the lane gives ldmatrix
    int tiles;
    int k = 0;               // chunks consumed
    GroupScales<Fmt> gs;     // the current group's decode state and column scales
    float acc[GEMM_WARP_TILES][4][4] = {};    // [m16 tile i][n8 tile j]: rows 16i + g (+8), columns 8j + 2q (+1)

    // Chunk c0 + n into its slot (if the split has it): one commit group per call, also when empty.
    __device__ void stage(int n)
    {
        if (c0 + n < c1) {
            half* slot = ring + (n % GEMM_STAGES) * slot_halves;
            const int col = 32 * (c0 + n);
            for (int i = threadIdx.x; i < rows * 4; i += THREADS) {
                const int r = i / 4, seg = i % 4, m = row0 + r;
                copy_async16(slot + r * GEMM_XS + 8 * seg, x + (size_t)min(m, M - 1) * K + col + 8 * seg, m < M);
            }
        }
        copy_async_commit();
    }

    template <int B>
    __device__ void chunk(const unsigned (&w)[B], int group_key, const typename Fmt::Raw& raw, int, Extra)
    {
        gs.template enter<B>(group_key, raw, threadIdx.x % 32 / 4);
        half2 b[16];
        decode_pairs<B, Fmt>(w, gs.st, b);
#pragma unroll
        for (int p = 0; p < 16; ++p) b[p] = __hmul2(b[p], gs.scale[p / 4]);     // fp16((code - z) * scale), as dequant
        copy_async_wait<GEMM_STAGES - 2>();
        __syncthreads();
        stage(k + GEMM_STAGES - 1);
        const half* xs = ring + (k % GEMM_STAGES) * slot_halves + a_offset;
        ++k;
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
            for (int i = 0; i < GEMM_WARP_TILES; ++i)
                if (i < tiles) {
                    unsigned a[4];
                    ldmatrix_x4(a, xs + 16 * i * GEMM_XS + 16 * s);
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        mma_16816(acc[i][j], a[0], a[1], a[2], a[3], as_bits(b[4 * j + 2 * s]),
                                  as_bits(b[4 * j + 2 * s + 1]));
                }
    }
};

// Block `local` of part pt: y [M, pt.n] (+ bias) = x [M, K] (stored order) @ W^T, or its split's fp32 partials to
// ws (this part's, [n_splits][M][Np]).
template <class Fmt>
__device__ __forceinline__ void gemm_part(const Params& p, const Part& pt, int local, int M, const half* x, half* y,
                                          float* ws)
{
    extern __shared__ __align__(16) unsigned char smem[];
    int2* meta_s = reinterpret_cast<int2*>(smem);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const GemmTile tile(p, pt, local, M, warp);
    const int c0 = pt.split_chunk[tile.split], c1 = pt.split_chunk[tile.split + 1];
    Stream st;
    tiled_start<Fmt>(pt, tile, c0, c1, meta_s, st, lane);

    GemmSink<Fmt> sink;
    sink.ring = reinterpret_cast<half*>(smem + p.ring_smem);
    sink.slot_halves = 16 * GEMM_WARP_TILES * p.row_groups * GEMM_XS;
    sink.x = x;
    sink.K = p.K; sink.M = M; sink.row0 = tile.row0; sink.rows = tile.rows; sink.c0 = c0; sink.c1 = c1;
    sink.a_offset = (tile.warp_row0 - tile.row0 + lane % 16) * GEMM_XS + 8 * (lane / 16);   // ldmatrix_x4's rows
    sink.tiles = tile.tiles;
#pragma unroll
    for (int n = 0; n < GEMM_STAGES - 1; ++n) sink.stage(n);
    __syncthreads();                                   // meta_s
    walk<Fmt>(pt, tile.strip, tile.split, meta_s, st, lane, sink);
    copy_async_wait<0>();
    if (!tile.writes) return;

    const int N = pt.n, Np = pt.np;
    float* part = pt.n_splits > 1 ? ws + (size_t)tile.split * M * Np : nullptr;
#pragma unroll
    for (int i = 0; i < GEMM_WARP_TILES; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int m = tile.warp_row0 + 16 * i + g + 8 * e, col = tile.strip * 32 + 8 * j + 2 * q;
                if (i >= tile.tiles || m >= M) continue;
                const float v0 = sink.acc[i][j][2 * e], v1 = sink.acc[i][j][2 * e + 1];
                if (part)
                    *reinterpret_cast<float2*>(part + (size_t)m * Np + col) = make_float2(v0, v1);
                else
                    store_pair(y, N, m, col, v0 + (col < N ? bias_at(pt.bias, col) : 0.f),
                               v1 + (col + 1 < N ? bias_at(pt.bias, col + 1) : 0.f));
            }
}

template <class Fmt>
__device__ __forceinline__ void gemm(const Params& p, int M, const half* x0, const half* x1, const half* x2,
                                     half* y0, half* y1, half* y2, float* ws)
{
    const int pi = part_of(p, blockIdx.x);
    const Part& pt = p.part[pi];
    gemm_part<Fmt>(p, pt, blockIdx.x - pt.block0, M, pi == 0 ? x0 : pi == 1 ? x1 : x2,
                   pi == 0 ? y0 : pi == 1 ? y1 : y2, ws ? ws + (size_t)pt.ws_offset * M : ws);
}

// Part blockIdx.y's split partials of the GEMM summed in split order (deterministic), plus bias, into y.
__device__ __forceinline__ void gemm_reduce(const Params& p, int M, half* y0, half* y1, half* y2, const float* ws)
{
    pdl_wait();                                        // ws is the GEMM's, just before
    const int pi = blockIdx.y;
    const Part& pt = p.part[pi];
    const int pairs = pt.np / 2, idx = blockIdx.x * THREADS + threadIdx.x;
    if (pt.n_splits == 1 || idx >= M * pairs) return;
    const int m = idx / pairs, col = 2 * (idx % pairs);
    if (col >= pt.n) return;
    const float* part = ws + (size_t)pt.ws_offset * M + (size_t)m * pt.np + col;
    float2 sum = make_float2(0.f, 0.f);
#pragma unroll 8
    for (int s = 0; s < pt.n_splits; ++s) {
        const float2 v = __ldcg(reinterpret_cast<const float2*>(part + (size_t)s * M * pt.np));
        sum.x += v.x;
        sum.y += v.y;
    }
    store_pair(pi == 0 ? y0 : pi == 1 ? y1 : y2, pt.n, m, col, sum.x + bias_at(pt.bias, col),
               sum.y + (col + 1 < pt.n ? bias_at(pt.bias, col + 1) : 0.f));
}

// Row blockIdx.x of x [M, K] for part blockIdx.y's GEMM: xp[part][m][k] = v[m][perm[gemm_k_row(k)]], through the
// row in shared memory (coalesced reads and writes). v is x, or what the op before the GEMM makes of it, as stage_xs
// applies it (so that the op needs no launch of its own): with norm_w the add_rmsnorm (residual non-null) or rmsnorm
// of x, part 0's blocks writing the new residual; with up the gated MLP's silu_mul (after the norm, if both). Each
// thread takes 8 consecutive elements at a time, as 16-byte vectors (x, up, residual, norm_w, new_residual and xp
// 16-byte aligned: the launcher sees to it; K a multiple of 32, as every lane layout's), the vectors residual_row
// gives it: with few blocks (M x parts), a thread's chain of one-element loads and stores set the time (1.23 ms
// over a cached-prefix first token's 128 launches, 0.85 ms so, on the H200). The perm entries of a thread's first
// PERMUTE_AHEAD output vectors (K <= 14,336: all) are read before pdl_wait, off the chain of dependent loads: that
// step's GPU time 9.9 -> 9.2-9.3 ms (several blocks a row, each gathering from global memory: 9.6; BENCHMARKS.md).
constexpr int PERMUTE_AHEAD = 7;

// The 8 rows of x that output vector o of permute_x gathers: xp's k = 8o + j is chunk row base + 4 (j / 2) +
// 2 half + j % 2 (gemm_k_row), half = which 8 of the 16.
__device__ __forceinline__ void permute_sources(const int* perm, int o, int (&src)[8])
{
    const int base = 8 * o - 8 * o % 16, half_ = o % 2;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int r = base + 4 * (j / 2) + 2 * half_ + j % 2;
        src[j] = perm ? __ldg(perm + r) : r;
    }
}

__device__ __forceinline__ uint4 gather_vector(const half* row_s, const int (&src)[8])
{
    uint4 v;
    half* h = reinterpret_cast<half*>(&v);
#pragma unroll
    for (int j = 0; j < 8; j++) h[j] = row_s[src[j]];
    return v;
}

__device__ __forceinline__ void permute_x(const Params& p, int M, const half* x, const half* up, const half* residual,
                                          const half* norm_w, half* new_residual, float eps, half* xp)
{
    extern __shared__ __align__(16) half row_s[];
    const int K = p.K, m = blockIdx.x;
    const int* perm = p.part[blockIdx.y].perm;
    const size_t at = (size_t)m * K;
    int ahead[PERMUTE_AHEAD][8];
#pragma unroll
    for (int a = 0; a < PERMUTE_AHEAD; a++)
        if (threadIdx.x + a * THREADS < K / 8) permute_sources(perm, threadIdx.x + a * THREADS, ahead[a]);
    pdl_wait();                                        // x is an earlier kernel's
    const float inv_rms = norm_w ? residual_row(x, residual, K, at, eps) : 0.f;
    for (int i = threadIdx.x * 8; i < K; i += THREADS * 8) {
        uint4 v = norm_w ? *reinterpret_cast<const uint4*>(row_s + i) : __ldg(reinterpret_cast<const uint4*>(x + at + i));
        half* h = reinterpret_cast<half*>(&v);
        if (norm_w) {
            if (residual && blockIdx.y == 0) *reinterpret_cast<uint4*>(new_residual + at + i) = v;
            const uint4 wv = __ldg(reinterpret_cast<const uint4*>(norm_w + i));
            const half* w = reinterpret_cast<const half*>(&wv);
#pragma unroll
            for (int j = 0; j < 8; j++) h[j] = normalise(h[j], w[j], inv_rms);
        }
        if (up) {
            const uint4 uv = __ldg(reinterpret_cast<const uint4*>(up + at + i));
            const half* u = reinterpret_cast<const half*>(&uv);
#pragma unroll
            for (int j = 0; j < 8; j++) h[j] = silu_mul(h[j], u[j]);
        }
        *reinterpret_cast<uint4*>(row_s + i) = v;      // (the same thread's elements as residual_row's)
    }
    __syncthreads();
    uint4* out = reinterpret_cast<uint4*>(xp + ((size_t)blockIdx.y * M + m) * K);
#pragma unroll
    for (int a = 0; a < PERMUTE_AHEAD; a++)
        if (threadIdx.x + a * THREADS < K / 8) out[threadIdx.x + a * THREADS] = gather_vector(row_s, ahead[a]);
    for (int o = threadIdx.x + PERMUTE_AHEAD * THREADS; o < K / 8; o += THREADS) {
        int src[8];
        permute_sources(perm, o, src);
        out[o] = gather_vector(row_s, src);
    }
}

}  // namespace qmm

// GEMM (qmm::gemm, GEMM KERNELS above): grid (the parts' blocks), block 256, dynamic shared memory as the plan says.
// M: rows of x; x_i: part i's x [M, K] in its stored row order; ws: split partials (fp32), or null without splits.
// QMM_GEMM_BLOCKS: blocks per SM (quant_matmul.GEMM_RESIDENT); at 2, 128 registers with a few bytes of spills
// (EXL2 12, GPTQ 60 on sm_90), at 1 ~185 registers without.
#ifndef QMM_GEMM_BLOCKS
#define QMM_GEMM_BLOCKS 2
#endif
#define QMM_GEMM(NAME, FMT)                                                                                            \
    extern "C" __global__ void __launch_bounds__(qmm::THREADS, QMM_GEMM_BLOCKS)                                        \
    NAME(const __grid_constant__ qmm::Params p, int M, const half* x0, const half* x1, const half* x2, half* y0,     \
         half* y1, half* y2, float* ws)                                                                                \
    {                                                                                                                  \
        exl::pdl_trigger();                                                                                           \
        qmm::gemm<FMT>(p, M, x0, x1, x2, y0, y1, y2, ws);                                                              \
    }

QMM_GEMM(exl2_gemm, qmm::Exl2)
QMM_GEMM(gptq_gemm, qmm::Gptq)

// grid (ceil(M * max Np / 512), parts), block 256: the GEMM's split partials summed into y (qmm::gemm_reduce).
extern "C" __global__ void __launch_bounds__(qmm::THREADS)
gemm_reduce(const __grid_constant__ qmm::Params p, int M, half* y0, half* y1, half* y2, const float* ws)
{
    exl::pdl_trigger();
    qmm::gemm_reduce(p, M, y0, y1, y2, ws);
}

// grid (M, parts), block 256, dynamic shared memory 2K bytes: x (or the op before's result, as stage_xs) in each
// part's stored row order (qmm::permute_x).
extern "C" __global__ void __launch_bounds__(qmm::THREADS)
permute_x(const __grid_constant__ qmm::Params p, int M, const half* x, const half* up, const half* residual,
          const half* norm_w, half* new_residual, float eps, half* xp)
{
    exl::pdl_trigger();
    qmm::permute_x(p, M, x, up, residual, norm_w, new_residual, eps, xp);
}

// wgmma.cu: the GEMM by Hopper's warpgroup MMA for WGMMA_MIN_M..WGMMA_MAX_M rows of x on compute capability 9.0
// (sm_90a). permute_x and gemm_reduce, launched around it, are gemm.cu's. Launcher: quant_matmul.py
// (QuantMatmul._wgmma). Shared code: qmm_tiled.cuh.
//
// WGMMA KERNELS  <fmt>_wgmma (WGMMA_MIN_M <= M <= WGMMA_MAX_M rows of x, compute capability 9.0 only: NVRTC builds
//   sm_90a there; on other targets the body is a trap and the launcher never picks it; docs/gemm.md)
//   The GEMM's Params, x (after permute_x), splits, partials and gemm_reduce, with one row group and one M tile of
//   up to WG_N = 128 rows; block 256 = 2 warpgroups of 4 strips, one block per SM (~250 registers), the grid one wave
//   (K split until it fills one). Per chunk each warp decodes its strip into shared memory and each warpgroup issues
//   4 wgmma.m64n128k16 with both operands by descriptor (layouts at the kernel below). Dynamic shared memory: the
//   split's chunk_meta entries, then at Params.ring_smem QMM_WG_STAGES x slots of 8 KB and QMM_WG_DEPTH A slots of
//   16 KB (quant_matmul.plan_wgmma sizes them).
//
#include "qmm_tiled.cuh"

namespace qmm {

using namespace exl;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// ------------------------------------------------------------------------------------------- GEMM by wgmma (sm_90a)
// <fmt>_wgmma (WGMMA KERNELS above): the tiled GEMM's plan, walk and decode, with Hopper's asynchronous warpgroup
// MMA in place of mma.sync. Warps 4h..4h+3 form warpgroup h, which owns the block's strips 4h..4h+3 (128 columns
// = column tiles t = 0, 1 of 64). Per chunk each warp decodes its strip into shared memory (A), and per k16 step s
// and tile t the warpgroup issues one m64n128k16: A = the tile's 64 columns of decoded weights, B = WG_N rows of x
// from the ring (D[column][x row]); both operands by descriptor, so no register is read asynchronously (A from
// registers gave wrong results: docs/gemm.md). Both operands are K-major core matrices of 8 rows x 16 bytes
// (no swizzle): two along K 128 bytes apart (leading byte offset), 512 bytes from one 8-row group to the next
// (stride byte offset).
//   x ring slot (WG_N x 32 halves): [row / 8][k / 8][row % 8][k % 8].
//   A slot (WARPS x WG_A_STRIP bytes): per strip [column / 8][k / 8][column % 8][k % 8], the strip's columns in MMA
//   order (as the small-M kernels' fragments: lane 4g + q decodes pairs (j, s, h) of columns 8j + g, k 16s + 8h + 2q).
constexpr int WG_N = 128;
constexpr int WG_A_STRIP = 4 * 4 * 128;     // bytes of a strip's decoded chunk
#ifndef QMM_WG_PIPELINE                     // 1: the next chunk's words load while this one decodes (walk_run)
#define QMM_WG_PIPELINE 1
#endif
#ifndef QMM_WG_DEPTH                        // chunks of MMAs a warpgroup keeps in flight (slots of decoded A)
#define QMM_WG_DEPTH 2
#endif
#ifndef QMM_WG_STAGES                       // x ring slots: copies run QMM_WG_STAGES - QMM_WG_DEPTH chunks ahead
#define QMM_WG_STAGES 4
#endif
constexpr int WG_DEPTH = QMM_WG_DEPTH, WG_STAGES = QMM_WG_STAGES, WG_AHEAD = WG_STAGES - WG_DEPTH;
constexpr int WG_COPIES = WG_N * 4 / THREADS;   // 16-byte x copies per thread and chunk
static_assert(WG_DEPTH >= 1 && WG_AHEAD >= 1 && WG_N * 4 % THREADS == 0, "wgmma ring");

// The low word of a shared-memory descriptor: start address / 16 (14 bits: shared addresses are below 256 KB) and
// the leading byte offset / 16 at bit 16; the high word is the stride byte offset / 16. Descriptors into one ring
// differ only in the start address, so a chunk's are one low word plus constants.
__device__ __forceinline__ unsigned wg_desc_lo(unsigned addr) { return addr >> 4 | (128 >> 4) << 16; }
__device__ __forceinline__ unsigned long long wg_desc(unsigned lo) { return (unsigned long long)(512 >> 4) << 32 | lo; }

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// d += A (descriptor) x B (descriptor), m64n128k16, fp32 accumulators.
__device__ __forceinline__ void wgmma_128(float (&d)[64], unsigned long long desc_a, unsigned long long desc_b)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(desc_a), "l"(desc_b));
}

// Per chunk k: decode (as GemmSink) into A slot k % WG_DEPTH; once every thread's copies of the chunk's x have
// landed and every warpgroup has waited for its MMAs of chunk k - WG_DEPTH (the barrier), the copies of chunk
// k + WG_AHEAD go to the x slot of chunk k - WG_DEPTH and the chunk's 4 MMAs go out; the warpgroup then waits until
// at most WG_DEPTH - 1 chunks of its MMAs are in flight.
template <class Fmt>
struct WgmmaSink : NoExtra {
    static constexpr bool PIPELINE = QMM_WG_PIPELINE;
    static constexpr int BATCH = 1;
    half* ring;              // WG_STAGES x slots
    unsigned char* aring;    // WG_DEPTH A slots
    const half* x;
    int c0, c1;
    int xoff[WG_COPIES];     // the thread's copies: x offset of their row and 8-column segment (chunk 0)
    unsigned xok;            // bit j: copy j's row is < M (else zeros)
    unsigned a_lo, b_lo;     // descriptor low words: the warpgroup's strips in A slot 0, x slot 0
    int k = 0;               // chunks consumed
    GroupScales<Fmt> gs;     // the current group's decode state and column scales
    float acc[2][64] = {};   // [tile t][4i + 2h + e]: D row (column) 16 (warp % 4) + g + 8h, x row 8i + 2q + e

    // Copy i = threadIdx.x + j THREADS of a chunk: x row row0 + 8 (i / 32) + i % 8, columns 8 (i / 8 % 4) ..
    __device__ void init(int K, int M, int row0)
    {
        xok = 0;
#pragma unroll
        for (int j = 0; j < WG_COPIES; ++j) {
            const int i = threadIdx.x + j * THREADS, m = row0 + 8 * (i / 32) + i % 8;
            xoff[j] = min(m, M - 1) * K + 8 * (i / 8 % 4);
            xok |= (m < M) << j;
        }
        a_lo = wg_desc_lo(smem_address(aring) + threadIdx.x / 128 * 4 * WG_A_STRIP);
        b_lo = wg_desc_lo(smem_address(ring));
    }

    // Chunk c0 + n into slot n % WG_STAGES: one commit group per call, also when empty.
    __device__ void stage(int n)
    {
        if (c0 + n < c1) {
            half* slot = ring + (n % WG_STAGES) * (WG_N * 32) + 8 * threadIdx.x;
            const half* src = x + 32 * (c0 + n);
#pragma unroll
            for (int j = 0; j < WG_COPIES; ++j) copy_async16(slot + 8 * j * THREADS, src + xoff[j], xok >> j & 1);
        }
        copy_async_commit();
    }

    template <int B>
    __device__ void chunk(const unsigned (&w)[B], int group_key, const typename Fmt::Raw& raw, int, Extra)
    {
        gs.template enter<B>(group_key, raw, threadIdx.x % 32 / 4);
        half2 a[16];
        decode_pairs<B, Fmt>(w, gs.st, a);
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        // pair p = (j, s, h) of lane 4g + q: core matrix (j, 2s + h) of the strip, row g, bytes 4q..
        unsigned char* as = aring + (k % WG_DEPTH) * (WARPS * WG_A_STRIP) + warp * WG_A_STRIP + lane / 4 * 16 +
                            lane % 4 * 4;
#pragma unroll
        for (int p = 0; p < 16; ++p)                                      // fp16((code - z) * scale), as dequant
            *reinterpret_cast<half2*>(as + (p / 4 * 4 + p / 2 % 2 * 2 + p % 2) * 128) = __hmul2(a[p], gs.scale[p / 4]);
        copy_async_wait<WG_AHEAD - 1>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // A and the copies, to wgmma's async proxy
        __syncthreads();
        stage(k + WG_AHEAD);               // (after the MMAs: 6 % slower, docs/gemm.md)
        // tile t: strips 4h + 2t, 4h + 2t + 1 (64 columns = 8 core-matrix rows 512 bytes apart)
        const unsigned ad = a_lo + (k % WG_DEPTH) * (WARPS * WG_A_STRIP >> 4);
        const unsigned bd = b_lo + (k % WG_STAGES) * (WG_N * 64 >> 4);
        wg_fence();
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
            for (int t = 0; t < 2; ++t)
                wgmma_128(acc[t], wg_desc(ad + (2 * t * WG_A_STRIP + 256 * s >> 4)), wg_desc(bd + 16 * s));
        wg_commit();
        ++k;
        wg_wait<WG_DEPTH - 1>();
    }
};

// Block `local` of part pt: as gemm_part, for a plan of one row group and one M tile of at most WG_N rows.
template <class Fmt>
__device__ __forceinline__ void wgmma_part(const Params& p, const Part& pt, int local, int M, const half* x, half* y,
                                           float* ws)
{
    extern __shared__ __align__(16) unsigned char smem[];
    int2* meta_s = reinterpret_cast<int2*>(smem);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const GemmTile tile(p, pt, local, M, warp);
    const int c0 = pt.split_chunk[tile.split], c1 = pt.split_chunk[tile.split + 1];
    Stream st;
    tiled_start<Fmt>(pt, tile, c0, c1, meta_s, st, lane);

    WgmmaSink<Fmt> sink;
    sink.ring = reinterpret_cast<half*>(smem + p.ring_smem);
    sink.aring = smem + p.ring_smem + WG_STAGES * WG_N * 64;
    sink.x = x;
    sink.c0 = c0; sink.c1 = c1;
    sink.init(p.K, M, tile.row0);
#pragma unroll
    for (int n = 0; n < WG_AHEAD; ++n) sink.stage(n);
    __syncthreads();                                   // meta_s
    walk<Fmt>(pt, tile.strip, tile.split, meta_s, st, lane, sink);
    wg_wait<0>();
    copy_async_wait<0>();

    const int N = pt.n, Np = pt.np;
    float* part = pt.n_splits > 1 ? ws + (size_t)tile.split * M * Np : nullptr;
    // D row 16 (warp % 4) + g + 8h of tile t: strip 4 (warp / 4) + 2t + warp % 4 / 2 of the block
    const int strip0 = local % pt.col_blocks * WARPS;
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int i = 0; i < WG_N / 8; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int strip = strip0 + warp / 4 * 4 + 2 * t + warp % 4 / 2;
                    const int col = strip * 32 + warp % 2 * 16 + 8 * h + g;
                    const int r = 8 * i + 2 * q + e, m = tile.row0 + r;
                    if (r >= tile.rows || m >= M || strip >= pt.strips) continue;
                    const float v = sink.acc[t][4 * i + 2 * h + e];
                    if (part)
                        part[(size_t)m * Np + col] = v;
                    else if (col < N)
                        y[(size_t)m * N + col] = __float2half_rn(v + bias_at(pt.bias, col));
                }
}

template <class Fmt>
__device__ __forceinline__ void wgmma(const Params& p, int M, const half* x0, const half* x1, const half* x2,
                                      half* y0, half* y1, half* y2, float* ws)
{
    const int pi = part_of(p, blockIdx.x);
    const Part& pt = p.part[pi];
    wgmma_part<Fmt>(p, pt, blockIdx.x - pt.block0, M, pi == 0 ? x0 : pi == 1 ? x1 : x2,
                    pi == 0 ? y0 : pi == 1 ? y1 : y2, ws ? ws + (size_t)pt.ws_offset * M : ws);
}
#endif

}  // namespace qmm

// The GEMM by wgmma (qmm::wgmma): arguments and shared memory as the GEMM's, one block per SM (~255 registers). Only
// an sm_90a build has its body (the loader compiles for sm_90a on compute capability 9.0, and the launcher calls it
// only there); elsewhere it traps.
#define QMM_WGMMA(NAME, FMT)                                                                                           \
    extern "C" __global__ void __launch_bounds__(qmm::THREADS, 1)                                                      \
    NAME(const __grid_constant__ qmm::Params p, int M, const half* x0, const half* x1, const half* x2, half* y0,     \
         half* y1, half* y2, float* ws)                                                                                \
    {                                                                                                                  \
        QMM_WGMMA_BODY(FMT)                                                                                           \
    }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QMM_WGMMA_BODY(FMT) exl::pdl_trigger(); qmm::wgmma<FMT>(p, M, x0, x1, x2, y0, y1, y2, ws);
#else
#define QMM_WGMMA_BODY(FMT) __trap();
#endif

QMM_WGMMA(exl2_wgmma, qmm::Exl2)
QMM_WGMMA(gptq_wgmma, qmm::Gptq)

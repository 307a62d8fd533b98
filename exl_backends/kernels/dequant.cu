// dequant.cu: a quantized weight to fp16 W^T [K, Np] in original row order (bit-exact with the reference), for
// the rows above the GEMMs' (then cuBLAS multiplies) and for QuantLinear.dense_weight. Launcher: quant_matmul.py
// (QuantMatmul._dequant).
//
// DEQUANT KERNELS  <fmt>_dequant
//   Same Params (one part, its own plan), block 256, static shared memory 20 KB. Warp w of block b decodes its
//   strip over the split's chunks to fp16 W = fp16((code - z) * scale) (bit-exact with the reference), stages each
//   32 x 32 tile in shared memory and writes its rows to w_out[perm[k']][strip cols] (row stride Np).
#include "qmm.cuh"

namespace qmm {

using namespace exl;

// ------------------------------------------------------------------------------------------- dequant

template <class Fmt>
struct DequantSink : NoExtra {
    static constexpr bool PIPELINE = false;
    static constexpr int BATCH = 0;
    half* tile;              // this warp's 32 x TILE_STRIDE halves
    half* w_out;
    const int* perm;
    int Np, strip, lane, g, q;
    GroupScales<Fmt> gs;     // the current group's decode state and column scales

    template <int B>
    __device__ void chunk(const unsigned (&w)[B], int group_key, const typename Fmt::Raw& raw, int c, Extra)
    {
        gs.template enter<B>(group_key, raw, g);
        half2 a[16];
        decode_pairs<B, Fmt>(w, gs.st, a);
#pragma unroll
        for (int p = 0; p < 16; ++p) {
            const int j = p / 4, s = p / 2 % 2, h = p % 2;
            const half2 v = __hmul2(a[p], gs.scale[j]);            // fp16((code - z) * scale): one rounding
            const int r = 16 * s + 4 * q + 2 * h, col = 16 * (j / 2) + 8 * (j % 2) + g;
            tile[r * TILE_STRIDE + col] = __low2half(v);
            tile[(r + 1) * TILE_STRIDE + col] = __high2half(v);
        }
        __syncwarp();
#pragma unroll
        for (int i = 0; i < 4; ++i) {                           // 8 rows of 64 bytes per instruction
            const int r = 8 * i + lane / 4, seg = lane % 4, row = 32 * c + r;
            const int dst = perm ? __ldg(perm + row) : row;
            *reinterpret_cast<uint4*>(w_out + (size_t)dst * Np + strip * 32 + seg * 8) =
                *reinterpret_cast<const uint4*>(tile + r * TILE_STRIDE + seg * 8);
        }
        __syncwarp();
    }
};

template <class Fmt>
__device__ __forceinline__ void dequant(const Params& p, half* w_out)
{
    __shared__ __align__(16) half tiles[WARPS][32 * TILE_STRIDE];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const Part& pt = p.part[0];
    const int split = blockIdx.x / pt.col_blocks, strip = blockIdx.x % pt.col_blocks * WARPS + warp;
    Stream st;
    if (strip < pt.strips) {
        start_stream(st, pt, strip, split, lane);
        prefetch_records<Fmt>(pt, strip, split, lane);
    }
    pdl_wait();                                        // w_out may still be read by an earlier kernel
    if (strip >= pt.strips) return;
    DequantSink<Fmt> sink;
    sink.tile = tiles[warp]; sink.w_out = w_out; sink.perm = pt.perm; sink.Np = pt.np; sink.strip = strip;
    sink.lane = lane; sink.g = lane / 4; sink.q = lane % 4;
    walk<Fmt>(pt, strip, split, pt.chunk_meta + pt.split_chunk[split], st, lane, sink);   // chunk_meta via L1
}

}  // namespace qmm

// w_out: W^T [K, Np] fp16 in original row order. 3 blocks per SM (quant_matmul.DEQUANT_RESIDENT).
#define QMM_DEQUANT(NAME, FMT)                                                                                         \
    extern "C" __global__ void __launch_bounds__(qmm::THREADS, 3)                                                      \
    NAME(const __grid_constant__ qmm::Params p, half* w_out)                                                          \
    {                                                                                                                  \
        exl::pdl_trigger();                                                                                           \
        qmm::dequant<FMT>(p, w_out);                                                                                   \
    }

QMM_DEQUANT(exl2_dequant, qmm::Exl2)
QMM_DEQUANT(gptq_dequant, qmm::Gptq)

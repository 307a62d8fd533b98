// RMSNorm, with the roundings of reference.rmsnorm: x in f32, y = fp16(x * rsqrt(mean(x^2) + eps)), then the fp16
// product w * y. add_rmsnorm first forms the new residual r = fp16(x + residual), writes it, and normalises r.
// embed_feed: one token's embedding row as the first block's residual, and as its q/k/v launch's x with the norm
// half done (qmm_rows.cuh STAGE-FREE NORM, the producer's end without a matmul before it).
//
// grid (rows), block 256: one block per row, one pass. Thread i holds the VEC-element vectors i, i + 256, ...,
// (at most NV of them, dim <= 256 * VEC * NV) in registers, and loads them and its weights at once; a block
// reduction gives the row's sum of squares. VEC = 8 moves 16-byte vectors (dim % 8 == 0 and aligned rows, checked by
// the launcher), VEC = 1 single elements. A decode step's rows are latency-bound: one round of loads, one barrier.
#include <cuda_fp16.h>

#include "common.cuh"
#include "norm.cuh"

namespace {

using exl::block_sum;
using exl::inverse_rms;
constexpr int THREADS = exl::NORM_THREADS;

template <int VEC>
struct __align__(2 * VEC) Pack {
    half h[VEC];
};

template <int VEC>
__device__ __forceinline__ Pack<VEC> load(const half* p) {
    return *reinterpret_cast<const Pack<VEC>*>(p);
}

template <int VEC>
__device__ __forceinline__ void store(half* p, const Pack<VEC>& v) {
    *reinterpret_cast<Pack<VEC>*>(p) = v;
}

template <int VEC>
__device__ __forceinline__ Pack<VEC> normalise(const Pack<VEC>& r, const Pack<VEC>& w, float inv_rms) {
    Pack<VEC> y;
#pragma unroll
    for (int i = 0; i < VEC; i++) y.h[i] = exl::normalise(r.h[i], w.h[i], inv_rms);
    return y;
}

// rmsnorm (RESIDUAL false: r = x) or add_rmsnorm (r = fp16(x + residual), written to new_residual) of row blockIdx.x.
template <int VEC, int NV, bool RESIDUAL>
__device__ __forceinline__ void norm_row(const half* __restrict__ x, const half* __restrict__ residual,
                                         const half* __restrict__ w, half* __restrict__ out,
                                         half* __restrict__ new_residual, int dim, float eps) {
    const size_t base = (size_t)blockIdx.x * dim;
    Pack<VEC> r[NV], wv[NV], b[NV];
#pragma unroll
    for (int k = 0; k < NV; k++) {
        const int i = (threadIdx.x + k * THREADS) * VEC;
        if (i < dim) {
            r[k] = load<VEC>(x + base + i);
            wv[k] = load<VEC>(w + i);
            if constexpr (RESIDUAL) b[k] = load<VEC>(residual + base + i);
        }
    }
    float sum_sq = 0.f;
#pragma unroll
    for (int k = 0; k < NV; k++) {
        const int i = (threadIdx.x + k * THREADS) * VEC;
        if (i < dim) {
            if constexpr (RESIDUAL) {
#pragma unroll
                for (int j = 0; j < VEC; j++) r[k].h[j] = exl::add_residual(r[k].h[j], b[k].h[j]);
                store<VEC>(new_residual + base + i, r[k]);
            }
            sum_sq += exl::sum_squares<VEC>(r[k].h);
        }
    }
    const float inv_rms = inverse_rms(block_sum(sum_sq), dim, eps);
#pragma unroll
    for (int k = 0; k < NV; k++) {
        const int i = (threadIdx.x + k * THREADS) * VEC;
        if (i < dim) store<VEC>(out + base + i, normalise<VEC>(r[k], wv[k], inv_rms));
    }
}

}  // namespace

// rmsnorm_f16_v<VEC>_n<NV> / add_rmsnorm_f16_v<VEC>_n<NV>: dim <= 256 * VEC * NV.
#define NORM_KERNELS(VEC, NV)                                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                       \
        rmsnorm_f16_v##VEC##_n##NV(const half* x, const half* w, half* out, int dim, float eps) {                \
        exl::pdl_trigger();  /* dependent launch (common.cuh): x comes from an earlier kernel */               \
        exl::pdl_wait();                                                                                         \
        norm_row<VEC, NV, false>(x, nullptr, w, out, nullptr, dim, eps);                                        \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS) add_rmsnorm_f16_v##VEC##_n##NV(                       \
        const half* x, const half* residual, const half* w, half* out, half* new_residual, int dim, float eps) { \
        exl::pdl_trigger();                                                                                      \
        exl::pdl_wait();                                                                                         \
        norm_row<VEC, NV, true>(x, residual, w, out, new_residual, dim, eps);                                   \
    }

NORM_KERNELS(8, 1)
NORM_KERNELS(8, 2)
NORM_KERNELS(8, 4)
NORM_KERNELS(8, 8)
NORM_KERNELS(8, 16)
NORM_KERNELS(1, 1)
NORM_KERNELS(1, 2)
NORM_KERNELS(1, 4)
NORM_KERNELS(1, 8)
NORM_KERNELS(1, 16)

// embed_feed: grid (ceil(dim / 256)), block 256, a warp per 32 columns. One token (ids[0]): r = table[ids[0]] [dim]
// is written to new_residual, fp16(r * w') to x[i * dim + (places[i * dim + col] & 0x7fffffff)] for each of the
// n_places consumer parts (times 2^-4 where bit 31 is set), and each 32 columns' sum of r^2 (fp32, warp_sum's fixed
// tree) to sums, as a producer's column ends write them (qmm_rows.cuh end_column; quant_matmul.NormFeed).
extern "C" __global__ void __launch_bounds__(THREADS)
    embed_feed(const long long* ids, const half* table, int dim, const half* w, const int* places, int n_places,
               half* x, half* new_residual, float* sums) {
    exl::pdl_trigger();
    exl::pdl_wait();           // the token comes from the step's input copy; x may still be read by a kernel before
    const int lane = threadIdx.x % 32, strip = (blockIdx.x * THREADS + threadIdx.x) / 32, col = strip * 32 + lane;
    if (strip * 32 >= dim) return;
    float sq = 0.f;
    if (col < dim) {
        const half r = table[(size_t)ids[0] * dim + col];
        new_residual[col] = r;
        const float rw = __half2float(r) * __half2float(w[col]);   // exact in fp32 (11-bit significands)
        for (int i = 0; i < n_places; ++i) {
            const int place = places[(size_t)i * dim + col];
            x[(size_t)i * dim + (place & 0x7fffffff)] = __float2half_rn(place < 0 ? rw * 0.0625f : rw);
        }
        sq = __half2float(r) * __half2float(r);
    }
    sq = exl::warp_sum(sq);
    if (lane == 0) sums[strip] = sq;
}

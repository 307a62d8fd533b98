// RMSNorm, with the roundings of reference.rmsnorm: x in f32, y = fp16(x * rsqrt(mean(x^2) + eps)), then the fp16
// product w * y. add_rmsnorm first forms the new residual r = fp16(x + residual), writes it, and normalises r.
//
// grid (rows), block 256: one block per row, one pass. Thread i holds the VEC-element vectors i, i + 256, ...,
// (at most NV of them, dim <= 256 * VEC * NV) in registers, and loads them and its weights at once; a block
// reduction gives the row's sum of squares. VEC = 8 moves 16-byte vectors (dim % 8 == 0 and aligned rows, checked by
// the launcher), VEC = 1 single elements. A decode step's rows are latency-bound: one round of loads, one barrier.
#include <cuda_fp16.h>

#include "common.cuh"

namespace {

constexpr unsigned FULL_MASK = 0xffffffffu;
constexpr int THREADS = 256;

__device__ __forceinline__ float block_sum(float x) {
    __shared__ float partial[THREADS / 32];
#pragma unroll
    for (int span = 16; span >= 1; span >>= 1) x += __shfl_xor_sync(FULL_MASK, x, span);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = x;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; w++) total += partial[w];
    return total;
}

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

// out = fp16(w * fp16(r * inv_rms)); r is this thread's VEC elements.
template <int VEC>
__device__ __forceinline__ Pack<VEC> normalise(const Pack<VEC>& r, const Pack<VEC>& w, float inv_rms) {
    Pack<VEC> y;
#pragma unroll
    for (int i = 0; i < VEC; i++) {
        const half n = __float2half_rn(__fmul_rn(__half2float(r.h[i]), inv_rms));
        y.h[i] = __float2half_rn(__fmul_rn(__half2float(w.h[i]), __half2float(n)));
    }
    return y;
}

__device__ __forceinline__ float inverse_rms(float sum_sq, int dim, float eps) {
    return __frsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, (float)dim), eps));
}

template <int VEC>
__device__ __forceinline__ float sum_squares(const Pack<VEC>& r) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < VEC; j++) s += __half2float(r.h[j]) * __half2float(r.h[j]);
    return s;
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
                for (int j = 0; j < VEC; j++)
                    r[k].h[j] = __float2half_rn(__fadd_rn(__half2float(r[k].h[j]), __half2float(b[k].h[j])));
                store<VEC>(new_residual + base + i, r[k]);
            }
            sum_sq += sum_squares<VEC>(r[k]);
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

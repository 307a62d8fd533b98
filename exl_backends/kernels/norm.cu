// RMSNorm, with the roundings of reference.rmsnorm: x in f32, y = fp16(x * rsqrt(mean(x^2) + eps)), then the fp16
// product w * y. add_rmsnorm first forms the new residual r = fp16(x + residual), writes it, and normalises r.
//
// grid (rows), block 256: one block per row. VEC = 8 moves the row in 16-byte vectors (dim % 8 == 0 and aligned
// rows, checked by the launcher), VEC = 1 element by element. Pass 1: each thread sums the squares of its elements
// (and writes its part of r); a block reduction gives the row's sum. Pass 2: each thread normalises its own
// elements again (re-reading what it read or wrote itself, so no barrier is needed on global memory).
#include <cuda_fp16.h>

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
__device__ void rmsnorm(const half* __restrict__ x, const half* __restrict__ w, half* __restrict__ out, int dim,
                        float eps) {
    const size_t base = (size_t)blockIdx.x * dim;
    float sum_sq = 0.f;
    for (int i = threadIdx.x * VEC; i < dim; i += THREADS * VEC) {
        const Pack<VEC> v = load<VEC>(x + base + i);
#pragma unroll
        for (int j = 0; j < VEC; j++) sum_sq += __half2float(v.h[j]) * __half2float(v.h[j]);
    }
    const float inv_rms = inverse_rms(block_sum(sum_sq), dim, eps);
    for (int i = threadIdx.x * VEC; i < dim; i += THREADS * VEC)
        store<VEC>(out + base + i, normalise<VEC>(load<VEC>(x + base + i), load<VEC>(w + i), inv_rms));
}

template <int VEC>
__device__ void add_rmsnorm(const half* __restrict__ x, const half* __restrict__ residual,
                            const half* __restrict__ w, half* __restrict__ out, half* __restrict__ new_residual,
                            int dim, float eps) {
    const size_t base = (size_t)blockIdx.x * dim;
    float sum_sq = 0.f;
    for (int i = threadIdx.x * VEC; i < dim; i += THREADS * VEC) {
        const Pack<VEC> a = load<VEC>(x + base + i), b = load<VEC>(residual + base + i);
        Pack<VEC> r;
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            r.h[j] = __float2half_rn(__fadd_rn(__half2float(a.h[j]), __half2float(b.h[j])));
            sum_sq += __half2float(r.h[j]) * __half2float(r.h[j]);
        }
        store<VEC>(new_residual + base + i, r);
    }
    const float inv_rms = inverse_rms(block_sum(sum_sq), dim, eps);
    for (int i = threadIdx.x * VEC; i < dim; i += THREADS * VEC)
        store<VEC>(out + base + i, normalise<VEC>(load<VEC>(new_residual + base + i), load<VEC>(w + i), inv_rms));
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
    rmsnorm_f16_vec8(const half* x, const half* w, half* out, int dim, float eps) {
    rmsnorm<8>(x, w, out, dim, eps);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    rmsnorm_f16(const half* x, const half* w, half* out, int dim, float eps) {
    rmsnorm<1>(x, w, out, dim, eps);
}

extern "C" __global__ void __launch_bounds__(THREADS) add_rmsnorm_f16_vec8(
    const half* x, const half* residual, const half* w, half* out, half* new_residual, int dim, float eps) {
    add_rmsnorm<8>(x, residual, w, out, new_residual, dim, eps);
}

extern "C" __global__ void __launch_bounds__(THREADS) add_rmsnorm_f16(
    const half* x, const half* residual, const half* w, half* out, half* new_residual, int dim, float eps) {
    add_rmsnorm<1>(x, residual, w, out, new_residual, dim, eps);
}

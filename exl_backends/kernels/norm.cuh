// RMSNorm arithmetic shared by norm.cu and matmul_rows.cu's stage_xs (which normalises x as it stages it), so that
// both round alike: a row is summed by 256 threads, thread i taking the VEC-element vectors i, i + 256, ... in that
// order (each vector's squares summed from 0, in order, then added to the thread's sum), then block_sum; the
// inverse RMS and the products are rounded as reference.rmsnorm rounds them.
#pragma once

#include <cuda_fp16.h>

namespace exl {

constexpr int NORM_THREADS = 256;

// The sum of x over threads 0 .. NORM_THREADS - 1 (every one gets it), which must all call it. Their barrier is
// named barrier 1, not __syncthreads: a megakernel's CTA has a producer warp beside them (megakernel.cu's ring).
__device__ __forceinline__ float block_sum(float x)
{
    __shared__ float partial[NORM_THREADS / 32];
#pragma unroll
    for (int span = 16; span >= 1; span >>= 1) x += __shfl_xor_sync(0xffffffffu, x, span);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = x;
    asm volatile("bar.sync 1, %0;" ::"n"(NORM_THREADS) : "memory");
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < NORM_THREADS / 32; w++) total += partial[w];
    return total;
}

// The sum of squares of n fp16 values, in order from 0 (explicit FMAs: the same with or without contraction).
template <int N>
__device__ __forceinline__ float sum_squares(const half* v)
{
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < N; j++) s = __fmaf_rn(__half2float(v[j]), __half2float(v[j]), s);
    return s;
}

__device__ __forceinline__ float inverse_rms(float sum_sq, int dim, float eps)
{
    return __frsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, (float)dim), eps));
}

// fp16(w * fp16(r * inv_rms)), as reference.rmsnorm.
__device__ __forceinline__ half normalise(half r, half w, float inv_rms)
{
    const half n = __float2half_rn(__fmul_rn(__half2float(r), inv_rms));
    return __float2half_rn(__fmul_rn(__half2float(w), __half2float(n)));
}

// fp16(x + residual), as reference.add_rmsnorm.
__device__ __forceinline__ half add_residual(half x, half residual)
{
    return __float2half_rn(__fadd_rn(__half2float(x), __half2float(residual)));
}

}  // namespace exl

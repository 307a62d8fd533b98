// Rotary position embedding in the rotate_half layout, with the roundings of reference.apply_rope:
//     out = fp16(fp16(x * cos) + fp16(rotate_half(x) * sin)),  rotate_half(x) = [-x2, x1] over the halves of Dh.
// Each product of two fp16 values is exact in f32, so rounding it once to fp16 is what torch's fp16 multiply does;
// the _rn intrinsics keep --use_fast_math from fusing the multiply into the add.
//
// x, out [T, H, Dh] fp16 (contiguous); cos, sin [T, Dh] fp16.
// grid ceil(T * H * Dh/2 / 256), block 256: thread i handles one (t, head, d < Dh/2) and writes out[d] and
// out[d + Dh/2] of that head.
//
// rope_cos_sin_f16: the tables themselves, as reference.rope_cos_sin computes them on torch's CUDA ops, in one
// launch instead of its ~9 (a decode step's graph replayed each as a node of its own): angle = fp32(position) *
// inv_freq[d % (Dh/2)], then fp16(cosf(angle) * scale) and fp16(sinf(angle) * scale). The family is compiled
// without --use_fast_math (loader.PRECISE_FAMILIES), so cosf and sinf are the CUDA math library's, as torch's.
// positions [T] int64, inv_freq [Dh/2] fp32, cos, sin [T, Dh] fp16; grid ceil(T * Dh / 256), block 256: one
// element of both tables a thread.
#include <cuda_fp16.h>

#include "common.cuh"

namespace {

__device__ __forceinline__ half mul(half a, half b) {
    return __float2half_rn(__fmul_rn(__half2float(a), __half2float(b)));
}

__device__ __forceinline__ half add(half a, half b) {
    return __float2half_rn(__fadd_rn(__half2float(a), __half2float(b)));
}

}  // namespace

extern "C" __global__ void __launch_bounds__(256)
    apply_rope_f16(const half* __restrict__ x, const half* __restrict__ cos, const half* __restrict__ sin,
                   half* __restrict__ out, int n_tokens, int n_heads, int head_dim) {
    exl::pdl_trigger();     // dependent launch (common.cuh): every input comes from an earlier kernel
    exl::pdl_wait();
    const int half_dim = head_dim / 2;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_tokens * n_heads * half_dim) return;
    const int d = (int)(i % half_dim);
    const long long head_row = i / half_dim;            // t * n_heads + head
    const int t = (int)(head_row / n_heads);
    const half* xh = x + head_row * head_dim;
    const half* c = cos + (size_t)t * head_dim;
    const half* s = sin + (size_t)t * head_dim;
    const half x1 = xh[d], x2 = xh[d + half_dim];
    half* o = out + head_row * head_dim;
    o[d] = add(mul(x1, c[d]), mul(__hneg(x2), s[d]));
    o[d + half_dim] = add(mul(x2, c[d + half_dim]), mul(x1, s[d + half_dim]));
}

extern "C" __global__ void __launch_bounds__(256)
    rope_cos_sin_f16(const long long* __restrict__ positions, const float* __restrict__ inv_freq, float scale,
                     half* __restrict__ cos, half* __restrict__ sin, int n_tokens, int head_dim) {
    exl::pdl_trigger();
    exl::pdl_wait();        // the positions come from an earlier copy or kernel
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_tokens * head_dim) return;
    const int t = (int)(i / head_dim), d = (int)(i % head_dim);
    const float angle = __fmul_rn((float)positions[t], inv_freq[d % (head_dim / 2)]);
    cos[i] = __float2half_rn(__fmul_rn(cosf(angle), scale));
    sin[i] = __float2half_rn(__fmul_rn(sinf(angle), scale));
}

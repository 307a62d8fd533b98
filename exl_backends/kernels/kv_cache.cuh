// The cache write's arithmetic, shared by kv_cache.cu (rope_kv_write, kv_write_quant) and attention.cu (whose
// decode kernel with RoPE writes the new token's K and V itself): the quantized layout and RoPE's rounding are
// described at the top of kv_cache.cu.
#pragma once

#include <cuda_fp16.h>

#include "common.cuh"

namespace kv {

// Lane l of the warp owns elements 2l (even) and 2l+1 (odd) of one chunk, x: quantizes both, writes their codes,
// and lanes 0 and 16 write the scales of the chunk's two groups (lanes 0-15 hold group 0, lanes 16-31 group 1).
__device__ __forceinline__ void quantize_chunk(half2 x, unsigned char* __restrict__ codes, half* __restrict__ scales,
                                               int chunk, int bits, int lane) {
    const float2 xf = __half22float2(x);
    const float ye = exl::hadamard32(xf.x, lane);
    const float yo = exl::hadamard32(xf.y, lane);
    float amax = fmaxf(fabsf(ye), fabsf(yo));
#pragma unroll
    for (int span = 8; span >= 1; span >>= 1)
        amax = fmaxf(amax, __shfl_xor_sync(exl::FULL_MASK, amax, span));   // over the 16 lanes of the group
    const float half_range = bits == 8 ? 128.f : 8.f;
    const float top = 2.f * half_range - 1.f;
    // reference: inv = half / amax (torch: reciprocal(amax) * half, exact since half is a power of two)
    const float inv = amax > 0.f ? __fmul_rn(__frcp_rn(amax), half_range) : 0.f;
    const float qe = fminf(fmaxf(rintf(__fadd_rn(__fmul_rn(ye, inv), half_range)), 0.f), top);
    const float qo = fminf(fmaxf(rintf(__fadd_rn(__fmul_rn(yo, inv), half_range)), 0.f), top);
    if (bits == 8) {
        reinterpret_cast<uchar2*>(codes)[chunk * 32 + lane] =
            make_uchar2((unsigned char)qe, (unsigned char)qo);
    } else {
        codes[chunk * 32 + lane] = (unsigned char)((unsigned)qe | ((unsigned)qo << 4));
    }
    if ((lane & 15) == 0)
        scales[chunk * 2 + (lane >> 4)] = __float2half_rn(__fmul_rn(amax, 1.f / half_range));
}

__device__ __forceinline__ half mul(half a, half b) {
    return __float2half_rn(__fmul_rn(__half2float(a), __half2float(b)));
}

__device__ __forceinline__ half add(half a, half b) {
    return __float2half_rn(__fadd_rn(__half2float(a), __half2float(b)));
}

// Element d of the head row x [head_dim] after RoPE with the token's cos/sin rows [head_dim].
__device__ __forceinline__ half rope_at(const half* __restrict__ x, const half* __restrict__ cos,
                                        const half* __restrict__ sin, int d, int head_dim) {
    const int h = head_dim / 2;
    const half rot = d < h ? __hneg(x[d + h]) : x[d - h];
    return add(mul(x[d], cos[d]), mul(rot, sin[d]));
}

// Elements d, d+1 (d even) of the head row x [head_dim] after RoPE, as rope_at.
__device__ __forceinline__ half2 rope_pair(const half* __restrict__ x, const half* __restrict__ cos,
                                           const half* __restrict__ sin, int d, int head_dim) {
    return __halves2half2(rope_at(x, cos, sin, d, head_dim), rope_at(x, cos, sin, d + 1, head_dim));
}

}  // namespace kv

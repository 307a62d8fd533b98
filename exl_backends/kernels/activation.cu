// SwiGLU's elementwise part, out = fp16(fp16(silu(gate)) * up), with the roundings of reference.silu_mul
// (torch: silu in f32 rounded to fp16, then an fp16 multiply). exp is the fast-math one (a few f32 ulps), so the
// result may differ from torch's in the last fp16 bit now and then.
//
// gate, up, out: n fp16 elements (contiguous). grid ceil(n / (256 * VEC)), block 256: each thread handles VEC
// consecutive elements; silu_mul_f16_vec8 moves 16-byte vectors (n % 8 == 0 and aligned, checked by the launcher).
#include <cuda_fp16.h>

namespace {

template <int VEC>
struct __align__(2 * VEC) Pack {
    half h[VEC];
};

template <int VEC>
__device__ __forceinline__ void silu_mul(const half* __restrict__ gate, const half* __restrict__ up,
                                         half* __restrict__ out, long long n) {
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    const Pack<VEC> g = *reinterpret_cast<const Pack<VEC>*>(gate + i);
    const Pack<VEC> u = *reinterpret_cast<const Pack<VEC>*>(up + i);
    Pack<VEC> y;
#pragma unroll
    for (int j = 0; j < VEC; j++) {
        const float x = __half2float(g.h[j]);
        const half s = __float2half_rn(__fdiv_rn(x, __fadd_rn(1.f, __expf(-x))));
        y.h[j] = __float2half_rn(__fmul_rn(__half2float(s), __half2float(u.h[j])));
    }
    *reinterpret_cast<Pack<VEC>*>(out + i) = y;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(256)
    silu_mul_f16_vec8(const half* gate, const half* up, half* out, long long n) {
    silu_mul<8>(gate, up, out, n);
}

extern "C" __global__ void __launch_bounds__(256)
    silu_mul_f16(const half* gate, const half* up, half* out, long long n) {
    silu_mul<1>(gate, up, out, n);
}

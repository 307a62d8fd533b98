// Elementwise ops of the block, with the roundings of their references. This family is compiled without fast math
// (loader.PRECISE_FAMILIES), so tanhf and '/' are the IEEE / libdevice ones torch's kernels use.
//  - gated MLP activations, out = fp16(fp16(act(gate)) * up) (reference.silu_mul, reference.gelu_tanh_mul: torch
//    computes act in f32, rounds it to fp16, then multiplies in fp16). act is silu (exp is the __expf intrinsic, a
//    few f32 ulps off torch's, so a result may differ in the last fp16 bit now and then) or GELU with the tanh
//    approximation (transformers' gelu_pytorch_tanh), torch's own formula and order of operations:
//    0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
//  - softcap, out = tanh(x / cap) * cap on f32 logits (reference.softcap), with torch's roundings: torch divides by
//    a scalar as a product with its reciprocal (rounded to f32), and so does this.
//
// gate, up, out: n fp16 elements (contiguous). grid ceil(n / (256 * VEC)), block 256: each thread handles VEC
// consecutive elements; the _vec8 variants move 16-byte vectors (n % 8 == 0 and aligned, checked by the launcher).
// softcap_f32: x, out n f32 elements, block 256, one element per thread, grid ceil(n / 256); softcap_f32_vec4: four
// per thread as 16-byte vectors (n % 4 == 0 and aligned, checked by the launcher), grid ceil(n / 1024).
#include <cuda_fp16.h>

#include "common.cuh"

namespace {

template <int VEC>
struct __align__(2 * VEC) Pack {
    half h[VEC];
};

struct Silu {
    __device__ __forceinline__ static float apply(float x) { return exl::silu(x); }
};

struct GeluTanh {
    __device__ __forceinline__ static float apply(float x) {
        constexpr float BETA = 0.7978845608028654f;    // sqrt(2 / pi)
        constexpr float KAPPA = 0.044715f;
        const float inner = BETA * (x + KAPPA * (x * x * x));
        return 0.5f * x * (1.f + tanhf(inner));
    }
};

template <class Act, int VEC>
__device__ __forceinline__ void gated(const half* __restrict__ gate, const half* __restrict__ up,
                                      half* __restrict__ out, long long n) {
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    const Pack<VEC> g = *reinterpret_cast<const Pack<VEC>*>(gate + i);
    const Pack<VEC> u = *reinterpret_cast<const Pack<VEC>*>(up + i);
    Pack<VEC> y;
#pragma unroll
    for (int j = 0; j < VEC; j++) {
        const half a = __float2half_rn(Act::apply(__half2float(g.h[j])));
        y.h[j] = __float2half_rn(__fmul_rn(__half2float(a), __half2float(u.h[j])));
    }
    *reinterpret_cast<Pack<VEC>*>(out + i) = y;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(256)
    silu_mul_f16_vec8(const half* gate, const half* up, half* out, long long n) {
    exl::pdl_trigger();     // dependent launch (common.cuh): every input comes from an earlier kernel
    exl::pdl_wait();
    gated<Silu, 8>(gate, up, out, n);
}

extern "C" __global__ void __launch_bounds__(256)
    silu_mul_f16(const half* gate, const half* up, half* out, long long n) {
    exl::pdl_trigger();
    exl::pdl_wait();
    gated<Silu, 1>(gate, up, out, n);
}

extern "C" __global__ void __launch_bounds__(256)
    gelu_tanh_mul_f16_vec8(const half* gate, const half* up, half* out, long long n) {
    exl::pdl_trigger();
    exl::pdl_wait();
    gated<GeluTanh, 8>(gate, up, out, n);
}

extern "C" __global__ void __launch_bounds__(256)
    gelu_tanh_mul_f16(const half* gate, const half* up, half* out, long long n) {
    exl::pdl_trigger();
    exl::pdl_wait();
    gated<GeluTanh, 1>(gate, up, out, n);
}

extern "C" __global__ void __launch_bounds__(256)
    softcap_f32_vec4(const float4* x, float4* out, long long n4, float cap) {
    exl::pdl_trigger();
    exl::pdl_wait();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const float inv = 1.f / cap;
    float4 v = x[i];
    v.x = tanhf(v.x * inv) * cap;
    v.y = tanhf(v.y * inv) * cap;
    v.z = tanhf(v.z * inv) * cap;
    v.w = tanhf(v.w * inv) * cap;
    out[i] = v;
}

extern "C" __global__ void __launch_bounds__(256)
    softcap_f32(const float* x, float* out, long long n, float cap) {
    exl::pdl_trigger();
    exl::pdl_wait();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = tanhf(x[i] * (1.f / cap)) * cap;
}

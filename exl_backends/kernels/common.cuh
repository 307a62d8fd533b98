// common.cuh: small helpers shared by the kernel families. Compiles with NVRTC and nvcc (only <cuda_fp16.h>,
// no host-only headers). Functions marked EXL_HD also compile for the host, so host-side tests can call them.
#pragma once

#include <cuda_fp16.h>

#define EXL_HD __host__ __device__ __forceinline__

namespace exl {

constexpr unsigned FULL_MASK = 0xffffffffu;

// ------------------------------------------------------------------------------------------- dependent launch

// Programmatic dependent launch (sm_90+; the loader launches the families in loader.PDL_FAMILIES with it). Every
// kernel of those families calls pdl_trigger() first, so the next kernel on the stream may be scheduled at once
// and run up to its own pdl_wait(); and it calls pdl_wait() before its first read of anything an earlier kernel
// may write, an L2 prefetch of it included (one made prompt attention read stale keys: docs/attention.md), and
// before its first global write (what it does before, e.g. L2 prefetches of weights, overlaps the previous
// kernel). pdl_wait returns once every earlier kernel has finished and its writes are visible; without
// the launch attribute, or on older GPUs, both are no-ops.
__device__ __forceinline__ void pdl_trigger()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// ------------------------------------------------------------------------------------------- math

// tanh to a few f32 ulps in a family compiled with --use_fast_math (loader.py), which turns tanhf into the hardware's
// tanh.approx (relative error ~2^-11): too coarse for soft-capped attention scores. expm1f keeps full precision under
// fast math and has no cancellation near 0; past |x| = 9, tanh rounds to 1.
__device__ __forceinline__ float tanh_accurate(float x)
{
    const float a = fabsf(x);
    if (a > 9.f) return copysignf(1.f, x);
    const float t = expm1f(2.f * a);
    return copysignf(__fdiv_rn(t, __fadd_rn(t, 2.f)), x);
}

// silu(x) = x / (1 + e^-x) with explicit roundings, so that it is the same whether or not a family is compiled with
// fast math (activation.cu's silu_mul, and matmul_rows.cu's stage_xs, which applies it as it stages x).
__device__ __forceinline__ float silu(float x) { return __fdiv_rn(x, __fadd_rn(1.f, __expf(-x))); }

// ------------------------------------------------------------------------------------------- fp16 bit patterns

// fp16 bits of an integer with |v| <= 2048 (exact).
EXL_HD constexpr unsigned half_bits_of_int(int v)
{
    const unsigned sign = v < 0 ? 0x8000u : 0u;
    const unsigned a = (unsigned)(v < 0 ? -v : v);
    if (a == 0) return sign;
    int e = 0;
    while ((a >> (e + 1)) != 0) ++e;                               // a in [2^e, 2^(e+1))
    const unsigned mantissa = (e <= 10 ? a << (10 - e) : a >> (e - 10)) & 0x3ffu;
    return sign | ((unsigned)(e + 15) << 10) | mantissa;
}

// fp16 bits of 2^e, -14 <= e <= 15.
EXL_HD constexpr unsigned half_bits_of_pow2(int e) { return (unsigned)(e + 15) << 10; }

// The same fp16 value in both halves of a 32-bit word.
EXL_HD constexpr unsigned dup16(unsigned bits16) { return bits16 * 0x10001u; }

__device__ __forceinline__ half2 as_half2(unsigned u) { return *reinterpret_cast<const half2*>(&u); }
__device__ __forceinline__ unsigned as_bits(half2 h) { return *reinterpret_cast<const unsigned*>(&h); }

// (a & b) | c as one LOP3: left to itself the compiler splits two constant operands over two instructions.
EXL_HD unsigned and_or(unsigned a, unsigned b, unsigned c)
{
#ifdef __CUDA_ARCH__
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#else
    return (a & b) | c;
#endif
}

// PRMT: byte n of the result is byte (s >> 4n) & 7 of the 8-byte value {y, x} (x the low word).
EXL_HD unsigned byte_perm(unsigned x, unsigned y, unsigned s)
{
#ifdef __CUDA_ARCH__
    return __byte_perm(x, y, s);
#else
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int n = 0; n < 4; ++n) r |= (unsigned)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n);
    return r;
#endif
}

// ------------------------------------------------------------------------------------------- memory

// Read-once data (packed weights): streamed through L2 with evict-first, not kept in L1.
__device__ __forceinline__ uint4 load_stream(const uint4* p) { return __ldcs(p); }
__device__ __forceinline__ uint2 load_stream(const uint2* p) { return __ldcs(p); }
__device__ __forceinline__ unsigned load_stream(const unsigned* p) { return __ldcs(p); }

// Starts the DRAM read of p's 128-byte line into L2 without waiting or using a register.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// The trace probes' clock and place (qmm_rows.cuh and attention.cu TRACE): ns on one clock for all SMs; the SM.
__device__ __forceinline__ unsigned long long globaltimer()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
}
__device__ __forceinline__ unsigned smid()
{
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    return sm;
}

// One arrival at a split-K counter: returns the count before it. Release: what the caller's group wrote before a
// barrier with it (__syncwarp / __syncthreads) is visible device-wide first (release is cumulative); acquire: the
// last to arrive then reads everyone's partials (past L1: __ldcg) after its group's next barrier. One atomic in place
// of __threadfence, atomicAdd, __threadfence, whose sequentially consistent fences each cost a MEMBAR.SC and an L1
// invalidation in every thread.
__device__ __forceinline__ int arrive(int* counter)
{
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
    return old;
}

// ------------------------------------------------------------------------------------------- tensor cores

// Four 8x8 fp16 matrices from shared memory: lane l gives the address of row l % 8 of matrix l / 8 (16 bytes,
// aligned) and receives r[j] = row l / 4, elements 2 (l % 4) .. + 1 of matrix j (sm_75+). With matrices A's rows
// 0-7 / 8-15 x columns 0-7 / 8-15 in the order (0-7, 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15), r is the A
// fragment a0..a3 of mma_16816.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((unsigned)__cvta_generic_to_shared(p)));
}

// d += A (16x16, fp16, row-major fragment a0..a3) * B (16x8, fp16, column-major fragment b0, b1), fp32 accumulate.
// Fragment of lane l (g = l/4, q = l%4): a0 = A[g][2q..2q+1], a1 = A[g+8][2q..2q+1], a2 = A[g][2q+8..2q+9],
// a3 = A[g+8][2q+8..2q+9]; b0 = B[2q..2q+1][g], b1 = B[2q+8..2q+9][g]; d = {C[g][2q], C[g][2q+1], C[g+8][2q],
// C[g+8][2q+1]}. Before sm_80 (Turing) it is two m16n8k8 products, same fragments.
__device__ __forceinline__ void mma_16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1)
{
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(b0));
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a2), "r"(a3), "r"(b1));
#endif
}

}  // namespace exl

// =========================================================================================== attention and KV cache
// Helpers of kv_cache.cu and attention.cu (kept in this section, apart from the ones above).
namespace exl {

// The unnormalised 32-point Walsh-Hadamard transform across a warp (lane i holds element i), in the butterfly order
// of reference._hadamard32 (span 1, 2, 4, 8, 16), so f32 results are bit-identical to the reference's.
__device__ __forceinline__ float hadamard32(float x, int lane)
{
#pragma unroll
    for (int span = 1; span < 32; span <<= 1) {
        const float other = __shfl_xor_sync(FULL_MASK, x, span);
        x = (lane & span) ? __fsub_rn(other, x) : __fadd_rn(x, other);
    }
    return x;
}

__device__ __forceinline__ float warp_max(float x)
{
#pragma unroll
    for (int span = 16; span >= 1; span >>= 1) x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, span));
    return x;
}

__device__ __forceinline__ float warp_sum(float x)
{
#pragma unroll
    for (int span = 16; span >= 1; span >>= 1) x += __shfl_xor_sync(FULL_MASK, x, span);
    return x;
}

}  // namespace exl

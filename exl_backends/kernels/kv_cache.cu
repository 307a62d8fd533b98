// KV-cache writes: fp16 rows copied into their slots, or quantized on the way in (q8/q6/q4), optionally fused with
// RoPE on the queries and keys (rope_kv_write: the one launch between the q/k/v projections and attention), and the
// dequantization of quantized slots back to fp16 (for prefill attention). The quantized layout is
// reference.quantize_kv's (ExLlamaV2's Q-cache): per token, the flat vector x[E] (E = n_kv_heads * head_dim) is cut
// into 64-element chunks; the even and the odd elements of a chunk each get an unnormalised 32-point Walsh-Hadamard
// transform; each 32 consecutive rotated values share one fp16 scale a/half (a = max |y|, half = 2^(bits-1)) and
// are stored as rint(y * (half / a) + half) clamped to [0, 2*half - 1]: 8-bit one byte each, 4-bit two per byte
// (element e in byte e/2, even e in the low nibble).
//
// No kernel here has a variant per head_dim: rows are handled as flat [E] vectors (fp16 copies: E % 8 == 0; quantized:
// E % 64 == 0, the chunks running across head boundaries as in the reference) and RoPE pairs element d with
// d +- head_dim/2 of its head (head_dim % 4 == 0). So head_dim 256 (Gemma 2 and 3) takes the same launches as 64/128.
//
// Every f32 operation below is the one the reference does, in the same order (the butterfly order of
// reference._hadamard32, the rounding intrinsics so that --use_fast_math cannot fuse or approximate them), so codes
// and scales come out bit-identical to the reference run by torch on the same GPU. RoPE rounds as
// reference.apply_rope: out = fp16(fp16(x * cos) + fp16(rotate_half(x) * sin)), rotate_half(x) = [-x2, x1] over the
// halves of the head (a product of two fp16 values is exact in f32, so one rounding is torch's fp16 multiply).
#include <cuda_fp16.h>

#include "common.cuh"
#include "kv_cache.cuh"

namespace {

using exl::hadamard32;
using kv::quantize_chunk;
using kv::rope_pair;

constexpr int WARPS = 4;   // warps per block; each warp handles one 64-element chunk

// Inverse of quantize_chunk for one chunk: lane l produces elements 2l and 2l+1 as fp16, exactly as
// reference.dequantize_kv: (code - half) * scale in f32, the same transform, / 32, rounded to fp16.
__device__ __forceinline__ half2 dequantize_chunk(const unsigned char* __restrict__ codes,
                                                  const half* __restrict__ scales, int chunk, int bits, int lane) {
    unsigned ce, co;
    float zero;
    if (bits == 8) {
        const uchar2 c = reinterpret_cast<const uchar2*>(codes)[chunk * 32 + lane];
        ce = c.x, co = c.y, zero = 128.f;
    } else {
        const unsigned c = codes[chunk * 32 + lane];
        ce = c & 15u, co = c >> 4, zero = 8.f;
    }
    const float scale = __half2float(scales[chunk * 2 + (lane >> 4)]);
    const float ye = hadamard32(__fmul_rn(__fsub_rn((float)ce, zero), scale), lane);
    const float yo = hadamard32(__fmul_rn(__fsub_rn((float)co, zero), scale), lane);
    return __floats2half2_rn(__fmul_rn(ye, 1.f / 32.f), __fmul_rn(yo, 1.f / 32.f));
}


// rope_kv_write<QUANT>: for T tokens, q_out = rope(q); rope(k) and v into the cache at slots[t].
// q [T, H, Dh], k and v [T, Hkv, Dh] fp16 (contiguous, 4-byte aligned); cos, sin [T, Dh] fp16; Dh % 4 == 0.
// Each lane handles one pair of elements (2i, 2i+1) of a token's flattened q, k or v row; per token the warps are
// wq = ceil(H*Dh/64) for q, then wkv = ceil(Hkv*Dh/64) for k, then wkv for v (quantized: Hkv*Dh % 64 == 0, so warp
// w of k or v is exactly 64-element chunk w, quantized as kv_write_quant does). grid ceil(T * (wq + 2*wkv) / 4),
// block 128.
template <bool QUANT>
__device__ __forceinline__ void rope_kv_write(const half* __restrict__ q, const half* __restrict__ k,
                                              const half* __restrict__ v, const half* __restrict__ cos,
                                              const half* __restrict__ sin, half* __restrict__ q_out,
                                              unsigned char* __restrict__ k_cache, unsigned char* __restrict__ v_cache,
                                              half* __restrict__ k_scales, half* __restrict__ v_scales,
                                              const long long* __restrict__ slots, int n_tokens, int n_heads,
                                              int n_kv_heads, int head_dim, int k_bits, int v_bits) {
    const int lane = threadIdx.x & 31;
    const int q_pairs = n_heads * head_dim / 2, kv_pairs = n_kv_heads * head_dim / 2;
    const int wq = (q_pairs + 31) / 32, wkv = (kv_pairs + 31) / 32;
    const long long job = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (job >= (long long)n_tokens * (wq + 2 * wkv)) return;   // whole warps exit; no block barrier follows
    const int t = (int)(job / (wq + 2 * wkv));
    int w = (int)(job % (wq + 2 * wkv));
    const half* cs = cos + (size_t)t * head_dim;
    const half* sn = sin + (size_t)t * head_dim;
    if (w < wq) {
        const int e = 2 * (w * 32 + lane);
        if (e < 2 * q_pairs) {
            const size_t base = (size_t)t * n_heads * head_dim + e / head_dim * head_dim;
            *reinterpret_cast<half2*>(q_out + (size_t)t * n_heads * head_dim + e) =
                rope_pair(q + base, cs, sn, e % head_dim, head_dim);
        }
        return;
    }
    w -= wq;
    const bool is_k = w < wkv;
    if (!is_k) w -= wkv;
    const int e = 2 * (w * 32 + lane);
    const int width = n_kv_heads * head_dim;
    const half* src = (is_k ? k : v) + (size_t)t * width;
    const size_t slot = (size_t)slots[t];
    if constexpr (QUANT) {
        const half2 x = is_k ? rope_pair(src + e / head_dim * head_dim, cs, sn, e % head_dim, head_dim)
                             : *reinterpret_cast<const half2*>(src + e);
        const int bits = is_k ? k_bits : v_bits;
        quantize_chunk(x, (is_k ? k_cache : v_cache) + slot * (width * bits / 8),
                       (is_k ? k_scales : v_scales) + slot * (width / 32), w, bits, lane);
    } else if (e < width) {
        const half2 x = is_k ? rope_pair(src + e / head_dim * head_dim, cs, sn, e % head_dim, head_dim)
                             : *reinterpret_cast<const half2*>(src + e);
        *reinterpret_cast<half2*>(reinterpret_cast<half*>(is_k ? k_cache : v_cache) + slot * width + e) = x;
    }
}

}  // namespace

// A row of `width` halves (width % 8 == 0, both 16-byte aligned) from src to dst, by the block's threads.
__device__ __forceinline__ void copy_row(half* __restrict__ dst, const half* __restrict__ src, int width) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int i = threadIdx.x; i < width / 8; i += blockDim.x) d[i] = s[i];
}

// kv_write_f16: copies the rows k[T, E] and v[T, E] (fp16) into k_cache/v_cache[slots[t], E].
// grid (T, 2): blockIdx.y 0 copies K, 1 copies V. block 128 threads; each thread moves 16-byte vectors of the row.
// Needs E % 8 == 0 and 16-byte aligned rows (the launcher checks).
extern "C" __global__ void kv_write_f16(const half* __restrict__ k, const half* __restrict__ v,
                                        half* __restrict__ k_cache, half* __restrict__ v_cache,
                                        const long long* __restrict__ slots, int width) {
    exl::pdl_trigger();     // dependent launch (common.cuh): every input comes from an earlier kernel
    exl::pdl_wait();
    const size_t row = blockIdx.x, slot = slots[row];
    copy_row((blockIdx.y == 0 ? k_cache : v_cache) + slot * width, (blockIdx.y == 0 ? k : v) + row * width, width);
}

// kv_read_f16: the rows k_cache/v_cache[slots[t], E] (fp16) -> k_out, v_out [T, E]: kv_write_f16 backwards, one
// launch for both (the prefill attention's gather: two torch index ops cost twice the host time). Same grid, block
// and alignment as kv_write_f16.
extern "C" __global__ void kv_read_f16(const half* __restrict__ k_cache, const half* __restrict__ v_cache,
                                       const long long* __restrict__ slots, half* __restrict__ k_out,
                                       half* __restrict__ v_out, int width) {
    exl::pdl_trigger();
    exl::pdl_wait();
    const size_t row = blockIdx.x, slot = slots[row];
    copy_row((blockIdx.y == 0 ? k_out : v_out) + row * width, (blockIdx.y == 0 ? k_cache : v_cache) + slot * width,
             width);
}

// kv_write_quant: quantizes the rows k[T, E] and v[T, E] (fp16) into the codes and scales of slots[t].
// grid (ceil(T * E/64 / 4), 2): blockIdx.y 0 is K (k_bits), 1 is V (v_bits). block 128 threads = 4 warps; warp w of
// block x handles chunk (x*4 + w) of the flattened [T, E/64] chunks. Codes: [slots, E*bits/8] uint8, scales
// [slots, E/32] fp16.
extern "C" __global__ void kv_write_quant(const half* __restrict__ k, const half* __restrict__ v,
                                          unsigned char* __restrict__ k_codes, unsigned char* __restrict__ v_codes,
                                          half* __restrict__ k_scales, half* __restrict__ v_scales,
                                          const long long* __restrict__ slots, int n_rows, int width,
                                          int k_bits, int v_bits) {
    exl::pdl_trigger();
    exl::pdl_wait();
    const int lane = threadIdx.x & 31;
    const int chunks = width / 64;
    const int job = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (job >= n_rows * chunks) return;   // whole warps exit; no block barrier follows
    const int t = job / chunks, chunk = job % chunks;
    const bool is_k = blockIdx.y == 0;
    const int bits = is_k ? k_bits : v_bits;
    const size_t slot = (size_t)slots[t];
    const half2* x = reinterpret_cast<const half2*>((is_k ? k : v) + (size_t)t * width);
    unsigned char* codes = (is_k ? k_codes : v_codes) + slot * (width * bits / 8);
    half* scales = (is_k ? k_scales : v_scales) + slot * (width / 32);
    quantize_chunk(x[chunk * 32 + lane], codes, scales, chunk, bits, lane);
}

// rope_kv_write_f16 / rope_kv_write_quant: see rope_kv_write (k_cache, v_cache: fp16 rows [slots, E] or codes; the
// scale pointers are null for fp16).
extern "C" __global__ void rope_kv_write_f16(const half* q, const half* k, const half* v, const half* cos,
                                             const half* sin, half* q_out, unsigned char* k_cache,
                                             unsigned char* v_cache, const long long* slots, int n_tokens,
                                             int n_heads, int n_kv_heads, int head_dim) {
    exl::pdl_trigger();
    exl::pdl_wait();
    rope_kv_write<false>(q, k, v, cos, sin, q_out, k_cache, v_cache, nullptr, nullptr, slots, n_tokens, n_heads,
                         n_kv_heads, head_dim, 16, 16);
}

extern "C" __global__ void rope_kv_write_quant(const half* q, const half* k, const half* v, const half* cos,
                                               const half* sin, half* q_out, unsigned char* k_codes,
                                               unsigned char* v_codes, half* k_scales, half* v_scales,
                                               const long long* slots, int n_tokens, int n_heads, int n_kv_heads,
                                               int head_dim, int k_bits, int v_bits) {
    exl::pdl_trigger();
    exl::pdl_wait();
    rope_kv_write<true>(q, k, v, cos, sin, q_out, k_codes, v_codes, k_scales, v_scales, slots, n_tokens, n_heads,
                        n_kv_heads, head_dim, k_bits, v_bits);
}

// kv_dequantize: the K and V of slots[l] (l < L) -> k_out, v_out [L, E] fp16, bit-identical to
// reference.dequantize_kv. grid (ceil(L * E/64 / 4), 2), block 128; one warp per 64-element chunk, as above.
extern "C" __global__ void kv_dequantize(const unsigned char* __restrict__ k_codes,
                                         const unsigned char* __restrict__ v_codes,
                                         const half* __restrict__ k_scales, const half* __restrict__ v_scales,
                                         const long long* __restrict__ slots, half* __restrict__ k_out,
                                         half* __restrict__ v_out, int n_rows, int width, int k_bits, int v_bits) {
    exl::pdl_trigger();
    exl::pdl_wait();
    const int lane = threadIdx.x & 31;
    const int chunks = width / 64;
    const int job = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (job >= n_rows * chunks) return;
    const int t = job / chunks, chunk = job % chunks;
    const bool is_k = blockIdx.y == 0;
    const int bits = is_k ? k_bits : v_bits;
    const size_t slot = (size_t)slots[t];
    const unsigned char* codes = (is_k ? k_codes : v_codes) + slot * (width * bits / 8);
    const half* scales = (is_k ? k_scales : v_scales) + slot * (width / 32);
    half2* out = reinterpret_cast<half2*>((is_k ? k_out : v_out) + (size_t)t * width);
    out[chunk * 32 + lane] = dequantize_chunk(codes, scales, chunk, bits, lane);
}

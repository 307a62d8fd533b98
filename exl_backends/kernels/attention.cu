// Paged attention for single query rows (decode), split-K ("flash-decoding"): attention_split_* computes, for one
// query row, one kv head and one slice ("split") of the row's keys, the partial softmax state (max, sum, weighted
// sum of V) of every query head of the kv head's group; attention_combine_* merges the splits of each
// (row, query head) and writes the fp16 result.
//
// Row r belongs to sequence b = row_seq[r] (row_seq null: b = r, the decode batch), sits at positions[r] and sees the
// keys 0 .. n_keys-1 with n_keys = min(seq_lens[b], positions[r] + 1) (causal). Key t lives in cache slot
// block_tables[b][t / page_size] * page_size + t % page_size. The grid is fixed by (rows, max pages): each row's keys
// are cut into splits of split_len = max(64, roundup(ceil(n_keys / n_splits), 32)) keys, computed on the device, so
// nothing is read on the host and the launch can be captured in a CUDA graph; splits past the keys exit at once.
// page_size must be a multiple of 32, so that a 32-key tile never crosses a page.
//
// Quantized caches (reference.quantize_kv): a stored key is k = R(y)/32, y = (code - zero) * scale, where R applies
// the 32-point Hadamard transform H to the even and to the odd elements of each 64-element chunk. H is symmetric, so
// q.k = (R(q)/32).y: each block rotates its queries once and takes dot products with the raw codes, never
// un-rotating a key. Likewise sum_t p_t v_t = R(sum_t p_t y_t)/32: V is accumulated in the rotated domain and the
// combine kernel applies R/32 once to each output row. head_dim is a multiple of 64 there, so chunks never cross
// heads. Results differ from the reference's only by f32 rounding (the reference rounds the dequantized K/V to fp16).
//
// Scores are kept in the log2 domain (queries pre-scaled by scale * log2(e)) so the softmax uses exp2.
#include <cuda_fp16.h>

#include "common.cuh"

namespace {

using exl::FULL_MASK;
using exl::hadamard32;
using exl::warp_max;
using exl::warp_sum;

constexpr int WARPS = 4;          // warps per split block
constexpr int TILE = 32;          // keys per warp step: lane t scores key t of the tile
constexpr int MIN_SPLIT = 64;     // keys; shorter rows use fewer splits (the rest exit at once)
constexpr int PV_UNROLL = 4;      // V rows in flight per half-warp

// ---------------------------------------------------------------------------------------------- small helpers

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Keys per split of a row with n_keys keys: an equal share, rounded up to whole tiles, at least MIN_SPLIT. The split
// and combine kernels both derive the row's splits from this.
__device__ __forceinline__ int split_length(int n_keys, int n_splits) {
    return max(MIN_SPLIT, ((n_keys + n_splits - 1) / n_splits + TILE - 1) & ~(TILE - 1));
}

// N bytes (2, 4, 8 or 16; N-aligned) from global memory, read-only path, as 32-bit words (a 2-byte read fills
// the low half of word 0).
template <int N>
__device__ __forceinline__ void load_words(const unsigned char* p, unsigned (&w)[(N + 3) / 4]) {
    if constexpr (N == 16) {
        const uint4 x = __ldg(reinterpret_cast<const uint4*>(p));
        w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
    } else if constexpr (N == 8) {
        const uint2 x = __ldg(reinterpret_cast<const uint2*>(p));
        w[0] = x.x, w[1] = x.y;
    } else if constexpr (N == 4) {
        w[0] = __ldg(reinterpret_cast<const unsigned*>(p));
    } else {
        static_assert(N == 2, "2, 4, 8 or 16 bytes");
        w[0] = __ldg(reinterpret_cast<const unsigned short*>(p));
    }
}

// Element i of a packed array of words as f32: fp16 as is, 8-bit codes minus 128, 4-bit codes minus 8 (element i
// in nibble i, low nibble first, as reference.quantize_kv packs them). Codes become floats through the 2^23 trick:
// the bit pattern 0x4B000000 | c is the float 2^23 + c, exact; one subtraction removes 2^23 and the zero point.
template <int BITS>
__device__ __forceinline__ float element(const unsigned* w, int i) {
    if constexpr (BITS == 16) {
        return __half2float(__ushort_as_half((unsigned short)(w[i / 2] >> (16 * (i % 2)))));
    } else if constexpr (BITS == 8) {
        return __int_as_float(__byte_perm(w[i / 4], 0x4B, 0x4550 | (i % 4))) - 8388736.f;   // 2^23 + 128
    } else {
        static_assert(BITS == 4, "fp16, 8-bit or 4-bit");
        return __int_as_float(((w[i / 8] >> (4 * (i % 8))) & 15u) | 0x4B000000u) - 8388616.f;   // 2^23 + 8
    }
}

// ---------------------------------------------------------------------------------------------- split kernel

// One lane's key row (head_dim DH, BITS per element) against the GT staged queries q_s [GT][DH] (smem, f32):
// s[g] += q_s[g] . k, in stretches of 32 elements (16 when DH is 16). Quantized rows: each stretch is one scale
// group, its dot with the codes times the group's scale.
template <int DH, int GT, int BITS>
__device__ __forceinline__ void score_key(const unsigned char* __restrict__ row, const half* __restrict__ scales,
                                          const float* __restrict__ q_s, float (&s)[GT]) {
    constexpr int STRETCH = DH < 32 ? DH : 32;
    constexpr int STRETCH_BYTES = STRETCH * BITS / 8;
    constexpr int WORDS = STRETCH_BYTES / 4;
    static_assert(BITS == 16 || DH % 64 == 0, "quantized rows come in whole 64-element chunks");
    float group_scale[DH / STRETCH];
    if constexpr (BITS != 16) {
        unsigned sw[(DH / 16 + 3) / 4];
        load_words<DH / 16>(reinterpret_cast<const unsigned char*>(scales), sw);
#pragma unroll
        for (int j = 0; j < DH / 32; j++) group_scale[j] = element<16>(sw, j);
    }
#pragma unroll
    for (int grp = 0; grp < DH / STRETCH; grp++) {
        unsigned w[WORDS];
#pragma unroll
        for (int i = 0; i < WORDS; i += 4) {
            unsigned v[4];
            load_words<16>(row + grp * STRETCH_BYTES + 4 * i, v);
            w[i] = v[0], w[i + 1] = v[1], w[i + 2] = v[2], w[i + 3] = v[3];
        }
        float part[GT];
#pragma unroll
        for (int g = 0; g < GT; g++) part[g] = 0.f;
#pragma unroll
        for (int e = 0; e < STRETCH; e += 4) {
            const float k0 = element<BITS>(w, e), k1 = element<BITS>(w, e + 1);
            const float k2 = element<BITS>(w, e + 2), k3 = element<BITS>(w, e + 3);
#pragma unroll
            for (int g = 0; g < GT; g++) {
                const float4 qv = *reinterpret_cast<const float4*>(q_s + g * DH + grp * STRETCH + e);
                part[g] += qv.x * k0 + qv.y * k1 + qv.z * k2 + qv.w * k3;
            }
        }
#pragma unroll
        for (int g = 0; g < GT; g++) s[g] += BITS == 16 ? part[g] : part[g] * group_scale[grp];
    }
}

// attention_split<DH, GT, K_BITS, V_BITS>: one (split, kv head [x head block], row) per block.
// grid (n_splits, n_kv_heads * head_blocks, rows); block 128 threads = 4 warps.
// Query heads: the group of kv head h is h*G .. h*G+G-1 (G = n_heads / n_kv_heads); a block takes GT of them
// (head_blocks = ceil(G / GT) blocks per kv head; padding heads get zero queries and are not written).
// Each warp walks 32-key tiles of the split (tile w, w+4, ...): lane t scores key t against all GT queries
// (its K row read once, used GT times), the warp updates its running max/sum, then the two half-warps take one key
// each in turn and add p * V to accumulators acc[GT][DH/16] (each lane owns DH/16 consecutive dims).
// The four warps' states are merged through shared memory; the block writes, per query head,
// part_acc[row, head, split, :] (f32, unnormalised, rotated for quantized V) and
// part_ml[row, head, split] = (max, sum).
template <int DH, int GT, int K_BITS, int V_BITS>
__device__ __forceinline__ void attention_split(
    const half* __restrict__ q, const unsigned char* __restrict__ k_cache, const unsigned char* __restrict__ v_cache,
    const half* __restrict__ k_scales, const half* __restrict__ v_scales, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const long long* __restrict__ positions, const int* __restrict__ row_seq,
    float* __restrict__ part_acc, float2* __restrict__ part_ml, int n_heads, int n_kv_heads, int max_pages,
    int page_size, int n_splits, float scale_log2) {
    constexpr int DPL = DH / 16;                     // V dims per lane
    constexpr int V_BYTES = DPL * V_BITS / 8;        // a lane's share of one V row
    constexpr int V_WORDS = (V_BYTES + 3) / 4;
    constexpr bool K_QUANT = K_BITS != 16;
    __shared__ __align__(16) float q_s[GT * DH];
    __shared__ __align__(16) float p_s[WARPS][TILE][GT];
    __shared__ float m_s[WARPS][GT], l_s[WARPS][GT];
    __shared__ float acc_s[WARPS][GT][DH];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int split = blockIdx.x, row = blockIdx.z;
    const int group = n_heads / n_kv_heads;
    const int head_blocks = (group + GT - 1) / GT;
    const int kv_head = blockIdx.y / head_blocks;
    const int head0 = kv_head * group + (blockIdx.y % head_blocks) * GT;      // first query head of the block
    const int n_g = min(GT, kv_head * group + group - head0);

    const int seq = row_seq ? row_seq[row] : row;
    const int n_keys = (int)min((long long)seq_lens[seq], positions[row] + 1);
    if (n_keys <= 0) return;
    const int split_len = split_length(n_keys, n_splits);
    const int t_begin = split * split_len;
    if (t_begin >= n_keys) return;
    const int t_end = min(t_begin + split_len, n_keys);

    // stage the queries, scaled into the log2 domain (and rotated for a quantized K)
    for (int i = tid; i < GT * DH; i += WARPS * 32) {
        const int g = i / DH;
        q_s[i] = g < n_g ? __half2float(q[((size_t)row * n_heads + head0 + g) * DH + i % DH]) * scale_log2 : 0.f;
    }
    if constexpr (K_QUANT) {
        __syncthreads();
        for (int c = warp; c < GT * DH / 64; c += WARPS) {
            float* chunk = q_s + c * 64;
            const float even = hadamard32(chunk[2 * lane], lane), odd = hadamard32(chunk[2 * lane + 1], lane);
            chunk[2 * lane] = even * (1.f / 32.f);
            chunk[2 * lane + 1] = odd * (1.f / 32.f);
        }
    }
    __syncthreads();

    const size_t width = (size_t)n_kv_heads * DH;                       // elements per slot
    const unsigned char* k_head = k_cache + (size_t)kv_head * DH * K_BITS / 8;
    const unsigned char* v_head = v_cache + (size_t)kv_head * DH * V_BITS / 8;
    const half* ks_head = k_scales + kv_head * (DH / 32);
    const half* vs_head = v_scales + kv_head * (DH / 32);
    const int* table = block_tables + (size_t)seq * max_pages;
    const int half_warp = lane >> 4, dim0 = (lane & 15) * DPL;

    float m[GT], l[GT], acc[GT][DPL];
#pragma unroll
    for (int g = 0; g < GT; g++) {
        m[g] = neg_inf(), l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[g][i] = 0.f;
    }

    for (int t0 = t_begin + warp * TILE; t0 < t_end; t0 += WARPS * TILE) {
        const int slot = table[t0 / page_size] * page_size + t0 % page_size + lane;
        const bool valid = t0 + lane < t_end;
        float s[GT];
#pragma unroll
        for (int g = 0; g < GT; g++) s[g] = 0.f;
        if (valid)
            score_key<DH, GT, K_BITS>(k_head + slot * width * K_BITS / 8, ks_head + slot * width / 32, q_s, s);

        // online softmax over the warp's keys so far; l is kept per lane (summed at the end), m per warp
#pragma unroll
        for (int g = 0; g < GT; g++) {
            if (!valid) s[g] = neg_inf();
            const float m_new = fmaxf(m[g], warp_max(s[g]));
            const float alpha = exp2f(m[g] - m_new);        // 0 on the first tile (m = -inf)
            const float p = exp2f(s[g] - m_new);
            l[g] = l[g] * alpha + p;
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[g][i] *= alpha;
            m[g] = m_new;
            p_s[warp][lane][g] = p;
        }
        __syncwarp();

        // p.V: the half-warps take keys j0 + 2u + half_warp; PV_UNROLL keys' loads are issued before any is used
        const int n_valid = min(TILE, t_end - t0);
        for (int j0 = 0; j0 < n_valid; j0 += 2 * PV_UNROLL) {
            unsigned w[PV_UNROLL][V_WORDS];
            float v_scale[PV_UNROLL];
#pragma unroll
            for (int u = 0; u < PV_UNROLL; u++) {
                const int j = j0 + 2 * u + half_warp;
                const int slot_j = __shfl_sync(FULL_MASK, slot, j & (TILE - 1));
                v_scale[u] = 1.f;
                if (j < n_valid) {
                    load_words<V_BYTES>(v_head + (slot_j * width + dim0) * V_BITS / 8, w[u]);
                    if constexpr (V_BITS != 16) v_scale[u] = __half2float(vs_head[slot_j * width / 32 + dim0 / 32]);
                }
            }
#pragma unroll
            for (int u = 0; u < PV_UNROLL; u++) {
                const int j = j0 + 2 * u + half_warp;
                if (j < n_valid) {
                    float p[GT];
#pragma unroll
                    for (int g = 0; g < GT; g++) p[g] = p_s[warp][j][g] * v_scale[u];
#pragma unroll
                    for (int i = 0; i < DPL; i++) {
                        const float v = element<V_BITS>(w[u], i);
#pragma unroll
                        for (int g = 0; g < GT; g++) acc[g][i] += p[g] * v;
                    }
                }
            }
        }
        __syncwarp();
    }

    // merge the two half-warps, then the warps
#pragma unroll
    for (int g = 0; g < GT; g++) {
        l[g] = warp_sum(l[g]);
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[g][i] += __shfl_xor_sync(FULL_MASK, acc[g][i], 16);
    }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < GT; g++) m_s[warp][g] = m[g], l_s[warp][g] = l[g];
    }
    if (lane < 16) {
#pragma unroll
        for (int g = 0; g < GT; g++)
#pragma unroll
            for (int i = 0; i < DPL; i++) acc_s[warp][g][dim0 + i] = acc[g][i];
    }
    __syncthreads();

    // warp 0 always had keys (t_begin < t_end), so the block max is finite; warps without keys weigh exp2(-inf) = 0
    for (int i = tid; i < n_g * DH; i += WARPS * 32) {
        const int g = i / DH, d = i % DH;
        float m_max = m_s[0][g];
#pragma unroll
        for (int w = 1; w < WARPS; w++) m_max = fmaxf(m_max, m_s[w][g]);
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) a += acc_s[w][g][d] * exp2f(m_s[w][g] - m_max);
        part_acc[(((size_t)row * n_heads + head0 + g) * n_splits + split) * DH + d] = a;
    }
    if (tid < n_g) {
        float m_max = m_s[0][tid];
#pragma unroll
        for (int w = 1; w < WARPS; w++) m_max = fmaxf(m_max, m_s[w][tid]);
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) sum += l_s[w][tid] * exp2f(m_s[w][tid] - m_max);
        part_ml[((size_t)row * n_heads + head0 + tid) * n_splits + split] = make_float2(m_max, sum);
    }
}

// ---------------------------------------------------------------------------------------------- combine kernel

// attention_combine<DH, ROTATED>: out[row, head, :] = sum_s acc_s * 2^(m_s - M) / sum_s l_s * 2^(m_s - M) over the
// row's used splits (M the max of the m_s), then R/32 applied when V was quantized (see the top of the file).
// grid ceil(rows * n_heads / 4), block 128: one warp per (row, query head); lane l owns elements 2l, 2l+1 of each
// 64-element chunk of the head (so the butterfly runs across lanes). A row without keys gets zeros.
template <int DH, bool ROTATED>
__device__ __forceinline__ void attention_combine(const float* __restrict__ part_acc,
                                                  const float2* __restrict__ part_ml,
                                                  const int* __restrict__ seq_lens,
                                                  const long long* __restrict__ positions,
                                                  const int* __restrict__ row_seq, half* __restrict__ out,
                                                  int n_rows, int n_heads, int n_splits) {
    constexpr int CHUNKS = (DH + 63) / 64;
    const int lane = threadIdx.x & 31;
    const int job = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (job >= n_rows * n_heads) return;
    const int row = job / n_heads;
    const int seq = row_seq ? row_seq[row] : row;
    const int n_keys = (int)min((long long)seq_lens[seq], positions[row] + 1);
    half2* dst = reinterpret_cast<half2*>(out + (size_t)job * DH);
    if (n_keys <= 0) {
        for (int e = 2 * lane; e < DH; e += 64) dst[e / 2] = __float2half2_rn(0.f);
        return;
    }
    const int split_len = split_length(n_keys, n_splits);
    const int n_used = (n_keys + split_len - 1) / split_len;
    const float2* ml = part_ml + (size_t)job * n_splits;
    const float* acc_rows = part_acc + (size_t)job * n_splits * DH;

    float m_max = neg_inf();
    for (int s = lane; s < n_used; s += 32) m_max = fmaxf(m_max, ml[s].x);
    m_max = warp_max(m_max);
    float sum = 0.f;
    for (int s = lane; s < n_used; s += 32) sum += ml[s].y * exp2f(ml[s].x - m_max);
    sum = warp_sum(sum);

    float2 acc[CHUNKS];
#pragma unroll
    for (int c = 0; c < CHUNKS; c++) acc[c] = make_float2(0.f, 0.f);
#pragma unroll 4
    for (int s = 0; s < n_used; s++) {
        const float weight = exp2f(ml[s].x - m_max);
#pragma unroll
        for (int c = 0; c < CHUNKS; c++) {
            const int e = c * 64 + 2 * lane;
            if (e < DH) {
                const float2 a = *reinterpret_cast<const float2*>(acc_rows + (size_t)s * DH + e);
                acc[c].x += weight * a.x;
                acc[c].y += weight * a.y;
            }
        }
    }
    const float inv_sum = 1.f / sum;
#pragma unroll
    for (int c = 0; c < CHUNKS; c++) {
        if constexpr (ROTATED) {
            acc[c].x = hadamard32(acc[c].x, lane) * (1.f / 32.f);
            acc[c].y = hadamard32(acc[c].y, lane) * (1.f / 32.f);
        }
        const int e = c * 64 + 2 * lane;
        if (e < DH) dst[e / 2] = __floats2half2_rn(acc[c].x * inv_sum, acc[c].y * inv_sum);
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------------- entry points
// attention_split_<mode>_d<DH>_g<GT>: modes fp16 (K, V fp16), q8 (8, 8 bits), q6 (K 8, V 4), q4 (4, 4).
// Cache pointers are passed as bytes; unused scale pointers may be null.

// __launch_bounds__(128, 1): without the explicit minimum, ptxas caps registers for occupancy and spills the
// accumulators of the 8-head variants.
#define ATTENTION_SPLIT(NAME, DH, GT, KB, VB)                                                                     \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) NAME(                                           \
        const half* q, const unsigned char* k_cache, const unsigned char* v_cache, const half* k_scales,        \
        const half* v_scales, const int* block_tables, const int* seq_lens, const long long* positions,         \
        const int* row_seq, float* part_acc, float2* part_ml, int n_heads, int n_kv_heads, int max_pages,        \
        int page_size, int n_splits, float scale_log2) {                                                         \
        attention_split<DH, GT, KB, VB>(q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens,        \
                                        positions, row_seq, part_acc, part_ml, n_heads, n_kv_heads, max_pages,   \
                                        page_size, n_splits, scale_log2);                                        \
    }

#define ATTENTION_SPLIT_GROUPS(MODE, DH, KB, VB)                                                                  \
    ATTENTION_SPLIT(attention_split_##MODE##_d##DH##_g2, DH, 2, KB, VB)                                          \
    ATTENTION_SPLIT(attention_split_##MODE##_d##DH##_g4, DH, 4, KB, VB)                                          \
    ATTENTION_SPLIT(attention_split_##MODE##_d##DH##_g8, DH, 8, KB, VB)

ATTENTION_SPLIT_GROUPS(fp16, 16, 16, 16)
ATTENTION_SPLIT_GROUPS(fp16, 32, 16, 16)
ATTENTION_SPLIT_GROUPS(fp16, 64, 16, 16)
ATTENTION_SPLIT_GROUPS(fp16, 128, 16, 16)
ATTENTION_SPLIT_GROUPS(q8, 64, 8, 8)
ATTENTION_SPLIT_GROUPS(q8, 128, 8, 8)
ATTENTION_SPLIT_GROUPS(q6, 64, 8, 4)
ATTENTION_SPLIT_GROUPS(q6, 128, 8, 4)
ATTENTION_SPLIT_GROUPS(q4, 64, 4, 4)
ATTENTION_SPLIT_GROUPS(q4, 128, 4, 4)

// attention_combine_d<DH>[_rotated]: the plain form for fp16 V, the rotated one for quantized V.
#define ATTENTION_COMBINE(NAME, DH, ROTATED)                                                                      \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                    \
        NAME(const float* part_acc, const float2* part_ml, const int* seq_lens, const long long* positions,      \
             const int* row_seq, half* out, int n_rows, int n_heads, int n_splits) {                             \
        attention_combine<DH, ROTATED>(part_acc, part_ml, seq_lens, positions, row_seq, out, n_rows, n_heads,   \
                                       n_splits);                                                                \
    }

ATTENTION_COMBINE(attention_combine_d16, 16, false)
ATTENTION_COMBINE(attention_combine_d32, 32, false)
ATTENTION_COMBINE(attention_combine_d64, 64, false)
ATTENTION_COMBINE(attention_combine_d128, 128, false)
ATTENTION_COMBINE(attention_combine_d64_rotated, 64, true)
ATTENTION_COMBINE(attention_combine_d128_rotated, 128, true)

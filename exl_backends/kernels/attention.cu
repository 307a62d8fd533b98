// Paged attention for single query rows (decode), split-K ("flash-decoding") in one launch, on the tensor cores.
//
// Row r belongs to sequence b = row_seq[r] (row_seq null: b = r, the decode batch), sits at p = positions[r] and sees
// the keys t_first .. n_keys-1 with n_keys = min(seq_lens[b], p + 1) (causal) and, for a sliding window w > 0,
// t_first = max(0, p - w + 1) (key t visible iff p - w < t <= p, as reference.attention), else 0. Key t lives in
// cache slot block_tables[b][t / page_size] * page_size + t % page_size. The row's keys are read from
// t_lo = t_first rounded down to 32 on: pages wholly before the window are never read, and the few keys of the
// first tile below t_first are masked. The grid is fixed by (rows, n_splits): each row's range [t_lo, n_keys) is
// cut on the device into splits of split_len = max(MIN_SPLIT, roundup(ceil((n_keys - t_lo) / n_splits), 32)) keys
// (one split when n_keys - t_lo <= ONE_SPLIT),
// so nothing is read on the host and the launch can be captured in a CUDA graph; splits past the keys exit at once.
// A row whose keys fit one split is finished by its one block. Otherwise each block writes its partial softmax
// state (max, sum, unnormalised sum of V) and the last block of the row to finish (an atomic counter per (row, head
// block), reset by that block) merges the partials and writes the output: no second launch.
//
// Block: one (split, kv head x 8-query-head block, row); 8 warps. The query heads of kv head h are h*G .. h*G+G-1
// (G = n_heads / n_kv_heads); a block takes 8 of them (padding heads get zero queries and are not written). Each
// warp walks KT-key tiles of the split (tile w, w+8, ...): it loads the tile's K and V into registers (all loads in
// flight at once), then with mma.m16n8k16 computes S = K Q^T (keys x 8 heads), the online softmax in f32, and
// O^T += V^T P^T (dims x 8 heads), P rounded to fp16 through shared memory. The warps' states merge in shared memory.
//
// head_dim 256 (Gemma 2 and 3): whole rows would need twice the registers of head_dim 128 (which already take ~230),
// so the warps pair up (Shape::DIM_PARTS 2). Warps 2s and 2s+1 form tile slot s and walk the tiles s, s+4, ...; warp
// 2s+p reads only dims 128p .. 128p+127 of each key and value row (its lane shares, registers and fragments are
// those of head_dim 128), computes its partial S over them, and the pair sums the two partial S through shared
// memory (a named barrier per pair, double-buffered by tile parity). Both warps then hold the same S, softmax state
// and P, and each accumulates O^T for its own 128 dims. The 4 tile slots merge as the 8 warps do otherwise. The
// quantized layout needs nothing else: 128 dims are two whole 64-element rotation chunks and four scale groups.
//
// Fragments. Lane l = (g = l / 4, qd = l % 4). A mma sums over k in any order, so each lane loads wide, contiguous
// pieces and the k index is mapped to whatever dims the pieces hold (the queries' B fragments the same way):
//  - K (A of S, rows = keys): lane (g, qd) holds, of keys 8r + g, the quarter row made of 16-byte (or smaller)
//    pieces qd, qd+4, ... (so the 4 lanes of a row read it contiguously); k_virtual/k_dim give each k its dim.
//  - V (A of O^T, rows = dims, k = keys): lane (g, qd) holds, of the 4 keys 2qd, 2qd+1, 2qd+8, 2qd+9 of each 16-key
//    step, the eighth of the row made of pieces g, g+8, ...; pairs of keys are packed into fragments with PRMT.
//
// Quantized caches (reference.quantize_kv): a stored key is k = R(y)/32, y = (code - zero) * scale, where R applies
// the 32-point Hadamard transform H to the even and to the odd elements of each 64-element chunk. H is symmetric, so
// q.k = (R(q)/32).y: each block rotates its queries once and takes dot products with y, never un-rotating a key.
// Likewise sum_t p_t v_t = R(sum_t p_t y_t)/32: V is accumulated in the rotated domain and R/32 is applied once to
// each output row. y is formed in fp16 ((code - zero) exactly, then one rounding of the product with the scale), as
// are the rotated queries and P; the reference rounds the dequantized K/V to fp16 instead: both differ from exact
// f32 arithmetic by a few fp16 roundings. fp16 K takes the fp16 queries as they are (exact).
//
// Scores are kept in the log2 domain (multiplied by scale * log2(e)) so the softmax uses exp2. With an attention logit
// soft-cap c (Gemma 2), a score s becomes c * tanh(s * scale / c) (then times log2(e)) before the mask, as
// reference.attention does: cap_in = scale / c and cap_out = c * log2(e) (cap_out 0: no soft-cap).
#include <cuda_fp16.h>

#include "common.cuh"
#include "kv_cache.cuh"

// TRACE (a probe; ATT_TRACE=n, 0 by default, and then AttStamps compiles to nothing): lane 0 of each warp of a
//   decode launch stamps %globaltimer (ns) at its start, when its wait is over, when its key loop is over, at its
//   end, and when its queries are staged (just before the key loop), then appends them as one record (qmm_rows.cuh's
//   TraceRecord layout, op 2) to att_trace[0 .. n) (att_trace_n counts, past n too). Rows finished by one block
//   only (a merge of splits is not stamped). benchmarks/trace_step.py reads them beside the matmuls' (QMM_TRACE).
#ifndef ATT_TRACE
#define ATT_TRACE 0
#endif

#if ATT_TRACE
struct AttTraceRecord {
    unsigned long long t[5];     // start, wait over, key loop over, end, queries staged
    unsigned op;                 // 2
    unsigned where;              // SM << 16 | warp << 12 | kv-head block
};
extern "C" {
__device__ AttTraceRecord att_trace[ATT_TRACE];
__device__ unsigned att_trace_n;
}
#endif

// ROPE IN REGISTERS: with RoPE here and an fp16 cache at head_dim 64 or 128, each lane rotates the query pieces it
//   loads for its B fragments itself (a lane's pieces hold both dims of every pair it rotates), and only the warp
//   whose tiles hold the new key writes it, so the queries skip shared memory and the block its two barriers before
//   the key loop (docs/megakernel.md "Attention's staging in registers").

// TILE BEFORE WAIT (a probe; ATT_TILE_BEFORE_WAIT=1, 0 by default, and then the decode kernels are as before it):
//   with RoPE here (the launch writes its rows' new keys itself) and an fp16 cache, each warp whose first tile holds
//   only keys older than the new one loads it before pdl_wait, past L1. Those keys are final before the step
//   starts (earlier steps wrote them, and a step's first launch waits for all work before it: prefetch_old_keys'
//   argument), so after the wait a warp loads only its queries (docs/megakernel.md "Still to do").
#ifndef ATT_TILE_BEFORE_WAIT
#define ATT_TILE_BEFORE_WAIT 0
#endif

namespace {

struct AttStamps {
#if ATT_TRACE
    __device__ __forceinline__ static unsigned long long* slot()
    {
        __shared__ unsigned long long stamps_s[32][5];
        return stamps_s[threadIdx.x / 32];
    }
    __device__ __forceinline__ void at(int i) const
    {
        const unsigned long long t = exl::globaltimer();
        if (threadIdx.x % 32 == 0) slot()[i] = t;
    }
    __device__ __forceinline__ void emit() const
    {
        if (threadIdx.x % 32) return;
        const unsigned i = atomicAdd(&att_trace_n, 1u);
        if (i >= ATT_TRACE) return;
        const unsigned sm = exl::smid();
        AttTraceRecord& r = att_trace[i];
        for (int k = 0; k < 5; ++k) r.t[k] = slot()[k];
        r.op = 2;
        r.where = sm << 16 | threadIdx.x / 32 << 12 | blockIdx.y % 4096;
    }
#else
    __device__ __forceinline__ void at(int) const {}
    __device__ __forceinline__ void emit() const {}
#endif
};

using exl::FULL_MASK;
using exl::hadamard32;
using exl::mma_16816;

constexpr int WARPS = 8;                // warps per block
constexpr int THREADS = WARPS * 32;
constexpr int HEADS = 8;                // query heads per block: the n of the mma
constexpr int MIN_SPLIT = 256;          // keys: one round of 32-key tiles for the 8 warps (head_dim 256: two)
constexpr int ONE_SPLIT = 2 * MIN_SPLIT;   // rows with at most this many keys take one block: a second round of
                                           // tiles costs less than writing, counting and merging split partials
constexpr int ALIGN = 32;               // split lengths are whole 32-key tiles; pages are multiples of 32

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Keys per split of a row with n_keys keys: an equal share, rounded up to whole 32-key tiles, at least MIN_SPLIT;
// all of them up to ONE_SPLIT.
__device__ __forceinline__ int split_length(int n_keys, int n_splits) {
    if (n_keys <= ONE_SPLIT) return (n_keys + ALIGN - 1) & ~(ALIGN - 1);
    return max(MIN_SPLIT, ((n_keys + n_splits - 1) / n_splits + ALIGN - 1) & ~(ALIGN - 1));
}

// max / sum over the 8 lanes that share lane % 4 (one column of an mma fragment)
__device__ __forceinline__ float column_max(float x) {
#pragma unroll
    for (int span = 4; span < 32; span <<= 1) x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, span));
    return x;
}

__device__ __forceinline__ float column_sum(float x) {
#pragma unroll
    for (int span = 4; span < 32; span <<= 1) x += __shfl_xor_sync(FULL_MASK, x, span);
    return x;
}

// N bytes (4, 8 or 16; N-aligned) from global memory into the words w[0 .. N/4-1]. Plain loads, not the read-only
// path: the cache's newest key may have been written by this block (paged_decode with RoPE), which a barrier
// makes visible to plain loads only. L2: past L1 (before pdl_wait an SM's L1 may hold an earlier step's lines).
template <int N, bool L2 = false>
__device__ __forceinline__ void load_words(const unsigned char* p, unsigned* w) {
    if constexpr (N == 16) {
        const uint4 x = L2 ? __ldcg(reinterpret_cast<const uint4*>(p)) : *reinterpret_cast<const uint4*>(p);
        w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
    } else if constexpr (N == 8) {
        const uint2 x = L2 ? __ldcg(reinterpret_cast<const uint2*>(p)) : *reinterpret_cast<const uint2*>(p);
        w[0] = x.x, w[1] = x.y;
    } else {
        static_assert(N == 4, "4, 8 or 16 bytes");
        w[0] = L2 ? __ldcg(reinterpret_cast<const unsigned*>(p)) : *reinterpret_cast<const unsigned*>(p);
    }
}

// The words w[0 .. N/4-1] to N bytes (4, 8 or 16; N-aligned) of global memory: load_words' inverse.
template <int N>
__device__ __forceinline__ void store_words(unsigned char* p, const unsigned* w) {
    if constexpr (N == 16) {
        *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    } else if constexpr (N == 8) {
        *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
    } else {
        static_assert(N == 4, "4, 8 or 16 bytes");
        *reinterpret_cast<unsigned*>(p) = w[0];
    }
}

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) { return exl::as_bits(__floats2half2_rn(lo, hi)); }

// Two codes of a word as the fp16 pair ((c_a - zero) * scale, (c_b - zero) * scale): 8-bit, sel 0 -> bytes 0, 1 and
// sel 1 -> bytes 2, 3; 4-bit, sel p -> nibbles p and p + 4. A code c becomes the fp16 1024 + c by placing it in the
// mantissa of 1024 (exact), minus 1024 + zero (exact), times the scale (one rounding).
template <int BITS>
__device__ __forceinline__ unsigned code_pair(unsigned w, int sel, half2 scale) {
    unsigned h;
    half2 offset;
    if constexpr (BITS == 8) {
        h = __byte_perm(w, 0x64646464u, sel ? 0x4342 : 0x4140);
        offset = exl::as_half2(exl::dup16(exl::half_bits_of_int(1024 + 128)));
    } else {
        static_assert(BITS == 4, "8 or 4 bits");
        h = exl::and_or(w >> (4 * sel), 0x000F000Fu, 0x64006400u);
        offset = exl::as_half2(exl::dup16(exl::half_bits_of_int(1024 + 8)));
    }
    return exl::as_bits(__hmul2(__hsub2(exl::as_half2(h), offset), scale));
}

// The widest load (16, 8 or 4 bytes) that a lane's share of `bytes` is made of (head_dim 96: 48 and 24 bytes).
__host__ __device__ constexpr int piece(int bytes) { return bytes % 16 == 0 ? 16 : bytes % 8 == 0 ? 8 : 4; }

// Compile-time shape of one (head_dim, K bits, V bits, keys per warp tile) variant. Up to head_dim 128 a warp
// takes whole key and value rows; above, the warps pair up (DIM_PARTS 2): both warps of a pair attend the same key
// tile, each over its WARP_DIMS = DH/2 dims of K and V (its lane shares are the head_dim-128 variant's).
template <int DH, int K_BITS, int V_BITS, int KT_>
struct Shape {
    static constexpr int KT = KT_;                  // keys per warp tile (32 or 64)
    static constexpr int DIM_PARTS = DH > 128 ? 2 : 1;          // warps per key tile
    static constexpr int WARP_DIMS = DH / DIM_PARTS;            // dims of K and V a warp reads: part * WARP_DIMS on
    static constexpr int TILE_SLOTS = WARPS / DIM_PARTS;        // key tiles a block attends at once
    static constexpr int STEPS = WARP_DIMS / 16;    // k steps of S = K Q^T, and m tiles of O^T = V^T P^T
    static constexpr int M_TILES = KT / 16;         // 16-key m tiles of S = k steps of O^T
    static constexpr int K_ROWS = KT / 8;           // key rows per lane: 8r + g
    static constexpr int K_BYTES = WARP_DIMS * K_BITS / 32;     // a lane's quarter of a key row's part
    static constexpr int K_PIECE = piece(K_BYTES);
    static constexpr int K_PIECES = K_BYTES / K_PIECE;
    static constexpr int K_WORDS = K_BYTES / 4;
    static constexpr int K_PIECE_ELEMS = K_PIECE * 8 / K_BITS;
    static constexpr int V_KEYS = KT / 4;           // value rows per lane: 4 per 16-key step
    static constexpr int V_BYTES = WARP_DIMS * V_BITS / 64;     // a lane's eighth of a value row's part
    static constexpr int V_PIECE = piece(V_BYTES);
    static constexpr int V_PIECES = V_BYTES / V_PIECE;
    static constexpr int V_WORDS = V_BYTES / 4;
    static constexpr int V_PIECE_ELEMS = V_PIECE * 8 / V_BITS;
    static constexpr int P_ROW = KT + 8;            // halves per head row of P (+8: conflict-free fragment reads)
    static constexpr int CHUNKS = (DH + 63) / 64;   // 64-element chunks of an output row (lane: 2l, 2l+1 of each)
    // DIM_PARTS 2: a warp's partial scores, per tile parity and warp, [M_TILES * 4][32 lanes] f32 (1: unused)
    static constexpr int X_FLOATS = DIM_PARTS == 2 ? 2 * WARPS * M_TILES * 4 * 32 : 1;
    static_assert(DIM_PARTS == 1 || WARP_DIMS % 64 == 0, "a part is whole 64-element rotation chunks");
    static_assert(K_BITS == 16 || (K_PIECES <= 2 && V_PIECES == 1), "a quantized piece lies in one scale group");
    static_assert(KT == 32 || KT == 64, "whole 32-key tiles");
    static_assert(K_PIECE_ELEMS % 4 == 0, "a k step takes 4 elements of one piece");
};

// Element of the lane's K pieces that the k index of step s, fragment register hi (a0/b0: 0, a2/b1: 1), half e
// stands for (an index into the concatenated pieces): consecutive for fp16 and 8-bit codes; for 4-bit codes the
// nibble pairs (p, p+4) that one mask extracts.
template <int K_BITS>
__device__ __forceinline__ constexpr int k_virtual(int s, int hi, int e) {
    return K_BITS == 4 ? 8 * (s / 2) + 2 * (s % 2) + hi + 4 * e : 4 * s + 2 * hi + e;
}

template <class S>
__device__ __forceinline__ int k_dim(int qd, int v) {
    return (qd + 4 * (v / S::K_PIECE_ELEMS)) * S::K_PIECE_ELEMS + v % S::K_PIECE_ELEMS;
}

// Element of the lane's V pieces that row half e (0: row g, 1: row g+8) of m tile t of O^T stands for.
template <int V_BITS>
__device__ __forceinline__ constexpr int v_virtual(int t, int e) {
    return V_BITS == 4 ? 8 * (t / 4) + t % 4 + 4 * e : 2 * t + e;
}

template <class S>
__device__ __forceinline__ int v_dim(int g, int v) {
    return (g + 8 * (v / S::V_PIECE_ELEMS)) * S::V_PIECE_ELEMS + v % S::V_PIECE_ELEMS;
}

// One warp tile's K and V, in registers.
template <class S>
struct Tile {
    unsigned k[S::K_ROWS][S::K_WORDS];
    half k_scale[S::K_ROWS][S::K_PIECES];
    unsigned v[S::V_KEYS][S::V_WORDS];
    half v_scale[S::V_KEYS];
};

struct Cache {
    const unsigned char* k;      // this kv head's bytes in slot 0
    const unsigned char* v;
    const half* k_scales;        // this kv head's scales in slot 0 (quantized)
    const half* v_scales;
    size_t k_stride, v_stride;   // bytes per slot
    int scale_stride;            // scales per slot
};

// Issues every load of the tile at keys t0 .. t0+KT-1 of the row (keys past t_end re-read key t_end-1; their scores
// are masked), without waiting for any. L2: the table and the words past L1 (fp16 only: before pdl_wait).
template <int DH, int K_BITS, int V_BITS, int KT, bool L2 = false>
__device__ __forceinline__ void load_tile(Tile<Shape<DH, K_BITS, V_BITS, KT>>& tile, const Cache& c,
                                          const int* __restrict__ table, int page_size, int t0, int t_end,
                                          int lane) {
    using S = Shape<DH, K_BITS, V_BITS, KT>;
    static_assert(!L2 || (K_BITS == 16 && V_BITS == 16), "the scales' loads have no L2 form");
    const int g = lane >> 2, qd = lane & 3;
    int slot[S::KT / 32];   // lane l: the slot of key t0 + l + 32i
#pragma unroll
    for (int i = 0; i < S::KT / 32; i++) {
        const int t = min(t0 + lane + 32 * i, t_end - 1);
        slot[i] = (L2 ? __ldcg(table + t / page_size) : __ldg(table + t / page_size)) * page_size + t % page_size;
    }
#pragma unroll
    for (int r = 0; r < S::K_ROWS; r++) {
        const size_t s = (size_t)__shfl_sync(FULL_MASK, slot[r / 4], (8 * r + g) & 31);
        const unsigned char* row = c.k + s * c.k_stride;
#pragma unroll
        for (int j = 0; j < S::K_PIECES; j++) {
            load_words<S::K_PIECE, L2>(row + (qd + 4 * j) * S::K_PIECE, &tile.k[r][j * S::K_PIECE / 4]);
            if constexpr (K_BITS != 16)
                tile.k_scale[r][j] = *(c.k_scales + s * c.scale_stride + (qd + 4 * j) * S::K_PIECE_ELEMS / 32);
        }
    }
#pragma unroll
    for (int i = 0; i < S::V_KEYS; i++) {
        const int key = 16 * (i / 4) + 2 * qd + (i & 1) + 8 * ((i >> 1) & 1);
        const size_t s = (size_t)__shfl_sync(FULL_MASK, slot[i / 8], key & 31);
        const unsigned char* row = c.v + s * c.v_stride;
#pragma unroll
        for (int j = 0; j < S::V_PIECES; j++)
            load_words<S::V_PIECE, L2>(row + (g + 8 * j) * S::V_PIECE, &tile.v[i][j * S::V_PIECE / 4]);
        if constexpr (V_BITS != 16)
            tile.v_scale[i] = *(c.v_scales + s * c.scale_stride + g * S::V_PIECE_ELEMS / 32);
    }
}

// A fragment register hi of k step s for key row r (fp16 pairs of K, or of y for quantized K).
template <int DH, int K_BITS, int V_BITS, int KT>
__device__ __forceinline__ unsigned k_fragment(const Tile<Shape<DH, K_BITS, V_BITS, KT>>& tile, int r, int s,
                                               int hi) {
    using S = Shape<DH, K_BITS, V_BITS, KT>;
    if constexpr (K_BITS == 16) {
        return tile.k[r][2 * s + hi];
    } else {
        const int word = K_BITS == 8 ? s : s / 2;
        const half2 scale = __half2half2(tile.k_scale[r][word * 4 / S::K_PIECE]);
        return code_pair<K_BITS>(tile.k[r][word], K_BITS == 8 ? hi : 2 * (s % 2) + hi, scale);
    }
}

// The pair (virtual element v_virtual(t, 0), v_virtual(t, 1)) of value row i, as fp16.
template <int DH, int K_BITS, int V_BITS, int KT>
__device__ __forceinline__ unsigned v_pair(const Tile<Shape<DH, K_BITS, V_BITS, KT>>& tile, int i, int t) {
    if constexpr (V_BITS == 16) {
        return tile.v[i][t];
    } else {
        const half2 scale = __half2half2(tile.v_scale[i]);
        return V_BITS == 8 ? code_pair<8>(tile.v[i][t / 2], t % 2, scale)
                           : code_pair<4>(tile.v[i][t / 4], t % 4, scale);
    }
}

// Softmax state of one warp; lane (g, qd) holds heads 2qd, 2qd+1 (m: the running max, equal over the column; l: this
// lane's share of the sum; acc: O^T fragments, c0/c2 head 2qd, c1/c3 head 2qd+1).
template <class S>
struct State {
    float m[2], l[2];
    float acc[S::STEPS][4];
};

// Waits for the other warp of this warp's pair (named barrier 1 + warp/2; 0 is __syncthreads').
__device__ __forceinline__ void pair_sync(int warp) {
    asm volatile("bar.sync %0, 64;" ::"r"(1 + (warp >> 1)) : "memory");
}

// One tile: scores, online softmax, P through shared memory (p_w: this warp's [HEADS][P_ROW] halves), O^T += V^T P^T.
// DIM_PARTS 2: the scores over this warp's dims are summed with its pair's through x ([2][WARPS][M_TILES*4][32] f32,
// one half per tile parity: a warp writes one half while its pair may still read the other). The sum is the same
// in both warps (f32 addition commutes), so both keep the same softmax state and P.
template <int DH, int K_BITS, int V_BITS, int KT>
__device__ __forceinline__ void attend_tile(State<Shape<DH, K_BITS, V_BITS, KT>>& st,
                                            const Tile<Shape<DH, K_BITS, V_BITS, KT>>& tile,
                                            const unsigned (&qb)[Shape<DH, K_BITS, V_BITS, KT>::STEPS][2],
                                            half* p_w, float* x, int parity, int t0, int t_first, int t_end,
                                            float scale_log2, float cap_in, float cap_out, int warp, int lane) {
    using S = Shape<DH, K_BITS, V_BITS, KT>;
    const int g = lane >> 2, qd = lane & 3;
    float sc[S::M_TILES][4];
#pragma unroll
    for (int mt = 0; mt < S::M_TILES; mt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) sc[mt][e] = 0.f;
#pragma unroll
        for (int s = 0; s < S::STEPS; s++)
            mma_16816(sc[mt], k_fragment(tile, 2 * mt, s, 0), k_fragment(tile, 2 * mt + 1, s, 0),
                      k_fragment(tile, 2 * mt, s, 1), k_fragment(tile, 2 * mt + 1, s, 1), qb[s][0], qb[s][1]);
    }
    if constexpr (S::DIM_PARTS == 2) {
        constexpr int WARP_FLOATS = S::M_TILES * 4 * 32;
        float* mine = x + (parity * WARPS + warp) * WARP_FLOATS + lane;
        const float* theirs = x + (parity * WARPS + (warp ^ 1)) * WARP_FLOATS + lane;
#pragma unroll
        for (int mt = 0; mt < S::M_TILES; mt++)
#pragma unroll
            for (int e = 0; e < 4; e++) mine[(4 * mt + e) * 32] = sc[mt][e];
        pair_sync(warp);
#pragma unroll
        for (int mt = 0; mt < S::M_TILES; mt++)
#pragma unroll
            for (int e = 0; e < 4; e++) sc[mt][e] += theirs[(4 * mt + e) * 32];
    }

    // sc[mt][e]: key t0 + 16mt + 8(e/2) + g, head 2qd + e%2
    float tile_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
    for (int mt = 0; mt < S::M_TILES; mt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int t = t0 + 16 * mt + 8 * (e >> 1) + g;
            const float s = cap_out != 0.f ? exl::tanh_accurate(sc[mt][e] * cap_in) * cap_out : sc[mt][e] * scale_log2;
            sc[mt][e] = t >= t_first && t < t_end ? s : neg_inf();
            tile_max[e & 1] = fmaxf(tile_max[e & 1], sc[mt][e]);
        }
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const float m_new = fmaxf(st.m[h], column_max(tile_max[h]));   // finite: every tile has a visible key
        alpha[h] = exp2f(st.m[h] - m_new);                              // 0 on the first tile (m = -inf)
        st.m[h] = m_new;
        st.l[h] *= alpha[h];
    }
#pragma unroll
    for (int mt = 0; mt < S::M_TILES; mt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float p = exp2f(sc[mt][e] - st.m[e & 1]);
            st.l[e & 1] += p;
            p_w[(2 * qd + (e & 1)) * S::P_ROW + 16 * mt + 8 * (e >> 1) + g] = __float2half_rn(p);
        }
#pragma unroll
    for (int t = 0; t < S::STEPS; t++)
#pragma unroll
        for (int e = 0; e < 4; e++) st.acc[t][e] *= alpha[e & 1];
    __syncwarp();

    // O^T[dims, heads] += V^T[dims, keys] P^T[keys, heads], 16 keys per k step
    const unsigned* p_words = reinterpret_cast<const unsigned*>(p_w + g * S::P_ROW);
#pragma unroll
    for (int ks = 0; ks < S::M_TILES; ks++) {
        const unsigned b0 = p_words[8 * ks + qd], b1 = p_words[8 * ks + qd + 4];
#pragma unroll
        for (int t = 0; t < S::STEPS; t++) {
            const unsigned x0 = v_pair(tile, 4 * ks, t), x1 = v_pair(tile, 4 * ks + 1, t);
            const unsigned x2 = v_pair(tile, 4 * ks + 2, t), x3 = v_pair(tile, 4 * ks + 3, t);
            mma_16816(st.acc[t], __byte_perm(x0, x1, 0x5410), __byte_perm(x0, x1, 0x7632),
                      __byte_perm(x2, x3, 0x5410), __byte_perm(x2, x3, 0x7632), b0, b1);
        }
    }
    __syncwarp();   // P is rewritten by the next tile
}

// Where the output goes: row r's element j (head * DH + dim) at base[r * width + j], fp16; or, with place (a decode
// row for a quantized o projection: QuantMatmul.stored_x), where and as that launch reads its x after stage_xs:
// base[r * width + (place[j] & 0x7fffffff)], times 2^-4 where bit 31 is set (a FOLDED 4-bit row), rounded as
// stage_xs rounds it (the fp16 output, then the scaled value), so the o projection's bits stay the same.
struct Out {
    half* base;
    const int* place;
    int width;

    __device__ __forceinline__ void put(int row, int j, float v) const {
        if (place) put_at(row, __ldg(place + j), v);
        else base[(size_t)row * width + j] = __float2half_rn(v);
    }
    __device__ __forceinline__ void put_at(int row, int at, float v) const {
        const half h = __float2half_rn(v);
        base[(size_t)row * width + (at & 0x7fffffff)] = at < 0 ? __float2half_rn(__half2float(h) * 0.0625f) : h;
    }
    // The places of heads head0 .. head0 + n - 1 into L2, a line a thread, ahead of the wait: read at the very end,
    // they would otherwise come from DRAM (the step's weights stream through L2 between two reads), ~0.6 us a launch.
    __device__ __forceinline__ void prefetch(int head0, int n, int dh, int tid) const {
        if (place && 32 * tid < n * dh)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(place + head0 * dh + 32 * tid));
    }
    // The places of a lane's elements of a head's row (elements j0 + c * 64 + 2 lane, + 1), loaded well before
    // finish_row needs them (after the key loop, ahead of the slots' merge): read there, their L2 round trip was
    // on the launch's last path. Zeros without places.
    template <int DH>
    __device__ __forceinline__ void places(int j0, int lane, int2 (&at)[(DH + 63) / 64]) const {
#pragma unroll
        for (int c = 0; c < (DH + 63) / 64; c++) {
            const int e = c * 64 + 2 * lane;
            at[c] = place && e < DH ? __ldg(reinterpret_cast<const int2*>(place + j0 + e)) : make_int2(0, 0);
        }
    }
    __device__ __forceinline__ void put2(int row, int j, int2 at, float v0, float v1) const {
        if (place) {
            put_at(row, at.x, v0);
            put_at(row, at.y, v1);
        } else {
            *reinterpret_cast<half2*>(base + (size_t)row * width + j) = __floats2half2_rn(v0, v1);
        }
    }
};

// Writes one output row of a query head (elements j0 .. j0 + DH - 1 of row `row`, at: their places, Out::places)
// from a warp: a = sum of p * V (lane: elements c*64 + 2l, +1), l = sum of p; for a quantized V, a is in the rotated
// domain and R/32 is applied here.
template <int DH, bool ROTATED>
__device__ __forceinline__ void finish_row(float2 (&a)[(DH + 63) / 64], float l, const Out& out, int row, int j0,
                                           const int2 (&at)[(DH + 63) / 64], int lane) {
    const float inv = 1.f / l;
#pragma unroll
    for (int c = 0; c < (DH + 63) / 64; c++) {
        if constexpr (ROTATED) {
            a[c].x = hadamard32(a[c].x, lane) * (1.f / 32.f);
            a[c].y = hadamard32(a[c].y, lane) * (1.f / 32.f);
        }
        const int e = c * 64 + 2 * lane;
        if (e < DH) out.put2(row, j0 + e, at[c], a[c].x * inv, a[c].y * inv);
    }
}

// The row's new token as the q/k/v projections left it, for a launch that rotates it and writes its key and value
// itself (k non-null): k, v [rows, n_kv_heads, DH], cos, sin [rows, DH] fp16, slots [rows] (where the token's K and V
// go; its key must be the row's last, at position positions[row] == seq_lens[row] - 1, as in a decode batch).
struct NewToken {
    const half* k;
    const half* v;
    const half* cos;
    const half* sin;
    const long long* slots;
};

// Into L2 ahead of the wait, for a launch that writes the row's new key itself (NewToken): the key and value rows of
// this kv head for keys t_begin .. t_stop - 1, all older than the new one (t_stop <= its position). Each was written
// by an earlier step, and a step's first launch waits for all the work before it (a graph's replay, or the step's
// input copies), so none of these lines is still being written: unlike the prompt rows' tiles, whose keys the kernel
// just before writes (docs/attention.md). Only where every 128-byte line belongs to one slot (a slot's rows of all
// heads whole lines), so that no line holds a byte of the new key's slot. Taken for fp16 caches (EARLY, below).
template <int DH, int K_BITS, int V_BITS>
__device__ __forceinline__ void prefetch_old_keys(const unsigned char* k_cache, const unsigned char* v_cache,
                                                  int kv_head, int n_kv_heads, const int* table, int page_size,
                                                  int t_begin, int t_stop, int tid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900   // (before: no dependent launch to hide it behind)
    constexpr int K_ROW = DH * K_BITS / 8, V_ROW = DH * V_BITS / 8;          // bytes of one key's row of a head
    constexpr int K_LINES = (K_ROW + 127) / 128, LINES = K_LINES + (V_ROW + 127) / 128;
    if (n_kv_heads * K_ROW % 128 || n_kv_heads * V_ROW % 128) return;
    for (int i = tid; i < (t_stop - t_begin) * LINES; i += THREADS) {
        const int t = t_begin + i / LINES, line = i % LINES;
        const size_t s = (size_t)__ldcg(table + t / page_size) * page_size + t % page_size;
        const unsigned char* at = line < K_LINES
            ? k_cache + (s * n_kv_heads + kv_head) * K_ROW + 128 * line
            : v_cache + (s * n_kv_heads + kv_head) * V_ROW + 128 * (line - K_LINES);
        asm volatile("prefetch.global.L2 [%0];" ::"l"(at));
    }
#endif
}

// The row's new token for kv head kv_head: its cache slot, its key and value rows and its cos / sin rows.
template <int DH>
struct NewRow {
    size_t slot;
    const half *k, *v, *cs, *sn;
    int width;        // elements per slot: n_kv_heads * DH

    __device__ __forceinline__ NewRow(const NewToken& nt, int row, int kv_head, int n_kv_heads)
        : slot((size_t)__ldcg(nt.slots + row)), k(nt.k + ((size_t)row * n_kv_heads + kv_head) * DH),
          v(nt.v + ((size_t)row * n_kv_heads + kv_head) * DH), cs(nt.cos + (size_t)row * DH),
          sn(nt.sin + (size_t)row * DH), width(n_kv_heads * DH) {}
};

// The new token's key (after RoPE) and value into the cache, by the whole block: fp16 a pair of elements a thread,
// as rope_kv_write; quantized, a warp per 64-element chunk (warps 0 .. DH/64 - 1 the key's, the next ones the value's).
template <int DH, int K_BITS, int V_BITS>
__device__ __forceinline__ void write_new_token(const NewToken& nt, int row, int kv_head, int n_kv_heads,
                                                unsigned char* k_cache, unsigned char* v_cache, half* k_scales,
                                                half* v_scales) {
    const NewRow<DH> r(nt, row, kv_head, n_kv_heads);
    if constexpr (K_BITS == 16) {
        static_assert(V_BITS == 16, "fp16 keys go with fp16 values");
        for (int e = 2 * threadIdx.x; e < 2 * DH; e += 2 * THREADS) {   // a pair of elements a thread
            const bool is_k = e < DH;
            const int d = is_k ? e : e - DH;
            const half2 x = is_k ? kv::rope_pair(r.k, r.cs, r.sn, d, DH) : *reinterpret_cast<const half2*>(r.v + d);
            *reinterpret_cast<half2*>(reinterpret_cast<half*>(is_k ? k_cache : v_cache) + r.slot * r.width +
                                      (size_t)kv_head * DH + d) = x;
        }
    } else {
        constexpr int CHUNKS = DH / 64;
        static_assert(DH % 64 == 0 && 2 * CHUNKS <= WARPS, "a warp per 64-element chunk of the key and the value");
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        if (warp < 2 * CHUNKS) {
            const bool is_k = warp < CHUNKS;
            const int d = warp % CHUNKS * 64 + 2 * lane;
            const half2 x = is_k ? kv::rope_pair(r.k, r.cs, r.sn, d, DH) : *reinterpret_cast<const half2*>(r.v + d);
            const int bits = is_k ? K_BITS : V_BITS;
            kv::quantize_chunk(x, (is_k ? k_cache : v_cache) + r.slot * (r.width * bits / 8),
                               (is_k ? k_scales : v_scales) + r.slot * (r.width / 32),
                               kv_head * CHUNKS + warp % CHUNKS, bits, lane);
        }
    }
}

// RoPE on a lane's query words as the unstaged fp16 path loads them (w: the pieces qd, qd + 4, ... of head g's row;
// c, s: the row's cos and sin at the same pieces), rounded as kv::rope_at: word i and word i + K_WORDS / 2 hold dims
// d and d + DH / 2, so each lane rotates its own pairs (ROPE IN REGISTERS, paged_decode).
template <class S>
__device__ __forceinline__ void rope_words(unsigned (&w)[S::K_WORDS], const unsigned (&c)[S::K_WORDS],
                                           const unsigned (&s)[S::K_WORDS]) {
    constexpr int H = S::K_WORDS / 2;
    const auto add = [](half2 a, half2 b) {
        return exl::as_bits(__floats2half2_rn(__fadd_rn(__low2float(a), __low2float(b)),
                                              __fadd_rn(__high2float(a), __high2float(b))));
    };
#pragma unroll
    for (int i = 0; i < H; i++) {
        const half2 lo = exl::as_half2(w[i]), hi = exl::as_half2(w[i + H]);
        w[i] = add(__hmul2(lo, exl::as_half2(c[i])), __hmul2(__hneg2(hi), exl::as_half2(s[i])));
        w[i + H] = add(__hmul2(hi, exl::as_half2(c[i + H])), __hmul2(lo, exl::as_half2(s[i + H])));
    }
}

// paged_decode<DH, K_BITS, V_BITS, KT>: grid (n_splits, n_kv_heads * head_blocks, rows), block 256 (8 warps).
// head_blocks = ceil(G / 8). part_acc [rows, n_heads, n_splits, DH] f32 and part_ml [rows, n_heads, n_splits]
// (max, sum) hold the partial states of rows with several splits (null when n_splits is 1); counters
// [rows * n_kv_heads * head_blocks] int32 must be zero before the launch and are zero after it. window: the sliding
// window (0: none); cap_in, cap_out: the soft-cap (cap_out 0: none), see the top of the file.
// nt.k non-null (RoPE here): q is the projection's, rotated here, and the block whose split holds the row's last key
// (the new token's) first writes that key and value (NewToken), so that no launch of rope_kv_write comes between
// the projections and this one; rows must then be decode rows (one new token per sequence, row_seq null) and a kv
// head's query heads one block (G <= 8: no two blocks write the same key).
template <int DH, int K_BITS, int V_BITS, int KT>
__device__ __forceinline__ void paged_decode(
    const half* __restrict__ q, unsigned char* k_cache, unsigned char* v_cache, half* k_scales, half* v_scales,
    const NewToken& nt, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const long long* __restrict__ positions, const int* __restrict__ row_seq,
    const Out out, float* __restrict__ part_acc, float2* __restrict__ part_ml, int* __restrict__ counters,
    int n_heads, int n_kv_heads, int max_pages, int page_size, int n_splits, float scale_log2, int window,
    float cap_in, float cap_out) {
    using S = Shape<DH, K_BITS, V_BITS, KT>;
    constexpr bool ROTATED = V_BITS != 16;
    constexpr int Q_PER_THREAD = (HEADS * DH + THREADS - 1) / THREADS;
    union Smem {
        float q[HEADS][DH];                  // staged queries (start)
        struct {
            half p[WARPS][HEADS * S::P_ROW]; // each warp's P tile (loop)
            float x[S::X_FLOATS];            // DIM_PARTS 2: partial scores, see attend_tile
        } loop;
        float acc[S::TILE_SLOTS][HEADS][DH]; // each tile slot's sum of p * V (end)
    };
    __shared__ __align__(16) Smem smem;
    __shared__ float m_s[S::TILE_SLOTS][HEADS], l_s[S::TILE_SLOTS][HEADS];
    __shared__ bool last_s;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, qd = lane & 3;
    const int slot = warp / S::DIM_PARTS, part = warp % S::DIM_PARTS;   // key tiles slot, slot + TILE_SLOTS, ...
    const int dim0 = part * S::WARP_DIMS;                              // and dims dim0 .. dim0 + WARP_DIMS - 1
    const int split = blockIdx.x, row = blockIdx.z;
    const int group = n_heads / n_kv_heads;
    const int head_blocks = (group + HEADS - 1) / HEADS;
    const int kv_head = blockIdx.y / head_blocks;
    const int head0 = kv_head * group + (blockIdx.y % head_blocks) * HEADS;   // first query head of the block
    const int n_g = min(HEADS, kv_head * group + group - head0);
    const AttStamps stamps;
    stamps.at(0);
    out.prefetch(head0, n_g, DH, tid);

    // Before pdl_wait: the row's key range. row_seq, positions and seq_lens come from the host or torch's ops, never
    // from a kernel of ours, so they are complete before the chain of dependent launches starts (common.cuh); q and
    // the cache's newest keys are not. They are read past L1 (__ldcg): before the wait, an SM's L1 may still hold an
    // earlier step's lines of them. The key tiles only as L2 prefetches, and only the keys older than the new one
    // that this launch writes (prefetch_old_keys): prompt rows' tiles, prefetched here, read stale keys of the kernel
    // before (docs/attention.md).
    const int seq = row_seq ? __ldcg(row_seq + row) : row;
    const long long pos = __ldcg(positions + row);
    const int n_keys = (int)min((long long)__ldcg(seq_lens + seq), pos + 1);
    const int t_first = window > 0 ? (int)max(0ll, pos - window + 1) : 0;
    if (n_keys <= t_first) {   // no keys: zeros
        exl::pdl_wait();       // (out may still be read by an earlier kernel)
        if (split == 0)
            for (int e = tid; e < n_g * DH; e += THREADS)
                out.put(row, head0 * DH + e, 0.f);
        return;
    }
    // the first tile holds t_first (t_first - t_lo < 32 <= KT), and every later tile starts at or after it, so each
    // tile a warp attends has a visible key
    const int t_lo = t_first & ~(ALIGN - 1);
    const int split_len = split_length(n_keys - t_lo, n_splits);
    const int n_used = (n_keys - t_lo + split_len - 1) / split_len;
    const int t_begin = t_lo + split * split_len;
    if (t_begin >= n_keys) return;
    const int t_end = min(t_begin + split_len, n_keys);

    const size_t dim = (size_t)kv_head * DH + dim0;   // the warp's first dim in the flat [n_kv_heads * DH] row
    const int scale0 = kv_head * (DH / 32) + dim0 / 32;
    const Cache cache{k_cache + dim * K_BITS / 8, v_cache + dim * V_BITS / 8, k_scales + scale0, v_scales + scale0,
                      (size_t)n_kv_heads * DH * K_BITS / 8, (size_t)n_kv_heads * DH * V_BITS / 8,
                      n_kv_heads * DH / 32};
    const int* table = block_tables + (size_t)seq * max_pages;
    int t0 = t_begin + slot * S::KT;
    if (K_BITS == 16 && nt.k)  // the block's first round of tiles, less the new key (fp16 caches: see EARLY)
        prefetch_old_keys<DH, K_BITS, V_BITS>(k_cache, v_cache, kv_head, n_kv_heads, table, page_size, t_begin,
                                              (int)min((long long)min(t_end, t_begin + S::TILE_SLOTS * S::KT), pos),
                                              tid);
    Tile<S> tile;
#if ATT_TILE_BEFORE_WAIT
    // TILE BEFORE WAIT: `early` below, in a launch that writes its rows' new keys (t_begin <= pos: the split's keys
    // end before the new one, or the tile does)
    const bool before = nt.k && t0 < t_end && (pos >= t_end || t0 + S::KT <= pos);
    if constexpr (K_BITS == 16)
        if (before) load_tile<DH, K_BITS, V_BITS, KT, true>(tile, cache, table, page_size, t0, t_end, lane);
#else
    constexpr bool before = false;
#endif
    exl::pdl_wait();           // q and the newest keys come from the kernels before
    stamps.at(1);

    // fp16 K: lane (g, qd) loads head g's k elements (the pieces of the warp's part of a key row) straight into its
    // B fragments, and with RoPE here rotates them there (ROPE IN REGISTERS: where a lane's pieces hold both dims of
    // each rotated pair, head_dim 64 and 128); quantized K, or RoPE at other head dims: the block stages them in
    // shared memory (to rotate them) first.
    const bool rope = nt.k != nullptr;
    constexpr bool REG_ROPE = K_BITS == 16 && S::DIM_PARTS == 1 && S::K_PIECES % 2 == 0;
    const bool staged = K_BITS != 16 || (rope && !REG_ROPE);
    const bool writes = rope && pos >= t_begin && pos < t_end;   // the block whose split holds the new key
    // ROPE IN REGISTERS: the new key and value are written by the one warp whose tiles hold the new key, which sees
    // its own writes after a __syncwarp: no block barrier before the key loop.
    const bool writer = writes && (int)(pos - t_begin) / S::KT % S::TILE_SLOTS == slot;
    // fp16 K and V: the warp's first tile is in flight while the queries are staged; in the writing block, after its
    // writes (and the barrier below) only where the tile reaches the new key: the others hold older keys alone, which
    // prefetch_old_keys has brought into L2. Quantized caches load as before both (measured, H100 2026-12-07: with
    // them the 8B shape's q4 step was 2-6 % slower, the 1B's 1-2 % faster; docs/attention.md).
    constexpr bool EARLY = K_BITS == 16;
    const bool early = EARLY && (!writes || t0 + S::KT <= pos);
    if (early && t0 < t_end && !before)
        load_tile<DH, K_BITS, V_BITS, KT>(tile, cache, table, page_size, t0, t_end, lane);
    const half* q_row = q + ((size_t)row * n_heads + head0) * DH;
    unsigned qb[S::STEPS][2];
    float q_reg[Q_PER_THREAD];
    if (!staged) {
        unsigned w[S::K_WORDS] = {};
        if (g < n_g) {
#pragma unroll
            for (int j = 0; j < S::K_PIECES; j++)
                load_words<S::K_PIECE>(reinterpret_cast<const unsigned char*>(q_row + g * DH + dim0) +
                                           (qd + 4 * j) * S::K_PIECE,
                                       &w[j * S::K_PIECE / 4]);
        }
        if constexpr (REG_ROPE) {
            if (rope) {
                // lanes g = 0 and 1 also take the new token's key and value at their query pieces' places (every
                // warp loads them, so that the loads go out with the queries'; the writer alone stores them)
                const NewRow<DH> r(nt, row, kv_head, n_kv_heads);
                const auto* cs = reinterpret_cast<const unsigned char*>(r.cs);
                const auto* sn = reinterpret_cast<const unsigned char*>(r.sn);
                const auto* kv_row = reinterpret_cast<const unsigned char*>(g == 0 ? r.k : r.v);
                unsigned c[S::K_WORDS], s[S::K_WORDS], x[S::K_WORDS];
#pragma unroll
                for (int j = 0; j < S::K_PIECES; j++) {
                    const int piece = (qd + 4 * j) * S::K_PIECE;
                    load_words<S::K_PIECE>(cs + piece, &c[j * S::K_PIECE / 4]);
                    load_words<S::K_PIECE>(sn + piece, &s[j * S::K_PIECE / 4]);
                    if (g < 2) load_words<S::K_PIECE>(kv_row + piece, &x[j * S::K_PIECE / 4]);
                }
                rope_words<S>(w, c, s);
                if (g == 0) rope_words<S>(x, c, s);
                if (writer && g < 2) {
                    auto* dst = (g == 0 ? k_cache : v_cache) + (r.slot * r.width + (size_t)kv_head * DH) * 2;
#pragma unroll
                    for (int j = 0; j < S::K_PIECES; j++)
                        store_words<S::K_PIECE>(dst + (qd + 4 * j) * S::K_PIECE, &x[j * S::K_PIECE / 4]);
                }
                __syncwarp();      // the writer's new key and value, visible to its own loads below
            }
        }
#pragma unroll
        for (int s = 0; s < S::STEPS; s++) qb[s][0] = w[2 * s], qb[s][1] = w[2 * s + 1];
    } else {
#pragma unroll
        for (int i = 0; i < Q_PER_THREAD; i++) {
            const int e = tid + i * THREADS;
            if (e >= HEADS * DH || e / DH >= n_g)
                q_reg[i] = 0.f;
            else if (rope)
                q_reg[i] = __half2float(kv::rope_at(q_row + e / DH * DH, nt.cos + (size_t)row * DH,
                                                    nt.sin + (size_t)row * DH, e % DH, DH));
            else
                q_reg[i] = __half2float(q_row[e]);
        }
        if (writes)
            write_new_token<DH, K_BITS, V_BITS>(nt, row, kv_head, n_kv_heads, k_cache, v_cache, k_scales, v_scales);
    }
    if (!EARLY && !writes && t0 < t_end)   // (quantized: while the queries are rotated)
        load_tile<DH, K_BITS, V_BITS, KT>(tile, cache, table, page_size, t0, t_end, lane);


    // the queries (quantized K: rotated, R(q)/32) as fp16 B fragments: lane (g, qd) holds head g's k elements
    if (staged) {
#pragma unroll
        for (int i = 0; i < Q_PER_THREAD; i++) {
            const int e = tid + i * THREADS;
            if (e < HEADS * DH) (&smem.q[0][0])[e] = q_reg[i];
        }
        __syncthreads();       // (also: the new key and value are written, and visible to the block's loads)
        if constexpr (K_BITS != 16) {
            for (int c = warp; c < HEADS * DH / 64; c += WARPS) {
                float* chunk = &smem.q[0][0] + c * 64;
                const float even = hadamard32(chunk[2 * lane], lane), odd = hadamard32(chunk[2 * lane + 1], lane);
                chunk[2 * lane] = even * (1.f / 32.f);
                chunk[2 * lane + 1] = odd * (1.f / 32.f);
            }
            __syncthreads();
        }
#pragma unroll
        for (int s = 0; s < S::STEPS; s++)
#pragma unroll
            for (int hi = 0; hi < 2; hi++)
                qb[s][hi] = pack_half2(smem.q[g][dim0 + k_dim<S>(qd, k_virtual<K_BITS>(s, hi, 0))],
                                       smem.q[g][dim0 + k_dim<S>(qd, k_virtual<K_BITS>(s, hi, 1))]);
        __syncthreads();   // smem.q is reused for P
    }
    if ((EARLY ? !early : writes) && t0 < t_end)
        load_tile<DH, K_BITS, V_BITS, KT>(tile, cache, table, page_size, t0, t_end, lane);

    State<S> st;
#pragma unroll
    for (int h = 0; h < 2; h++) st.m[h] = neg_inf(), st.l[h] = 0.f;
#pragma unroll
    for (int t = 0; t < S::STEPS; t++)
#pragma unroll
        for (int e = 0; e < 4; e++) st.acc[t][e] = 0.f;
    stamps.at(4);
    // both warps of a pair walk the same tiles, so they meet at every pair_sync
    for (int parity = 0; t0 < t_end; parity ^= 1) {
        attend_tile<DH, K_BITS, V_BITS, KT>(st, tile, qb, smem.loop.p[warp], smem.loop.x, parity, t0, t_first,
                                            t_end, scale_log2, cap_in, cap_out, warp, lane);
        t0 += S::TILE_SLOTS * S::KT;
        if (t0 < t_end) load_tile<DH, K_BITS, V_BITS, KT>(tile, cache, table, page_size, t0, t_end, lane);
    }

    stamps.at(2);
    // merge the tile slots: each writes its state (the warps of a pair hold the same m and l, and their own dims);
    // warp h then takes query head h
    int2 at[S::CHUNKS];
    if (warp < n_g) out.places<DH>((head0 + warp) * DH, lane, at);
#pragma unroll
    for (int h = 0; h < 2; h++) st.l[h] = column_sum(st.l[h]);
    __syncthreads();   // every warp is done with its P tile and scores (aliased by acc)
    if (g == 0 && part == 0) {
#pragma unroll
        for (int h = 0; h < 2; h++) m_s[slot][2 * qd + h] = st.m[h], l_s[slot][2 * qd + h] = st.l[h];
    }
#pragma unroll
    for (int t = 0; t < S::STEPS; t++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            smem.acc[slot][2 * qd + (e & 1)][dim0 + v_dim<S>(g, v_virtual<V_BITS>(t, e >> 1))] = st.acc[t][e];
    __syncthreads();

    const size_t head_row = (size_t)row * n_heads + head0 + warp;   // this warp's query head
    if (warp < n_g) {
        float m_max = m_s[0][warp];
#pragma unroll
        for (int w = 1; w < S::TILE_SLOTS; w++) m_max = fmaxf(m_max, m_s[w][warp]);   // finite: slot 0 had keys
        float l = 0.f;
        float2 a[S::CHUNKS];
#pragma unroll
        for (int c = 0; c < S::CHUNKS; c++) a[c] = make_float2(0.f, 0.f);
#pragma unroll
        for (int w = 0; w < S::TILE_SLOTS; w++) {
            const float f = exp2f(m_s[w][warp] - m_max);   // 0 for slots without keys
            l += l_s[w][warp] * f;
#pragma unroll
            for (int c = 0; c < S::CHUNKS; c++) {
                const int e = c * 64 + 2 * lane;
                if (e < DH) {
                    a[c].x += f * smem.acc[w][warp][e];
                    a[c].y += f * smem.acc[w][warp][e + 1];
                }
            }
        }
        if (n_used == 1) {
            finish_row<DH, ROTATED>(a, l, out, row, (head0 + warp) * DH, at, lane);
        } else {
            float* dst = part_acc + (head_row * n_splits + split) * DH;
#pragma unroll
            for (int c = 0; c < S::CHUNKS; c++) {
                const int e = c * 64 + 2 * lane;
                if (e < DH) *reinterpret_cast<float2*>(dst + e) = a[c];
            }
            if (lane == 0) part_ml[head_row * n_splits + split] = make_float2(m_max, l);
        }
    }
    if (n_used == 1) {
        stamps.at(3);
        stamps.emit();
        return;
    }

    // several splits: the last block of the row to get here merges them
    __syncthreads();            // the block's partials, then its arrival (release; acquire for the last)
    if (tid == 0) {
        int* counter = counters + (size_t)row * gridDim.y + blockIdx.y;
        last_s = exl::arrive(counter) == n_used - 1;
        if (last_s) *counter = 0;   // ready for the next launch
    }
    __syncthreads();
    if (!last_s || warp >= n_g) return;
    const float2* ml = part_ml + head_row * n_splits;
    const float* acc_rows = part_acc + head_row * n_splits * DH;
    float m_max = neg_inf();
    for (int s = lane; s < n_used; s += 32) m_max = fmaxf(m_max, __ldcg(ml + s).x);
    m_max = exl::warp_max(m_max);
    float l = 0.f;
    float2 a[S::CHUNKS];
#pragma unroll
    for (int c = 0; c < S::CHUNKS; c++) a[c] = make_float2(0.f, 0.f);
    for (int base = 0; base < n_used; base += 32) {   // lane j weighs split base + j; the lanes share the weights
        const float2 x = base + lane < n_used ? __ldcg(ml + base + lane) : make_float2(neg_inf(), 0.f);
        const float f_lane = exp2f(x.x - m_max);
        l += x.y * f_lane;
        const int count = min(32, n_used - base);
#pragma unroll 8
        for (int j = 0; j < count; j++) {
            const float f = __shfl_sync(FULL_MASK, f_lane, j);
#pragma unroll
            for (int c = 0; c < S::CHUNKS; c++) {
                const int e = c * 64 + 2 * lane;
                if (e < DH) {
                    const float2 y = __ldcg(reinterpret_cast<const float2*>(acc_rows + (size_t)(base + j) * DH + e));
                    a[c].x += f * y.x;
                    a[c].y += f * y.y;
                }
            }
        }
    }
    finish_row<DH, ROTATED>(a, exl::warp_sum(l), out, row, (head0 + warp) * DH, at, lane);
}

}  // namespace

// ---------------------------------------------------------------------------------------------- entry points
// paged_decode_<mode>_d<DH>: modes fp16 (K, V fp16), q8 (8, 8 bits), q6 (K 8, V 4), q4 (4, 4).
// Cache pointers are passed as bytes; unused scale pointers may be null. k, v, cos, sin, slots: the new token
// (NewToken; k null: q is already rotated and the new key and value already in the cache). out_place: null, or
// where each output element goes (Out).
// KT: keys per warp tile. MIN_BLOCKS: blocks per SM that __launch_bounds__ asks registers for (2: at most 128 per
// thread); the variants whose tiles need more registers (ptxas spills at 128) keep one block of 8 warps per SM.
// The launcher reads the resident blocks per SM off the compiled kernel. The d256 variants run warp pairs (see the
// top of the file) with the per-warp shapes, KT and register use of the d128 ones.
#define PAGED_DECODE(MODE, DH, KB, VB, KT, MIN_BLOCKS)                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) paged_decode_##MODE##_d##DH(                \
        const half* q, unsigned char* k_cache, unsigned char* v_cache, half* k_scales, half* v_scales,            \
        const half* k, const half* v, const half* cos, const half* sin, const long long* slots,                   \
        const int* block_tables, const int* seq_lens, const long long* positions, const int* row_seq,             \
        half* out, const int* out_place, float* part_acc, float2* part_ml, int* counters, int n_heads,            \
        int n_kv_heads, int max_pages, int page_size, int n_splits, float scale_log2, int window, float cap_in,   \
        float cap_out) {                                                                                          \
        exl::pdl_trigger();  /* dependent launch (common.cuh): paged_decode waits once it has the row's keys */   \
        paged_decode<DH, KB, VB, KT>(q, k_cache, v_cache, k_scales, v_scales, NewToken{k, v, cos, sin, slots},    \
                                     block_tables, seq_lens, positions, row_seq,                                  \
                                     Out{out, out_place, n_heads * DH}, part_acc, part_ml, counters, n_heads,     \
                                     n_kv_heads, max_pages, page_size, n_splits, scale_log2, window, cap_in,      \
                                     cap_out);                                                                    \
    }

PAGED_DECODE(fp16, 16, 16, 16, 32, 2)
PAGED_DECODE(fp16, 32, 16, 16, 32, 2)
PAGED_DECODE(fp16, 64, 16, 16, 32, 1)
PAGED_DECODE(fp16, 96, 16, 16, 32, 1)
PAGED_DECODE(fp16, 128, 16, 16, 32, 1)
PAGED_DECODE(q8, 64, 8, 8, 32, 2)
PAGED_DECODE(q8, 128, 8, 8, 32, 1)
PAGED_DECODE(q6, 64, 8, 4, 32, 2)
PAGED_DECODE(q6, 128, 8, 4, 32, 1)
PAGED_DECODE(q4, 64, 4, 4, 32, 2)
PAGED_DECODE(q4, 128, 4, 4, 64, 1)
PAGED_DECODE(fp16, 256, 16, 16, 32, 1)
PAGED_DECODE(q8, 256, 8, 8, 32, 1)
PAGED_DECODE(q6, 256, 8, 4, 32, 1)
PAGED_DECODE(q4, 256, 4, 4, 64, 1)

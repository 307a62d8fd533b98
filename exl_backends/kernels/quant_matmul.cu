// quant_matmul.cu: y = x @ W^T (+ bias) for EXL2 and GPTQ weights, and their dequantization to fp16, from the
// "lane layout" that quant_matmul.py builds once per layer (prepare()). The launcher is quant_matmul.py.
//
// LANE LAYOUT (one layout for both formats)
//   Rows of W^T [K, N] are taken in stored order: EXL2's act-order rows as stored, GPTQ rows sorted by group. The
//   activations are gathered into that order (x_s[k'] = x[perm[k']]); a dequantized row k' is written to W row
//   perm[k']. Rows are cut into chunks of 32; a chunk has one bit width B in {2,3,4,5,6,8} and one group (every
//   group is a whole number of chunks; EXL2 groups are ordered by non-increasing width, so equal widths form runs).
//   Columns (padded to Np, a multiple of 32) are cut into strips of 32. For each (strip, chunk) the 32 lanes of a
//   warp own B 32-bit words each, 128*B bytes in all: lane l = 4g + q holds the codes of columns
//   col(j) = 16*(j/2) + 8*(j%2) + g (j = 0..3) and rows 16s + 4q + 2h + e (s, h, e in 0..1) of the chunk, as 16
//   pairs p = 4j + 2s + h. A pair's e=0 code sits at bits [o, o+B) of a word, its e=1 code at [16+o, 16+o+B), so
//   one LOP3 turns a pair into a half2 (pair_bits below; quant_matmul.PAIR_BITS is the same table, tested). The
//   lane's B words are stored in planes of 16, 8 and 4 bytes per lane (B=3: 8+4, B=5: 16+4, B=6: 16+8,
//   B=8: 16+16), so every load instruction of a warp reads one contiguous, aligned span.
//   Memory order: [strip][chunk][plane][lane]; chunk c of a strip starts at word 32 * bits_prefix[c].
//   Tables (int32): bits_prefix[C+1] (running sum of chunk widths), run_bounds[7] (the chunks of width 8, 6, 5, 4,
//   3, 2 are run_bounds[i]..run_bounds[i+1]), chunk_meta[C] (int2, byte offsets of the chunk's group in the
//   metadata below; EXL2: x = in meta0, y = the group's scale base fp16(q_scale_max * 2^-8) in both halves; GPTQ:
//   x = in meta0, y = in meta1). Per group and strip:
//     EXL2  meta0 = scale codes, 4 words per (group, strip): lane g's 16 bits in word g/2, half g%2, bytes
//                   (c_j0 | c_j2 << 4, c_j1 | c_j3 << 4) with c the 4-bit scale code of column col(j).
//     GPTQ  meta0 = fp16 scales [group][strip][g][j]; meta1 = zero points, uint8 [group][strip][g][j].
//
// DECODE ("magic number" dequant): OR-ing 0x6400 into a half that holds code << i (i <= 10 - B) gives the fp16
//   number 1024 + code * 2^i exactly; one HFMA2 by 2^-i with -(1024 * 2^-i + z) gives (code - z) exactly.
//
// MATMUL KERNELS  <fmt>_matmul_m1 / _m8 / _m16 (M = rows of x: 1, <= 8, <= 16)
//   grid (ceil(strips / 8), splits), block 256 = 8 warps, dynamic shared memory M * xs_stride halves.
//   Block (bx, split) covers strips 8bx..8bx+7 and chunks [split_starts[split], split_starts[split+1]) (the
//   launcher balances the splits by bytes). All 256 threads first gather x's rows of the chunk range into shared
//   memory in stored order. Then warp w owns strip 8bx + w and walks its chunks in batches (the batch 4 KB ahead is
//   prefetched into L2, so many DRAM reads are in flight without holding registers): per chunk each lane
//   decodes its 32 codes into 16 half2 values (code - z) and issues m16n8k16 MMAs with A = 16 columns x 16 rows
//   of (code - z), B = 16 rows x 8 rows of x from shared memory, C = fp32 partial of the current group. At each
//   group change the partial is scaled by the group's per-column scale (fp32) and added to the accumulator, so
//   results are exact products accumulated in fp32. The EXL2 scale is computed exactly as
//   fp16((c + 1)^2 * fp16(q_scale_max * 2^-8)).
//   splits == 1: the warp adds bias and writes y (fp16). splits > 1: the warp writes its fp32 partial to ws
//   [split][M][Np], then counts itself in counters[strip]; the last warp of a strip to finish sums the partials
//   in split order (deterministic), adds bias, writes y, and resets the counter to 0 for the next launch.
//
// DEQUANT KERNELS  <fmt>_dequant
//   grid (ceil(strips / 8), splits), block 256, static shared memory 20 KB. Warp w of block (bx, split) decodes
//   strip 8bx + w over the split's chunks to fp16 W = fp16((code - z) * scale) (bit-exact with the reference),
//   stages each 32 x 32 tile in shared memory and writes its rows to w_out[perm[k']][strip cols] (row stride Np).
#include "common.cuh"

namespace qmm {

using namespace exl;

constexpr int WARPS = 8;                 // strips per block
constexpr int THREADS = WARPS * 32;
constexpr int TILE_STRIDE = 40;         // halves per row of a dequant tile: 32 + 8 pad, rows stay 16-byte aligned
constexpr int PREFETCH_WORDS = 1024;     // L2 prefetch distance, 4 KB of a strip: about 1-2 us of one warp's reads
constexpr int STAGE_LOADS = 8;           // gathers of x per thread in flight
constexpr int REDUCE_LOADS = 16;         // split partials per lane in flight in the final reduction

// ------------------------------------------------------------------------------------------- pair layout

// Shift i of pair p's codes after extraction (the half holds 1024 + code * 2^i).
template <int B>
EXL_HD constexpr int magic_shift(int p)
{
    if constexpr (B == 2) return 2 * (p % 8) >= 10 ? 2 * (p % 8) - 10 : 2 * (p % 8);
    else if constexpr (B == 3) return p == 15 ? 0 : (3 * (p % 5) >= 9 ? 3 * (p % 5) - 9 : 3 * (p % 5));
    else if constexpr (B == 4) return 4 * (p % 4) >= 8 ? 4 * (p % 4) - 8 : 4 * (p % 4);
    else if constexpr (B == 5) return p == 15 ? 0 : (5 * (p % 3) == 10 ? 0 : 5 * (p % 3));
    else return 0;
}

// Pair p of a lane's B words as two fp16 bit patterns 0x6400 | code << i (i = magic_shift). Direct slots:
// B=2: 8 per word at o = 2(p%8); B=3: 5 per word at 3(p%5), pair 15 from bit 15 of words 0-2 (code bit k in word
// k); B=4: 4 per word at 4(p%4); B=5: 3 per word at 5(p%3), pair 15 from bit 15 of words 0-4; B=6: 2 per word at
// 6(p%2), pairs 12-15 from bits 12-15 of all six words (code r bit k at spare bit 6r+k: word (6r+k)/4, bit
// 12 + (6r+k)%4); B=8: 2 per word at 8(p%2). Slots whose code would not stay below bit 10 are read after a shift.
template <int B>
EXL_HD unsigned pair_bits(const unsigned (&w)[B], int p)
{
    constexpr unsigned MAGIC = 0x64006400u;
    constexpr unsigned MASK = ((1u << B) - 1u) * 0x10001u;
    if constexpr (B == 2) {
        const int o = 2 * (p % 8);
        const unsigned x = o >= 10 ? w[p / 8] >> 10 : w[p / 8];
        return and_or(x, MASK << magic_shift<2>(p), MAGIC);
    } else if constexpr (B == 3) {
        if (p == 15)
            return ((w[0] >> 15) & 0x10001u) | ((w[1] >> 14) & 0x20002u) | ((w[2] >> 13) & 0x40004u) | MAGIC;
        const unsigned x = 3 * (p % 5) >= 9 ? w[p / 5] >> 9 : w[p / 5];
        return and_or(x, MASK << magic_shift<3>(p), MAGIC);
    } else if constexpr (B == 4) {
        const unsigned x = 4 * (p % 4) >= 8 ? w[p / 4] >> 8 : w[p / 4];
        return and_or(x, MASK << magic_shift<4>(p), MAGIC);
    } else if constexpr (B == 5) {
        if (p == 15)
            return ((w[0] >> 15) & 0x10001u) | ((w[1] >> 14) & 0x20002u) | ((w[2] >> 13) & 0x40004u) |
                   ((w[3] >> 12) & 0x80008u) | ((w[4] >> 11) & 0x100010u) | MAGIC;
        const unsigned x = p % 3 == 2 ? w[p / 3] >> 10 : w[p / 3];
        return and_or(x, MASK << magic_shift<5>(p), MAGIC);
    } else if constexpr (B == 6) {
        if (p >= 12) {
            const int r = p - 12;                     // spare codes 0, 2: 4 bits + 2 bits; 1, 3: 2 bits + 4 bits
            const int a = r / 2 * 3 + r % 2;          // first word holding the code's bits: 0, 1, 3, 4
            if (r % 2 == 0) return ((w[a] >> 12) & 0x000f000fu) | ((w[a + 1] >> 8) & 0x00300030u) | MAGIC;
            return ((w[a] >> 14) & 0x00030003u) | ((w[a + 1] >> 10) & 0x003c003cu) | MAGIC;
        }
        const unsigned x = p % 2 ? w[p / 2] >> 6 : w[p / 2];
        return and_or(x, MASK, MAGIC);
    } else {
        static_assert(B == 8, "EXL2/GPTQ widths are 2, 3, 4, 5, 6, 8");
        return byte_perm(w[p / 2], 0x64646464u, p % 2 ? 0x4341u : 0x4240u);   // bytes (1, 3) or (0, 2)
    }
}

// Distinct magic shifts of a width are 0, B, 2B, ...: shift i has index i / B.
template <int B>
EXL_HD constexpr int n_shifts() { return B == 2 ? 5 : B == 3 ? 3 : B == 4 ? 2 : B == 5 ? 2 : 1; }

// Chunks loaded into registers per batch (the loads mostly hit L2, prefetched): 8 to 16 words per lane.
template <int B>
EXL_HD constexpr int batch() { return B == 2 ? 4 : B == 3 ? 4 : B == 4 ? 3 : 2; }

// A lane's B words of one chunk: planes of 16, 8, then 4 bytes per lane.
template <int B>
__device__ __forceinline__ void load_chunk(const unsigned* chunk, int lane, unsigned (&w)[B])
{
    constexpr int P16 = B / 4, P8 = B % 4 / 2, P4 = B % 2;
#pragma unroll
    for (int i = 0; i < P16; ++i) {
        const uint4 v = load_stream(reinterpret_cast<const uint4*>(chunk) + 32 * i + lane);
        w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    }
    if constexpr (P8 == 1) {
        const uint2 v = load_stream(reinterpret_cast<const uint2*>(chunk + 128 * P16) + lane);
        w[4 * P16] = v.x; w[4 * P16 + 1] = v.y;
    }
    if constexpr (P4 == 1) w[B - 1] = load_stream(chunk + 128 * P16 + 64 * P8 + lane);
}

// ------------------------------------------------------------------------------------------- formats

struct Packed {
    const unsigned* qw;
    const int* bits_prefix;
    const int* run_bounds;
    const int2* chunk_meta;
    const void* meta0;
    const void* meta1;
    int strips;
    int words_per_strip;
};

// p advanced by a byte offset (32-bit add, no sign extension).
template <class T>
__device__ __forceinline__ const T* at(const T* p, int bytes)
{
    return reinterpret_cast<const T*>(reinterpret_cast<const char*>(p) + (unsigned)bytes);
}

// Lane g's scale codes from its word of the (group, strip) record (16 bits at half g%2): fp16 bit patterns
// (1024 + c) of columns (col(0), col(1)) in pairs[0] and (col(2), col(3)) in pairs[1].
EXL_HD void scale_code_pairs(unsigned word, int g, unsigned (&pairs)[2])
{
    const unsigned d = byte_perm(word, 0u, (g & 1) ? 0x4342u : 0x4140u);     // byte 0 low half, byte 1 high half
    pairs[0] = and_or(d, 0x000f000fu, 0x64006400u);
    pairs[1] = and_or(d >> 4, 0x000f000fu, 0x64006400u);
}

// GPTQ zero point of column col(j) from lane g's zeros word (byte j), as fp16 bits (1024 + z) in both halves.
EXL_HD unsigned zero_pair(unsigned zeros, int j) { return byte_perm(zeros, 0x64646464u, j | 0x40 | j << 8 | 0x4000); }

// EXL2: zero point 2^(B-1); per-column scale fp16((c+1)^2 * m) from a 4-bit code c and the group's base m.
struct Exl2 {
    struct Cursor { const unsigned* codes; };    // the lane's word of group 0's record
    struct Raw { unsigned codes, base; };
    struct State { half2 scale[2]; };            // (col(0), col(1)), (col(2), col(3))

    template <int B>
    EXL_HD static constexpr bool has_width() { return true; }

    __device__ static Cursor cursor(const Packed& pk, int strip, int g)
    {
        return {static_cast<const unsigned*>(pk.meta0) + strip * 4 + (g >> 1)};
    }

    __device__ static Raw load(const Cursor& cur, int2 meta)
    {
        return {__ldg(at(cur.codes, meta.x)), (unsigned)meta.y};
    }

    // fp16((c+1)^2 * m) for a pair of codes: (1024 + c) - 1023 and its square are exact, the product with m is
    // the one rounding the spec has.
    __device__ static half2 scale(unsigned code_pair, unsigned base)
    {
        const half2 c1 = __hsub2(as_half2(code_pair), as_half2(dup16(half_bits_of_int(1023))));
        return __hmul2(__hmul2(c1, c1), as_half2(base));
    }

    template <int B>
    __device__ static void enter(const Raw& r, int g, State& st)
    {
        unsigned pairs[2];
        scale_code_pairs(r.codes, g, pairs);
        st.scale[0] = scale(pairs[0], r.base);
        st.scale[1] = scale(pairs[1], r.base);
    }

    template <int B>
    __device__ static half2 bias(const State&, int, int i)
    {
        return as_half2(dup16(half_bits_of_int(-(1024 >> i) - (1 << (B - 1)))));
    }
};

// GPTQ: zero point and fp16 scale per (group, column), read as given (v1/v2 already resolved by prepare()).
struct Gptq {
    struct Cursor { const uint2* scales; const unsigned* zeros; };     // the lane's entries of group 0
    struct Raw { uint2 scales; unsigned zeros; };
    struct State { half2 scale[2]; half2 bias[4][5]; };    // bias[j][i / B] = -(1024 * 2^-i + z_j)

    template <int B>
    EXL_HD static constexpr bool has_width() { return B == 2 || B == 3 || B == 4 || B == 8; }

    __device__ static Cursor cursor(const Packed& pk, int strip, int g)
    {
        return {static_cast<const uint2*>(pk.meta0) + strip * 8 + g,
                static_cast<const unsigned*>(pk.meta1) + strip * 8 + g};
    }

    __device__ static Raw load(const Cursor& cur, int2 meta)
    {
        return {__ldg(at(cur.scales, meta.x)), __ldg(at(cur.zeros, meta.y))};
    }

    template <int B>
    __device__ static void enter(const Raw& r, int, State& st)
    {
        st.scale[0] = as_half2(r.scales.x);
        st.scale[1] = as_half2(r.scales.y);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const half2 z = as_half2(zero_pair(r.zeros, j));
#pragma unroll
            for (int k = 0; k < n_shifts<B>(); ++k)
                st.bias[j][k] = __hsub2(as_half2(dup16(half_bits_of_int(1024 - (1024 >> (k * B))))), z);
        }
    }

    template <int B>
    __device__ static half2 bias(const State& st, int j, int i) { return st.bias[j][i / B]; }
};

// The lane's 16 pairs of one chunk as (code - z), exact.
template <int B, class Fmt>
__device__ __forceinline__ void decode_pairs(const unsigned (&w)[B], const typename Fmt::State& st, half2 (&a)[16])
{
#pragma unroll
    for (int p = 0; p < 16; ++p) {
        const int i = magic_shift<B>(p);
        a[p] = __hfma2(as_half2(pair_bits<B>(w, p)), as_half2(dup16(half_bits_of_pow2(-i))),
                       Fmt::template bias<B>(st, p / 4, i));
    }
}

// ------------------------------------------------------------------------------------------- walking chunks

// U chunks from c on: load all their words and group metadata first, then consume them in order.
template <int U, int B, class Fmt, class Sink>
__device__ __forceinline__ void walk_batch(const typename Fmt::Cursor& cur, const int2* meta_of, const unsigned* words,
                                           int c, int lane, Sink& sink)
{
    unsigned w[U][B];
    int2 meta[U];
    typename Fmt::Raw raw[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        load_chunk<B>(words + u * 32 * B, lane, w[u]);
        meta[u] = __ldg(meta_of + u);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) raw[u] = Fmt::load(cur, meta[u]);
#pragma unroll
    for (int u = 0; u < U; ++u) sink.template chunk<B>(w[u], meta[u].x, raw[u], c + u);
}

// One width run [c, end) of a strip: batches of batch<B>() chunks, each first prefetching into L2 the batch
// PREFETCH_WORDS ahead (no registers held, so DRAM sees many requests in flight), then the run's last chunks.
template <int B, class Fmt, class Sink>
__device__ __forceinline__ void walk_run(const typename Fmt::Cursor& cur, const int2* meta_of, const unsigned* words,
                                         const unsigned* range_end, int c, int end, int lane, Sink& sink)
{
    constexpr int U = batch<B>();
    const unsigned* ahead = words + PREFETCH_WORDS + 32 * lane;         // one 128-byte line per lane
    for (; c + U <= end; c += U, words += U * 32 * B, ahead += U * 32 * B, meta_of += U) {
        if (lane < U * B && ahead < range_end) prefetch_l2(ahead);
        walk_batch<U, B, Fmt>(cur, meta_of, words, c, lane, sink);
    }
    for (; c < end; ++c, words += 32 * B, ++meta_of)                    // already prefetched by the batches
        walk_batch<1, B, Fmt>(cur, meta_of, words, c, lane, sink);
}

// The chunks of width B within [c0, c1): run_bounds[I]..run_bounds[I+1], widths in stored order 8, 6, 5, 4, 3, 2.
template <int B, int I, class Fmt, class Sink>
__device__ __forceinline__ void walk_width(const Packed& pk, const typename Fmt::Cursor& cur,
                                           const unsigned* strip_words, const unsigned* range_end, int c0, int c1,
                                           int lane, Sink& sink)
{
    if constexpr (Fmt::template has_width<B>()) {
        const int lo = max(c0, __ldg(pk.run_bounds + I)), hi = min(c1, __ldg(pk.run_bounds + I + 1));
        if (lo < hi)
            walk_run<B, Fmt>(cur, pk.chunk_meta + lo, strip_words + 32 * __ldg(pk.bits_prefix + lo), range_end, lo, hi,
                             lane, sink);
    }
}

// Chunks [c0, c1) of one strip, width by width: straight-line code, so each width's loop keeps its own registers.
template <class Fmt, class Sink>
__device__ __forceinline__ void walk(const Packed& pk, int strip, int c0, int c1, int lane, Sink& sink)
{
    const unsigned* strip_words = pk.qw + (size_t)strip * pk.words_per_strip;
    const unsigned* range_end = strip_words + 32 * __ldg(pk.bits_prefix + c1);
    const typename Fmt::Cursor cur = Fmt::cursor(pk, strip, lane / 4);
    walk_width<8, 0, Fmt>(pk, cur, strip_words, range_end, c0, c1, lane, sink);
    walk_width<6, 1, Fmt>(pk, cur, strip_words, range_end, c0, c1, lane, sink);
    walk_width<5, 2, Fmt>(pk, cur, strip_words, range_end, c0, c1, lane, sink);
    walk_width<4, 3, Fmt>(pk, cur, strip_words, range_end, c0, c1, lane, sink);
    walk_width<3, 4, Fmt>(pk, cur, strip_words, range_end, c0, c1, lane, sink);
    walk_width<2, 5, Fmt>(pk, cur, strip_words, range_end, c0, c1, lane, sink);
}

// ------------------------------------------------------------------------------------------- matmul

// Accumulates y^T for the warp's 32 columns: acc[t][n] is the C fragment of column tile t (columns 16t..16t+15
// of the strip) and x-row tile n (rows 8n..8n+7). M1: only x row 0, i.e. fragment entries 0 and 2.
template <class Fmt, int N8, bool M1>
struct MatmulSink {
    // B fragments come from x row min(g, M-1) (+ tile1 for row min(8+g, M-1)), columns 4q.. of the current chunk.
    // Clamping needs no zero fill: rows past M only feed the MMA columns of x rows >= M, which are never written.
    const half* xc;
    int tile1;
    int group = -1;
    typename Fmt::State st;
    float sf[4] = {};        // scales of the current group's columns col(0..3), fp32
    float part[2][N8][4] = {};
    float acc[2][N8][4] = {};

    __device__ void flush()
    {
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int n = 0; n < N8; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    if (!M1 || i % 2 == 0) {
                        acc[t][n][i] = fmaf(part[t][n][i], sf[2 * t + i / 2], acc[t][n][i]);
                        part[t][n][i] = 0.f;
                    }
    }

    template <int B>
    __device__ void chunk(const unsigned (&w)[B], int group_key, const typename Fmt::Raw& raw, int)
    {
        if (group_key != group) {
            flush();
            Fmt::template enter<B>(raw, g(), st);
            sf[0] = __low2float(st.scale[0]); sf[1] = __high2float(st.scale[0]);
            sf[2] = __low2float(st.scale[1]); sf[3] = __high2float(st.scale[1]);
            group = group_key;
        }
        half2 a[16];
        decode_pairs<B, Fmt>(w, st, a);
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            unsigned b[N8][2];
#pragma unroll
            for (int n = 0; n < N8; ++n) {
                const uint2 v = *reinterpret_cast<const uint2*>(xc + n * tile1 + 16 * s);
                b[n][0] = v.x;                         // rows 16s + 4q, +1  (MMA k = 2q, 2q+1)
                b[n][1] = v.y;                         // rows 16s + 4q + 2, +3  (MMA k = 2q+8, 2q+9)
            }
#pragma unroll
            for (int t = 0; t < 2; ++t)
#pragma unroll
                for (int n = 0; n < N8; ++n)           // A rows g / g+8 = columns col(2t) / col(2t+1)
                    mma_16816(part[t][n], as_bits(a[8 * t + 2 * s]), as_bits(a[8 * t + 4 + 2 * s]),
                              as_bits(a[8 * t + 2 * s + 1]), as_bits(a[8 * t + 4 + 2 * s + 1]), b[n][0], b[n][1]);
        }
        xc += 32;
    }

    __device__ static int g() { return threadIdx.x % 32 / 4; }
};

// x rows [r0, r0 + rows) of stored order into shared memory: xs[m][r] = x[m][perm[r0 + r]]. Each thread has
// STAGE_LOADS independent gathers in flight (they hit L2: x and perm are shared by every block).
__device__ __forceinline__ void stage_x(half* xs, const half* x, const int* perm, int M, int K, int r0, int rows,
                                        int xs_stride)
{
    for (int base = threadIdx.x; base < rows; base += THREADS * STAGE_LOADS) {
        int src[STAGE_LOADS];
#pragma unroll
        for (int u = 0; u < STAGE_LOADS; ++u) {
            const int r = min(base + u * THREADS, rows - 1);   // past the end: a harmless repeat of the last row
            src[u] = perm ? __ldg(perm + r0 + r) : r0 + r;
        }
        for (int m = 0; m < M; ++m) {
            half v[STAGE_LOADS];
#pragma unroll
            for (int u = 0; u < STAGE_LOADS; ++u) v[u] = __ldg(x + (size_t)m * K + src[u]);
#pragma unroll
            for (int u = 0; u < STAGE_LOADS; ++u)
                if (base + u * THREADS < rows) xs[m * xs_stride + base + u * THREADS] = v[u];
        }
    }
}

__device__ __forceinline__ float bias_at(const half* bias, int col) { return bias ? __half2float(bias[col]) : 0.f; }

template <class Fmt, int N8, bool M1>
__device__ __forceinline__ void matmul(const half* x, half* y, const half* bias, int M, int K, int N, int Np,
                                       const Packed& pk, const int* perm, const int* split_starts, int n_splits,
                                       int xs_stride, float* ws, int* counters)
{
    extern __shared__ __align__(16) unsigned char smem[];
    half* xs = reinterpret_cast<half*>(smem);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const int split = blockIdx.y, strip = blockIdx.x * WARPS + warp;
    const int c0 = __ldg(split_starts + split), c1 = __ldg(split_starts + split + 1);

    if (strip < pk.strips) {                     // the first DRAM reads overlap the gather of x
        const int first = __ldg(pk.bits_prefix + c0), words = 32 * (__ldg(pk.bits_prefix + c1) - first);
        if (32 * lane < words) prefetch_l2(pk.qw + (size_t)strip * pk.words_per_strip + 32 * first + 32 * lane);
        static_assert(PREFETCH_WORDS == 32 * 32, "the 32 lanes prefetch the first PREFETCH_WORDS");
    }
    stage_x(xs, x, perm, M, K, 32 * c0, 32 * (c1 - c0), xs_stride);
    __syncthreads();
    if (strip >= pk.strips) return;

    MatmulSink<Fmt, N8, M1> sink;
    sink.xc = xs + min(g, M - 1) * xs_stride + 4 * q;
    sink.tile1 = (min(8 + g, M - 1) - min(g, M - 1)) * xs_stride;
    walk<Fmt>(pk, strip, c0, c1, lane, sink);
    sink.flush();

    // acc[t][n][i]: column strip*32 + 16t + g + 8(i/2), x row 8n + 2q + i%2
    if (n_splits == 1) {
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int n = 0; n < N8; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int m = 8 * n + 2 * q + i % 2, col = strip * 32 + 16 * t + g + 8 * (i / 2);
                    if ((!M1 || i % 2 == 0) && m < M && col < N)
                        y[(size_t)m * N + col] = __float2half_rn(sink.acc[t][n][i] + bias_at(bias, col));
                }
        return;
    }
    float* part = ws + (size_t)split * M * Np;
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int n = 0; n < N8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int m = 8 * n + 2 * q + i % 2, col = strip * 32 + 16 * t + g + 8 * (i / 2);
                if ((!M1 || i % 2 == 0) && m < M) part[(size_t)m * Np + col] = sink.acc[t][n][i];
            }
    __threadfence();                             // partials visible device-wide before this warp is counted
    __syncwarp();
    int done = 0;
    if (lane == 0) done = atomicAdd(counters + strip, 1);
    done = __shfl_sync(FULL_MASK, done, 0);
    if (done != n_splits - 1) return;
    __threadfence();                             // the last warp of the strip: every other split's partial is in
    const int col = strip * 32 + lane;
    for (int m = 0; m < M; ++m) {
        float sum = 0.f;
        for (int s0 = 0; s0 < n_splits; s0 += REDUCE_LOADS) {    // loads in flight together, added in split order
            float v[REDUCE_LOADS];
#pragma unroll
            for (int u = 0; u < REDUCE_LOADS; ++u)
                v[u] = s0 + u < n_splits ? __ldcg(ws + ((size_t)(s0 + u) * M + m) * Np + col) : 0.f;
#pragma unroll
            for (int u = 0; u < REDUCE_LOADS; ++u) sum += v[u];
        }
        if (col < N) y[(size_t)m * N + col] = __float2half_rn(sum + bias_at(bias, col));
    }
    if (lane == 0) counters[strip] = 0;
}

// ------------------------------------------------------------------------------------------- dequant

template <class Fmt>
struct DequantSink {
    half* tile;              // this warp's 32 x TILE_STRIDE halves
    half* w_out;
    const int* perm;
    int Np, strip, lane, g, q;
    int group = -1;
    typename Fmt::State st;
    half2 scale[4];          // (s, s) of column col(j)

    template <int B>
    __device__ void chunk(const unsigned (&w)[B], int group_key, const typename Fmt::Raw& raw, int c)
    {
        if (group_key != group) {
            Fmt::template enter<B>(raw, g, st);
            scale[0] = __low2half2(st.scale[0]); scale[1] = __high2half2(st.scale[0]);
            scale[2] = __low2half2(st.scale[1]); scale[3] = __high2half2(st.scale[1]);
            group = group_key;
        }
        half2 a[16];
        decode_pairs<B, Fmt>(w, st, a);
#pragma unroll
        for (int p = 0; p < 16; ++p) {
            const int j = p / 4, s = p / 2 % 2, h = p % 2;
            const half2 v = __hmul2(a[p], scale[j]);            // fp16((code - z) * scale): one rounding
            const int r = 16 * s + 4 * q + 2 * h, col = 16 * (j / 2) + 8 * (j % 2) + g;
            tile[r * TILE_STRIDE + col] = __low2half(v);
            tile[(r + 1) * TILE_STRIDE + col] = __high2half(v);
        }
        __syncwarp();
#pragma unroll
        for (int i = 0; i < 4; ++i) {                           // 8 rows of 64 bytes per instruction
            const int r = 8 * i + lane / 4, seg = lane % 4, row = 32 * c + r;
            const int dst = perm ? __ldg(perm + row) : row;
            *reinterpret_cast<uint4*>(w_out + (size_t)dst * Np + strip * 32 + seg * 8) =
                *reinterpret_cast<const uint4*>(tile + r * TILE_STRIDE + seg * 8);
        }
        __syncwarp();
    }
};

template <class Fmt>
__device__ __forceinline__ void dequant(const Packed& pk, const int* perm, const int* split_starts, int Np,
                                        half* w_out)
{
    __shared__ __align__(16) half tiles[WARPS][32 * TILE_STRIDE];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int strip = blockIdx.x * WARPS + warp;
    if (strip >= pk.strips) return;
    const int c0 = __ldg(split_starts + blockIdx.y), c1 = __ldg(split_starts + blockIdx.y + 1);
    DequantSink<Fmt> sink;
    sink.tile = tiles[warp]; sink.w_out = w_out; sink.perm = perm; sink.Np = Np; sink.strip = strip;
    sink.lane = lane; sink.g = lane / 4; sink.q = lane % 4;
    walk<Fmt>(pk, strip, c0, c1, lane, sink);
}

}  // namespace qmm

// ------------------------------------------------------------------------------------------- entry points

// Blocks per SM the register budget is fitted to: M1 fits 3 (80 registers) without spilling, M8/M16 need 2.
#define QMM_MATMUL(NAME, FMT, N8, M1, BLOCKS_PER_SM)                                                                   \
    extern "C" __global__ void __launch_bounds__(qmm::THREADS, BLOCKS_PER_SM)                                          \
    NAME(const half* x, half* y, const half* bias, int M, int K, int N, int Np, const unsigned* qw,                    \
         const int* bits_prefix, const int* run_bounds, const int2* chunk_meta, const void* meta0,                     \
         const void* meta1, int words_per_strip, const int* perm, const int* split_starts, int n_splits,               \
         int xs_stride, float* ws, int* counters)                                                                      \
    {                                                                                                                  \
        const qmm::Packed pk{qw, bits_prefix, run_bounds, chunk_meta, meta0, meta1, Np / 32, words_per_strip};         \
        qmm::matmul<FMT, N8, M1>(x, y, bias, M, K, N, Np, pk, perm, split_starts, n_splits, xs_stride, ws,             \
                                 counters);                                                                            \
    }

QMM_MATMUL(exl2_matmul_m1, qmm::Exl2, 1, true, 3)
QMM_MATMUL(exl2_matmul_m8, qmm::Exl2, 1, false, 2)
QMM_MATMUL(exl2_matmul_m16, qmm::Exl2, 2, false, 2)
QMM_MATMUL(gptq_matmul_m1, qmm::Gptq, 1, true, 3)
QMM_MATMUL(gptq_matmul_m8, qmm::Gptq, 1, false, 2)
QMM_MATMUL(gptq_matmul_m16, qmm::Gptq, 2, false, 2)

#define QMM_DEQUANT(NAME, FMT)                                                                                         \
    extern "C" __global__ void __launch_bounds__(qmm::THREADS)                                                         \
    NAME(const unsigned* qw, const int* bits_prefix, const int* run_bounds, const int2* chunk_meta,                    \
         const void* meta0, const void* meta1, int words_per_strip, const int* perm, const int* split_starts,          \
         int Np, half* w_out)                                                                                          \
    {                                                                                                                  \
        const qmm::Packed pk{qw, bits_prefix, run_bounds, chunk_meta, meta0, meta1, Np / 32, words_per_strip};         \
        qmm::dequant<FMT>(pk, perm, split_starts, Np, w_out);                                                          \
    }

QMM_DEQUANT(exl2_dequant, qmm::Exl2)
QMM_DEQUANT(gptq_dequant, qmm::Gptq)

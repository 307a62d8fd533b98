// dequant.cuh: the EXL2 / GPTQ codes of the quantized-matmul lane layout decoded to fp16: which bits of a lane's
// B words hold which pair of codes, per width (pair_bits, magic_shift), the EXL2 scale codes and GPTQ zero points
// of a group record (scale_code_pairs, zero_pair), and a chunk's 16 pairs as (code - z) (decode_pairs) or as the
// raw magic halves (decode_raw, FOLDED widths); and the inverse, a lane's words from its codes (code_bit,
// encode_lane: the repack, lane_layout.cu). Shared by every kernel family that reads packed weights (qmm.cuh);
// host-callable where marked EXL_HD (tests/kernels/test_quant_matmul.py compiles them for the host).
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
//   Memory order: [strip][chunk][plane][lane], so a warp's chunk range is one contiguous span. The chunks of width
//   WIDTHS[i] = 8, 6, 5, 4, 3, 2 are run_start[i]..run_start[i+1], starting at word run_word[i] of a strip (Part
//   fields). chunk_meta[C] (int2): x = the chunk's group index g; y = EXL2:
//   the group's scale base fp16(q_scale_max * 2^-8) in both halves (GPTQ: unused). Per-group metadata is
//   strip-major, so a warp's records are contiguous too:
//     EXL2  meta0 = scale codes, [strip][g][4 words]: lane g's 16 bits in word g/2, half g%2, bytes
//                   (c_j0 | c_j2 << 4, c_j1 | c_j3 << 4) with c the 4-bit scale code of column col(j).
//     GPTQ  meta0 = fp16 scales [strip][g][8][4] ([..][g][j]: lane g, column col(j)); meta1 = zero points, uint8
//                   [strip][g][8][4].
//
// DECODE ("magic number" dequant): OR-ing 0x6400 into a half that holds code << i (i <= 10 - B) gives the fp16
//   number 1024 + code * 2^i exactly; one HFMA2 by 2^-i with -(1024 * 2^-i + z) gives (code - z) exactly. The
//   matmul skips the HFMA2 for B = 4, 6, 8 (FOLDED below): there i depends only on a chunk row's position, so 2^-i
//   moves into the staged x and the offset becomes one correction per chunk and x row.
//
#pragma once
#include "common.cuh"

namespace qmm {

using namespace exl;

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

// The inverse, for the repack (lane_layout.cu): the bit position (32 * word + bit) in a lane's B words of bit k of
// pair p's e = 0 code; its e = 1 code sits 16 bits above (quant_matmul.PAIR_BITS is the same table, tested).
EXL_HD constexpr int code_bit(int B, int p, int k)
{
    const int per_word = B == 2 ? 8 : B == 3 ? 5 : B == 4 ? 4 : B == 5 ? 3 : 2;
    const int direct = B == 3 || B == 5 ? 15 : B == 6 ? 12 : 16;
    if (p < direct) return 32 * (p / per_word) + B * (p % per_word) + k;
    if (B == 6) return 32 * ((6 * (p - 12) + k) / 4) + 12 + (6 * (p - 12) + k) % 4;
    return 32 * k + 15;
}

// Lane 4g + q's B words (w[0..B)) of one (strip, chunk) from code(row, col), the codes of the chunk's rows
// 16s + 4q + 2h + e and the strip's columns col(j) (LANE LAYOUT).
template <class Code>
EXL_HD void encode_lane(unsigned (&w)[8], int B, int lane, const Code& code)
{
    const int g = lane / 4, q = lane % 4;
    for (int i = 0; i < 8; ++i) w[i] = 0u;
    for (int p = 0; p < 16; ++p) {
        const int j = p / 4, s = p / 2 % 2, h = p % 2;
        for (int e = 0; e < 2; ++e) {
            const unsigned c = code(16 * s + 4 * q + 2 * h + e, 16 * (j / 2) + 8 * (j % 2) + g);
            for (int k = 0; k < B; ++k) {
                const int pos = code_bit(B, p, k) + 16 * e;
                w[pos / 32] |= (c >> k & 1u) << (pos % 32);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------- formats

// Lane g's scale codes from its word of the (strip, group) record (16 bits at half g%2): fp16 bit patterns
// (1024 + c) of columns (col(0), col(1)) in pairs[0] and (col(2), col(3)) in pairs[1].
EXL_HD void scale_code_pairs(unsigned word, int g, unsigned (&pairs)[2])
{
    const unsigned d = byte_perm(word, 0u, (g & 1) ? 0x4342u : 0x4140u);     // byte 0 low half, byte 1 high half
    pairs[0] = and_or(d, 0x000f000fu, 0x64006400u);
    pairs[1] = and_or(d >> 4, 0x000f000fu, 0x64006400u);
}

// GPTQ zero point of column col(j) from lane g's zeros word (byte j), as fp16 bits (1024 + z) in both halves.
EXL_HD unsigned zero_pair(unsigned zeros, int j) { return byte_perm(zeros, 0x64646464u, j | 0x40 | j << 8 | 0x4000); }

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

// FOLDED widths: the matmul feeds the MMA the raw halves 1024 + code * 2^i, with 2^-i moved into x (i depends only
// on a chunk row's position: B=4: i = 4 for rows with (r >> 1) & 1, else 0; B=6, 8: i = 0) and the offset
// 1024 * 2^-i + z subtracted once per chunk as sum_r (1024 x'_r + z x_r) (stage_corrections): one LOP3 per pair
// instead of LOP3 + HFMA2.
template <int B>
EXL_HD constexpr bool folded() { return B == 4 || B == 6 || B == 8; }

template <int B>
__device__ __forceinline__ void decode_raw(const unsigned (&w)[B], half2 (&a)[16])
{
#pragma unroll
    for (int p = 0; p < 16; ++p) a[p] = as_half2(pair_bits<B>(w, p));
}

}  // namespace qmm

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
// LAUNCH PARAMETERS  One Params struct by value (__grid_constant__: read from the constant bank, so a block
//   knows its weights' addresses without a dependent load). It describes up to MAX_PARTS weights ("parts") that
//   share x and K (q/k/v, gate/up: one launch), each with its own layout, group tables, permutation, bias, output
//   and plan: blocks part.block0 .. + col_blocks * n_splits, block b of a part covering strips
//   S (b % col_blocks) .. + S - 1 (S strips per block: 8, or blockDim.x / 32 for the small-M kernels) and chunks
//   split_chunk[s] .. split_chunk[s + 1] with s = b / col_blocks.
//   quant_matmul.PARAMS_DTYPE mirrors the struct (a host test compares their offsets).
//
// MATMUL KERNELS  <fmt>_matmul_m1 / _m8 / _m16 (M = rows of x: 1, <= 8, <= 16), each after stage_xs
//   stage_xs writes x (or the gated MLP's silu(x) * up) once per launch as the matmul reads it: each part's R = 1, 8 or
//   16 rows (rows past M repeat row M - 1) in stored order (x' = x * 2^-i for FOLDED rows), then each chunk's
//   corrections per row (float2 (sum_r 1024 x'_r, sum_r x_r) for FOLDED widths). Grid (sum of the parts' blocks), block
//   S = 8 or 7 warps, one a strip, dynamic shared memory: the split's chunk_meta entries. The launcher sizes the grid
//   to one wave of resident blocks where it can. A warp first prefetches into L2 the start of its weight span
//   (PREFETCH_BYTES) and all group records of its range, and the block stages its chunk_meta entries: all from the
//   parameters, so this overlaps the kernel before (dependent launch, common.cuh). After pdl_wait, warp w walks the
//   chunks of strip S bx + w in batches (each batch prefetches into L2 the span PREFETCH_BYTES ahead, so DRAM reads are
//   in flight without holding registers), loading with each chunk's words its B fragments of x and its corrections
//   (L2): per chunk each lane decodes its 32 codes into 16 half2 values (code - z; FOLDED: 1024 + code * 2^i) and
//   issues m16n8k16 MMAs with A = 16 columns x 16 rows of them, B = 16 rows x 8 rows of x, C = fp32 partial of the
//   current group. At each group change the partial (minus the FOLDED corrections) is scaled by the group's per-column
//   scale (fp32) and added to the accumulator, so results are exact products accumulated in fp32 (FOLDED: up to the
//   fp32 rounding of the larger sums). The EXL2 scale is computed exactly as fp16((c + 1)^2 * fp16(q_scale_max*2^-8)).
//   (docs/decode-matmul.md: a per-block prologue that gathered x into shared memory was ~35 % of the M1 warps' time.)
//   The MoE kernels stage x per block instead (matmul_part: x gather and corrections in shared memory after
//   pdl_wait; the perm reads of the gather's first round before it), since each block serves its expert's rows.
//   n_splits == 1: the warp adds bias and writes y (fp16). n_splits > 1: the warp writes its fp32 partial to ws
//   [part.ws_offset + (split * M + m) * Np + col], then counts itself in counters[strip]; the last warp of a strip
//   to finish sums the partials in split order (deterministic), adds bias, writes y, and resets the counter to 0
//   for the next launch.
//
// GEMM KERNELS  <fmt>_gemm, permute_x, gemm_reduce (LARGE_M <= M <= GEMM_MAX_M rows of x; docs/gemm.md)
//   The lane layout's per-lane pairs are exactly the B fragments of m16n8k16 MMAs with x as A: pair (j, s, h) of
//   lane 4g + q is B[k = 2q + 8h + e][n = g] of n8 tile j (strip columns 8j..8j+7) at k16 step s, MMA k 2q + 8h + e
//   being chunk row 16s + 4q + 2h + e. So a warp decodes its strip's chunk straight into registers as
//   fp16((code - z) * scale), the dequant kernel's own instructions (bit-identical weights), and multiplies it by up
//   to GEMM_WARP_TILES m16 tiles of x (64 rows) from shared memory, accumulating in fp32: no W tile in shared memory.
//   Block 256 = 8 warps = (8 / R) strips x R row groups (Params.row_groups: R = 1 up to 64 rows of x, 2 above).
//   Block b of a part: column tile b % col_blocks (strips (8 / R) * that ..), M tile b / col_blocks % m_tiles,
//   split b / col_blocks / m_tiles; an M tile is ceil(M16 / m_tiles) m16 tiles of x (M16 = ceil(M / 16)), split
//   over its R row groups (at most 4 each, by the launcher's choice of R and m_tiles). Warps of strips past the
//   part's last decode the last one (every warp takes part in the block's barriers) but write nothing.
//   x: the part's x_i [M, K] in stored row order, its columns within each 16 in MMA k order (permute_x made it:
//   gemm_k_row), 16-byte aligned; chunk by chunk into a ring of GEMM_STAGES slots of the M tile's rows x GEMM_XS
//   halves (cp.async, rows past M zero), one __syncthreads per chunk; a warp's A fragments come from the ring by
//   one ldmatrix.x4 each, already in the registers the MMA reads (two 8-byte loads gave them in another order, and
//   the register moves that reordered them were a fifth of the kernel's instructions: docs/gemm.md).
//   Dynamic shared memory: the split's chunk_meta entries, then the ring at Params.ring_smem. Dependent launch:
//   weight and record prefetches and the chunk_meta copy before pdl_wait.
//   n_splits == 1: y = acc (+ bias). Otherwise fp32 partials ws[(part.ws_offset + split * Np) * M + m * Np + col]
//   (ws_offset: floats per x row before this part's), summed in split order by gemm_reduce (grid (ceil(M Np / 2 /
//   256), parts), one column pair per thread), which adds the bias: the "last block reduces" scheme of the small-M
//   kernels would leave one block reading splits x 64 x 256 x 4 bytes alone.
//   permute_x: grid (M, parts), block 256, dynamic shared memory 2K bytes: x_i[m][k] = x[m][perm_i[gemm_k_row(k)]]
//   (perm_i the identity for a part without one), through the row in shared memory (coalesced reads and writes;
//   the perm entries read before pdl_wait);
//   x replaced, as in stage_xs, by the block's norm of it or the gated MLP's silu_mul, which then take no launch.
//
// WGMMA KERNELS  <fmt>_wgmma (WGMMA_MIN_M <= M <= WGMMA_MAX_M rows of x, compute capability 9.0 only: NVRTC builds
//   sm_90a there; on other targets the body is a trap and the launcher never picks it; docs/gemm.md)
//   The GEMM's Params, x (after permute_x), splits, partials and gemm_reduce, with one row group and one M tile of
//   up to WG_N = 128 rows; block 256 = 2 warpgroups of 4 strips, one block per SM (~250 registers), the grid one wave
//   (K split until it fills one). Per chunk each warp decodes its strip into shared memory and each warpgroup issues
//   4 wgmma.m64n128k16 with both operands by descriptor (layouts at the kernel below). Dynamic shared memory: the
//   split's chunk_meta entries, then at Params.ring_smem QMM_WG_STAGES x slots of 8 KB and QMM_WG_DEPTH A slots of
//   16 KB (quant_matmul.plan_wgmma sizes them).
//
// DEQUANT KERNELS  <fmt>_dequant
//   Same Params (one part, its own plan), block 256, static shared memory 20 KB. Warp w of block b decodes its
//   strip over the split's chunks to fp16 W = fp16((code - z) * scale) (bit-exact with the reference), stages each
//   32 x 32 tile in shared memory and writes its rows to w_out[perm[k']][strip cols] (row stride Np).
#include "common.cuh"
#include "norm.cuh"

namespace qmm {

using namespace exl;

constexpr int WARPS = 8;                 // strips per block
constexpr int THREADS = WARPS * 32;
constexpr int MAX_PARTS = 3;             // weights per launch (q, k, v)
constexpr int MAX_SPLITS = 64;           // K splits of one part
constexpr int N_WIDTHS = 6;
constexpr int TILE_STRIDE = 40;          // halves per row of a dequant tile: 32 + 8 pad, rows stay 16-byte aligned
#ifndef QMM_PREFETCH_BYTES                 // benchmarks/tune_matmul.py times other values
#define QMM_PREFETCH_BYTES 4096            // 2 KB and 8 KB measured slower (docs/decode-matmul.md)
#endif
constexpr unsigned PREFETCH_BYTES = QMM_PREFETCH_BYTES;   // L2 prefetch distance of a warp's weight stream
constexpr int STAGE_LOADS = 8;           // gathers of x per thread per x row in flight
constexpr int STAGE_ROWS = 4;            // x rows staged together (M8/M16): STAGE_ROWS * STAGE_LOADS gathers in flight
#ifndef QMM_REDUCE_ROWS                    // benchmarks/tune_matmul.py times other values
#define QMM_REDUCE_ROWS 2                  // 4 measured 4-30 % slower at 16 rows (docs/decode-matmul.md)
#endif
constexpr int REDUCE_LOADS = 16;         // split partials per lane in flight in the final reduction (M1)
constexpr int REDUCE_ROWS = QMM_REDUCE_ROWS;   // x rows reduced together (M8/M16), REDUCE_LOADS / 2 splits of each
#ifndef QMM_GEMM_STAGES                    // benchmarks/tune_matmul.py times other values (also QMM_GEMM_BATCH,
#define QMM_GEMM_STAGES 4                  // QMM_GEMM_BLOCKS below)
#endif
#ifndef QMM_GEMM_BATCH                     // chunks a GEMM warp loads per batch: 1 fits 2 blocks per SM (2: ~16 more
#define QMM_GEMM_BATCH 1                   // registers, spills at 128)
#endif
constexpr int GEMM_STAGES = QMM_GEMM_STAGES;   // x chunks in flight in a GEMM block's ring (quant_matmul.GEMM_STAGES)
constexpr int GEMM_XS = 40;              // halves per x row of a ring slot: 32 + 8 pad, ldmatrix conflict-free
                                         // (quant_matmul.GEMM_XS)
#ifndef QMM_GEMM_WARP_TILES                 // benchmarks/tune_matmul.py times 8 (with QMM_GEMM_BLOCKS=1)
#define QMM_GEMM_WARP_TILES 4
#endif
constexpr int GEMM_WARP_TILES = QMM_GEMM_WARP_TILES;   // m16 tiles of x per GEMM warp (quant_matmul.GEMM_WARP_ROWS)

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

// Chunks loaded into registers per batch: 8 to 16 words per lane (twice as many measured no faster, and spill).
template <int B>
EXL_HD constexpr int batch() { return B == 2 ? 4 : B == 3 ? 4 : B == 4 ? 3 : 2; }

// ------------------------------------------------------------------------------------------- parameters

// One weight of a launch (LAUNCH PARAMETERS above). Field order: pointers, ints, shorts (no padding inside).
struct Part {
    const unsigned* qw;          // [strips][words_per_strip]
    const int2* chunk_meta;      // [chunks]
    const void* meta0;           // strip-major group records
    const void* meta1;
    const int* perm;             // [K] stored row -> row of x, or null for the identity
    const half* bias;            // [n] or null
    int* counters;               // [strips] split-K arrivals, self-resetting
    int n, np, strips, words_per_strip;
    int n_groups, n_splits, block0, col_blocks;
    int ws_offset;               // floats into ws of this part's partials [n_splits][M][np]
    int run_start[N_WIDTHS + 1];
    int run_word[N_WIDTHS];      // word offset within a strip of run i's first chunk
    int split_word[MAX_SPLITS + 1];       // word offset within a strip of each split's first chunk (the last: total)
    short split_chunk[MAX_SPLITS + 1];
    short split_group[MAX_SPLITS + 1];    // group of each split's first chunk (the last: n_groups - 1)
};

struct Params {
    Part part[MAX_PARTS];
    int n_parts, M, K;
    int xs_stride;               // halves per row of the x tile
    int meta_smem;               // byte offset of the chunk_meta copy in dynamic shared memory
    int corr_smem;               // byte offset of the folded chunks' corrections (float2 [chunk][M])
    int row_groups, m_tiles;     // GEMM: warps per strip (R) and M tiles of a launch
    int ring_smem;               // GEMM: byte offset of the x ring in dynamic shared memory
};

EXL_HD constexpr int width_of(int i) { return i == 0 ? 8 : i == 1 ? 6 : i == 2 ? 5 : i == 3 ? 4 : i == 4 ? 3 : 2; }

// The part of block b (parts are laid out in block order).
__device__ __forceinline__ int part_of(const Params& p, int b)
{
    int pi = 0;
#pragma unroll
    for (int i = 1; i < MAX_PARTS; ++i)
        if (i < p.n_parts && b >= p.part[i].block0) pi = i;
    return pi;
}

// Prefetches the 128-byte lines holding bytes [lo, hi) of p into L2, one line per lane and step.
__device__ __forceinline__ void prefetch_span(const void* p, unsigned lo, unsigned hi, int lane)
{
    const size_t base = reinterpret_cast<size_t>(p), end = base + hi;
    for (size_t a = ((base + lo) & ~size_t(127)) + 128 * lane; a < end; a += 128 * 32)
        prefetch_l2(reinterpret_cast<const void*>(a));
}

// ------------------------------------------------------------------------------------------- weight stream

// A warp's weight span (its strip's words of chunks [c0, c1): one contiguous range), read chunk by chunk in order
// straight from global memory, with L2 prefetches PREFETCH_BYTES ahead that hold no registers. (A bulk-copy ring in
// shared memory kept more bytes in flight but cost more instructions and ran slower: docs/decode-matmul.md.)
struct Stream {
    const unsigned char* src;    // the span in global memory
    unsigned span;               // its bytes (a multiple of 128)

    // The first PREFETCH_BYTES: a kernel's first work (only parameters are needed).
    __device__ void start(const void* p, unsigned bytes, int lane)
    {
        src = static_cast<const unsigned char*>(p);
        span = bytes;
        prefetch_span(src, 0, min(span, PREFETCH_BYTES), lane);
    }

    // Before reading bytes [off, end) (at most 32 lines): prefetch the same bytes PREFETCH_BYTES ahead.
    __device__ void ahead(unsigned off, unsigned end, int lane) const
    {
        const unsigned a = off + PREFETCH_BYTES + 128 * lane;
        if (a < min(span, end + PREFETCH_BYTES)) prefetch_l2(src + a);
    }

    // Lane's B words of the chunk at `chunk` (the span's start plus an offset): planes of 16, 8, then 4 bytes per
    // lane. A batch passes its first chunk's pointer plus constants, so the loads take immediate offsets.
    template <int B>
    __device__ static void load(const unsigned char* chunk, int lane, unsigned (&w)[B])
    {
        constexpr int P16 = B / 4, P8 = B % 4 / 2, P4 = B % 2;
#pragma unroll
        for (int i = 0; i < P16; ++i) {
            const uint4 v = load_stream(reinterpret_cast<const uint4*>(chunk + 512 * i) + lane);
            w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
        }
        if constexpr (P8 == 1) {
            const uint2 v = load_stream(reinterpret_cast<const uint2*>(chunk + 512 * P16) + lane);
            w[4 * P16] = v.x; w[4 * P16 + 1] = v.y;
        }
        if constexpr (P4 == 1)
            w[B - 1] = load_stream(reinterpret_cast<const unsigned*>(chunk + 512 * P16 + 256 * P8) + lane);
    }
};

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

// EXL2: zero point 2^(B-1); per-column scale fp16((c+1)^2 * m) from a 4-bit code c and the group's base m.
struct Exl2 {
    static constexpr int REC0 = 16, REC1 = 0;    // bytes of a (strip, group) record in meta0, meta1
    struct Cursor { const unsigned* codes; };    // the lane's word of group 0's record
    struct Raw { unsigned codes, base; };
    struct State { half2 scale[2]; };            // (col(0), col(1)), (col(2), col(3))

    template <int B>
    EXL_HD static constexpr bool has_width() { return true; }

    __device__ static Cursor cursor(const Part& pt, int strip, int g)
    {
        return {static_cast<const unsigned*>(pt.meta0) + (size_t)strip * pt.n_groups * 4 + (g >> 1)};
    }

    __device__ static Raw load(const Cursor& cur, int2 meta)
    {
        return {__ldg(cur.codes + 4 * meta.x), (unsigned)meta.y};
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

    template <int B>
    __device__ static float zero(const Raw&, int) { return float(1 << (B - 1)); }
};

// GPTQ: zero point and fp16 scale per (group, column), read as given (v1/v2 already resolved by prepare()).
struct Gptq {
    static constexpr int REC0 = 64, REC1 = 32;
    struct Cursor { const uint2* scales; const unsigned* zeros; };     // the lane's entries of group 0
    struct Raw { uint2 scales; unsigned zeros; };
    struct State { half2 scale[2]; half2 bias[4][5]; };    // bias[j][i / B] = -(1024 * 2^-i + z_j)

    template <int B>
    EXL_HD static constexpr bool has_width() { return B == 2 || B == 3 || B == 4 || B == 8; }

    __device__ static Cursor cursor(const Part& pt, int strip, int g)
    {
        const size_t rec = (size_t)strip * pt.n_groups * 8 + g;
        return {static_cast<const uint2*>(pt.meta0) + rec, static_cast<const unsigned*>(pt.meta1) + rec};
    }

    __device__ static Raw load(const Cursor& cur, int2 meta)
    {
        return {__ldg(cur.scales + 8 * meta.x), __ldg(cur.zeros + 8 * meta.x)};
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

    template <int B>
    __device__ static float zero(const Raw& r, int j) { return float(r.zeros >> 8 * j & 0xff); }
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

// ------------------------------------------------------------------------------------------- walking chunks

// Starts the DRAM reads of a warp's group records (all of its range) into L2: only parameters are read, so this
// can be a kernel's first work.
template <class Fmt>
__device__ __forceinline__ void prefetch_records(const Part& pt, int strip, int split, int lane)
{
    const unsigned g0 = pt.split_group[split], g1 = pt.split_group[split + 1] + 1u;
    prefetch_span(static_cast<const char*>(pt.meta0) + (size_t)strip * pt.n_groups * Fmt::REC0, g0 * Fmt::REC0,
                  g1 * Fmt::REC0, lane);
    if constexpr (Fmt::REC1 > 0)
        prefetch_span(static_cast<const char*>(pt.meta1) + (size_t)strip * pt.n_groups * Fmt::REC1, g0 * Fmt::REC1,
                      g1 * Fmt::REC1, lane);
}

// The weight stream of a warp's chunks of split s of its strip, started.
__device__ __forceinline__ void start_stream(Stream& st, const Part& pt, int strip, int split, int lane)
{
    const int w0 = pt.split_word[split];
    st.start(pt.qw + (size_t)strip * pt.words_per_strip + w0, 4u * (pt.split_word[split + 1] - w0), lane);
}

// U chunks' words, chunk_meta entries and group records, loaded together (fetch), then consumed in order.
// With them, whatever else the sink reads per chunk (Sink::Extra: the M1 matmul's x fragments and corrections).
template <int U, int B, class Fmt, class Sink>
struct Batch {
    unsigned w[U][B];
    int2 m[U];
    typename Fmt::Raw raw[U];
    typename Sink::Extra ex[U];

    // The chunks c, c + 1, ... from span offset off on; meta: their chunk_meta entries.
    __device__ __forceinline__ void fetch(const typename Fmt::Cursor& cur, const int2* meta, const Stream& st,
                                          unsigned off, int lane, int c, const Sink& sink)
    {
        const unsigned char* chunk = st.src + off;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            Stream::load<B>(chunk + u * 128 * B, lane, w[u]);
            m[u] = meta[u];
        }
        sink.template extras<B, U>(c, ex);
#pragma unroll
        for (int u = 0; u < U; ++u) raw[u] = Fmt::load(cur, m[u]);
    }

    __device__ __forceinline__ void consume(int c, Sink& sink) const
    {
#pragma unroll
        for (int u = 0; u < U; ++u) sink.template chunk<B>(w[u], m[u].x, raw[u], c + u, ex[u]);
    }
};

// A warp's current group for sinks that scale the decoded pairs themselves (dequant, GEMM, wgmma): its decode state
// and (s, s) of column col(j), entered when the group changes.
template <class Fmt>
struct GroupScales {
    int group = -1;
    typename Fmt::State st;
    half2 scale[4];

    template <int B>
    __device__ void enter(int group_key, const typename Fmt::Raw& raw, int g)
    {
        if (group_key == group) return;
        Fmt::template enter<B>(raw, g, st);
        scale[0] = __low2half2(st.scale[0]); scale[1] = __high2half2(st.scale[0]);
        scale[2] = __low2half2(st.scale[1]); scale[3] = __high2half2(st.scale[1]);
        group = group_key;
    }
};

// Sinks that read nothing else per chunk.
struct NoExtra {
    struct Extra {};

    template <int B, int U>
    __device__ void extras(int, Extra (&)[U]) const {}
};

// One width run [c, end) of a strip, from span offset off: batches of batch<B>() chunks (Sink::BATCH if set), then the
// run's last ones.
// Sinks with PIPELINE (the staged matmuls) issue the next batch's loads before consuming the current one, so a warp's
// demand loads stay in flight while it computes (the registers this takes cost one resident block per SM, and
// still measured 5-38 % faster at M = 1: docs/decode-matmul.md).
template <int B, class Fmt, class Sink>
__device__ __forceinline__ void walk_run(const typename Fmt::Cursor& cur, const int2* meta, const Stream& st,
                                         unsigned off, int c, int end, int lane, Sink& sink)
{
    constexpr int U = Sink::BATCH > 0 ? Sink::BATCH : batch<B>(), BYTES = 128 * B;
    if constexpr (Sink::PIPELINE) {
        if (c + U <= end) {
            Batch<U, B, Fmt, Sink> now;
            st.ahead(off, off + U * BYTES, lane);
            now.fetch(cur, meta, st, off, lane, c, sink);
            for (; c + 2 * U <= end; c += U, off += U * BYTES, meta += U) {
                Batch<U, B, Fmt, Sink> next;
                st.ahead(off + U * BYTES, off + 2 * U * BYTES, lane);
                next.fetch(cur, meta + U, st, off + U * BYTES, lane, c + U, sink);
                now.consume(c, sink);
                now = next;
            }
            now.consume(c, sink);
            c += U, off += U * BYTES, meta += U;
        }
    } else {
        for (; c + U <= end; c += U, off += U * BYTES, meta += U) {
            st.ahead(off, off + U * BYTES, lane);
            Batch<U, B, Fmt, Sink> now;
            now.fetch(cur, meta, st, off, lane, c, sink);
            now.consume(c, sink);
        }
    }
    for (; c < end; ++c, off += BYTES, ++meta) {                        // already prefetched by the batches
        Batch<1, B, Fmt, Sink> one;
        one.fetch(cur, meta, st, off, lane, c, sink);
        one.consume(c, sink);
    }
}

// The chunks of width B = width_of(I) within [c0, c1).
template <int I, class Fmt, class Sink>
__device__ __forceinline__ void walk_width(const Part& pt, const typename Fmt::Cursor& cur, const int2* meta_s,
                                           const Stream& st, int c0, int c1, int chunk_word0, int lane, Sink& sink)
{
    constexpr int B = width_of(I);
    if constexpr (Fmt::template has_width<B>()) {
        const int lo = max(c0, pt.run_start[I]), hi = min(c1, pt.run_start[I + 1]);
        if (lo < hi)
            walk_run<B, Fmt>(cur, meta_s + (lo - c0), st,
                             4u * (pt.run_word[I] + 32 * B * (lo - pt.run_start[I]) - chunk_word0), lo, hi, lane,
                             sink);
    }
}

// Chunks of split s = [c0, c1) of one strip (the stream st), width by width: straight-line code, so each width's
// loop keeps its own registers. meta_s: chunk_meta[c0..c1).
template <class Fmt, class Sink>
__device__ __forceinline__ void walk(const Part& pt, int strip, int split, const int2* meta_s, const Stream& st,
                                     int lane, Sink& sink)
{
    const typename Fmt::Cursor cur = Fmt::cursor(pt, strip, lane / 4);
    const int c0 = pt.split_chunk[split], c1 = pt.split_chunk[split + 1], w0 = pt.split_word[split];
    walk_width<0, Fmt>(pt, cur, meta_s, st, c0, c1, w0, lane, sink);
    walk_width<1, Fmt>(pt, cur, meta_s, st, c0, c1, w0, lane, sink);
    walk_width<2, Fmt>(pt, cur, meta_s, st, c0, c1, w0, lane, sink);
    walk_width<3, Fmt>(pt, cur, meta_s, st, c0, c1, w0, lane, sink);
    walk_width<4, Fmt>(pt, cur, meta_s, st, c0, c1, w0, lane, sink);
    walk_width<5, Fmt>(pt, cur, meta_s, st, c0, c1, w0, lane, sink);
}

// chunk_meta[c0..c1) into shared memory (every thread of the block takes part).
__device__ __forceinline__ void stage_meta(int2* meta_s, const int2* chunk_meta, int c0, int c1)
{
    for (int c = c0 + (int)threadIdx.x; c < c1; c += blockDim.x) meta_s[c - c0] = __ldg(chunk_meta + c);
}

// ------------------------------------------------------------------------------------------- matmul

template <bool C, class A, class B> struct Pick { using T = A; };
template <class A, class B> struct Pick<false, A, B> { using T = B; };

// x as stage_xs left it, read per chunk with the weights (GX sinks): the lane's B fragments of the two k16 steps
// for each x-row tile, and the chunk's corrections of its x rows (one row: row 0's (x, y); else rows 2q, 2q + 1 of
// each tile as (x, y, z, w)).
template <int N8, bool M1>
struct XChunk {
    uint2 b[N8][2];
    typename Pick<M1, float2, float4>::T corr[N8];
};

// Accumulates y^T for the warp's 32 columns: acc[t][n] is the C fragment of column tile t (columns 16t..16t+15
// of the strip) and x-row tile n (rows 8n..8n+7). M1: only x row 0, i.e. fragment entries 0 and 2.
// GX (the dense launches): x and the corrections come from global memory (stage_xs's output) in the batches, not
// from the block's shared memory (MoE stages them per block).
template <class Fmt, int N8, bool M1, bool GX = false>
struct MatmulSink {
    // Every staged kernel pipelines its batches (walk_run), the 8- and 16-row ones at one block per SM for the
    // registers (docs/decode-matmul.md); MoE's 16-row kernel (two blocks per SM, x in shared memory) does not.
    static constexpr bool PIPELINE = M1 || GX;
    static constexpr int BATCH = 0;            // chunks per batch: 0 for batch<B>() (walk_run)
    static constexpr int ROWS = M1 ? 1 : 8 * N8;       // GX: x rows staged (rows past M repeat row M - 1)
    using Extra = typename Pick<GX, XChunk<N8, M1>, NoExtra::Extra>::T;
    // B fragments come from x row min(g, M-1) (+ tile1 for row min(8+g, M-1)), columns 4q.. of the current chunk.
    // Clamping needs no zero fill: rows past M only feed the MMA columns of x rows >= M, which are never written.
    const half* xc;
    int tile1;
    const float2* corr;      // the split's corrections [chunk - c0][M] (FOLDED widths)
    int c0, M;
    const half* xg;          // GX: the part's x in stored order [ROWS][K], at row g (M1: row 0)
    size_t tile_step;        // GX: halves from row g to row 8 + g
    const float2* cg;        // GX: its corrections [chunk][ROWS], at row 2q (M1: row 0)
    int group = -1;
    typename Fmt::State st;
    float sf[4] = {};        // scales of the current group's columns col(0..3), fp32
    float zf[4] = {};        // zero points of those columns (FOLDED widths)
    float s1[N8][2] = {}, s0[N8][2] = {};     // the group's sum of corrections of x rows 8n + 2q + e
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
                        const int j = 2 * t + i / 2;
                        const float offset = fmaf(zf[j], s0[n][i % 2], s1[n][i % 2]);
                        acc[t][n][i] = fmaf(part[t][n][i] - offset, sf[j], acc[t][n][i]);
                        part[t][n][i] = 0.f;
                    }
#pragma unroll
        for (int n = 0; n < N8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) s1[n][e] = s0[n][e] = 0.f;
    }

    // Chunks c .. c + U - 1: from one 64-bit pointer per batch, so every load takes an immediate offset (per-chunk
    // 32-bit indexes cost ~13 address instructions per chunk: ncu, docs/decode-matmul.md).
    template <int B, int U>
    __device__ void extras(int c, Extra (&ex)[U]) const
    {
        if constexpr (GX) {
            const float2* cb = cg + (ptrdiff_t)c * ROWS;
#pragma unroll
            for (int n = 0; n < N8; ++n) {
                const uint2* xb =
                    reinterpret_cast<const uint2*>(xg + n * tile_step + 32 * (ptrdiff_t)c) + threadIdx.x % 4;
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    ex[u].b[n][0] = __ldg(xb + 8 * u);        // rows 4q .. 4q + 3 of chunk c + u
                    ex[u].b[n][1] = __ldg(xb + 8 * u + 4);    // rows 16 + 4q ..
                    if constexpr (M1)
                        ex[u].corr[n] = folded<B>() ? __ldg(cb + u) : make_float2(0.f, 0.f);
                    else                                      // rows 8n + 2q, + 1: 16-byte aligned
                        ex[u].corr[n] = folded<B>() ? __ldg(reinterpret_cast<const float4*>(cb + u * ROWS + 8 * n))
                                                    : make_float4(0.f, 0.f, 0.f, 0.f);
                }
            }
        }
    }

    template <int B>
    __device__ void chunk(const unsigned (&w)[B], int group_key, const typename Fmt::Raw& raw, int c, const Extra& ex)
    {
        if (group_key != group) {
            flush();
            Fmt::template enter<B>(raw, g(), st);
            sf[0] = __low2float(st.scale[0]); sf[1] = __high2float(st.scale[0]);
            sf[2] = __low2float(st.scale[1]); sf[3] = __high2float(st.scale[1]);
#pragma unroll
            for (int j = 0; j < 4; ++j) zf[j] = Fmt::template zero<B>(raw, j);
            group = group_key;
        }
        half2 a[16];
        if constexpr (folded<B>() && GX) {
            decode_raw<B>(w, a);
#pragma unroll
            for (int n = 0; n < N8; ++n) {
                s1[n][0] += ex.corr[n].x;
                s0[n][0] += ex.corr[n].y;
                if constexpr (!M1) {
                    s1[n][1] += ex.corr[n].z;
                    s0[n][1] += ex.corr[n].w;
                }
            }
        } else if constexpr (folded<B>()) {
            decode_raw<B>(w, a);
            const float2* cc = corr + (c - c0) * M;
            const int q = threadIdx.x % 4;
#pragma unroll
            for (int n = 0; n < N8; ++n)
#pragma unroll
                for (int e = 0; e < (M1 ? 1 : 2); ++e) {
                    const float2 v = cc[min(8 * n + 2 * q + e, M - 1)];
                    s1[n][e] += v.x;
                    s0[n][e] += v.y;
                }
        } else {
            decode_pairs<B, Fmt>(w, st, a);
        }
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            unsigned b[N8][2];
#pragma unroll
            for (int n = 0; n < N8; ++n) {
                uint2 v;
                if constexpr (GX) v = ex.b[n][s];
                else v = *reinterpret_cast<const uint2*>(xc + n * tile1 + 16 * s);
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
        if constexpr (!GX) xc += 32;
    }

    __device__ static int g() { return threadIdx.x % 32 / 4; }
};

// Width of chunk c (from the part's runs).
__device__ __forceinline__ int width_at(const Part& pt, int c)
{
    int b = 2;
#pragma unroll
    for (int i = N_WIDTHS - 1; i >= 0; --i)
        if (c < pt.run_start[i + 1]) b = width_of(i);
    return b;
}

// 2^-i of row r of a chunk of width b (FOLDED widths; 1 otherwise).
__device__ __forceinline__ float row_scale(int b, int r) { return b == 4 && (r >> 1 & 1) ? 0.0625f : 1.f; }

// One round of the x gather: for rows base + u * THREADS of a split (u < STAGE_LOADS), the row of x each comes
// from (perm) and its FOLDED scale 2^-i. These depend on the weights only, so the first round is prepared before
// pdl_wait: the perm reads (an L2 round trip) overlap the kernel before this one.
struct GatherRound {
    int src[STAGE_LOADS];
    float scale[STAGE_LOADS];

    __device__ __forceinline__ void prepare(const Part& pt, int c0, int rows, int base)
    {
        const int r0 = 32 * c0;
#pragma unroll
        for (int u = 0; u < STAGE_LOADS; ++u) {
            const int r = max(0, min(base + u * THREADS, rows - 1));   // past the end: a repeat of the last row
            src[u] = pt.perm ? __ldg(pt.perm + r0 + r) : r0 + r;
            scale[u] = row_scale(width_at(pt, c0 + r / 32), r % 32);
        }
    }
};

// x rows [32 c0, 32 c1) of stored order into shared memory: xs[m][r] = x[m][perm[32 c0 + r]] (x' = x * 2^-i for
// FOLDED rows). first: the first round, prepared. Each thread has ROWS * STAGE_LOADS independent gathers in flight
// (they hit L2: x is shared by every block): a row at a time, 16 rows took 16 L2 round trips before the first MMA.
template <int ROWS>
__device__ __forceinline__ void stage_x(half* xs, const half* x, const Part& pt, int M, int K, int c0, int c1,
                                        int xs_stride, GatherRound round)
{
    const int rows = 32 * (c1 - c0);
    for (int base = threadIdx.x; base < rows; base += THREADS * STAGE_LOADS) {
        if (base != (int)threadIdx.x) round.prepare(pt, c0, rows, base);
        for (int m0 = 0; m0 < M; m0 += ROWS) {
            half v[ROWS][STAGE_LOADS];
#pragma unroll
            for (int i = 0; i < ROWS; ++i)                     // rows past M: a harmless repeat of row M - 1
#pragma unroll
                for (int u = 0; u < STAGE_LOADS; ++u)
                    v[i][u] = __ldg(x + (size_t)min(m0 + i, M - 1) * K + round.src[u]);
#pragma unroll
            for (int i = 0; i < ROWS; ++i)
#pragma unroll
                for (int u = 0; u < STAGE_LOADS; ++u) {
                    const int r = base + u * THREADS;
                    if (m0 + i < M && r < rows)
                        xs[(m0 + i) * xs_stride + r] = __float2half_rn(__half2float(v[i][u]) * round.scale[u]);
                }
        }
    }
}

__device__ __forceinline__ float bias_at(const half* bias, int col) { return bias ? __half2float(bias[col]) : 0.f; }

// y (+ bias) for column col of a strip whose n_splits partials are in: each x row's partials added in split order
// (deterministic). ROWS x rows at a time with SPLITS partials each in flight per lane (one row at a time, 16 rows
// took 16 L2 round trips).
template <int ROWS, int SPLITS>
__device__ __forceinline__ void reduce_splits(const float* parts, half* y, const half* bias, int M, int N, int Np,
                                              int ws_rows, int n_splits, int col)
{
    for (int m0 = 0; m0 < M; m0 += ROWS) {
        float sum[ROWS] = {};
        for (int s0 = 0; s0 < n_splits; s0 += SPLITS) {
            float v[ROWS][SPLITS];
#pragma unroll
            for (int i = 0; i < ROWS; ++i)
#pragma unroll
                for (int u = 0; u < SPLITS; ++u)
                    v[i][u] = m0 + i < M && s0 + u < n_splits
                                  ? __ldcg(parts + ((size_t)(s0 + u) * ws_rows + m0 + i) * Np + col) : 0.f;
#pragma unroll
            for (int i = 0; i < ROWS; ++i)
#pragma unroll
                for (int u = 0; u < SPLITS; ++u) sum[i] += v[i][u];
        }
#pragma unroll
        for (int i = 0; i < ROWS; ++i)
            if (m0 + i < M && col < N) y[(size_t)(m0 + i) * N + col] = __float2half_rn(sum[i] + bias_at(bias, col));
    }
}

// Per chunk of the split and x row m: (sum_r 1024 x'_r, sum_r x_r) over its 32 rows for FOLDED widths ((0, 0)
// otherwise), x'_r as staged and x_r = x'_r * 2^i (what the MMA's products amount to). A warp takes a chunk at a
// time, P lanes per x row, each lane 32 / P rows of it.
__device__ __forceinline__ void stage_corrections(float2* corr, const half* xs, const Part& pt, int M, int c0, int c1,
                                                  int xs_stride)
{
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int P = M <= 1 ? 32 : M <= 2 ? 16 : M <= 4 ? 8 : M <= 8 ? 4 : 2, per = 32 / P;
    const int m = lane / P, r0 = lane % P * per;
    for (int c = warp; c < c1 - c0; c += WARPS) {
        const int b = width_at(pt, c0 + c);
        float lo = 0.f, hi = 0.f;                   // rows with (r >> 1) & 1 clear / set
        if (m < M)
            for (int r = r0; r < r0 + per; ++r) {
                const float v = __half2float(xs[m * xs_stride + 32 * c + r]);
                if (r >> 1 & 1) hi += v; else lo += v;
            }
        for (int span = P / 2; span >= 1; span /= 2) {
            lo += __shfl_xor_sync(FULL_MASK, lo, span);
            hi += __shfl_xor_sync(FULL_MASK, hi, span);
        }
        if (m < M && lane % P == 0)
            corr[c * M + m] = (b == 4 || b == 6 || b == 8)
                                  ? make_float2(1024.f * (lo + hi), lo + hi / row_scale(b, 2)) : make_float2(0.f, 0.f);
    }
}

// Calls f(value, m, col) for each of the warp's accumulators of its strip with x row m < M (acc[t][n][i]: column
// strip*32 + 16t + g + 8(i/2), x row 8n + 2q + i%2; M1: entries 0 and 2 only).
template <int N8, bool M1, class F>
__device__ __forceinline__ void for_each_acc(const float (&acc)[2][N8][4], int strip, int M, F f)
{
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int n = 0; n < N8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int m = 8 * n + 2 * q + i % 2;
                if ((!M1 || i % 2 == 0) && m < M) f(acc[t][n][i], m, strip * 32 + 16 * t + g + 8 * (i / 2));
            }
}

// The warp's accumulators of its strip: y (+ bias) without splits, else the split's partials, and the strip's last
// warp to arrive reduces them.
template <int N8, bool M1>
__device__ __forceinline__ void finish(const float (&acc)[2][N8][4], const Part& pt, int split, int strip, int M,
                                       half* y, float* ws, int ws_rows, int* counters)
{
    const int lane = threadIdx.x % 32;
    const int N = pt.n, Np = pt.np;
    if (pt.n_splits == 1) {
        for_each_acc<N8, M1>(acc, strip, M, [&](float v, int m, int col) {
            if (col < N) y[(size_t)m * N + col] = __float2half_rn(v + bias_at(pt.bias, col));
        });
        return;
    }
    float* part = ws + (size_t)split * ws_rows * Np;
    for_each_acc<N8, M1>(acc, strip, M, [&](float v, int m, int col) { part[(size_t)m * Np + col] = v; });
    __syncwarp();                                // the warp's partials, then its arrival (release)
    int done = 0;
    if (lane == 0) done = arrive(counters + strip);
    done = __shfl_sync(FULL_MASK, done, 0);
    if (done != pt.n_splits - 1) return;
    __syncwarp();                                // the last warp of the strip: every other split's partial is in
    if constexpr (M1)
        reduce_splits<1, REDUCE_LOADS>(ws, y, pt.bias, M, N, Np, ws_rows, pt.n_splits, strip * 32 + lane);
    else
        reduce_splits<REDUCE_ROWS, REDUCE_LOADS / 2>(ws, y, pt.bias, M, N, Np, ws_rows, pt.n_splits, strip * 32 + lane);
    if (lane == 0) counters[strip] = 0;
}

// Block `local` of part pt (of p): y [M, pt.n] = x [M, K] @ W^T (+ bias). Split partials go to
// ws[(split * ws_rows + m) * Np + col] (ws: this part's, row 0), arrivals to counters[strip] (this part's).
template <class Fmt, int N8, bool M1>
__device__ __forceinline__ void matmul_part(const Params& p, const Part& pt, int local, int M, const half* x, half* y,
                                            float* ws, int ws_rows, int* counters)
{
    extern __shared__ __align__(16) unsigned char smem[];
    half* xs = reinterpret_cast<half*>(smem);
    int2* meta_s = reinterpret_cast<int2*>(smem + p.meta_smem);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const int split = local / pt.col_blocks, strip = local % pt.col_blocks * WARPS + warp;
    const int c0 = pt.split_chunk[split], c1 = pt.split_chunk[split + 1];

    Stream st;
    if (strip < pt.strips) {                 // DRAM reads first; they overlap the staging below
        start_stream(st, pt, strip, split, lane);
        prefetch_records<Fmt>(pt, strip, split, lane);
    }
    GatherRound first;                                 // the weights' own metadata: no earlier kernel writes it
    first.prepare(pt, c0, 32 * (c1 - c0), threadIdx.x);
    stage_meta(meta_s, pt.chunk_meta, c0, c1);
    pdl_wait();                                        // x, ws and the counters belong to earlier kernels
    stage_x<M1 ? 1 : STAGE_ROWS>(xs, x, pt, M, p.K, c0, c1, p.xs_stride, first);
    __syncthreads();
    float2* corr = reinterpret_cast<float2*>(smem + p.corr_smem);
    stage_corrections(corr, xs, pt, M, c0, c1, p.xs_stride);
    __syncthreads();
    if (strip >= pt.strips) return;

    MatmulSink<Fmt, N8, M1> sink;
    sink.xc = xs + min(g, M - 1) * p.xs_stride + 4 * q;
    sink.tile1 = (min(8 + g, M - 1) - min(g, M - 1)) * p.xs_stride;
    sink.corr = corr;
    sink.c0 = c0;
    sink.M = M;
    walk<Fmt>(pt, strip, split, meta_s, st, lane, sink);
    sink.flush();
    finish<N8, M1>(sink.acc, pt, split, strip, M, y, ws, ws_rows, counters);
}

// Block `local` of part pt, M rows of x that stage_xs staged (xg: the part's x in stored order [ROWS][K], cg: its
// corrections [K / 32][ROWS]): no x tile and no barrier after pdl_wait, so every warp starts on its weights at once
// and reads x with them. Shared memory: the split's chunk_meta entries (staged before pdl_wait). A block has one
// warp per strip, 8 or fewer (blockDim.x / 32: the launcher picks the count that fills the wave best).
template <class Fmt, int N8, bool M1>
__device__ __forceinline__ void matmul_part_staged(const Params& p, const Part& pt, int local, int M, const half* xg,
                                                   const float2* cg, half* y, float* ws, int* counters)
{
    extern __shared__ __align__(16) unsigned char smem[];
    int2* meta_s = reinterpret_cast<int2*>(smem + p.meta_smem);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int split = local / pt.col_blocks, strip = local % pt.col_blocks * (blockDim.x / 32) + warp;
    Stream st;
    if (strip < pt.strips) {
        start_stream(st, pt, strip, split, lane);
        prefetch_records<Fmt>(pt, strip, split, lane);
    }
    stage_meta(meta_s, pt.chunk_meta, pt.split_chunk[split], pt.split_chunk[split + 1]);
    __syncthreads();                                   // the weights' own metadata: overlaps the kernel before
    if (strip >= pt.strips) return;
    pdl_wait();                                        // x (stage_xs's), ws and the counters
    MatmulSink<Fmt, N8, M1, true> sink;
    const int g = lane / 4, q = lane % 4;
    sink.xg = xg + (M1 ? 0 : g * (size_t)p.K);
    sink.tile_step = 8 * (size_t)p.K;
    sink.cg = cg + (M1 ? 0 : 2 * q);
    walk<Fmt>(pt, strip, split, meta_s, st, lane, sink);
    sink.flush();
    finish<N8, M1>(sink.acc, pt, split, strip, M, y, ws, M, counters);
}

// The launch of p: block blockIdx.x of the parts laid out in block order. xs is stage_xs's output for R = 1 (M1),
// 8 or 16 (N8 = 1, 2) staged rows: the parts' x in stored order [n_parts][R][K], then their corrections
// [n_parts][K / 32][R] as float2.
template <class Fmt, int N8, bool M1>
__device__ __forceinline__ void matmul(const Params& p, const half* xs, half* y0, half* y1, half* y2, float* ws)
{
    constexpr int R = M1 ? 1 : 8 * N8;
    const int pi = part_of(p, blockIdx.x);
    const Part& pt = p.part[pi];
    half* y = pi == 0 ? y0 : pi == 1 ? y1 : y2;
    const float2* corr =
        reinterpret_cast<const float2*>(xs + (size_t)p.n_parts * R * p.K) + (size_t)pi * (p.K / 32) * R;
    matmul_part_staged<Fmt, N8, M1>(p, pt, blockIdx.x - pt.block0, p.M, xs + (size_t)pi * R * p.K, corr, y,
                                    ws ? ws + pt.ws_offset : ws, pt.counters);
}

// r = fp16(x + residual) of the block's row of x (row: its offset in x; residual null: r = x) into shared memory
// (K halves, dynamic; x and residual 16-byte aligned, K % 8 == 0: the launchers check), and its inverse RMS, as
// norm.cu computes them (norm.cuh). Every thread of the block calls it (block_sum's barrier, which also publishes r).
__device__ __forceinline__ float residual_row(const half* x, const half* residual, int K, size_t row, float eps)
{
    static_assert(THREADS == NORM_THREADS, "norm.cuh sums a row over NORM_THREADS threads");
    extern __shared__ __align__(16) half r_s[];
    float sum_sq = 0.f;
    for (int i = threadIdx.x * 8; i < K; i += THREADS * 8) {
        uint4 xv = *reinterpret_cast<const uint4*>(x + row + i);
        half* r = reinterpret_cast<half*>(&xv);
        if (residual) {
            const uint4 bv = *reinterpret_cast<const uint4*>(residual + row + i);
            const half* b = reinterpret_cast<const half*>(&bv);
#pragma unroll
            for (int j = 0; j < 8; j++) r[j] = add_residual(r[j], b[j]);
        }
        *reinterpret_cast<uint4*>(r_s + i) = xv;
        sum_sq += sum_squares<8>(r);
    }
    return inverse_rms(block_sum(sum_sq), K, eps);
}

// The add_rmsnorm of the block's row of x (residual_row), fp16(w * fp16(r * inv_rms)) at the lane's src, w = the norm
// weight there; a writer block (part 0, blockIdx.z < M) writes its 256 elements of r, 256 blockIdx.x on, to
// new_residual.
__device__ __forceinline__ half stage_norm(const half* x, const half* residual, half w, half* new_residual, int K,
                                           size_t row, int src, float eps, bool writer)
{
    extern __shared__ __align__(16) half r_s[];
    const float inv_rms = residual_row(x, residual, K, row, eps);
    const int e = blockIdx.x * THREADS + threadIdx.x;
    if (writer && residual && e < K) new_residual[row + e] = r_s[e];
    return normalise(r_s[src], w, inv_rms);
}

// The gated MLP's fp16(fp16(silu(gate)) * up), rounded as activation.cu's silu_mul.
__device__ __forceinline__ half silu_mul(half gate, half up)
{
    const half act = __float2half_rn(silu(__half2float(gate)));
    return __float2half_rn(__fmul_rn(__half2float(act), __half2float(up)));
}

// x [M, K] for the small-M launch of p, R = gridDim.z staged rows (1, 8 or 16; row m >= M repeats row M - 1):
// chunk c = blockIdx.x * WARPS + warp of part blockIdx.y and row m = blockIdx.z, by one warp, lane r taking stored
// row 32c + r: xs[part][m][k'] = x[m][perm[k']] (x' = x * 2^-i for FOLDED rows, as stage_x) and the chunk's
// correction corr[part][c][m] (as stage_corrections for one row: the same sums in the same order). What is staged
// in place of x, so that the op before needs no launch of its own:
//  - up non-null ([M, K] like x): the gated MLP's fp16(fp16(silu(x)) * up), rounded as activation.cu's silu_mul;
//  - norm_w non-null: the block's add_rmsnorm (residual non-null) or rmsnorm of x with weight norm_w (stage_norm),
//    the new residual written to new_residual.
__device__ __forceinline__ void stage_xs(const Params& p, const half* x, const half* up, const half* residual,
                                         const half* norm_w, half* new_residual, float eps, half* xs)
{
    const int part = blockIdx.y, c = blockIdx.x * WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    const int m = blockIdx.z, R = gridDim.z, chunks = p.K / 32;
    const bool active = c < chunks;                    // (the grid's y is n_parts)
    if (!active && !norm_w) return;                    // (with a norm, every thread takes part in its barrier)
    const Part& pt = p.part[part];
    const int k = 32 * c + lane, b = active ? width_at(pt, c) : 0;
    const int src = !active ? 0 : pt.perm ? __ldg(pt.perm + k) : k;
    const half w = norm_w ? __ldg(norm_w + src) : half();
    pdl_wait();                                        // x comes from the kernel before
    const size_t row = (size_t)min(m, p.M - 1) * p.K;
    half in;
    if (norm_w) {
        in = stage_norm(x, residual, w, new_residual, p.K, row, src, eps, part == 0 && m < p.M);
        if (!active) return;
    } else {
        in = x[row + src];
    }
    if (up) in = silu_mul(in, up[row + src]);
    const half v = __float2half_rn(__half2float(in) * row_scale(b, lane));
    xs[((size_t)part * R + m) * p.K + k] = v;
    float lo = 0.f, hi = 0.f;                          // rows with (r >> 1) & 1 clear / set
    if (lane >> 1 & 1) hi = __half2float(v); else lo = __half2float(v);
    for (int span = 16; span >= 1; span /= 2) {
        lo += __shfl_xor_sync(FULL_MASK, lo, span);
        hi += __shfl_xor_sync(FULL_MASK, hi, span);
    }
    float2* corr = reinterpret_cast<float2*>(xs + (size_t)p.n_parts * R * p.K);
    if (lane == 0)
        corr[((size_t)part * chunks + c) * R + m] = (b == 4 || b == 6 || b == 8)
                                              ? make_float2(1024.f * (lo + hi), lo + hi / row_scale(b, 2))
                                              : make_float2(0.f, 0.f);
}

// MoE: the experts of one layer (experts[e], a Params in device memory, all with the same parts' shapes and block
// counts) applied to the rows of x routed to them, which the launcher has sorted by expert: rows offsets[e] ..
// offsets[e] + counts[e] - 1 of x [S, K] go through expert e into the same rows of y0 (and y1) [S, n]. Block
// (b, e, z) is block b of expert e for its rows 16z .. 16z + 15 (ROWS per pass: 1 for the m1 kernel, which the
// launcher uses when no expert has more than one row); experts without rows there exit at once, so only the routed
// experts' weights are read, and the launch reads no host value (CUDA-graph safe). Split partials of part i:
// ws[i * ws_part + (split * S + row) * np], arrivals: counters[((e * gridDim.z + z) * MAX_PARTS + i) * strips_max +
// strip] (zero before, zero after).
template <class Fmt, int N8, bool M1>
__device__ __forceinline__ void moe_matmul(const Params* experts, const int* offsets, const int* counts, int S,
                                           const half* x, half* y0, half* y1, float* ws, long long ws_part,
                                           int* counters, int strips_max)
{
    constexpr int ROWS = M1 ? 1 : 8 * N8;
    pdl_wait();                                        // the routing (offsets, counts) comes from earlier kernels
    const int e = blockIdx.y, z = blockIdx.z;
    const int M = min(ROWS, __ldg(counts + e) - ROWS * z);
    if (M <= 0) return;
    const int row0 = __ldg(offsets + e) + ROWS * z;
    const Params& p = experts[e];
    const int pi = part_of(p, blockIdx.x);
    const Part& pt = p.part[pi];
    const int local = blockIdx.x - pt.block0;
    if (local >= pt.col_blocks * pt.n_splits) return;
    matmul_part<Fmt, N8, M1>(p, pt, local, M, x + (size_t)row0 * p.K, (pi == 0 ? y0 : y1) + (size_t)row0 * pt.n,
                             ws ? ws + pi * ws_part + (size_t)row0 * pt.np : ws, S,
                             counters + ((size_t)(e * gridDim.z + z) * MAX_PARTS + pi) * strips_max);
}

// ------------------------------------------------------------------------------------------- dequant

template <class Fmt>
struct DequantSink : NoExtra {
    static constexpr bool PIPELINE = false;
    static constexpr int BATCH = 0;
    half* tile;              // this warp's 32 x TILE_STRIDE halves
    half* w_out;
    const int* perm;
    int Np, strip, lane, g, q;
    GroupScales<Fmt> gs;     // the current group's decode state and column scales

    template <int B>
    __device__ void chunk(const unsigned (&w)[B], int group_key, const typename Fmt::Raw& raw, int c, Extra)
    {
        gs.template enter<B>(group_key, raw, g);
        half2 a[16];
        decode_pairs<B, Fmt>(w, gs.st, a);
#pragma unroll
        for (int p = 0; p < 16; ++p) {
            const int j = p / 4, s = p / 2 % 2, h = p % 2;
            const half2 v = __hmul2(a[p], gs.scale[j]);            // fp16((code - z) * scale): one rounding
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
__device__ __forceinline__ void dequant(const Params& p, half* w_out)
{
    __shared__ __align__(16) half tiles[WARPS][32 * TILE_STRIDE];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const Part& pt = p.part[0];
    const int split = blockIdx.x / pt.col_blocks, strip = blockIdx.x % pt.col_blocks * WARPS + warp;
    Stream st;
    if (strip < pt.strips) {
        start_stream(st, pt, strip, split, lane);
        prefetch_records<Fmt>(pt, strip, split, lane);
    }
    pdl_wait();                                        // w_out may still be read by an earlier kernel
    if (strip >= pt.strips) return;
    DequantSink<Fmt> sink;
    sink.tile = tiles[warp]; sink.w_out = w_out; sink.perm = pt.perm; sink.Np = pt.np; sink.strip = strip;
    sink.lane = lane; sink.g = lane / 4; sink.q = lane % 4;
    walk<Fmt>(pt, strip, split, pt.chunk_meta + pt.split_chunk[split], st, lane, sink);   // chunk_meta via L1
}


// ------------------------------------------------------------------------------------------- GEMM

__device__ __forceinline__ unsigned smem_address(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// 16 bytes from global to shared memory without waiting (sm_80+: cp.async, L2 only); !valid: zeros. Before sm_80 a
// plain copy (the wait and commit below are then no-ops, and the block barrier orders it).
__device__ __forceinline__ void copy_async16(void* dst, const void* src, bool valid)
{
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0) : "memory");
#else
    *static_cast<uint4*>(dst) = valid ? *static_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
#endif
}

__device__ __forceinline__ void copy_async_commit()
{
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void copy_async_wait()
{
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Columns col, col + 1 of row m of y [M, n] (those < n), as one 4-byte store where aligned.
__device__ __forceinline__ void store_pair(half* y, int n, int m, int col, float v0, float v1)
{
    half* out = y + (size_t)m * n + col;
    if (col + 1 < n && n % 2 == 0) {
        *reinterpret_cast<half2*>(out) = __floats2half2_rn(v0, v1);
    } else {
        if (col < n) out[0] = __float2half_rn(v0);
        if (col + 1 < n) out[1] = __float2half_rn(v1);
    }
}

// A GEMM block's place (GEMM KERNELS above): its column tile, M tile and split, and its warp's strip and m16 tiles.
struct GemmTile {
    int split;
    int strip;               // the warp's strip, clamped to the part's last
    bool writes;             // the warp's own strip exists
    int row0, rows;          // the block's x rows [row0, row0 + rows): whole m16 tiles, those >= M zero-filled
    int warp_row0, tiles;    // the warp's first x row and its m16 tiles (0..GEMM_WARP_TILES)

    __device__ GemmTile(const Params& p, const Part& pt, int local, int M, int warp)
    {
        const int R = p.row_groups, strips_per_block = WARPS / R;
        const int col_tile = local % pt.col_blocks, rest = local / pt.col_blocks;
        const int m_tile = rest % p.m_tiles;
        split = rest / p.m_tiles;
        const int own = col_tile * strips_per_block + warp % strips_per_block;
        writes = own < pt.strips;
        strip = min(own, pt.strips - 1);
        const int m16 = (M + 15) / 16, per_tile = (m16 + p.m_tiles - 1) / p.m_tiles;
        const int t0 = min(m16, m_tile * per_tile), t1 = min(m16, t0 + per_tile);
        const int per_warp = (per_tile + R - 1) / R;
        const int w0 = min(t1, t0 + warp / strips_per_block * per_warp);
        row0 = 16 * t0;
        rows = 16 * (t1 - t0);
        warp_row0 = 16 * w0;
        tiles = min(per_warp, t1 - w0);
    }
};

// A tiled block's (GEMM, wgmma) reads before the kernel ahead of it ends: DRAM first (the warp's weight stream and
// group records into L2), the split's chunk_meta into shared memory; then the wait (x and ws belong to that kernel).
template <class Fmt>
__device__ __forceinline__ void tiled_start(const Part& pt, const GemmTile& tile, int c0, int c1, int2* meta_s,
                                            Stream& st, int lane)
{
    start_stream(st, pt, tile.strip, tile.split, lane);
    prefetch_records<Fmt>(pt, tile.strip, tile.split, lane);
    stage_meta(meta_s, pt.chunk_meta, c0, c1);
    pdl_wait();
}

// Multiplies x's rows of the block by the warp's strip, chunk by chunk (walk), staging x through the ring: chunk
// number k of the split is in slot k % GEMM_STAGES; before computing chunk k every thread waits for its own copies
// of it, the barrier makes them visible and frees chunk k - 1's slot, which then receives chunk k + GEMM_STAGES - 1.
template <class Fmt>
struct GemmSink : NoExtra {
    static constexpr bool PIPELINE = false;          // loading the next batch first: slower (docs/gemm.md)
    static constexpr int BATCH = QMM_GEMM_BATCH;     // chunks per batch (walk_run)
    half* ring;
    int slot_halves;
    const half* x;           // [M, K], stored row order
    int K, M, row0, rows, c0, c1;
    int a_offset;            // halves from a slot's start to the row whose address the lane gives ldmatrix
    int tiles;
    int k = 0;               // chunks consumed
    GroupScales<Fmt> gs;     // the current group's decode state and column scales
    float acc[GEMM_WARP_TILES][4][4] = {};    // [m16 tile i][n8 tile j]: rows 16i + g (+8), columns 8j + 2q (+1)

    // Chunk c0 + n into its slot (if the split has it): one commit group per call, also when empty.
    __device__ void stage(int n)
    {
        if (c0 + n < c1) {
            half* slot = ring + (n % GEMM_STAGES) * slot_halves;
            const int col = 32 * (c0 + n);
            for (int i = threadIdx.x; i < rows * 4; i += THREADS) {
                const int r = i / 4, seg = i % 4, m = row0 + r;
                copy_async16(slot + r * GEMM_XS + 8 * seg, x + (size_t)min(m, M - 1) * K + col + 8 * seg, m < M);
            }
        }
        copy_async_commit();
    }

    template <int B>
    __device__ void chunk(const unsigned (&w)[B], int group_key, const typename Fmt::Raw& raw, int, Extra)
    {
        gs.template enter<B>(group_key, raw, threadIdx.x % 32 / 4);
        half2 b[16];
        decode_pairs<B, Fmt>(w, gs.st, b);
#pragma unroll
        for (int p = 0; p < 16; ++p) b[p] = __hmul2(b[p], gs.scale[p / 4]);     // fp16((code - z) * scale), as dequant
        copy_async_wait<GEMM_STAGES - 2>();
        __syncthreads();
        stage(k + GEMM_STAGES - 1);
        const half* xs = ring + (k % GEMM_STAGES) * slot_halves + a_offset;
        ++k;
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
            for (int i = 0; i < GEMM_WARP_TILES; ++i)
                if (i < tiles) {
                    unsigned a[4];
                    ldmatrix_x4(a, xs + 16 * i * GEMM_XS + 16 * s);
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        mma_16816(acc[i][j], a[0], a[1], a[2], a[3], as_bits(b[4 * j + 2 * s]),
                                  as_bits(b[4 * j + 2 * s + 1]));
                }
    }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// ------------------------------------------------------------------------------------------- GEMM by wgmma (sm_90a)
// <fmt>_wgmma (WGMMA KERNELS above): the tiled GEMM's plan, walk and decode, with Hopper's asynchronous warpgroup
// MMA in place of mma.sync. Warps 4h..4h+3 form warpgroup h, which owns the block's strips 4h..4h+3 (128 columns
// = column tiles t = 0, 1 of 64). Per chunk each warp decodes its strip into shared memory (A), and per k16 step s
// and tile t the warpgroup issues one m64n128k16: A = the tile's 64 columns of decoded weights, B = WG_N rows of x
// from the ring (D[column][x row]); both operands by descriptor, so no register is read asynchronously (A from
// registers gave wrong results: docs/gemm.md). Both operands are K-major core matrices of 8 rows x 16 bytes
// (no swizzle): two along K 128 bytes apart (leading byte offset), 512 bytes from one 8-row group to the next
// (stride byte offset).
//   x ring slot (WG_N x 32 halves): [row / 8][k / 8][row % 8][k % 8].
//   A slot (WARPS x WG_A_STRIP bytes): per strip [column / 8][k / 8][column % 8][k % 8], the strip's columns in MMA
//   order (as the small-M kernels' fragments: lane 4g + q decodes pairs (j, s, h) of columns 8j + g, k 16s + 8h + 2q).
constexpr int WG_N = 128;
constexpr int WG_A_STRIP = 4 * 4 * 128;     // bytes of a strip's decoded chunk
#ifndef QMM_WG_PIPELINE                     // 1: the next chunk's words load while this one decodes (walk_run)
#define QMM_WG_PIPELINE 1
#endif
#ifndef QMM_WG_DEPTH                        // chunks of MMAs a warpgroup keeps in flight (slots of decoded A)
#define QMM_WG_DEPTH 2
#endif
#ifndef QMM_WG_STAGES                       // x ring slots: copies run QMM_WG_STAGES - QMM_WG_DEPTH chunks ahead
#define QMM_WG_STAGES 4
#endif
constexpr int WG_DEPTH = QMM_WG_DEPTH, WG_STAGES = QMM_WG_STAGES, WG_AHEAD = WG_STAGES - WG_DEPTH;
constexpr int WG_COPIES = WG_N * 4 / THREADS;   // 16-byte x copies per thread and chunk
static_assert(WG_DEPTH >= 1 && WG_AHEAD >= 1 && WG_N * 4 % THREADS == 0, "wgmma ring");

// The low word of a shared-memory descriptor: start address / 16 (14 bits: shared addresses are below 256 KB) and
// the leading byte offset / 16 at bit 16; the high word is the stride byte offset / 16. Descriptors into one ring
// differ only in the start address, so a chunk's are one low word plus constants.
__device__ __forceinline__ unsigned wg_desc_lo(unsigned addr) { return addr >> 4 | (128 >> 4) << 16; }
__device__ __forceinline__ unsigned long long wg_desc(unsigned lo) { return (unsigned long long)(512 >> 4) << 32 | lo; }

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// d += A (descriptor) x B (descriptor), m64n128k16, fp32 accumulators.
__device__ __forceinline__ void wgmma_128(float (&d)[64], unsigned long long desc_a, unsigned long long desc_b)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(desc_a), "l"(desc_b));
}

// Per chunk k: decode (as GemmSink) into A slot k % WG_DEPTH; once every thread's copies of the chunk's x have
// landed and every warpgroup has waited for its MMAs of chunk k - WG_DEPTH (the barrier), the copies of chunk
// k + WG_AHEAD go to the x slot of chunk k - WG_DEPTH and the chunk's 4 MMAs go out; the warpgroup then waits until
// at most WG_DEPTH - 1 chunks of its MMAs are in flight.
template <class Fmt>
struct WgmmaSink : NoExtra {
    static constexpr bool PIPELINE = QMM_WG_PIPELINE;
    static constexpr int BATCH = 1;
    half* ring;              // WG_STAGES x slots
    unsigned char* aring;    // WG_DEPTH A slots
    const half* x;
    int c0, c1;
    int xoff[WG_COPIES];     // the thread's copies: x offset of their row and 8-column segment (chunk 0)
    unsigned xok;            // bit j: copy j's row is < M (else zeros)
    unsigned a_lo, b_lo;     // descriptor low words: the warpgroup's strips in A slot 0, x slot 0
    int k = 0;               // chunks consumed
    GroupScales<Fmt> gs;     // the current group's decode state and column scales
    float acc[2][64] = {};   // [tile t][4i + 2h + e]: D row (column) 16 (warp % 4) + g + 8h, x row 8i + 2q + e

    // Copy i = threadIdx.x + j THREADS of a chunk: x row row0 + 8 (i / 32) + i % 8, columns 8 (i / 8 % 4) ..
    __device__ void init(int K, int M, int row0)
    {
        xok = 0;
#pragma unroll
        for (int j = 0; j < WG_COPIES; ++j) {
            const int i = threadIdx.x + j * THREADS, m = row0 + 8 * (i / 32) + i % 8;
            xoff[j] = min(m, M - 1) * K + 8 * (i / 8 % 4);
            xok |= (m < M) << j;
        }
        a_lo = wg_desc_lo(smem_address(aring) + threadIdx.x / 128 * 4 * WG_A_STRIP);
        b_lo = wg_desc_lo(smem_address(ring));
    }

    // Chunk c0 + n into slot n % WG_STAGES: one commit group per call, also when empty.
    __device__ void stage(int n)
    {
        if (c0 + n < c1) {
            half* slot = ring + (n % WG_STAGES) * (WG_N * 32) + 8 * threadIdx.x;
            const half* src = x + 32 * (c0 + n);
#pragma unroll
            for (int j = 0; j < WG_COPIES; ++j) copy_async16(slot + 8 * j * THREADS, src + xoff[j], xok >> j & 1);
        }
        copy_async_commit();
    }

    template <int B>
    __device__ void chunk(const unsigned (&w)[B], int group_key, const typename Fmt::Raw& raw, int, Extra)
    {
        gs.template enter<B>(group_key, raw, threadIdx.x % 32 / 4);
        half2 a[16];
        decode_pairs<B, Fmt>(w, gs.st, a);
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        // pair p = (j, s, h) of lane 4g + q: core matrix (j, 2s + h) of the strip, row g, bytes 4q..
        unsigned char* as = aring + (k % WG_DEPTH) * (WARPS * WG_A_STRIP) + warp * WG_A_STRIP + lane / 4 * 16 +
                            lane % 4 * 4;
#pragma unroll
        for (int p = 0; p < 16; ++p)                                      // fp16((code - z) * scale), as dequant
            *reinterpret_cast<half2*>(as + (p / 4 * 4 + p / 2 % 2 * 2 + p % 2) * 128) = __hmul2(a[p], gs.scale[p / 4]);
        copy_async_wait<WG_AHEAD - 1>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // A and the copies, to wgmma's async proxy
        __syncthreads();
        stage(k + WG_AHEAD);               // (after the MMAs: 6 % slower, docs/gemm.md)
        // tile t: strips 4h + 2t, 4h + 2t + 1 (64 columns = 8 core-matrix rows 512 bytes apart)
        const unsigned ad = a_lo + (k % WG_DEPTH) * (WARPS * WG_A_STRIP >> 4);
        const unsigned bd = b_lo + (k % WG_STAGES) * (WG_N * 64 >> 4);
        wg_fence();
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
            for (int t = 0; t < 2; ++t)
                wgmma_128(acc[t], wg_desc(ad + (2 * t * WG_A_STRIP + 256 * s >> 4)), wg_desc(bd + 16 * s));
        wg_commit();
        ++k;
        wg_wait<WG_DEPTH - 1>();
    }
};

// Block `local` of part pt: as gemm_part, for a plan of one row group and one M tile of at most WG_N rows.
template <class Fmt>
__device__ __forceinline__ void wgmma_part(const Params& p, const Part& pt, int local, int M, const half* x, half* y,
                                           float* ws)
{
    extern __shared__ __align__(16) unsigned char smem[];
    int2* meta_s = reinterpret_cast<int2*>(smem);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const GemmTile tile(p, pt, local, M, warp);
    const int c0 = pt.split_chunk[tile.split], c1 = pt.split_chunk[tile.split + 1];
    Stream st;
    tiled_start<Fmt>(pt, tile, c0, c1, meta_s, st, lane);

    WgmmaSink<Fmt> sink;
    sink.ring = reinterpret_cast<half*>(smem + p.ring_smem);
    sink.aring = smem + p.ring_smem + WG_STAGES * WG_N * 64;
    sink.x = x;
    sink.c0 = c0; sink.c1 = c1;
    sink.init(p.K, M, tile.row0);
#pragma unroll
    for (int n = 0; n < WG_AHEAD; ++n) sink.stage(n);
    __syncthreads();                                   // meta_s
    walk<Fmt>(pt, tile.strip, tile.split, meta_s, st, lane, sink);
    wg_wait<0>();
    copy_async_wait<0>();

    const int N = pt.n, Np = pt.np;
    float* part = pt.n_splits > 1 ? ws + (size_t)tile.split * M * Np : nullptr;
    // D row 16 (warp % 4) + g + 8h of tile t: strip 4 (warp / 4) + 2t + warp % 4 / 2 of the block
    const int strip0 = local % pt.col_blocks * WARPS;
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int i = 0; i < WG_N / 8; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int strip = strip0 + warp / 4 * 4 + 2 * t + warp % 4 / 2;
                    const int col = strip * 32 + warp % 2 * 16 + 8 * h + g;
                    const int r = 8 * i + 2 * q + e, m = tile.row0 + r;
                    if (r >= tile.rows || m >= M || strip >= pt.strips) continue;
                    const float v = sink.acc[t][4 * i + 2 * h + e];
                    if (part)
                        part[(size_t)m * Np + col] = v;
                    else if (col < N)
                        y[(size_t)m * N + col] = __float2half_rn(v + bias_at(pt.bias, col));
                }
}

template <class Fmt>
__device__ __forceinline__ void wgmma(const Params& p, int M, const half* x0, const half* x1, const half* x2,
                                      half* y0, half* y1, half* y2, float* ws)
{
    const int pi = part_of(p, blockIdx.x);
    const Part& pt = p.part[pi];
    wgmma_part<Fmt>(p, pt, blockIdx.x - pt.block0, M, pi == 0 ? x0 : pi == 1 ? x1 : x2,
                    pi == 0 ? y0 : pi == 1 ? y1 : y2, ws ? ws + (size_t)pt.ws_offset * M : ws);
}
#endif

// Block `local` of part pt: y [M, pt.n] (+ bias) = x [M, K] (stored order) @ W^T, or its split's fp32 partials to
// ws (this part's, [n_splits][M][Np]).
template <class Fmt>
__device__ __forceinline__ void gemm_part(const Params& p, const Part& pt, int local, int M, const half* x, half* y,
                                          float* ws)
{
    extern __shared__ __align__(16) unsigned char smem[];
    int2* meta_s = reinterpret_cast<int2*>(smem);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const GemmTile tile(p, pt, local, M, warp);
    const int c0 = pt.split_chunk[tile.split], c1 = pt.split_chunk[tile.split + 1];
    Stream st;
    tiled_start<Fmt>(pt, tile, c0, c1, meta_s, st, lane);

    GemmSink<Fmt> sink;
    sink.ring = reinterpret_cast<half*>(smem + p.ring_smem);
    sink.slot_halves = 16 * GEMM_WARP_TILES * p.row_groups * GEMM_XS;
    sink.x = x;
    sink.K = p.K; sink.M = M; sink.row0 = tile.row0; sink.rows = tile.rows; sink.c0 = c0; sink.c1 = c1;
    sink.a_offset = (tile.warp_row0 - tile.row0 + lane % 16) * GEMM_XS + 8 * (lane / 16);   // ldmatrix_x4's rows
    sink.tiles = tile.tiles;
#pragma unroll
    for (int n = 0; n < GEMM_STAGES - 1; ++n) sink.stage(n);
    __syncthreads();                                   // meta_s
    walk<Fmt>(pt, tile.strip, tile.split, meta_s, st, lane, sink);
    copy_async_wait<0>();
    if (!tile.writes) return;

    const int N = pt.n, Np = pt.np;
    float* part = pt.n_splits > 1 ? ws + (size_t)tile.split * M * Np : nullptr;
#pragma unroll
    for (int i = 0; i < GEMM_WARP_TILES; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int m = tile.warp_row0 + 16 * i + g + 8 * e, col = tile.strip * 32 + 8 * j + 2 * q;
                if (i >= tile.tiles || m >= M) continue;
                const float v0 = sink.acc[i][j][2 * e], v1 = sink.acc[i][j][2 * e + 1];
                if (part)
                    *reinterpret_cast<float2*>(part + (size_t)m * Np + col) = make_float2(v0, v1);
                else
                    store_pair(y, N, m, col, v0 + (col < N ? bias_at(pt.bias, col) : 0.f),
                               v1 + (col + 1 < N ? bias_at(pt.bias, col + 1) : 0.f));
            }
}

template <class Fmt>
__device__ __forceinline__ void gemm(const Params& p, int M, const half* x0, const half* x1, const half* x2,
                                     half* y0, half* y1, half* y2, float* ws)
{
    const int pi = part_of(p, blockIdx.x);
    const Part& pt = p.part[pi];
    gemm_part<Fmt>(p, pt, blockIdx.x - pt.block0, M, pi == 0 ? x0 : pi == 1 ? x1 : x2,
                   pi == 0 ? y0 : pi == 1 ? y1 : y2, ws ? ws + (size_t)pt.ws_offset * M : ws);
}

// Part blockIdx.y's split partials of the GEMM summed in split order (deterministic), plus bias, into y.
__device__ __forceinline__ void gemm_reduce(const Params& p, int M, half* y0, half* y1, half* y2, const float* ws)
{
    pdl_wait();                                        // ws is the GEMM's, just before
    const int pi = blockIdx.y;
    const Part& pt = p.part[pi];
    const int pairs = pt.np / 2, idx = blockIdx.x * THREADS + threadIdx.x;
    if (pt.n_splits == 1 || idx >= M * pairs) return;
    const int m = idx / pairs, col = 2 * (idx % pairs);
    if (col >= pt.n) return;
    const float* part = ws + (size_t)pt.ws_offset * M + (size_t)m * pt.np + col;
    float2 sum = make_float2(0.f, 0.f);
#pragma unroll 8
    for (int s = 0; s < pt.n_splits; ++s) {
        const float2 v = __ldcg(reinterpret_cast<const float2*>(part + (size_t)s * M * pt.np));
        sum.x += v.x;
        sum.y += v.y;
    }
    store_pair(pi == 0 ? y0 : pi == 1 ? y1 : y2, pt.n, m, col, sum.x + bias_at(pt.bias, col),
               sum.y + (col + 1 < pt.n ? bias_at(pt.bias, col + 1) : 0.f));
}

// The stored row (chunk row 16s + r) of MMA k index 16s + k: the lane layout gives lane 4g + q the weights of chunk
// rows 4q, 4q + 1 as B[2q..2q+1] and rows 4q + 2, 4q + 3 as B[2q+8..2q+9] (LANE LAYOUT), so x's columns are put in
// that order and ldmatrix's A fragments (A[g][2q..2q+1], A[g][2q+8..2q+9]) match them.
EXL_HD int gemm_k_row(int k)
{
    const int r = k % 16;
    return k - r + 4 * (r % 8 / 2) + 2 * (r / 8) + r % 2;
}

// Row blockIdx.x of x [M, K] for part blockIdx.y's GEMM: xp[part][m][k] = v[m][perm[gemm_k_row(k)]], through the
// row in shared memory (coalesced reads and writes). v is x, or what the op before the GEMM makes of it, as stage_xs
// applies it (so that the op needs no launch of its own): with norm_w the add_rmsnorm (residual non-null) or rmsnorm
// of x, part 0's blocks writing the new residual; with up the gated MLP's silu_mul (after the norm, if both). Each
// thread takes 8 consecutive elements at a time, as 16-byte vectors (x, up, residual, norm_w, new_residual and xp
// 16-byte aligned: the launcher sees to it; K a multiple of 32, as every lane layout's), the vectors residual_row
// gives it: with few blocks (M x parts), a thread's chain of one-element loads and stores set the time (1.23 ms
// over a cached-prefix first token's 128 launches, 0.85 ms so, on the H200). The perm entries of a thread's first
// PERMUTE_AHEAD output vectors (K <= 14,336: all) are read before pdl_wait, off the chain of dependent loads: that
// step's GPU time 9.9 -> 9.2-9.3 ms (several blocks a row, each gathering from global memory: 9.6; BENCHMARKS.md).
constexpr int PERMUTE_AHEAD = 7;

// The 8 rows of x that output vector o of permute_x gathers: xp's k = 8o + j is chunk row base + 4 (j / 2) +
// 2 half + j % 2 (gemm_k_row), half = which 8 of the 16.
__device__ __forceinline__ void permute_sources(const int* perm, int o, int (&src)[8])
{
    const int base = 8 * o - 8 * o % 16, half_ = o % 2;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int r = base + 4 * (j / 2) + 2 * half_ + j % 2;
        src[j] = perm ? __ldg(perm + r) : r;
    }
}

__device__ __forceinline__ uint4 gather_vector(const half* row_s, const int (&src)[8])
{
    uint4 v;
    half* h = reinterpret_cast<half*>(&v);
#pragma unroll
    for (int j = 0; j < 8; j++) h[j] = row_s[src[j]];
    return v;
}

__device__ __forceinline__ void permute_x(const Params& p, int M, const half* x, const half* up, const half* residual,
                                          const half* norm_w, half* new_residual, float eps, half* xp)
{
    extern __shared__ __align__(16) half row_s[];
    const int K = p.K, m = blockIdx.x;
    const int* perm = p.part[blockIdx.y].perm;
    const size_t at = (size_t)m * K;
    int ahead[PERMUTE_AHEAD][8];
#pragma unroll
    for (int a = 0; a < PERMUTE_AHEAD; a++)
        if (threadIdx.x + a * THREADS < K / 8) permute_sources(perm, threadIdx.x + a * THREADS, ahead[a]);
    pdl_wait();                                        // x is an earlier kernel's
    const float inv_rms = norm_w ? residual_row(x, residual, K, at, eps) : 0.f;
    for (int i = threadIdx.x * 8; i < K; i += THREADS * 8) {
        uint4 v = norm_w ? *reinterpret_cast<const uint4*>(row_s + i) : __ldg(reinterpret_cast<const uint4*>(x + at + i));
        half* h = reinterpret_cast<half*>(&v);
        if (norm_w) {
            if (residual && blockIdx.y == 0) *reinterpret_cast<uint4*>(new_residual + at + i) = v;
            const uint4 wv = __ldg(reinterpret_cast<const uint4*>(norm_w + i));
            const half* w = reinterpret_cast<const half*>(&wv);
#pragma unroll
            for (int j = 0; j < 8; j++) h[j] = normalise(h[j], w[j], inv_rms);
        }
        if (up) {
            const uint4 uv = __ldg(reinterpret_cast<const uint4*>(up + at + i));
            const half* u = reinterpret_cast<const half*>(&uv);
#pragma unroll
            for (int j = 0; j < 8; j++) h[j] = silu_mul(h[j], u[j]);
        }
        *reinterpret_cast<uint4*>(row_s + i) = v;      // (the same thread's elements as residual_row's)
    }
    __syncthreads();
    uint4* out = reinterpret_cast<uint4*>(xp + ((size_t)blockIdx.y * M + m) * K);
#pragma unroll
    for (int a = 0; a < PERMUTE_AHEAD; a++)
        if (threadIdx.x + a * THREADS < K / 8) out[threadIdx.x + a * THREADS] = gather_vector(row_s, ahead[a]);
    for (int o = threadIdx.x + PERMUTE_AHEAD * THREADS; o < K / 8; o += THREADS) {
        int src[8];
        permute_sources(perm, o, src);
        out[o] = gather_vector(row_s, src);
    }
}

}  // namespace qmm

// ------------------------------------------------------------------------------------------- entry points

// Blocks per SM the register budget is fitted to (quant_matmul.RESIDENT_BLOCKS): M1 2, up to 128 registers (it ran
// at 3, 80 registers, until its pipelined batches needed more; 2 blocks measured faster even without them, and 4 no
// faster); M8 and M16 1 (168-247 registers, pipelined: 8-25 % faster than 2 blocks unpipelined; docs/decode-matmul.md
// v25). QMM_M1_BLOCKS: for benchmarks/tune_matmul.py.
// ys: the parts' outputs [M, part.n] fp16; ws: split partials (fp32, see Part.ws_offset), unused without splits.
#define QMM_MATMUL(NAME, FMT, N8, M1, BLOCKS_PER_SM)                                                                   \
    extern "C" __global__ void __launch_bounds__(qmm::THREADS, BLOCKS_PER_SM)                                          \
    NAME(const __grid_constant__ qmm::Params p, const half* x, half* y0, half* y1, half* y2, float* ws)              \
    {                                                                                                                  \
        exl::pdl_trigger();                                                                                           \
        qmm::matmul<FMT, N8, M1>(p, x, y0, y1, y2, ws);                                                                \
    }

#ifndef QMM_M1_BLOCKS
#define QMM_M1_BLOCKS 2
#endif
QMM_MATMUL(exl2_matmul_m1, qmm::Exl2, 1, true, QMM_M1_BLOCKS)
QMM_MATMUL(exl2_matmul_m8, qmm::Exl2, 1, false, 1)
QMM_MATMUL(exl2_matmul_m16, qmm::Exl2, 2, false, 1)
QMM_MATMUL(gptq_matmul_m1, qmm::Gptq, 1, true, QMM_M1_BLOCKS)
QMM_MATMUL(gptq_matmul_m8, qmm::Gptq, 1, false, 1)
QMM_MATMUL(gptq_matmul_m16, qmm::Gptq, 2, false, 1)

// MoE (qmm::moe_matmul): grid (blocks per expert, experts, passes of 1 or 16 rows), block 256, dynamic shared memory
// as the experts' plans say. experts: Params [E] in device memory (parts w1, w3 or w2 of each expert).
#define QMM_MOE(NAME, FMT, N8, M1, BLOCKS_PER_SM)                                                                      \
    extern "C" __global__ void __launch_bounds__(qmm::THREADS, BLOCKS_PER_SM)                                          \
    NAME(const qmm::Params* experts, const int* offsets, const int* counts, int S, const half* x, half* y0,          \
         half* y1, float* ws, long long ws_part, int* counters, int strips_max)                                      \
    {                                                                                                                  \
        exl::pdl_trigger();                                                                                           \
        qmm::moe_matmul<FMT, N8, M1>(experts, offsets, counts, S, x, y0, y1, ws, ws_part, counters, strips_max);     \
    }

QMM_MOE(exl2_moe_m1, qmm::Exl2, 1, true, QMM_M1_BLOCKS)
QMM_MOE(exl2_moe_m16, qmm::Exl2, 2, false, 2)
QMM_MOE(gptq_moe_m1, qmm::Gptq, 1, true, QMM_M1_BLOCKS)
QMM_MOE(gptq_moe_m16, qmm::Gptq, 2, false, 2)

// w_out: W^T [K, Np] fp16 in original row order. 3 blocks per SM (quant_matmul.DEQUANT_RESIDENT).
#define QMM_DEQUANT(NAME, FMT)                                                                                         \
    extern "C" __global__ void __launch_bounds__(qmm::THREADS, 3)                                                      \
    NAME(const __grid_constant__ qmm::Params p, half* w_out)                                                          \
    {                                                                                                                  \
        exl::pdl_trigger();                                                                                           \
        qmm::dequant<FMT>(p, w_out);                                                                                   \
    }

QMM_DEQUANT(exl2_dequant, qmm::Exl2)
QMM_DEQUANT(gptq_dequant, qmm::Gptq)

// GEMM (qmm::gemm, GEMM KERNELS above): grid (the parts' blocks), block 256, dynamic shared memory as the plan says.
// M: rows of x; x_i: part i's x [M, K] in its stored row order; ws: split partials (fp32), or null without splits.
// QMM_GEMM_BLOCKS: blocks per SM (quant_matmul.GEMM_RESIDENT); at 2, 128 registers with a few bytes of spills
// (EXL2 12, GPTQ 60 on sm_90), at 1 ~185 registers without.
#ifndef QMM_GEMM_BLOCKS
#define QMM_GEMM_BLOCKS 2
#endif
#define QMM_GEMM(NAME, FMT)                                                                                            \
    extern "C" __global__ void __launch_bounds__(qmm::THREADS, QMM_GEMM_BLOCKS)                                        \
    NAME(const __grid_constant__ qmm::Params p, int M, const half* x0, const half* x1, const half* x2, half* y0,     \
         half* y1, half* y2, float* ws)                                                                                \
    {                                                                                                                  \
        exl::pdl_trigger();                                                                                           \
        qmm::gemm<FMT>(p, M, x0, x1, x2, y0, y1, y2, ws);                                                              \
    }

QMM_GEMM(exl2_gemm, qmm::Exl2)
QMM_GEMM(gptq_gemm, qmm::Gptq)

// The GEMM by wgmma (qmm::wgmma): arguments and shared memory as the GEMM's, one block per SM (~255 registers). Only
// an sm_90a build has its body (the loader compiles for sm_90a on compute capability 9.0, and the launcher calls it
// only there); elsewhere it traps.
#define QMM_WGMMA(NAME, FMT)                                                                                           \
    extern "C" __global__ void __launch_bounds__(qmm::THREADS, 1)                                                      \
    NAME(const __grid_constant__ qmm::Params p, int M, const half* x0, const half* x1, const half* x2, half* y0,     \
         half* y1, half* y2, float* ws)                                                                                \
    {                                                                                                                  \
        QMM_WGMMA_BODY(FMT)                                                                                           \
    }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QMM_WGMMA_BODY(FMT) exl::pdl_trigger(); qmm::wgmma<FMT>(p, M, x0, x1, x2, y0, y1, y2, ws);
#else
#define QMM_WGMMA_BODY(FMT) __trap();
#endif

QMM_WGMMA(exl2_wgmma, qmm::Exl2)
QMM_WGMMA(gptq_wgmma, qmm::Gptq)

// grid (ceil(M * max Np / 512), parts), block 256: the GEMM's split partials summed into y (qmm::gemm_reduce).
extern "C" __global__ void __launch_bounds__(qmm::THREADS)
gemm_reduce(const __grid_constant__ qmm::Params p, int M, half* y0, half* y1, half* y2, const float* ws)
{
    exl::pdl_trigger();
    qmm::gemm_reduce(p, M, y0, y1, y2, ws);
}

// grid (M, parts), block 256, dynamic shared memory 2K bytes: x (or the op before's result, as stage_xs) in each
// part's stored row order (qmm::permute_x).
// grid (ceil(K / 32 / 8), parts, 1 / 8 / 16 staged rows), block 256: x (or silu(x) * up, or the add_rmsnorm of x)
// staged for the small-M kernels (qmm::stage_xs); dynamic shared memory 2K bytes with norm_w, else none.
extern "C" __global__ void __launch_bounds__(qmm::THREADS)
stage_xs(const __grid_constant__ qmm::Params p, const half* x, const half* up, const half* residual,
         const half* norm_w, half* new_residual, float eps, half* xs)
{
    exl::pdl_trigger();
    qmm::stage_xs(p, x, up, residual, norm_w, new_residual, eps, xs);
}

extern "C" __global__ void __launch_bounds__(qmm::THREADS)
permute_x(const __grid_constant__ qmm::Params p, int M, const half* x, const half* up, const half* residual,
          const half* norm_w, half* new_residual, float eps, half* xp)
{
    exl::pdl_trigger();
    qmm::permute_x(p, M, x, up, residual, norm_w, new_residual, eps, xp);
}

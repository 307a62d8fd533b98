// qmm_tiled.cuh: what the two tiled GEMMs (gemm.cu: mma.sync, wgmma.cu: sm_90a) share: cp.async copies, a
// block's tile and split (GemmTile, tiled_start), pair stores, and the MMA k order of x's columns (gemm_k_row).
//
#pragma once
#include "qmm.cuh"

namespace qmm {

using namespace exl;

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

// The stored row (chunk row 16s + r) of MMA k index 16s + k: the lane layout gives lane 4g + q the weights of chunk
// rows 4q, 4q + 1 as B[2q..2q+1] and rows 4q + 2, 4q + 3 as B[2q+8..2q+9] (LANE LAYOUT), so x's columns are put in
// that order and ldmatrix's A fragments (A[g][2q..2q+1], A[g][2q+8..2q+9]) match them.
EXL_HD int gemm_k_row(int k)
{
    const int r = k % 16;
    return k - r + 4 * (r % 8 / 2) + 2 * (r / 8) + r % 2;
}

}  // namespace qmm

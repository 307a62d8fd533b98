"""Launcher of the quantized-matmul kernel families: y = x @ W^T (+ bias) for EXL2 and GPTQ weights on CUDA.

The kernels, one .cu per family beside this file (FAMILIES below), share their device code in qmm.cuh (launch
parameters, weight stream, walk), dequant.cuh (the lane layout's decode), qmm_rows.cuh and qmm_tiled.cuh. The MoE
family's launcher is matmul_moe.py.

`prepare(weight, bias)` runs once per layer: it repacks the packed weight into the kernels' lane layout (described at
the top of dequant.cuh, built by lane_layout.py), plans how each launch cuts K, and returns the forward. `fuse(kernels)` joins forwards that share x (q/k/v, gate/up) into one
that runs them in one launch per pass. Per call the forward only allocates its outputs (and, for split K with more
than one row of x, an fp32 partial-sum buffer; the GEMM also x in stored row order) through torch's caching
allocator and launches: no host sync, nothing compiled or queried, so a warmed-up forward can be captured in a CUDA
graph.

Below LARGE_M rows of x, the small-M kernel reads each packed word once per 16 rows of x; from LARGE_M to GEMM_MAX_M
rows the tiled GEMM reads and decodes it once per M tile (up to 128 rows) and multiplies on tensor cores; above that
the weight is dequantized to an fp16 scratch (bit-exact with the reference) and multiplied by cuBLAS. The path is
chosen per call from the number of rows alone."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from ..errors import DeviceError
from ..formats.exl2 import Exl2Weight
from ..formats.gptq import GptqWeight
from . import activation, megakernel, norm
from .lane_layout import STRIP, WIDTHS, Format, LaneLayout, layout_for
from .loader import aligned, cluster_slots, compute_capability, launch
from .planning import (CHUNK, CLUSTER_CC, CLUSTER_SIZES, MAX_SPLITS, WARPS, Lazy, choose_splits, cluster_size,
                       clustered_splits, rows_class, small_blocks, split_starts, x_tile)

THREADS = WARPS * 32
MAX_PARTS = 3                   # weights per launch (qmm.cuh MAX_PARTS)

ROWS_PER_PASS = 16              # rows of x one small-M launch handles (two 8-row MMA tiles)
# stage_xs's arguments (up, residual, norm_w, new_residual, eps) that stage x as it is; QuantMatmul.forward and
# forward_normed pass others, which apply the gated MLP's activation or the block's norm to x as it is staged
PLAIN = (None, None, None, None, 0.0)
STAGE_NORM_SMEM = 48 * 1024     # shared memory stage_xs may keep a row in (the default limit, no opt-in)
# Routing by rows of x (crossovers measured on the H200: docs/gemm.md, "Routing"): from LARGE_M rows the tiled GEMM
# (17..32 rows would cost the small-M kernel two passes over the weight); up to GEMM_MAX_M, then dequantize + cuBLAS;
# on compute capability 9.0 (sm_90a) rows WGMMA_MIN_M..WGMMA_MAX_M take the GEMM by wgmma (one M tile, one block
# per SM; below 65 rows the mma.sync GEMM wins or ties).
LARGE_M = 17
GEMM_MAX_M = 96
WGMMA_MIN_M = 65
WGMMA_MAX_M = 128
WGMMA_ROWS = 128                # x rows of a wgmma block (wgmma.cu WG_N)
WGMMA_STAGES = 4                # x chunks in flight per wgmma block (wgmma.cu QMM_WG_STAGES)
WGMMA_DEPTH = 2                 # chunks of MMAs in flight per warpgroup: slots of decoded A (QMM_WG_DEPTH)
GEMM_ROWS_LIMIT = 512           # the most rows QuantMatmul._gemm is planned for (benchmarks time past GEMM_MAX_M)
GEMM_WARP_ROWS = 64             # rows of x per GEMM warp (qmm.cuh GEMM_WARP_TILES m16 tiles)
# Warps per strip above GEMM_WARP_ROWS rows: 2 gives blocks of 128 columns x 128 rows (each weight decoded by both
# warps of its strip), 1 blocks of 256 columns x 64 rows (half the x read from L2 per FLOP, M tiles of 64 rows):
# tune_matmul.py --set GEMM_ROW_GROUPS=1,GEMM_ROW_GROUPS=2 compares
GEMM_ROW_GROUPS = 2
GEMM_STAGES = 4                 # x chunks in flight per GEMM block (qmm.cuh GEMM_STAGES)
GEMM_XS = 40                    # halves per x row of a ring slot (qmm.cuh GEMM_XS)
# GEMM blocks per SM (launch bounds QMM_GEMM_BLOCKS: 128 registers, a few bytes of spills; at 1 block ~185 without:
# tune_matmul.py --defines QMM_GEMM_BLOCKS=1 compares); K is split until a launch fills one wave of them
GEMM_RESIDENT = 2
GEMM_MIN_CHUNKS = 8             # chunks per split at least: fewer would not fill the ring's pipeline
MOE_RESIDENT_BLOCKS = {1: 2, 16: 2}     # the MoE kernels' (their 16-row one gathers x per block, unpipelined)
DEQUANT_RESIDENT = 3            # blocks per SM of the dequant kernels (up to 80 registers, 20 KB shared)


MATMUL_KERNELS = {   # (format, rows-of-x class) -> entry point of matmul_rows.cu
    (Format.EXL2, 1): "exl2_matmul_m1", (Format.EXL2, 8): "exl2_matmul_m8", (Format.EXL2, 16): "exl2_matmul_m16",
    (Format.GPTQ, 1): "gptq_matmul_m1", (Format.GPTQ, 8): "gptq_matmul_m8", (Format.GPTQ, 16): "gptq_matmul_m16",
}
DEQUANT_KERNELS = {Format.EXL2: "exl2_dequant", Format.GPTQ: "gptq_dequant"}
GEMM_KERNELS = {Format.EXL2: "exl2_gemm", Format.GPTQ: "gptq_gemm"}
WGMMA_KERNELS = {Format.EXL2: "exl2_wgmma", Format.GPTQ: "gptq_wgmma"}
WGMMA_CC = (9, 0)               # the compute capability the loader compiles sm_90a for (loader.arch)
MOE_KERNELS = {   # (format, rows per pass) -> MoE entry point of matmul_moe.cu (qmm::moe_matmul)
    (Format.EXL2, 1): "exl2_moe_m1", (Format.EXL2, 16): "exl2_moe_m16",
    (Format.GPTQ, 1): "gptq_moe_m1", (Format.GPTQ, 16): "gptq_moe_m16",
}
FAMILIES = {     # kernel family (<family>.cu) -> its entry points
    "matmul_rows": (*MATMUL_KERNELS.values(), "stage_xs"),
    "matmul_moe": tuple(MOE_KERNELS.values()),
    "gemm": (*GEMM_KERNELS.values(), "permute_x", "gemm_reduce"),
    "wgmma": tuple(WGMMA_KERNELS.values()),
    "dequant": tuple(DEQUANT_KERNELS.values()),
    "lane_layout": ("exl2_lane_words",),
}
FAMILY = {kernel: family for family, kernels in FAMILIES.items() for kernel in kernels}

# qmm.cuh's Part and Params (launch parameters, passed by value); a host test checks the offsets.
PART_DTYPE = np.dtype([
    ("qw", np.uint64), ("chunk_meta", np.uint64), ("meta0", np.uint64), ("meta1", np.uint64), ("perm", np.uint64),
    ("bias", np.uint64), ("counters", np.uint64),
    ("n", np.int32), ("np", np.int32), ("strips", np.int32), ("words_per_strip", np.int32),
    ("n_groups", np.int32), ("n_splits", np.int32), ("block0", np.int32), ("col_blocks", np.int32),
    ("ws_offset", np.int32), ("run_start", np.int32, (len(WIDTHS) + 1,)), ("run_word", np.int32, (len(WIDTHS),)),
    ("split_word", np.int32, (MAX_SPLITS + 1,)),
    ("split_chunk", np.int16, (MAX_SPLITS + 1,)), ("split_group", np.int16, (MAX_SPLITS + 1,))], align=True)
PARAMS_DTYPE = np.dtype([("part", PART_DTYPE, (MAX_PARTS,)), ("n_parts", np.int32), ("M", np.int32),
                         ("K", np.int32), ("xs_stride", np.int32), ("meta_smem", np.int32),
                         ("corr_smem", np.int32), ("row_groups", np.int32), ("m_tiles", np.int32),
                         ("ring_smem", np.int32)], align=True)
# qmm.cuh's Chain: what a one-row launch does at its end besides y (qmm_rows.cuh STAGE-FREE NORM; zeros: y alone)
CHAIN_DTYPE = np.dtype([("x", np.uint64), ("places", np.uint64, (MAX_PARTS,)), ("residual", np.uint64),
                        ("new_residual", np.uint64), ("w", np.uint64), ("sums", np.uint64), ("sums_in", np.uint64),
                        ("eps", np.float32), ("unscale", np.float32), ("n_places", np.int32), ("dim", np.int32),
                        ("gated", np.int32)], align=True)
NO_CHAIN = np.zeros((), CHAIN_DTYPE)


# ----------------------------------------------------------------------------------------------- planning



@dataclass(frozen=True)
class Plan:
    """One launch: kernel, grid, shared memory, and its Params (by value) with the ws it needs."""
    kernel: str
    blocks: int
    smem: int
    params: np.ndarray       # 0-d PARAMS_DTYPE
    ws_floats: int           # fp32 split partials the launch needs (0: none); GEMM plans: per row of x
    threads: int = THREADS   # per block (small-M plans: 32 per strip of a block)
    cluster: int = 1         # blocks per thread-block cluster (planning.cluster_size; 1: none)

    def arg(self) -> np.ndarray:
        """The Params as a kernel argument (the loader passes the struct's bytes by value)."""
        return self.params


def _ptr(t: Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def make_plan(kernel: str, layouts: list[LaneLayout], biases: list[Tensor | None], counters: list[Tensor],
              splits: list[int], rows: int, strips_per_block: int = WARPS) -> Plan:
    p = np.zeros((), PARAMS_DTYPE)
    block0, ws, starts_all = _fill_parts(p, layouts, biases, counters, splits, strips_per_block, 1, rows)
    p["n_parts"], p["M"], p["K"] = len(layouts), rows, layouts[0].k
    smem = 0
    if rows:                                  # the part with the longest split sets both sizes (_tile_bytes)
        p["xs_stride"] = max(x_tile(s, rows)[0] for s in starts_all)
        p["meta_smem"] = -(-rows * int(p["xs_stride"]) * 2 // 16) * 16
        chunks = max(b - a for s in starts_all for a, b in zip(s, s[1:]))
        p["corr_smem"] = int(p["meta_smem"]) + 8 * chunks
        smem = int(p["corr_smem"]) + 8 * chunks * rows
    return Plan(kernel, block0, smem, p, ws, 32 * strips_per_block)


def _fill_parts(p: np.ndarray, layouts: list[LaneLayout], biases: list[Tensor | None], counters: list[Tensor | None],
                splits: list[int], strips_per_block: int, m_tiles: int, ws_rows: int) -> tuple[int, int, list]:
    """The parts of Params p: pointers, shapes, split tables; part i's blocks are col_blocks * m_tiles * splits
    (column tiles of strips_per_block strips) from block0, its partials n_splits * ws_rows * np floats from
    ws_offset. Returns (blocks, ws floats, each part's split starts)."""
    part = p["part"]
    block0 = ws = 0
    starts_all = []
    for i, (lay, bias, cnt, n) in enumerate(zip(layouts, biases, counters, splits)):
        starts = split_starts(lay.chunk_bits, n)
        starts_all.append(starts)
        col_blocks = -(-lay.strips // strips_per_block)
        for name, value in (("qw", _ptr(lay.words)), ("chunk_meta", _ptr(lay.chunk_meta)), ("meta0", _ptr(lay.meta0)),
                            ("meta1", _ptr(lay.meta1)), ("perm", _ptr(lay.perm)), ("bias", _ptr(bias)),
                            ("counters", _ptr(cnt)), ("n", lay.n), ("np", lay.np_), ("strips", lay.strips),
                            ("words_per_strip", lay.words_per_strip), ("n_groups", lay.n_groups), ("n_splits", n),
                            ("block0", block0), ("col_blocks", col_blocks), ("ws_offset", ws)):
            part[name][i] = value
        part["run_start"][i] = lay.run_start
        words = np.cumsum([0] + [32 * b for b in lay.chunk_bits])          # word offset of each chunk in a strip
        part["run_word"][i] = words[lay.run_start[:-1]]
        part["split_word"][i, :n + 1] = words[starts]
        part["split_chunk"][i, :n + 1] = starts
        part["split_group"][i, :n + 1] = [lay.chunk_group[min(c, len(lay.chunk_group) - 1)] for c in starts]
        block0 += col_blocks * m_tiles * n
        ws += n * ws_rows * lay.np_ if n > 1 else 0
    return block0, ws, starts_all


def _check_fp16(*tensors: Tensor | None) -> None:
    for t in tensors:
        if t is not None and t.dtype != torch.float16:
            raise DeviceError(f"the CUDA quantized matmul takes fp16 activations, got {t.dtype}; load the model "
                              f"with dtype=torch.float16")


def plan_small(layouts: list[LaneLayout], biases: list[Tensor | None], counters: list[Tensor], rows: int,
               n_sm: int, slots: dict[int, int]) -> Plan:
    """The small-M launch for `rows` rows of x, which stage_xs stages; in clusters where its splits allow and the
    GPU runs them all at once (`slots`: clusters of each size it runs at once; empty where there are none)."""
    strips_per_block, splits = small_blocks(layouts, rows, n_sm)
    if rows == 1 and slots:
        splits = clustered_splits(layouts, n_sm, strips_per_block, splits, slots)
    plan = staged_plan(layouts, biases, counters, splits, rows, strips_per_block)
    clusters = sum(-(-lay.strips // strips_per_block) for lay in layouts)
    return replace(plan, cluster=cluster_size(splits, rows, clusters, slots))


def staged_plan(layouts: list[LaneLayout], biases: list[Tensor | None], counters: list[Tensor], splits: list[int],
                rows: int, strips_per_block: int) -> Plan:
    """A small-M launch with these splits: a block's shared memory holds only its split's chunk_meta entries
    (qmm_rows.cuh matmul_part_staged)."""
    plan = make_plan(MATMUL_KERNELS[layouts[0].fmt, rows_class(rows)], layouts, biases, counters, splits, rows,
                     strips_per_block)
    p = plan.params.copy()
    p["xs_stride"] = p["meta_smem"] = p["corr_smem"] = 0
    chunks = max(int(np.diff(p["part"]["split_chunk"][i, :n + 1]).max()) for i, n in enumerate(splits))
    return replace(plan, params=p, smem=8 * chunks)


def one_row_cluster_slots(device: torch.device) -> dict[int, int]:
    """Clusters of each of CLUSTER_SIZES blocks of the one-row EXL2 kernel that the device runs at once."""
    kernel = MATMUL_KERNELS[Format.EXL2, 1]
    return cluster_slots(FAMILY[kernel], kernel, THREADS, CLUSTER_SIZES, device.index)


def gemm_shape(rows: int) -> tuple[int, int]:
    """(row groups R, M tiles) of the GEMM for `rows` rows of x: a block is 8 / R strips x R * GEMM_WARP_ROWS rows;
    one warp per strip (R = 1) while the rows fit one warp, else GEMM_ROW_GROUPS, the rows then cut into M tiles of
    at most R * GEMM_WARP_ROWS. Every warp gets at most GEMM_WARP_ROWS rows (ceil(M16 / m_tiles) m16 tiles over R
    warps)."""
    groups = 1 if rows <= GEMM_WARP_ROWS else GEMM_ROW_GROUPS
    return groups, -(-rows // (GEMM_WARP_ROWS * groups))


def _tiled_params(layouts: list[LaneLayout], biases: list[Tensor | None], groups: int, m_tiles: int, resident: int,
                  n_sm: int) -> tuple[np.ndarray, int, int]:
    """A tiled launch's Params (GEMM, wgmma), blocks and ws_floats per row of x: blocks of WARPS // groups strips x
    m_tiles M tiles, K split into as many parts as fit one wave of `resident` blocks per SM (within GEMM_MIN_CHUNKS
    chunks per split and MAX_SPLITS); ring_smem after the split's chunk_meta entries."""
    tiles = sum(-(-lay.strips // (WARPS // groups)) * m_tiles for lay in layouts)
    want = resident * n_sm // tiles                # rounded down: a second, nearly empty wave costs a whole one
    splits = [max(1, min(want, len(lay.chunk_bits) // GEMM_MIN_CHUNKS, MAX_SPLITS)) for lay in layouts]
    p = np.zeros((), PARAMS_DTYPE)
    blocks, ws, starts_all = _fill_parts(p, layouts, biases, [None] * len(layouts), splits, WARPS // groups, m_tiles,
                                         1)
    p["n_parts"], p["K"], p["row_groups"], p["m_tiles"] = len(layouts), layouts[0].k, groups, m_tiles
    chunks = max(b - a for s in starts_all for a, b in zip(s, s[1:]))
    p["ring_smem"] = -(-8 * chunks // 16) * 16
    return p, blocks, ws


def plan_gemm(layouts: list[LaneLayout], biases: list[Tensor | None], shape: tuple[int, int], n_sm: int) -> Plan:
    """The GEMM launch for a (row groups, M tiles) shape, GEMM_RESIDENT blocks per SM; its ring after ring_smem."""
    groups, m_tiles = shape
    p, blocks, ws = _tiled_params(layouts, biases, groups, m_tiles, GEMM_RESIDENT, n_sm)
    smem = int(p["ring_smem"]) + GEMM_STAGES * GEMM_WARP_ROWS * groups * GEMM_XS * 2
    return Plan(GEMM_KERNELS[layouts[0].fmt], blocks, smem, p, ws)


def plan_wgmma(layouts: list[LaneLayout], biases: list[Tensor | None], n_sm: int) -> Plan:
    """The launch of the GEMM by wgmma for up to WGMMA_ROWS rows: one row group, one M tile, one block per SM;
    after ring_smem WGMMA_STAGES slots of WGMMA_ROWS x CHUNK halves of x, WGMMA_DEPTH of a block's decoded weights."""
    p, blocks, ws = _tiled_params(layouts, biases, 1, 1, 1, n_sm)
    smem = int(p["ring_smem"]) + WGMMA_STAGES * WGMMA_ROWS * CHUNK * 2 + WGMMA_DEPTH * WARPS * CHUNK * STRIP * 2
    return Plan(WGMMA_KERNELS[layouts[0].fmt], blocks, smem, p, ws)


def plan_dequant(layout: LaneLayout, n_sm: int) -> Plan:
    splits = choose_splits([layout], 1, n_sm, DEQUANT_RESIDENT, 0)
    return make_plan(DEQUANT_KERNELS[layout.fmt], [layout], [None], [None], splits, 0)


# ----------------------------------------------------------------------------------------------- forward


class QuantMatmul:
    """The forward of one or more quantized weights that share x (same K and format; qmm.cuh: LAUNCH
    PARAMETERS) on CUDA: part i gives y_i [M, N_i] fp16 = x [M, K] fp16 @ W_i^T (+ bias_i)."""

    def __init__(self, layouts: list[LaneLayout], biases: list[Tensor | None]):
        if not 1 <= len(layouts) <= MAX_PARTS or len({(lay.fmt, lay.k) for lay in layouts}) != 1:
            raise ValueError(f"one launch takes 1 to {MAX_PARTS} weights of one format and K")
        device = layouts[0].words.device
        n_sm = torch.cuda.get_device_properties(device).multi_processor_count
        self.layouts = layouts
        self.biases = [None if b is None else b[:lay.n].to(device, torch.float16).contiguous()
                       for lay, b in zip(layouts, biases)]
        self.counters = [torch.zeros(lay.strips, dtype=torch.int32, device=device) for lay in layouts]  # self-resetting
        # Plans by rows of x (1..ROWS_PER_PASS), part (dequantize) and gemm_shape, made on first use: they are
        # host data only (no launch, no sync, so also inside a graph capture), and a model uses few of them.
        cc = compute_capability(device)
        clustered = layouts[0].fmt is Format.EXL2 and cc >= CLUSTER_CC    # GPTQ's kernel would spill (CLUSTER SUMS)
        self.plans = Lazy(lambda rows: plan_small(layouts, self.biases, self.counters, rows, n_sm,
                                                  one_row_cluster_slots(device) if clustered else {}))
        self.dequant_plans = Lazy(lambda i: plan_dequant(layouts[i], n_sm))
        self.gemm_plans = Lazy(lambda shape: plan_gemm(layouts, self.biases, shape, n_sm))
        wgmma = cc == WGMMA_CC                                    # what the loader builds sm_90a for
        self.wgmma_plan = plan_wgmma(layouts, self.biases, n_sm) if wgmma else None
        self.ws1: Tensor | None = None          # split partials of one-row launches, kept (made on first use)
        self.k = layouts[0].k
        self.staged: dict[int, Tensor] = {}     # x staged for the small-M kernels (_stage), per rows class, kept
        self.places: Tensor | None = None       # stored_x's, made on first use
        # the stage-free norms a model linked (Model.link_norms): the one after this launch's one weight, the one in
        # front of this launch
        self.feeding: NormFeed | None = None
        self.fed_by: NormFeed | None = None
        self.gating: Gating | None = None      # a fed gate/up's launch that stages down's x (link_gating)
        self.segment = None                     # the one-row launch pair as megakernel ops
        if layouts[0].fmt is Format.EXL2 and megakernel.enabled(device):
            self.segment = megakernel.OneRowMatmul(self.plans[1], self.k, -(-self.k // CHUNK // WARPS), device)

    def __call__(self, x: Tensor, up: Tensor | None = None) -> Tensor:
        """The forward of a single weight."""
        (y,) = self.forward(x, up)
        return y

    def forward(self, x: Tensor, up: Tensor | None = None) -> list[Tensor]:
        """One output per weight, [..., N_i] for x [..., K]. With `up` (x's shape), for the gated MLP's
        silu(x) * up (activation.silu_mul's roundings): stage_xs (below LARGE_M rows) or the tiled GEMMs'
        permute_x applies it as it stages or reorders x; only the dequantize + cuBLAS path launches silu_mul."""
        _check_fp16(x, up)
        if up is not None and up.shape != x.shape:
            raise ValueError(f"gate {tuple(x.shape)} and up {tuple(up.shape)} differ in shape")
        lead = x.shape[:-1]
        x = x.reshape(-1, self.k).contiguous()
        path = self._path(x.shape[0])
        if up is None:
            ys = path(x)
        elif path == self._dequant_matmul:
            ys = path(activation.silu_mul(x, up.reshape(x.shape)))
        else:
            ys = path(x, (aligned(up.reshape(x.shape).contiguous()), *PLAIN[1:]))   # (permute_x: 16-byte vectors)
        return [y.reshape(*lead, lay.n) for y, lay in zip(ys, self.layouts)]

    def forward_normed(self, h: Tensor, residual: Tensor | None, w: Tensor, eps: float) -> tuple[list[Tensor], Tensor]:
        """(forward(x), r) for the block's norm in front of these weights: r = residual + h (residual None: h, the
        first block's), x = rmsnorm(r) * w, as norm.add_rmsnorm and norm.rmsnorm compute them, bit for bit.
        stage_xs (below LARGE_M rows) or the tiled GEMMs' permute_x normalises x as it stages or reorders it: the
        norm needs no launch of its own, except before dequantize + cuBLAS and for rows not 16-byte aligned."""
        _check_fp16(h, residual, w)
        if residual is not None and residual.shape != h.shape:
            raise ValueError(f"x {tuple(h.shape)} and residual {tuple(residual.shape)} differ in shape")
        lead = h.shape[:-1]
        h = h.reshape(-1, self.k).contiguous()
        residual = None if residual is None else residual.reshape(h.shape).contiguous()
        path = self._path(h.shape[0])
        fused = (path != self._dequant_matmul
                 and (path != self._small or 2 * self.k <= STAGE_NORM_SMEM)    # stage_xs's row in shared memory
                 and all(t is None or t.data_ptr() % 16 == 0 for t in (h, residual, w)))  # read as 16-byte vectors
        if fused:
            new = h if residual is None else torch.empty_like(h)
            ys = path(h, (None, residual, w, new, float(eps)))
        else:
            x, new = (norm.rmsnorm(h, w, eps), h) if residual is None else norm.add_rmsnorm(h, residual, w, eps)
            ys = path(x)
        return [y.reshape(*lead, lay.n) for y, lay in zip(ys, self.layouts)], new.reshape(*lead, self.k)

    def _path(self, rows: int):
        """The method that multiplies `rows` rows of x (LARGE_M, GEMM_MAX_M, WGMMA_MIN_M)."""
        if rows < LARGE_M:
            return self._small
        if self.wgmma_plan is not None and WGMMA_MIN_M <= rows <= WGMMA_MAX_M:
            return self._wgmma
        return self._gemm if rows <= GEMM_MAX_M else self._dequant_matmul

    def _small(self, x: Tensor, before: tuple = PLAIN) -> list[Tensor]:
        """Passes of ROWS_PER_PASS rows of x. before: what stage_xs applies to x as it stages it (PLAIN: nothing),
        for x of at most ROWS_PER_PASS rows (one pass)."""
        m = x.shape[0]
        chain = megakernel.active() if m == 1 and self.segment is not None else None
        if chain is not None:               # two ops of the chain's next launch instead of two launches now
            ys = [torch.empty(1, lay.n, dtype=torch.float16, device=x.device) for lay in self.layouts]
            self.segment.append(chain, x, before, self._stage_buffer(1, x.device), ys)
            return ys
        if before is not PLAIN and m > ROWS_PER_PASS:     # (its tensors cover the first pass only)
            raise ValueError(f"stage_xs applies an op to at most {ROWS_PER_PASS} rows of x in one pass, got {m}")
        ys = [torch.empty(m, lay.n, dtype=torch.float16, device=x.device) for lay in self.layouts]
        for m0 in range(0, m, ROWS_PER_PASS):
            rows = min(ROWS_PER_PASS, m - m0)
            xs, outs = (x, ys) if m0 == 0 else (x[m0:], [y[m0:] for y in ys])     # views cost host time
            self._launch_small(rows, self._stage(xs, rows, before), outs)
        return ys

    def _launch_small(self, rows: int, staged: Tensor, ys: list[Tensor | None], chain: np.ndarray = NO_CHAIN) -> None:
        """The small-M kernel on `rows` rows of x as stage_xs leaves them (staged), into ys; one row's launch ends as
        `chain` says (NO_CHAIN: ys alone)."""
        plan = self.plans[rows]
        args = (plan.arg(), staged, *ys, *(None,) * (MAX_PARTS - len(ys)), self._ws(plan, rows, staged.device))
        launch(FAMILY[plan.kernel], plan.kernel, grid=(plan.blocks,), block=(plan.threads,),
               args=args + ((chain,) if rows == 1 else ()), shared_mem=plan.smem, cluster=plan.cluster)

    def stored_x(self, rows: int) -> tuple[Tensor, Tensor] | None:
        """Where the op before may write `rows` rows of x so that forward_stored multiplies them without a stage_xs
        launch: (buffer, place), x's element j at buffer[place[j] & 0x7fffffff], times 2^-4 where bit 31 is set, as
        stage_xs stages it (attention.cu's Out does). One row of one weight outside a megakernel chain; else None
        (the staged x of more rows is padded and has corrections, a chain stages in its own ops)."""
        if rows != 1 or len(self.layouts) != 1 or (self.segment is not None and megakernel.active() is not None):
            return None
        device = self.layouts[0].words.device
        if self.places is None:
            self.places = stored_places(self.layouts[0])
        return self._stage_buffer(1, device), self.places

    def forward_stored(self, staged: Tensor) -> Tensor:
        """The one weight's y [1, n] from one row of x written where stored_x said."""
        y = torch.empty(1, self.layouts[0].n, dtype=torch.float16, device=staged.device)
        self._launch_small(1, staged, [y])
        return y

    def norm_feed(self, w: Tensor, eps: float) -> NormFeed | None:
        """Where the one-row launch before this one may leave its x with the norm in front of it (weight w, epsilon
        eps) half done, so that no launch stages it (NormFeed). Made once, when a model is linked (it reads w's
        largest magnitude on the host); None where this launch cannot take it (a GPTQ or EXL2 one-row launch can)."""
        k = self.k
        if w.shape != (k,) or w.dtype != torch.float16 or w.device != self.layouts[0].words.device:
            return None
        device = self.layouts[0].words.device
        e = max(0, math.ceil(math.log2(max(float(w.abs().max()), 2.0 ** -14))))    # |w * 2^-e| <= 1
        places = torch.stack([stored_places(lay) for lay in self.layouts])
        # (sums: whole 16-byte vectors, as the consumer's warps copy them)
        staged, sums = self._stage_buffer(1, device), torch.empty(-(-k // 128) * 4, dtype=torch.float32, device=device)
        scaled = (w.float() * 2.0 ** -e).half().contiguous()
        producer, consumer = np.zeros((), CHAIN_DTYPE), np.zeros((), CHAIN_DTYPE)     # (made once: host time)
        producer["x"], producer["w"], producer["sums"], producer["n_places"] = (_ptr(staged), _ptr(scaled),
                                                                               _ptr(sums), len(places))
        producer["places"][:len(places)] = [_ptr(place) for place in places]
        consumer["sums_in"], consumer["eps"], consumer["unscale"], consumer["dim"] = _ptr(sums), eps, 2.0 ** e, k
        return NormFeed(staged, places, scaled, 2.0 ** e, float(eps), sums, producer, consumer)

    def feeds(self, rows: int) -> bool:
        """Whether a launch of `rows` rows of x leaves its output as self.feeding's x (forward_feeding): one row of
        one weight, linked to the norm after it, outside a megakernel chain."""
        return rows == 1 and self.feeding is not None and len(self.layouts) == 1 and megakernel.active() is None

    def stage_gated(self, gate: Tensor, up: Tensor) -> Tensor:
        """One row of the gated MLP's silu(gate) * up staged as forward(gate, up) stages it, for forward_feeding."""
        _check_fp16(gate, up)
        if gate.shape != (1, self.k) or up.shape != gate.shape:
            raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)}: one row of {self.k} each expected")
        return self._stage(gate.contiguous(), 1, (up.contiguous(), *PLAIN[1:]))

    def forward_feeding(self, staged: Tensor, residual: Tensor) -> Tensor:
        """The one weight on one row of x, staged (stored_x's buffer, or stage_gated's), its output y left as
        self.feeding's x instead of returned: returns r = residual + y (as add_rmsnorm adds them), the stream's new
        residual [1, n], and writes r * w' in the next launch's stored order with r's sums of squares."""
        lay, feed = self.layouts[0], self.feeding
        if residual.shape != (1, lay.n):
            raise ValueError(f"a launch of {lay.n} outputs cannot add them to a residual {tuple(residual.shape)}")
        residual = aligned(residual)            # (copied 16 bytes at a time)
        r = torch.empty_like(residual)
        chain = feed.producer_chain.copy()
        chain["residual"], chain["new_residual"] = _ptr(residual), _ptr(r)
        self._launch_small(1, staged, [None], chain)
        return r

    def forward_fed(self) -> list[Tensor]:
        """forward_normed's outputs for the one row of x that a forward_feeding launch left in self.fed_by."""
        feed = self.fed_by
        ys = [torch.empty(1, lay.n, dtype=torch.float16, device=feed.sums.device) for lay in self.layouts]
        self._launch_small(1, feed.staged, ys, feed.consumer_chain)
        return ys

    def link_gating(self, down: QuantMatmul) -> None:
        """Makes this fed gate/up launch (two weights of equal width, fed_by set) stage down's one row of x itself,
        fp16(silu(gate)) * up in down's stored order, so that no stage_xs launch sits between them (qmm_rows.cuh
        PAIRED ENDS): forward_gated. Left unlinked where the two weights split K differently (the launch pairs their
        strips) or down takes no stored x."""
        lays, into = self.layouts, down.stored_x(1)
        if self.fed_by is None or len(lays) != 2 or lays[0].n != lays[1].n or into is None or down.k != lays[0].n:
            return
        device = lays[0].words.device
        strips_per_block, splits = small_blocks(lays, 1, torch.cuda.get_device_properties(device).multi_processor_count)
        if splits[0] != splits[1]:
            return
        plan = staged_plan(lays, self.biases, [self.counters[0]] * 2, splits, 1, strips_per_block)   # one counter
        if splits[0] == 1:                      # (every partial is written, unsplit too: part 1's after part 0's)
            params = plan.params.copy()
            params["part"]["ws_offset"][1] = lays[0].np_
            plan = replace(plan, params=params, ws_floats=2 * lays[0].np_)
        chain = self.fed_by.consumer_chain.copy()
        chain["x"], chain["places"][0], chain["n_places"], chain["gated"] = _ptr(into[0]), _ptr(into[1]), 1, 1
        self.gating = Gating(plan, chain, torch.empty(plan.ws_floats, dtype=torch.float32, device=device), into)

    def forward_gated(self) -> Tensor:
        """The fed row through gate/up, left as down's staged x (link_gating): returns down's stage buffer."""
        g = self.gating
        plan = g.plan
        launch(FAMILY[plan.kernel], plan.kernel, grid=(plan.blocks,), block=(plan.threads,),
               args=(plan.arg(), self.fed_by.staged, None, None, None, g.ws, g.chain), shared_mem=plan.smem)
        return g.into[0]

    def _stage_buffer(self, rows: int, device: torch.device) -> Tensor:
        """The buffer stage_xs writes `rows` rows of x into (kept from call to call, one per rows class): each part's
        rows_class(rows) rows in stored order, then their corrections (written and read for more than one row only:
        one row's matmul sums its corrections itself)."""
        k, parts, cls = self.k, len(self.layouts), rows_class(rows)
        buf = self.staged.get(cls)
        if buf is None:
            buf = self.staged[cls] = torch.empty(parts * cls * (k + (k // CHUNK) * 4), dtype=torch.float16,
                                                 device=device)
        return buf

    def _stage(self, x: Tensor, rows: int, before: tuple) -> Tensor:
        """`rows` rows of x (after `before`) as the small-M kernels read them (matmul_rows.cu stage_xs)."""
        k, parts, cls = self.k, len(self.layouts), rows_class(rows)
        buf = self._stage_buffer(rows, x.device)
        normed = before[2] is not None          # stage_norm keeps the row in shared memory
        launch("matmul_rows", "stage_xs", grid=(-(-k // CHUNK // WARPS), parts, cls), block=(THREADS,),
               args=(self.plans[rows].arg(), x, *before, buf), shared_mem=2 * k if normed else 0)
        return buf

    def _ws(self, plan: Plan, rows: int, device: torch.device) -> Tensor | None:
        if plan.ws_floats == 0:
            return None
        if rows > 1:
            return torch.empty(plan.ws_floats, dtype=torch.float32, device=device)
        if self.ws1 is None:
            self.ws1 = torch.empty(plan.ws_floats, dtype=torch.float32, device=device)
        return self.ws1

    def _gemm(self, x: Tensor, before: tuple = PLAIN) -> list[Tensor]:
        """The tiled GEMM (gemm.cu), for up to GEMM_ROWS_LIMIT rows."""
        if x.shape[0] > GEMM_ROWS_LIMIT:
            raise ValueError(f"the tiled GEMM is planned for at most {GEMM_ROWS_LIMIT} rows of x, got {x.shape[0]}")
        return self._tiled(x, self.gemm_plans[gemm_shape(x.shape[0])], before)

    def _wgmma(self, x: Tensor, before: tuple = PLAIN) -> list[Tensor]:
        """The GEMM by wgmma (compute capability 9.0 only), for up to WGMMA_ROWS rows."""
        if x.shape[0] > WGMMA_ROWS:
            raise ValueError(f"the wgmma GEMM takes at most {WGMMA_ROWS} rows of x, got {x.shape[0]}")
        return self._tiled(x, self.wgmma_plan, before)

    def _tiled(self, x: Tensor, plan: Plan, before: tuple) -> list[Tensor]:
        """A tiled GEMM launch (x, after `before` as _small takes it, in each part's stored order first); its split
        partials, if any, summed by a second launch."""
        m = x.shape[0]
        xs = self._stored_order(x, plan, before)
        ys = [torch.empty(m, lay.n, dtype=torch.float16, device=x.device) for lay in self.layouts]
        nulls = (None,) * (MAX_PARTS - len(ys))
        ws = torch.empty(plan.ws_floats * m, dtype=torch.float32, device=x.device) if plan.ws_floats else None
        launch(FAMILY[plan.kernel], plan.kernel, grid=(plan.blocks,), block=(THREADS,),
               args=(plan.arg(), m, *xs, *nulls, *ys, *nulls, ws), shared_mem=plan.smem)
        if ws is not None:
            pairs = m * max(lay.np_ for lay in self.layouts) // 2
            launch("gemm", "gemm_reduce", grid=(-(-pairs // THREADS), len(ys)), block=(THREADS,),
                   args=(plan.arg(), m, *ys, *nulls, ws))
        return ys

    def _stored_order(self, x: Tensor, plan: Plan, before: tuple) -> list[Tensor]:
        """x [M, K] (after `before`) as each part's GEMM reads it (permute_x: its stored row order, in MMA k order
        within each 16 columns), [parts, M, K]."""
        m, k = x.shape
        xp = torch.empty(len(self.layouts), m, k, dtype=torch.float16, device=x.device)
        launch("gemm", "permute_x", grid=(m, len(self.layouts)), block=(THREADS,),
               args=(plan.arg(), m, aligned(x), *before, xp), shared_mem=2 * k)
        return list(xp)

    def _dequant_matmul(self, x: Tensor) -> list[Tensor]:
        ys = []
        for i, (lay, bias) in enumerate(zip(self.layouts, self.biases)):
            w = self._dequant(i)[:, :lay.n]
            ys.append(torch.mm(x, w) if bias is None else torch.addmm(bias, x, w))
        return ys

    def _dequant(self, i: int) -> Tensor:
        """W_i^T [K, Np] fp16 in original row order, bit-exact with the reference."""
        lay, plan = self.layouts[i], self.dequant_plans[i]
        w = torch.empty(lay.k, lay.np_, dtype=torch.float16, device=lay.words.device)
        launch(FAMILY[plan.kernel], plan.kernel, grid=(plan.blocks,), block=(THREADS,), args=(plan.arg(), w))
        return w

    def nbytes(self) -> int:
        """Device bytes of the repacked weights (what a decode step reads), biases included."""
        return sum(lay.nbytes() for lay in self.layouts) + sum(b.numel() * 2 for b in self.biases if b is not None)

    def dequantize(self, i: int = 0) -> Tensor:
        """Weight i in fp16 [N, K] as the large-M path uses it."""
        return self._dequant(i)[:, :self.layouts[i].n].T.contiguous()


@dataclass
class NormFeed:
    """One row of a matmul's x with the block's norm in front of it done at the two ends of its dependency instead
    of by a stage_xs launch (qmm_rows.cuh STAGE-FREE NORM): the launch before (QuantMatmul.forward_feeding) writes
    r * w' into `staged` as stage_xs would stage x and each 32 columns' sum of r^2 into `sums`; this one
    (forward_fed) multiplies its outputs by unscale / rms(r). w' = w / unscale, a power of two that keeps |w'| <= 1
    so that r * w' cannot overflow fp16. Outputs match forward_normed's up to rounding (the norm's scale comes after
    the matmul)."""
    # (the chains below hold raw pointers to staged, places, w and sums: the feed keeps them alive)
    staged: Tensor      # the consumer's one-row stage buffer
    places: Tensor      # int32 [parts, K]: stored_places of each of the consumer's weights
    w: Tensor           # fp16 [K]: w'
    unscale: float
    eps: float
    sums: Tensor        # fp32 [K / 32] (padded to whole 16-byte vectors)
    producer_chain: np.ndarray      # CHAIN_DTYPE: the producer's launch's, less its residual and new residual
    consumer_chain: np.ndarray      # CHAIN_DTYPE: the consumer's launch's


@dataclass
class Gating:
    """A gate/up launch that stages down's x (QuantMatmul.link_gating): its plan (gate's and up's strips on one
    counter, no clusters), its chain, its split partials, and down's (stage buffer, places)."""
    plan: Plan
    chain: np.ndarray
    ws: Tensor
    into: tuple[Tensor, Tensor]


def stored_places(lay: LaneLayout) -> Tensor:
    """int32 [K]: where stage_xs puts x's element j in one staged row, its stored row k (perm[k] = j), with bit 31
    set where it scales it by 2^-4 (row_scale in qmm_rows.cuh: rows with (k >> 1) & 1 of 4-bit chunks)."""
    device = lay.words.device
    k = torch.arange(lay.k, device=device)
    bits = torch.tensor(lay.chunk_bits, device=device).repeat_interleave(CHUNK)
    scaled = (bits == 4) & (k >> 1 & 1).bool()
    places = torch.empty_like(k)
    places[k if lay.perm is None else lay.perm.long()] = k - (scaled.long() << 31)     # bit 31 as int32's sign
    return places.to(torch.int32)


def prepare(weight: Exl2Weight | GptqWeight, bias: Tensor | None, device: torch.device | None = None) -> QuantMatmul:
    """Called once when a layer is placed on the GPU (`device`; default: where the weight is): repack, plan, and
    return the forward f(x) -> y."""
    return QuantMatmul([layout_for(weight, device)], [bias])


def fuse(kernels: list[QuantMatmul]) -> QuantMatmul | None:
    """One forward for single-weight forwards that share x (their layouts and biases, no copy), or None when they
    cannot share a launch (formats or K differ, too many)."""
    layouts = [lay for k in kernels for lay in k.layouts]
    if len(layouts) > MAX_PARTS or len({(lay.fmt, lay.k) for lay in layouts}) != 1:
        return None
    return QuantMatmul(layouts, [b for k in kernels for b in k.biases])

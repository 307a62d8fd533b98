"""How the quantized-matmul launches cut their work (quant_matmul.py builds the launches from it): the splits of K
per weight and the strips per block of a small-M launch, chosen by a model of a launch's time (below), memoised by
shape. Pure host code on plain numbers, so it runs and is tested without a GPU."""
from __future__ import annotations

import bisect
import functools
import math
from typing import NamedTuple

from ..errors import UnsupportedFormatError

CHUNK = 32                      # rows of K per chunk; every group must be a whole number of chunks
WARPS = 8                       # strips per block (qmm.cuh WARPS)
MAX_SPLITS = 64                 # K splits of one part (qmm.cuh MAX_SPLITS)
RESIDENT_BLOCKS = {1: 2, 8: 1, 16: 1}   # blocks per SM the kernels' registers allow (launch bounds in the .cu)
MIN_CHUNKS_PER_SPLIT = 4        # below this a split spends more on setup (x gather, bookkeeping) than on weights
# splits * rows of x: bounds the partial sums the last warp of a strip adds up. With x staged, 128 left 12-16 rows
# too few blocks: 14336 x 4096 at 12 rows 39.0 us against 29.7 at 256, 4096 x 4096 24.1 against 19.5; 512 no
# faster (H200, tune_matmul.py --set). Kernels that gather x per block (MoE) keep 128: when every kernel did, 64
# measured 5-25 % slower at 16 rows on the 8B shapes' small matrices.
MAX_SPLIT_ROWS = 256
GATHER_SPLIT_ROWS = 128
X_SMEM_BYTES = 48 * 1024        # a block's x tile and chunk_meta copy; more would need an opt-in per kernel
# The planner's model of a launch (H200 measurements, good enough elsewhere: only ratios matter): the SMs share
# BANDWIDTH bytes/s evenly, so a wave lasts as long as its busiest SM's bytes take (an SM left with fewer blocks
# idles: the kernels are bound per SM by instruction issue, docs/decode-matmul.md); with several rows of x an SM decodes
# and multiplies at most SM_RATES[rows class] bytes/s; one warp alone streams at most WARP_RATES[rows class] (one
# row: its prefetch distance over the memory latency; 8 and 16 rows: its decode and MMAs); each wave costs
# WAVE_SECONDS on top (ramp-up, prologue; at one row also the split-K tail). With several rows of x and splits,
# the strip's last warp reads every split's partial of every row, 16 loads a lane in flight (qmm.cuh
# reduce_splits: REDUCE_ROWS = 2 rows x REDUCE_SPLITS = 8 splits), each such round REDUCE_SECONDS after the one
# before. The 8- and 16-row figures are fitted to tune_matmul.py (docs/decode-matmul.md): at 16 rows 4096 x 4096 in
# 8 splits 18.2 us against 20.5 in 16, 4096 x 6144 in 8 19.8 against 22.3 in 11, 14336 x 4096 31.1 in 16 against
# 40.6 in 8, 4096 x 14336 in blocks of 7 strips ~6 % faster than of 8 (SM_RATES; 8 rows: scaled as the warp
# rate). One-row launches reduce their partials in rounds of up to M1_MAX_SPLITS (qmm.cuh REDUCE_LOADS) a
# lane; the model has no term for them, so one-row plans stop at one round: the 1B shape's down projection (8192 x
# 2048) took 8.71 us in 33 splits (3 rounds) against 8.25 in 16, and the 1B decode step 1.5-2 % less
# (docs/decode-matmul.md). The one-row warp rate, 3.0e9 until 2026-12-06, is 2.8e9 since the cluster sums: at 3.0
# the 1B shape's gate/up took 2 clustered splits (128 blocks, one an SM) for 4 through the counters and its launch
# measured 13.7 us against 11.0 (H100, bench_segment); at 2.8 the one-row plans without clusters are unchanged.
M1_MAX_SPLITS = 16
BANDWIDTH = 4.0e12
WARP_RATES = {1: 2.8e9, 8: 1.35e9, 16: 0.97e9}
SM_RATES = {1: math.inf, 8: 19.5e9, 16: 14.0e9}
WAVE_SECONDS = 3.0e-6
REDUCE_SECONDS = 0.8e-6
REDUCE_ROWS, REDUCE_SPLITS = 2, 8
# Strips (warps) per block the small-M planner tries. 7 fills the wave where 8-strip blocks leave SMs with one block
# of two: the 8B shape's gate/up (2 x 448 strips, 2 splits) runs 224 blocks on 264 slots with 8, 256 with 7; a wave
# that fills its slots measured ~11 % faster per byte (4096 x 16896 against 4096 x 14336, docs/decode-matmul.md).
SMALL_STRIPS_PER_BLOCK = (8, 7)
SMALL_BLOCKS_GAIN = 0.95


def split_starts(chunk_bits: list[int], n_splits: int) -> list[int]:
    """Chunk index where each split starts (plus the end): splits of nearly equal packed bytes."""
    prefix = [0]
    for b in chunk_bits:
        prefix.append(prefix[-1] + b)
    return [bisect.bisect_left(prefix, s * prefix[-1] // n_splits) for s in range(n_splits)] + [len(chunk_bits)]


def x_tile(starts: list[int], rows: int) -> tuple[int, int]:
    """(row stride in halves, bytes) of the gathered x tile: the longest split, padded so that the rows of x start
    8 banks apart (conflict-free 8-byte B-fragment loads)."""
    longest = CHUNK * max(b - a for a, b in zip(starts, starts[1:]))
    stride = longest + 2 * ((8 - longest // 2) % 32)
    return stride, rows * stride * 2


def _tile_bytes(starts: list[int], rows: int) -> int:
    """Shared memory of one block: the x tile, then the split's chunk_meta entries (8 bytes each), then its
    corrections (8 bytes per chunk and row of x)."""
    return -(-x_tile(starts, rows)[1] // 16) * 16 + 8 * (1 + rows) * max(b - a for a, b in zip(starts, starts[1:]))


def _launch_seconds(strip_bytes: list[int], col_blocks: list[int], splits: list[int], n_sm: int, per_sm: int,
                    strips_per_block: int = WARPS, rows: int = 1) -> float:
    """The planner's model (BANDWIDTH, SM_RATES, WARP_RATES, WAVE_SECONDS, REDUCE_SECONDS above) of a launch's
    time for `rows` rows of x: per_sm blocks of strips_per_block warps fit on each of n_sm SMs, a warp streams its
    strip's bytes over its split, and with several rows and splits the last warp of a strip reduces the partials."""
    blocks = sum(c * s for c, s in zip(col_blocks, splits))
    warp = max(b / s for b, s in zip(strip_bytes, splits))
    cls = rows_class(rows)
    seconds = 0.0
    if rows > 1 and max(splits) > 1:
        seconds += REDUCE_SECONDS * -(-rows // REDUCE_ROWS) * -(-max(splits) // REDUCE_SPLITS)
    while blocks > 0:
        wave = min(blocks, n_sm * per_sm)
        busiest = -(-wave // n_sm) * strips_per_block * warp           # the bytes of the SM with the most blocks
        seconds += WAVE_SECONDS + max(busiest * n_sm / BANDWIDTH, busiest / SM_RATES[cls], warp / WARP_RATES[cls])
        blocks -= wave
    return seconds


def choose_splits(layouts: list, rows: int, n_sm: int, per_sm: int, smem_rows: int,
                  strips_per_block: int = WARPS, max_splits: int = MAX_SPLITS) -> list[int]:
    """Splits of K per part: the fastest plan by _launch_seconds, every part's splits within its limits (at least
    MIN_CHUNKS_PER_SPLIT chunks, max_splits, and splits * rows within MAX_SPLIT_ROWS, GATHER_SPLIT_ROWS where each
    block gathers x) and its x tile within X_SMEM_BYTES (smem_rows rows of x gathered per block; 0 for none: x
    staged once per launch). Ties go to the plan with fewer waves, then more blocks."""
    split_rows = GATHER_SPLIT_ROWS if smem_rows else MAX_SPLIT_ROWS
    slots = n_sm * per_sm
    strip_bytes = [128 * sum(lay.chunk_bits) for lay in layouts]
    col_blocks = [-(-lay.strips // strips_per_block) for lay in layouts]
    lo, hi = [], []
    for lay in layouts:
        chunks = len(lay.chunk_bits)
        n = 1
        while smem_rows and _tile_bytes(split_starts(lay.chunk_bits, n), smem_rows) > X_SMEM_BYTES:
            n += 1
        lo.append(n)
        hi.append(max(n, min(chunks // MIN_CHUNKS_PER_SPLIT, split_rows // rows, max_splits)))
    best = None
    for b, h in zip(strip_bytes, hi):
        for s in range(1, h + 1):              # candidate bytes per warp: b / s
            splits = [min(hq, max(lq, math.ceil(bq * s / b))) for bq, lq, hq in zip(strip_bytes, lo, hi)]
            blocks = sum(c * n for c, n in zip(col_blocks, splits))
            seconds = _launch_seconds(strip_bytes, col_blocks, splits, n_sm, per_sm, strips_per_block, rows)
            key = (round(seconds, 8), -(-blocks // slots), -blocks)
            if best is None or key < best[0]:
                best = (key, splits)
    if max(best[1]) > MAX_SPLITS:
        raise UnsupportedFormatError(f"a layer of K = {layouts[0].k} needs {max(best[1])} splits of K for its x "
                                     f"tile; the kernels take at most {MAX_SPLITS}")
    return best[1]


# qmm_rows.cuh CLUSTER SUMS: a one-row launch whose parts all split K the same C ways, C one of CLUSTER_SIZES, runs
# in clusters of C blocks on compute capability 9.0+ and sums its splits through distributed shared memory instead
# of a counter and a workspace in device memory. Sizes that divide 16: a GPC of the H100 (16-18 SMs, 2 blocks each)
# then holds whole clusters with few slots left over; how many it holds the driver says (loader.cluster_slots).
# Above 8 blocks a cluster is "non-portable" (the loader allows it).
CLUSTER_SIZES = (2, 4, 8, 16)
CLUSTER_CC = (9, 0)


# The one-row split-K tail (bench_segment --trace, H100, 04be3c3): the summing warp's arrival at its strip's counter
# and its read of every split's partial, ~1.7 us a launch. Through a cluster's shared memory 0.5 was the prediction;
# the trace measured 1.6-1.9 us from the median warp's walk to the launch's end either way (the wait for the slowest
# split, not the sum). 0.5 stays because it is what the step rewards: with it the 8B shape's q/k/v and o take 8
# clustered splits (for 11 and 16 through the counters), slower launched alone (+0.3, +1.1 us) but the chained block
# 67.2 -> 63.8 us (their 128-192 blocks leave SMs free for the next launch's start), decode +4 %; the 1B shape's
# q/k/v, o and down run 16 clustered (H100, bench_segment and bench_decode, 2026-12-06, docs/megakernel.md).
COUNTER_TAIL_SECONDS = 1.7e-6
CLUSTER_TAIL_SECONDS = 0.5e-6


def clustered_splits(layouts: list, n_sm: int, strips_per_block: int, splits: list[int],
                     slots: dict[int, int]) -> list[int]:
    """The one-row splits for a launch that may run in clusters: the planner's own (`splits`) or a cluster size
    every part can take and the GPU can run all of the launch's clusters of at once (`slots`: clusters of each size
    it runs at once), whichever _launch_seconds plus its reduction's tail rates faster."""
    per_sm = RESIDENT_BLOCKS[1]
    strip_bytes = [128 * sum(lay.chunk_bits) for lay in layouts]
    col_blocks = [-(-lay.strips // strips_per_block) for lay in layouts]

    def seconds(s: list[int]) -> float:
        tail = 0.0 if max(s) == 1 else CLUSTER_TAIL_SECONDS if cluster_size(s, 1, sum(col_blocks), slots) > 1 \
            else COUNTER_TAIL_SECONDS
        return _launch_seconds(strip_bytes, col_blocks, s, n_sm, per_sm, strips_per_block, 1) + tail
    most = min(min(len(lay.chunk_bits) // MIN_CHUNKS_PER_SPLIT, MAX_SPLIT_ROWS, M1_MAX_SPLITS) for lay in layouts)
    options = [list(splits)] + [[c] * len(layouts) for c in CLUSTER_SIZES
                                if c <= most and cluster_size([c] * len(layouts), 1, sum(col_blocks), slots) > 1]
    return min(options, key=seconds)


def cluster_size(splits: list[int], rows: int, clusters: int, slots: dict[int, int]) -> int:
    """Blocks per cluster of a small-M launch with these splits per part and `clusters` column blocks (a cluster
    each), 1 for none: where every part splits K the same C ways and the GPU runs `clusters` clusters of C blocks
    at once (slots[C]; a GPC holds whole clusters, and a second wave would cost more than the sums save)."""
    c = splits[0]
    if rows != 1 or any(n != c for n in splits) or slots.get(c, 0) < clusters:
        return 1
    return c


def rows_class(rows: int) -> int:
    """The small-M kernel for `rows` rows of x (1, 8 or 16), i.e. the rows stage_xs stages for it."""
    return 1 if rows == 1 else 8 if rows <= 8 else 16


def small_blocks(layouts: list, rows: int, n_sm: int) -> tuple[int, list[int]]:
    """(strips per block, splits per part) of the small-M launch for `rows` rows of x: blocks of the first of
    SMALL_STRIPS_PER_BLOCK (8 strips, the measured default), or of another count where _launch_seconds rates its
    best splits SMALL_BLOCKS_GAIN faster (the model is coarse: a few percent decide nothing)."""
    shapes = tuple(Shape(lay.k, lay.strips, tuple(lay.chunk_bits)) for lay in layouts)
    spb, splits = _small_blocks(shapes, rows, n_sm, RESIDENT_BLOCKS[rows_class(rows)], SMALL_STRIPS_PER_BLOCK)
    return spb, list(splits)


Shape = NamedTuple("Shape", [("k", int), ("strips", int), ("chunk_bits", tuple)])    # what planning reads of a layout


# Memoised: a model's layers repeat a few shapes, and a plan's search takes ~1 ms (an 8B model's from_pretrained
# spent 5.5 of its 11.4 s here, H100, 2026-12-06).
@functools.cache
def _small_blocks(layouts: tuple[Shape, ...], rows: int, n_sm: int, per_sm: int,
                  candidates: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    strip_bytes = [128 * sum(lay.chunk_bits) for lay in layouts]
    plans = []
    for spb in candidates:
        splits = choose_splits(layouts, rows, n_sm, per_sm, 0, spb, M1_MAX_SPLITS if rows == 1 else MAX_SPLITS)
        col_blocks = [-(-lay.strips // spb) for lay in layouts]
        plans.append((_launch_seconds(strip_bytes, col_blocks, splits, n_sm, per_sm, spb, rows), spb, splits))
    best = min(plans, key=lambda plan: plan[0])
    _, spb, splits = best if best[0] < SMALL_BLOCKS_GAIN * plans[0][0] else plans[0]
    return spb, tuple(splits)


class Lazy(dict):
    """A dict whose missing values make(key) makes and keeps."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        value = self[key] = self.make(key)
        return value

"""Launcher of quant_matmul.cu: y = x @ W^T (+ bias) for EXL2 and GPTQ weights on CUDA.

`prepare(weight, bias)` runs once per layer: it repacks the packed weight into the kernels' lane layout (described at
the top of quant_matmul.cu and built here by plain torch functions, which run and are tested on CPU too), plans how
each launch cuts K, and returns the forward. Per call the forward only allocates its output (and, for split K, an
fp32 partial-sum buffer) through torch's caching allocator and launches: no host sync, nothing compiled or queried,
so a warmed-up forward can be captured in a CUDA graph.

Up to LARGE_M rows of x, the small-M kernel reads each packed word once per 16 rows of x; from LARGE_M rows on,
the weight is dequantized to an fp16 scratch (bit-exact with the reference) and multiplied by cuBLAS."""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

from .. import reference
from ..errors import DeviceError, UnsupportedFormatError
from ..formats.exl2 import Exl2Weight
from ..formats.gptq import GptqWeight
from .loader import launch

CHUNK = 32                      # rows of K per chunk; every group must be a whole number of chunks
STRIP = 32                      # columns per strip (one warp)
WARPS = 8                       # strips per block (quant_matmul.cu WARPS)
THREADS = WARPS * 32
WIDTHS = (8, 6, 5, 4, 3, 2)     # the stored order of widths; run_bounds[i]..run_bounds[i+1] have width WIDTHS[i]

ROWS_PER_PASS = 16              # rows of x one small-M launch handles (two 8-row MMA tiles)
# From this many rows of x on, dequantize + cuBLAS. A small-M pass reads the packed weight once per 16 rows
# (~b/8 bytes per weight, 0.5 at 4 bpw); the dequant path reads it once, writes and re-reads 2 bytes per weight
# (~4.5 bytes at 4 bpw) and then runs at cuBLAS speed. The byte counts cross near 8 passes; per-pass overheads
# (gathering x, MMA issue) pull that down, so the switch sits at 4 passes. Measured by benchmarks/bench_matmul.py.
LARGE_M = 64
RESIDENT_BLOCKS = {1: 3, 8: 2, 16: 2}   # blocks per SM the kernels' registers allow (launch bounds in the .cu)
MIN_CHUNKS_PER_SPLIT = 4        # below this a split spends more on setup (x gather, bookkeeping) than on weights
MAX_SPLIT_ROWS = 64             # splits * rows of x: bounds the partial sums the last warp of a strip adds up
X_SMEM_BYTES = 48 * 1024        # the gathered x tile of one block; more would need an opt-in per kernel
SLAB_CODES = 1 << 22            # codes unpacked at once while repacking (int64 temporaries of 32 MB)


class Format(Enum):
    EXL2 = "exl2"
    GPTQ = "gptq"


MATMUL_KERNELS = {   # (format, rows-of-x class) -> entry point of quant_matmul.cu
    (Format.EXL2, 1): "exl2_matmul_m1", (Format.EXL2, 8): "exl2_matmul_m8", (Format.EXL2, 16): "exl2_matmul_m16",
    (Format.GPTQ, 1): "gptq_matmul_m1", (Format.GPTQ, 8): "gptq_matmul_m8", (Format.GPTQ, 16): "gptq_matmul_m16",
}
DEQUANT_KERNELS = {Format.EXL2: "exl2_dequant", Format.GPTQ: "gptq_dequant"}


# ----------------------------------------------------------------------------------------------- lane layout


def _pair_bits(bits: int) -> list[list[int]]:
    """Bit positions (32 * word + bit) of the low code of each pair p = 0..15 in a lane's words; the pair's high
    code sits 16 bits above. The same table as pair_bits<B> in quant_matmul.cu (tests check they agree)."""
    per_word = {2: 8, 3: 5, 4: 4, 5: 3, 6: 2, 8: 2}[bits]
    direct = {2: 16, 3: 15, 4: 16, 5: 15, 6: 12, 8: 16}[bits]
    table = []
    for p in range(16):
        if p < direct:
            first = 32 * (p // per_word) + bits * (p % per_word)
            table.append([first + k for k in range(bits)])
        elif bits == 6:          # bits 12-15 of the six words: code p-12 bit k is spare bit 6(p-12)+k
            spare = [6 * (p - 12) + k for k in range(6)]
            table.append([32 * (s // 4) + 12 + s % 4 for s in spare])
        else:                    # bit 15 of each word, code bit k in word k
            table.append([32 * k + 15 for k in range(bits)])
    return table


PAIR_BITS = {b: _pair_bits(b) for b in WIDTHS}


def plane_words(bits: int) -> list[int]:
    """A lane's words of one chunk, split in loads of 16, 8 and 4 bytes."""
    return [4] * (bits // 4) + [2] * (bits % 4 // 2) + [1] * (bits % 2)


def _int32(words: Tensor) -> Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def lane_words(codes: Tensor, bits: int) -> Tensor:
    """codes [32 C, 32 S] of one width (stored rows x padded columns) -> int32 [S, C * 32 * bits]: per strip, its
    chunks in the lane layout (lane 4g + q: columns 16(j//2) + 8(j%2) + g, rows 16s + 4q + 2h + e, pair
    p = 4j + 2s + h; words in planes)."""
    rows, cols = codes.shape
    c, s = rows // CHUNK, cols // STRIP
    x = codes.to(torch.int64).reshape(c, 2, 4, 2, 2, s, 2, 2, 8)        # [c, s_, q, h, e, strip, t, u, g]
    x = x.permute(5, 0, 8, 2, 6, 7, 1, 3, 4).reshape(s, c, 32, 16, 2)   # [strip, c, lane, pair, e]
    pos = torch.tensor(PAIR_BITS[bits], dtype=torch.int64, device=codes.device)    # [16, bits]
    words = torch.zeros(s, c, 32, bits, dtype=torch.int64, device=codes.device)
    for k in range(bits):
        bit = (x >> k) & 1
        words.index_add_(3, pos[:, k] // 32, (bit[..., 0] | bit[..., 1] << 16) << (pos[:, k] % 32))
    planes = torch.split(_int32(words), plane_words(bits), dim=3)        # each [S, C, 32, w]
    return torch.cat([p.reshape(s, c, -1) for p in planes], dim=2).reshape(s, -1)


def lane_order(values: Tensor) -> Tensor:
    """Per-column values [G, Np] -> [G, strips, 8, 4]: entry [.., g, j] is column 16(j//2) + 8(j%2) + g."""
    g, np_ = values.shape
    return values.reshape(g, np_ // STRIP, 2, 2, 8).permute(0, 1, 4, 2, 3).reshape(g, np_ // STRIP, 8, 4)


def exl2_scale_codes(q_scale: Tensor) -> Tensor:
    """q_scale int32 [G, Np/8] -> int32 [G, strips, 4]: lane g's 4 codes in 16 bits at word g/2, half g%2, as
    bytes (c_j0 | c_j2 << 4, c_j1 | c_j3 << 4), c_j the code of column 16(j//2) + 8(j%2) + g."""
    nibbles = reference.unpack_bits(q_scale.cpu().T.contiguous(), 4, q_scale.shape[1] * 8).T    # [G, Np]
    c = lane_order(nibbles)                                                                # [G, strips, 8, 4]
    lane16 = c[..., 0] | c[..., 2] << 4 | c[..., 1] << 8 | c[..., 3] << 12               # [G, strips, 8]
    return _int32(lane16[..., 0::2] | lane16[..., 1::2] << 16).contiguous()


@dataclass
class LaneLayout:
    """A weight in the kernels' lane layout, on the weight's device (quant_matmul.cu: LANE LAYOUT)."""
    fmt: Format
    k: int
    n: int
    np_: int
    words: Tensor            # int32 [strips * words_per_strip]
    chunk_bits: list[int]    # width of each chunk (host copy, for planning splits)
    bits_prefix: Tensor      # int32 [chunks + 1]
    run_bounds: Tensor       # int32 [7]: chunks of width WIDTHS[i] are run_bounds[i]..run_bounds[i+1]
    chunk_meta: Tensor       # int32 [chunks, 2]: byte offsets of the chunk's group in meta0, meta1 (EXL2: base)
    meta0: Tensor            # EXL2: int32 [G, strips, 4] scale codes; GPTQ: fp16 [G, strips, 8, 4] scales
    meta1: Tensor | None     # GPTQ: uint8 [G, strips, 8, 4] zero points; EXL2: None
    perm: Tensor | None      # int32 [K]: stored row k' is original row perm[k']; None for the identity

    @property
    def strips(self) -> int:
        return self.np_ // STRIP

    @property
    def words_per_strip(self) -> int:
        return 32 * sum(self.chunk_bits)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.bits_prefix, self.run_bounds,
                                                           self.chunk_meta, self.meta0, self.meta1, self.perm)
                   if t is not None)


def _chunk_tables(chunk_bits: list[int], device) -> tuple[Tensor, Tensor]:
    """bits_prefix [C+1] and run_bounds [7] of chunk widths in non-increasing order."""
    prefix = [0]
    for b in chunk_bits:
        prefix.append(prefix[-1] + b)
    bounds = [0]
    for width in WIDTHS:
        bounds.append(bounds[-1] + chunk_bits.count(width))
    return (torch.tensor(prefix, dtype=torch.int32, device=device),
            torch.tensor(bounds, dtype=torch.int32, device=device))


def _slab_rows(np_: int) -> int:
    return max(CHUNK, SLAB_CODES // np_ // CHUNK * CHUNK)


def _identity_or(perm: Tensor) -> Tensor | None:
    perm = perm.to(torch.int32)
    return None if torch.equal(perm.cpu(), torch.arange(perm.numel(), dtype=torch.int32)) else perm.contiguous()


def exl2_layout(w: Exl2Weight) -> LaneLayout:
    """EXL2 tensors -> lane layout. Groups must be whole chunks (the converter only writes 32/64/128-row groups)."""
    k, device = w.in_features, w.q_weight.device
    np_ = w.q_weight.shape[1]
    groups = reference.exl2_groups(w.q_groups.cpu(), k)
    if any(rows % CHUNK for _, _, rows in groups):
        raise UnsupportedFormatError(f"EXL2 layer [{k} -> {w.out_features}] has groups of "
                                     f"{sorted({r for _, _, r in groups})} rows; the CUDA kernels need multiples of "
                                     f"{CHUNK} (run it on CPU, or re-convert with group sizes 32/64/128)")
    chunk_bits = [b for b, _, rows in groups for _ in range(rows // CHUNK)]
    chunk_group = [i for i, (_, _, rows) in enumerate(groups) for _ in range(rows // CHUNK)]
    if any(a < b for a, b in zip(chunk_bits, chunk_bits[1:])):
        raise UnsupportedFormatError(f"EXL2 layer [{k} -> {w.out_features}]: q_groups widths are not in "
                                     f"non-increasing order; the checkpoint is corrupt")
    parts = []
    for width in WIDTHS:                      # one run per width, a continuous bit stream in q_weight
        run = [(qrow, rows) for b, qrow, rows in groups if b == width]
        if not run:
            continue
        qrow0, rows = run[0][0], sum(r for _, r in run)
        step = _slab_rows(np_)
        for r in range(0, rows, step):
            n_rows = min(step, rows - r)
            words = w.q_weight[qrow0 + r * width // 32: qrow0 + (r + n_rows) * width // 32]
            parts.append(lane_words(reference.unpack_bits(words, width, n_rows), width))
    base = (w.q_scale_max.float() * 2.0**-8).half().view(torch.int16).to(torch.int64) & 0xFFFF   # fp16 bits of m
    group = torch.tensor(chunk_group, dtype=torch.int64, device=device)
    chunk_meta = torch.stack((group * (np_ // STRIP) * 16, _int32((base | base << 16)[group]).long()), dim=1)
    prefix, bounds = _chunk_tables(chunk_bits, device)
    return LaneLayout(Format.EXL2, k, w.out_features, np_, torch.cat(parts, dim=1).reshape(-1), chunk_bits,
                      prefix, bounds, chunk_meta.to(torch.int32).contiguous(),
                      exl2_scale_codes(w.q_scale).to(device), None, _identity_or(torch.argsort(w.q_invperm.long())))


def gptq_layout(w: GptqWeight) -> LaneLayout:
    """GPTQ tensors -> lane layout: rows sorted by group (stable), so each group is a run of whole chunks."""
    k, n, bits, device = w.in_features, w.out_features, w.bits, w.qweight.device
    np_ = -(-n // STRIP) * STRIP
    n_groups = w.scales.shape[0]
    perm = torch.sort(w.g_idx.long(), stable=True).indices                        # stored row -> original row
    counts = torch.bincount(w.g_idx.long(), minlength=n_groups).tolist()
    if k % CHUNK or any(c % CHUNK for c in counts):
        raise UnsupportedFormatError(f"GPTQ layer [{k} -> {n}] has groups of {sorted(set(counts) - {0})} rows; the "
                                     f"CUDA kernels need multiples of {CHUNK} (run it on CPU)")
    codes = torch.zeros(k, np_, dtype=torch.uint8, device=device)               # original row order
    step = _slab_rows(np_)
    for r in range(0, k, step):
        n_rows = min(step, k - r)
        codes[r: r + n_rows, :n] = reference.unpack_bits(w.qweight[r * bits // 32: (r + n_rows) * bits // 32], bits,
                                                n_rows).to(torch.uint8)
    codes = codes[perm]
    parts = [lane_words(codes[r: r + step], bits) for r in range(0, k, step)]
    group = w.g_idx.long()[perm][::CHUNK]
    chunk_meta = torch.stack((group * (np_ // STRIP) * 64, group * (np_ // STRIP) * 32), dim=1).to(torch.int32)
    pad = (0, np_ - n)
    zeros = torch.nn.functional.pad(reference.gptq_zeros(w.qzeros.cpu(), bits, n, w.v2), pad).to(device, torch.uint8)
    scales = torch.nn.functional.pad(w.scales.half(), pad)
    prefix, bounds = _chunk_tables([bits] * (k // CHUNK), device)
    return LaneLayout(Format.GPTQ, k, n, np_, torch.cat(parts, dim=1).reshape(-1), [bits] * (k // CHUNK),
                      prefix, bounds, chunk_meta.contiguous(), lane_order(scales).contiguous(),
                      lane_order(zeros).contiguous(), _identity_or(perm))


# ----------------------------------------------------------------------------------------------- planning


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


@dataclass(frozen=True)
class Plan:
    """How one launch of the small-M kernel for a given number of x rows is cut."""
    kernel: str
    n_splits: int
    starts: Tensor           # int32 [n_splits + 1] chunk bounds, on the device
    xs_stride: int
    smem: int


def plan_small(layout: LaneLayout, rows: int, n_sm: int) -> Plan:
    """Enough splits of K to fill the GPU (RESIDENT_BLOCKS per SM), within the limits above."""
    rows_class = 1 if rows == 1 else 8 if rows <= 8 else 16
    chunks = len(layout.chunk_bits)
    col_blocks = -(-layout.strips // WARPS)
    n = math.ceil(RESIDENT_BLOCKS[rows_class] * n_sm / col_blocks)
    n = max(1, min(n, chunks // MIN_CHUNKS_PER_SPLIT, MAX_SPLIT_ROWS // rows))
    while x_tile(split_starts(layout.chunk_bits, n), rows)[1] > X_SMEM_BYTES:
        n += 1
    starts = split_starts(layout.chunk_bits, n)
    stride, smem = x_tile(starts, rows)
    return Plan(MATMUL_KERNELS[layout.fmt, rows_class], n, torch.tensor(starts, dtype=torch.int32,
                device=layout.words.device), stride, smem)


def plan_dequant(layout: LaneLayout, n_sm: int) -> Tensor:
    """Chunk bounds of the dequant kernel's splits: about 4 blocks per SM (it holds no x tile)."""
    n = max(1, min(math.ceil(4 * n_sm / -(-layout.strips // WARPS)), len(layout.chunk_bits)))
    return torch.tensor(split_starts(layout.chunk_bits, n), dtype=torch.int32, device=layout.words.device)


# ----------------------------------------------------------------------------------------------- forward


class QuantMatmul:
    """The forward of one quantized layer on CUDA: y [M, N] fp16 = x [M, K] fp16 @ W^T (+ bias)."""

    def __init__(self, layout: LaneLayout, bias: Tensor | None):
        device = layout.words.device
        n_sm = torch.cuda.get_device_properties(device).multi_processor_count
        self.layout = layout
        self.bias = None if bias is None else bias[:layout.n].to(device, torch.float16).contiguous()
        self.plans = {rows: plan_small(layout, rows, n_sm) for rows in range(1, ROWS_PER_PASS + 1)}
        self.dequant_starts = plan_dequant(layout, n_sm)
        self.counters = torch.zeros(layout.strips, dtype=torch.int32, device=device)   # self-resetting
        self.packed = (layout.words, layout.bits_prefix, layout.run_bounds, layout.chunk_meta, layout.meta0,
                       layout.meta1, layout.words_per_strip, layout.perm)      # the kernels' weight arguments

    def __call__(self, x: Tensor) -> Tensor:
        lay = self.layout
        if x.dtype != torch.float16:
            raise DeviceError(f"the CUDA quantized matmul takes fp16 activations, got {x.dtype}; load the model "
                              f"with dtype=torch.float16")
        lead = x.shape[:-1]
        x = x.reshape(-1, lay.k).contiguous()
        y = self._dequant_matmul(x) if x.shape[0] >= LARGE_M else self._small(x)
        return y.reshape(*lead, lay.n)

    def _small(self, x: Tensor) -> Tensor:
        lay = self.layout
        m = x.shape[0]
        y = torch.empty(m, lay.n, dtype=torch.float16, device=x.device)
        for m0 in range(0, m, ROWS_PER_PASS):
            rows = min(ROWS_PER_PASS, m - m0)
            plan = self.plans[rows]
            ws = (torch.empty(plan.n_splits * rows * lay.np_, dtype=torch.float32, device=x.device)
                  if plan.n_splits > 1 else None)
            launch("quant_matmul", plan.kernel, grid=(-(-lay.strips // WARPS), plan.n_splits), block=(THREADS,),
                   args=(x[m0:], y[m0:], self.bias, rows, lay.k, lay.n, lay.np_, *self.packed, plan.starts,
                         plan.n_splits, plan.xs_stride, ws, self.counters), shared_mem=plan.smem)
        return y

    def _dequant_matmul(self, x: Tensor) -> Tensor:
        w = self._dequant()[:, :self.layout.n]
        return torch.mm(x, w) if self.bias is None else torch.addmm(self.bias, x, w)

    def _dequant(self) -> Tensor:
        """W^T [K, Np] fp16 in original row order, bit-exact with the reference."""
        lay = self.layout
        w = torch.empty(lay.k, lay.np_, dtype=torch.float16, device=lay.words.device)
        launch("quant_matmul", DEQUANT_KERNELS[lay.fmt], grid=(-(-lay.strips // WARPS), len(self.dequant_starts) - 1),
               block=(THREADS,), args=(*self.packed, self.dequant_starts, lay.np_, w))
        return w

    def nbytes(self) -> int:
        """Device bytes of the repacked weight (what a decode step reads), bias included."""
        return self.layout.nbytes() + (0 if self.bias is None else self.bias.numel() * 2)

    def dequantize(self) -> Tensor:
        """The fp16 weight [N, K] as the large-M path uses it."""
        return self._dequant()[:, :self.layout.n].T.contiguous()


def layout_for(weight: Exl2Weight | GptqWeight) -> LaneLayout:
    if isinstance(weight, Exl2Weight):
        return exl2_layout(weight)
    if isinstance(weight, GptqWeight):
        return gptq_layout(weight)
    raise TypeError(f"no CUDA quantized matmul for {type(weight).__name__}")


def prepare(weight: Exl2Weight | GptqWeight, bias: Tensor | None) -> QuantMatmul:
    """Called once when a layer is placed on the GPU: repack, plan, and return the forward f(x) -> y."""
    return QuantMatmul(layout_for(weight), bias)

"""GPTQ with per-group bit widths (ExLlamaV2's AdaptiveGPTQ, exl2-format.md §10.3-§10.5), and the plain GPTQ
group quantizer of the GPTQ format (gptq-format.md §5, §10).

One call quantizes one linear under several settings at once (the measurement tries up to 15 per projection):
the settings share the Hessian, its permutation and its inverse, and differ only in how rows are grouped.
Rows are processed in blocks of 32 (every group boundary is a multiple of 32 rows), error compensation inside
the block row by row, then one lazy update of all later rows per block; this is the same arithmetic as
updating after every group.

The work is shaped for a GPU, where the row loop is otherwise bound by the cost of launching its many small
operations: within a block each row costs 7 operations for all settings at once (quantize, error, rank-1
update of the block), and on CUDA a block's 32 rows are one captured CUDA graph, as is each group-scale search
(one per group size starting at a block, the settings' bit widths batched). On the CPU the same steps run
eagerly."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ..errors import ExlError

BLOCK = 32
EXL2_DAMP = 0.12            # fraction of mean(diag H) added to the diagonal (§10.4)
CHOLESKY_ATTEMPTS = 10
SCALE_GRID = (0.70, 1.20, 97)   # candidate factors p of the common scale: linspace(0.7, 1.2, 97) (§10.5)
GRID_STRIDES = (16, 4, 1)   # coarse-to-fine passes over SCALE_GRID: 7 points, then 5 around the best, twice
MAX_BATCH_ELEMENTS = 2 ** 28   # settings quantized together are split so W [S, K, N] stays below ~1 GiB f32
BATCH_BYTES_PER_ELEMENT = 128  # on CUDA the cap is total memory / this (H200: ~1.1e9, a down_proj's 14 settings)


class Hessian:
    """H = (1/T) sum over the T calibration tokens a layer saw of x_t^T x_t, in f32. (ExLlamaV2 divides by the
    number of rows instead; a constant factor, which neither the relative damping nor GPTQ's updates see.)
    Per token, because an MoE expert sees a different number of tokens from every row."""

    def __init__(self, k: int, device: torch.device):
        self.sum = torch.zeros(k, k, dtype=torch.float32, device=device)
        self.tokens = 0

    def add(self, x: Tensor) -> None:
        """x [..., K]: layer inputs."""
        flat = x.reshape(-1, x.shape[-1]).float()
        self.sum.addmm_(flat.T, flat)
        self.tokens += flat.shape[0]

    def value(self) -> Tensor:
        return self.sum / max(self.tokens, 1)


@dataclass
class Prepared:
    """What every setting quantized against one Hessian shares."""
    perm: Tensor      # [K] int64: stored row k' is original input row perm[k'] (act-order)
    hinv: Tensor      # [K, K] f32: upper Cholesky factor of (H_perm + d I)^-1


def prepare(h: Tensor, damp: float, act_order: bool = True) -> Prepared:
    """Act-order permutation (diag(H) descending; ties keep index order) and the damped inverse factor.
    A Cholesky failure adds the damping again, up to 10 times (§10.4)."""
    k = h.shape[0]
    diag = torch.diagonal(h)
    perm = torch.argsort(diag, descending=True, stable=True) if act_order else torch.arange(k, device=h.device)
    hp = h[perm][:, perm].double()
    d = max(damp * float(diag.mean()), 1e-5)
    eye = torch.eye(k, dtype=torch.float64, device=h.device)
    for attempt in range(1, CHOLESKY_ATTEMPTS + 1):
        lower, info = torch.linalg.cholesky_ex(hp + attempt * d * eye)
        if int(info) == 0:
            upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
            if int(info) == 0 and torch.isfinite(upper).all():
                return Prepared(perm, upper.float())
    raise ExlError(f"the Hessian of a {k}-input layer is not positive definite even after {CHOLESKY_ATTEMPTS} "
                   f"rounds of damping; the calibration activations are degenerate (NaN or all zero?)")


# ----------------------------------------------------------------------------------------------- group scales

# A scale rule chooses, for a batch of groups' current rows [B, rows, N] at widths bits [B] (f32), the effective
# per-column scales [B, N] (fp16 values, held in f32) and what the file stores for them, batched: name ->
# [B, ...]. It must not synchronise with the host (on CUDA it runs inside a CUDA graph).
ScaleRule = Callable[[Tensor, Tensor], tuple[Tensor, dict[str, Tensor]]]


def exl2_scale(w: Tensor, bits: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """§10.5: 4-bit quadratic scale codes qs relative to the group maximum, then a common factor p chosen on a
    97-point grid minimising sum |dequant - w|^3.5. The grid is searched coarse to fine (every 16th point, then
    every 4th and then every point within half the previous step of the best so far: 17 evaluations), which
    finds the grid minimum whenever the error is unimodal at each scale. Returns the scales the loader will
    compute from the stored numbers (exl2-format.md §5)."""
    half = torch.exp2(bits - 1)                                         # [B] zero point 2^(bits-1)
    amax = w.abs().amax(1) + 1e-12                                     # [B, N]
    base = amax / ((2 * half - 1) / 2)[:, None]                         # maxq / 2
    top = base.amax(1, keepdim=True)                                    # [B, 1]
    qs = torch.clamp(torch.round(16 * torch.sqrt(base / top)), 1, 16)  # [B, N] in 1..16
    s = (qs / 16) ** 2 * top
    grid = torch.linspace(*SCALE_GRID, device=w.device)
    steps = torch.arange(-2, 3, device=w.device)
    r = (w / s[:, None, :])[:, None]                                    # [B, 1, rows, N]
    weight = s.pow(3.5)[:, :, None]                                     # [B, N, 1]
    bounds = (-half[:, None, None, None], (half - 1)[:, None, None, None])
    best = None
    for stride in GRID_STRIDES:
        if best is None:
            points = torch.arange(0, len(grid), stride, device=w.device).expand(w.shape[0], -1)
        else:
            points = (best + stride * steps).clamp_(0, len(grid) - 1)   # [B, 5], includes best
        err = _grid_error(r, weight, grid[points], bounds)              # [B, P]
        best = points.gather(1, err.argmin(1, keepdim=True))            # [B, 1]
    scale_max = (top * grid[best]).half()[:, 0]                         # stored q_scale_max [B]
    m = (scale_max.float() * 2.0 ** -8).half().float()                  # loader's prescale, may be subnormal
    scale = ((qs ** 2) * m[:, None]).half().float()
    return scale, {"scale_codes": qs.to(torch.int64), "scale_max": scale_max}


def _grid_error(r: Tensor, weight: Tensor, factors: Tensor, bounds: tuple[Tensor, Tensor]) -> Tensor:
    """sum |clamp(rint(w / (s p))) * s p - w|^3.5 [B, P] for factors p [B, P], computed as
    sum_n s_n^3.5 sum_rows |clamp(rint(r / p)) p - r|^3.5 from r = w / s [B, 1, rows, N] and s^3.5 [B, N, 1],
    in place (this is the converter's hottest loop)."""
    chunk = max(1, max_batch_elements(r.device) // 16 // r.numel())
    out = []
    for i in range(0, factors.shape[1], chunk):
        p = factors[:, i: i + chunk, None, None]                        # [B, P, 1, 1]
        y = r * (1.0 / p)                                               # [B, P, rows, N]
        y.round_().clamp_(*bounds).mul_(p).sub_(r).abs_()
        root, square = y.sqrt(), y * y
        y.mul_(square).mul_(root)                                       # |d|^3.5 without pow()
        out.append(torch.bmm(y.sum(2), weight)[:, :, 0])                # [B, P]
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def gptq_sym_scale(w: Tensor, bits: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """gptq-format.md §5, symmetric: scale = 2 max|w| / maxq (an all-zero column uses max|w| = 1), stored fp16."""
    amax = w.abs().amax(1)                                              # [B, N]
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    scale = (2 * amax / (torch.exp2(bits) - 1)[:, None]).half()
    return scale.float(), {"scales": scale}


def max_batch_elements(device: torch.device) -> int:
    """Weights [S, K, N] quantized in one batch (and the grid search's working size, / 16): MAX_BATCH_ELEMENTS,
    or on a GPU with more memory a share of its total memory (not of the free memory: the batches, and so the
    results, must not depend on what else is allocated)."""
    if device.type != "cuda":
        return MAX_BATCH_ELEMENTS
    total = torch.cuda.get_device_properties(device).total_memory
    return max(MAX_BATCH_ELEMENTS, total // BATCH_BYTES_PER_ELEMENT)


# ----------------------------------------------------------------------------------------------- quantization


@dataclass
class QuantizedLinear:
    """One linear under one setting. Rows are in stored (act-order) order unless said otherwise."""
    perm: Tensor                      # [K] int64
    groups: list[tuple[int, int]]     # (bits, rows) per group
    codes: Tensor                     # uint8 [K, N]
    group_data: list[dict[str, Tensor]]   # per group, what the scale rule stores
    weight: Tensor                    # fp16 [N, K]: the dequantized weight in HF layout (original row order)


def quantize(weight: Tensor, prepared: Prepared, layouts: list[list[tuple[int, int]]],
             rule: ScaleRule) -> list[QuantizedLinear]:
    """GPTQ-quantizes weight [N, K] under each group layout ((bits, rows) per group, stored order)."""
    n, k = weight.shape
    per_batch = max(1, max_batch_elements(weight.device) // (k * n))
    out = []
    for i in range(0, len(layouts), per_batch):
        out += _quantize_batch(weight, prepared, layouts[i: i + per_batch], rule)
    return out


def _quantize_batch(weight: Tensor, prepared: Prepared, layouts: list[list[tuple[int, int]]],
                    rule: ScaleRule) -> list[QuantizedLinear]:
    n, k = weight.shape
    n_set = len(layouts)
    device, hinv = weight.device, prepared.hinv
    w = weight.float().T[prepared.perm].contiguous()                   # [K, N] stored order
    w = w.expand(n_set, k, n).clone()                                   # [S, K, N]
    codes = torch.empty(n_set, k, n, dtype=torch.uint8, device=device)
    dequant = torch.empty(n_set, k, n, dtype=torch.float16, device=device)
    starts, bounds = _plan(layouts, k, device)
    group_data: list[list[dict[str, Tensor]]] = [[] for _ in layouts]
    graphs = _captures(device)
    pool = torch.cuda.graph_pool_handle() if graphs else None
    block = _Block(n_set, n, device, pool)
    rules: dict[tuple[int, int], ScaleRule] = {}
    for t, a in enumerate(range(0, k, BLOCK)):
        b = a + BLOCK
        for start in starts[t]:                                          # groups starting here, by size
            shape = (len(start.members), start.rows)
            if shape not in rules:
                rules[shape] = _GraphedRule(rule, *shape, n, device, pool) if graphs else rule
            rows = w[:, a: a + start.rows]
            scale, data = rules[shape](rows if start.idx is None else rows[start.idx], start.bits)
            if start.idx is None:
                block.scale.copy_(scale)
            else:
                block.scale[start.idx] = scale
            parts = {name: v.unbind(0) for name, v in data.items()}
            for j, i in enumerate(start.members):
                group_data[i].append({name: v[j] for name, v in parts.items()})
        if starts[t]:
            block.set_groups(bounds[t])
        block.w.copy_(w[:, a: b])
        block.hinv.copy_(hinv[a: b, a: b])
        block.step()
        codes[:, a: b] = block.q
        dequant[:, a: b] = block.dq
        if b < k:
            w[:, b:] -= torch.matmul(hinv[a: b, b:].T, block.err)        # [K-b, 32] @ [S, 32, N]
    inv = torch.argsort(prepared.perm)
    return [QuantizedLinear(prepared.perm, layouts[s], codes[s], group_data[s], dequant[s][inv].T.contiguous())
            for s in range(n_set)]


@dataclass
class _Start:
    """Settings whose next group starts at a block, all with groups of `rows` rows."""
    rows: int
    members: list[int]               # the settings, ascending
    idx: Tensor | None               # the same on the device (None: every setting of the batch)
    bits: Tensor                     # [B] f32: their groups' widths


def _plan(layouts: list[list[tuple[int, int]]], k: int,
          device: torch.device) -> tuple[list[list[_Start]], Tensor]:
    """Per block: the groups starting there, batched by size; and per block the (lo, hi, zero) of every setting's
    current group [K/32, 3, S, 1] f32 (q - zero is clamped to [lo, hi] = [-2^(b-1), 2^(b-1) - 1]). Made on the
    host and moved to the device in one copy each, so the block loop never waits for the host."""
    n_blocks = k // BLOCK
    starts = [_group_starts(layout, k) for layout in layouts]
    half = [[0.0] * len(layouts) for _ in range(n_blocks)]
    by_block: list[dict[int, list[int]]] = [{} for _ in range(n_blocks)]
    for i, layout_starts in enumerate(starts):
        for row, (bits, rows) in layout_starts.items():
            by_block[row // BLOCK].setdefault(rows, []).append(i)
            for t in range(row // BLOCK, (row + rows) // BLOCK):
                half[t][i] = float(2 ** (bits - 1))
    flat_idx, flat_bits = [], []
    for t, groups in enumerate(by_block):
        for rows, members in sorted(groups.items()):
            flat_idx += members
            flat_bits += [float(starts[i][t * BLOCK][0]) for i in members]
    idx_all = torch.tensor(flat_idx, dtype=torch.int64).to(device)
    bits_all = torch.tensor(flat_bits, dtype=torch.float32).to(device)
    out, pos = [], 0
    for groups in by_block:
        block = []
        for rows, members in sorted(groups.items()):
            every = len(members) == len(layouts)
            end = pos + len(members)
            block.append(_Start(rows, members, None if every else idx_all[pos: end], bits_all[pos: end]))
            pos = end
        out.append(block)
    h = torch.tensor(half, dtype=torch.float32)                         # [K/32, S]
    bounds = torch.stack((-h, h - 1, h), dim=1)[..., None].to(device)   # [K/32, 3, S, 1]
    return out, bounds


class _Block:
    """One block of 32 rows for all S settings at once, in static buffers: the block's rows w (error-compensated in
    place), its part of hinv, the current groups' scales and bounds; out come q (the codes), dq (the dequantized
    fp16 rows) and err (the scaled errors for the lazy update). The row loop is 7 operations a row on [S, N]
    tiles, captured once as a CUDA graph on CUDA (one launch per block); eager on the CPU."""

    def __init__(self, s: int, n: int, device: torch.device, pool):
        self.w = torch.zeros(s, BLOCK, n, device=device)
        self.hinv = torch.eye(BLOCK, device=device)                     # [32, 32]
        self.scale = torch.ones(s, n, device=device)
        self.safe = torch.ones(s, n, device=device)                     # scale, inf where a group is all zero
        self.bounds = torch.zeros(3, s, 1, device=device)               # lo, hi, zero per setting
        self.q = torch.zeros(s, BLOCK, n, device=device)
        self.dq = torch.zeros(s, BLOCK, n, dtype=torch.float16, device=device)
        self.err = torch.zeros(s, BLOCK, n, device=device)
        self._inf = torch.tensor(float("inf"), device=device)
        self._rows = [(self.w[:, j], self.q[:, j], self.dq[:, j], self.err[:, j], self.err[:, j, None],
                       self.hinv[j, j], self.hinv[j, None, :, None]) for j in range(BLOCK)]
        self.step = _graphed(self._rows_loop, device, pool)

    def set_groups(self, bounds: Tensor) -> None:
        """After new groups started: their bounds [3, S, 1] in; a scale of 0 (a group of zeros) gets the safe
        divisor inf, so its codes come out as the zero point and its weights as 0."""
        self.bounds.copy_(bounds)
        torch.where(self.scale > 0, self.scale, self._inf, out=self.safe)

    def _rows_loop(self) -> None:
        lo, hi, zero = self.bounds
        for x, q, dq, e, e_row, d, h_row in self._rows:
            torch.div(x, self.safe, out=q)
            q.round_().clamp_(lo, hi)                                   # q - zero
            torch.mul(q, self.scale, out=dq)                            # what the loader reconstructs (fp16)
            torch.sub(x, dq, out=e).div_(d)
            self.w.addcmul_(h_row, e_row, value=-1)                     # rows above this one: h_row is 0 there
        self.q.add_(zero[:, :, None])                                   # codes


class _GraphedRule:
    """A scale rule for one batch shape [B, rows, N] as a CUDA graph over static inputs."""

    def __init__(self, rule: ScaleRule, b: int, rows: int, n: int, device: torch.device, pool):
        self.rule = rule
        self.w = torch.zeros(b, rows, n, device=device)
        self.bits = torch.full((b,), 4.0, device=device)
        self.step = _graphed(self._run, device, pool)

    def _run(self) -> None:
        self.out = self.rule(self.w, self.bits)

    def __call__(self, w: Tensor, bits: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        self.w.copy_(w)
        self.bits.copy_(bits)
        self.step()
        scale, data = self.out                                          # overwritten by the next replay
        return scale, {name: v.clone() for name, v in data.items()}


def _captures(device: torch.device) -> bool:
    """Whether the block and scale steps run as CUDA graphs (on CUDA; the CPU runs them eagerly)."""
    return device.type == "cuda"


def _graphed(fn: Callable[[], None], device: torch.device, pool) -> Callable[[], None]:
    """fn itself on the CPU (pool None); on CUDA fn captured once as a CUDA graph (after one warm-up run on a side
    stream, as capture requires), whose replay runs all its kernels for one launch. fn works on static buffers
    only; the graphs of one batch share a memory pool (they run one after another). Captured with capture_begin /
    capture_end rather than torch.cuda.graph, which synchronises the device and empties the allocator's cache at
    every capture (dozens a layer); thread-local so that the states writer's copy in another thread
    (job.StatesWriter) cannot invalidate a capture."""
    if pool is None:
        return fn
    current, stream = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    stream.wait_stream(current)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            fn()
        finally:
            graph.capture_end()
    current.wait_stream(stream)
    return graph.replay


def _group_starts(layout: list[tuple[int, int]], k: int) -> dict[int, tuple[int, int]]:
    starts, row = {}, 0
    for bits, rows in layout:
        if row % BLOCK or rows % BLOCK:
            raise ValueError(f"group layout {layout}: groups must start and end on multiples of {BLOCK} rows")
        starts[row] = (bits, rows)
        row += rows
    if row != k:
        raise ValueError(f"group layout {layout} covers {row} rows, the layer has {k}")
    return starts

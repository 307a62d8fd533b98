"""GPTQ with per-group bit widths (ExLlamaV2's AdaptiveGPTQ, exl2-format.md §10.3-§10.5), and the plain GPTQ
group quantizer of the GPTQ format (gptq-format.md §5, §10).

One call quantizes one linear under several settings at once (the measurement tries up to 15 per projection):
the settings share the Hessian, its permutation and its inverse, and differ only in how rows are grouped.
Rows are processed in blocks of 32 (every group boundary is a multiple of 32 rows), error compensation inside
the block row by row, then one lazy update of all later rows per block; this is the same arithmetic as
updating after every group."""
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

# A scale rule chooses, for a batch of groups' current rows [B, rows, N] at `bits`, the effective per-column
# scales [B, N] (fp16 values, held in f32) and, per group, the values the file stores for them.
ScaleRule = Callable[[Tensor, int], tuple[Tensor, list[dict[str, Tensor]]]]


def exl2_scale(w: Tensor, bits: int) -> tuple[Tensor, list[dict[str, Tensor]]]:
    """§10.5: 4-bit quadratic scale codes qs relative to the group maximum, then a common factor p chosen on a
    97-point grid minimising sum |dequant - w|^3.5. The grid is searched coarse to fine (every 16th point, then
    every 4th and then every point within half the previous step of the best so far: 17 evaluations), which
    finds the grid minimum whenever the error is unimodal at each scale. Returns the scales the loader will
    compute from the stored numbers (exl2-format.md §5)."""
    maxq = 2 ** bits - 1
    amax = w.abs().amax(1) + 1e-12                                     # [B, N]
    base = amax / (maxq / 2)
    top = base.amax(1, keepdim=True)                                    # [B, 1]
    qs = torch.clamp(torch.round(16 * torch.sqrt(base / top)), 1, 16)  # [B, N] in 1..16
    s = (qs / 16) ** 2 * top
    grid = torch.linspace(*SCALE_GRID, device=w.device)
    steps = torch.arange(-2, 3, device=w.device)
    best = torch.full((w.shape[0],), len(grid) // 2, device=w.device, dtype=torch.int64)
    for stride in GRID_STRIDES:
        if stride == GRID_STRIDES[0]:
            points = torch.arange(0, len(grid), stride, device=w.device).expand(w.shape[0], -1)
        else:
            points = (best[:, None] + stride * steps).clamp(0, len(grid) - 1)   # [B, 5], includes best
        err = _grid_error(w, s, grid[points], bits)                      # [B, P]
        best = points.gather(1, err.argmin(1, keepdim=True))[:, 0]
    scale_max = (top[:, 0] * grid[best]).half()                         # stored q_scale_max [B]
    m = (scale_max.float() * 2.0 ** -8).half().float()                  # loader's prescale, may be subnormal
    scale = ((qs ** 2) * m[:, None]).half().float()
    return scale, [{"scale_codes": qs[i].to(torch.int64), "scale_max": scale_max[i]} for i in range(w.shape[0])]


def _grid_error(w: Tensor, s: Tensor, factors: Tensor, bits: int) -> Tensor:
    """w [B, rows, N], s [B, N], factors [B, P] -> sum |clamp(rint(w / (s p))) * s p - w|^3.5 [B, P], computed
    as sum_n s_n^3.5 sum_rows |clamp(rint(r / p)) p - r|^3.5 with r = w / s, in place (this is the converter's
    hottest loop)."""
    half = 2 ** (bits - 1)
    r = (w / s[:, None, :])[:, None]                                    # [B, 1, rows, N]
    weight = s.pow(3.5)[:, :, None]                                     # [B, N, 1]
    chunk = max(1, MAX_BATCH_ELEMENTS // 16 // w.numel())
    out = []
    for i in range(0, factors.shape[1], chunk):
        p = factors[:, i: i + chunk, None, None]                        # [B, P, 1, 1]
        y = r * (1.0 / p)                                               # [B, P, rows, N]
        y.round_().clamp_(-half, half - 1).mul_(p).sub_(r).abs_()
        root, square = y.sqrt(), y * y
        y.mul_(square).mul_(root)                                       # |d|^3.5 without pow()
        out.append(torch.bmm(y.sum(2), weight)[:, :, 0])                # [B, P]
    return torch.cat(out, dim=1)


def gptq_sym_scale(w: Tensor, bits: int) -> tuple[Tensor, list[dict[str, Tensor]]]:
    """gptq-format.md §5, symmetric: scale = 2 max|w| / maxq (an all-zero column uses max|w| = 1), stored fp16."""
    amax = w.abs().amax(1)                                              # [B, N]
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    scale = (2 * amax / (2 ** bits - 1)).half()
    return scale.float(), [{"scales": scale[i]} for i in range(w.shape[0])]


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
    per_batch = max(1, MAX_BATCH_ELEMENTS // (k * n))
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
    starts = [_group_starts(layout, k) for layout in layouts]
    group_data: list[list[dict[str, Tensor]]] = [[] for _ in layouts]
    scale = torch.ones(n_set, n, device=device)
    zero = torch.zeros(n_set, 1, device=device)
    maxq = torch.zeros(n_set, 1, device=device)
    for a in range(0, k, BLOCK):
        b = a + BLOCK
        starting: dict[tuple[int, int], list[int]] = {}                  # groups starting here, by (bits, rows)
        for i, layout_starts in enumerate(starts):
            if a in layout_starts:
                starting.setdefault(layout_starts[a], []).append(i)
        for (bits, rows), batch in starting.items():
            idx = torch.tensor(batch, device=device)
            scale[idx], data = rule(w[idx, a: a + rows], bits)          # from the error-compensated rows
            for i, d in zip(batch, data):
                group_data[i].append(d)
            zero[idx], maxq[idx] = 2 ** (bits - 1), 2 ** bits - 1
        usable = scale > 0                                               # a group of zeros has scale 0
        safe = torch.where(usable, scale, torch.ones_like(scale))
        err = torch.empty(n_set, BLOCK, n, device=device)
        for c in range(a, b):
            x = w[:, c]                                                  # [S, N]
            q = torch.round(x / safe).masked_fill_(~usable, 0).add_(zero).clamp_(min=0)
            q = torch.minimum(q, maxq)
            dq = ((q - zero) * scale).half()                             # what the loader reconstructs
            e = (x - dq.float()).div_(hinv[c, c])
            w[:, c + 1: b].addcmul_(hinv[c, c + 1: b][None, :, None], e[:, None, :], value=-1)
            err[:, c - a] = e
            codes[:, c] = q
            dequant[:, c] = dq
        if b < k:
            w[:, b:] -= torch.matmul(hinv[a:b, b:].T, err)              # [K-b, 32] @ [S, 32, N]
    inv = torch.argsort(prepared.perm)
    return [QuantizedLinear(prepared.perm, layouts[s], codes[s], group_data[s], dequant[s][inv].T.contiguous())
            for s in range(n_set)]


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

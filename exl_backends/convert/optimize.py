"""Choosing one measured candidate per sub-layer so the decoder's bits per weight hit the target.

Objective as ExLlamaV2's (exl2-format.md §10.8): minimise sum(err^eta) over sub-layers, err = 1 - accuracy,
with eta picked from a sweep of 1.5..3.5 as the one whose solution has the smallest maximum error. Where
ExLlamaV2 searches by simulated annealing, this solves each eta exactly by dynamic programming over the total
cost (a knapsack with one choice per slot, costs on a grid of 1e-4 bpw), and it requires the result to land
in [target - tolerance, target]: the issue asks for the written bpw within ±0.02 of the target, and an
annealed solution only guarantees staying below it. Deterministic: no random numbers."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ExlError

TOLERANCE = 0.02
GRID_BPW = 1e-4
ETAS = np.linspace(1.5, 3.5, 17)


@dataclass(frozen=True)
class Option:
    bits: int        # total bits of the sub-layer's packed projections
    err: float       # 1 - accuracy


@dataclass(frozen=True)
class Solution:
    choice: list[int]     # option index per slot
    bits: int
    bpw: float
    max_err: float
    eta: float


def optimize(slots: list[list[Option]], n_weights: int, target_bpw: float,
             tolerance: float = TOLERANCE) -> Solution:
    """slots: the options of every sub-layer; n_weights: sum of K*N over all of them."""
    unit = GRID_BPW * n_weights                                   # bits per grid step
    low, high = _reachable(slots, n_weights)
    if not low - tolerance <= target_bpw <= high + tolerance:
        raise ExlError(f"target {target_bpw} bpw is out of reach for this model: its candidate settings give "
                       f"{low:.3f} to {high:.3f} bpw (decoder layers, head not counted)")
    window = (int(np.floor((target_bpw - tolerance) / GRID_BPW)), int(np.floor(target_bpw / GRID_BPW)))
    best = None
    for eta in ETAS:
        sol = _solve(slots, unit, window, float(eta), n_weights)
        if sol is None:
            continue
        if best is None or (sol.max_err, _objective(slots, sol.choice, 1.0)) < \
                (best.max_err, _objective(slots, best.choice, 1.0)):
            best = sol
    if best is None:
        raise ExlError(f"no combination of candidate settings lands within {tolerance} bpw below {target_bpw} "
                       f"for this model (reachable {low:.3f} to {high:.3f}); try a target a little higher or lower")
    return best


def _reachable(slots: list[list[Option]], n_weights: int) -> tuple[float, float]:
    return (sum(min(o.bits for o in s) for s in slots) / n_weights,
            sum(max(o.bits for o in s) for s in slots) / n_weights)


def _objective(slots: list[list[Option]], choice: list[int], eta: float) -> float:
    return sum(slots[i][c].err ** eta for i, c in enumerate(choice))


def _solve(slots: list[list[Option]], unit: float, window: tuple[int, int], eta: float,
           n_weights: int) -> Solution | None:
    """Exact minimum of sum(err^eta) with the total cost (in grid steps) inside window."""
    size = window[1] + 1
    best = np.full(size, np.inf)
    best[0] = 0.0
    picks = np.zeros((len(slots), size), dtype=np.int16)
    for i, options in enumerate(slots):
        nxt = np.full(size, np.inf)
        for j, o in enumerate(options):
            step = int(round(o.bits / unit))
            if step >= size:
                continue
            cand = np.full(size, np.inf)
            cand[step:] = best[:size - step] + max(o.err, 0.0) ** eta
            better = cand < nxt
            nxt[better] = cand[better]
            picks[i, better] = j
        best = nxt
    lo = max(window[0], 0)
    if not np.isfinite(best[lo:]).any():
        return None
    at = lo + int(np.argmin(best[lo:]))
    choice = []
    for i in range(len(slots) - 1, -1, -1):
        j = int(picks[i, at])
        choice.append(j)
        at -= int(round(slots[i][j].bits / unit))
    choice.reverse()
    bits = sum(slots[i][c].bits for i, c in enumerate(choice))
    return Solution(choice, bits, bits / n_weights, max(slots[i][c].err for i, c in enumerate(choice)), eta)

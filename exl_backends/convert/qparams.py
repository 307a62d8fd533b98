"""Quantization settings of one linear layer (QParams) and the candidate tables the measurement tries.

The tables are ExLlamaV2's (exllamav2/conversion/qparams.py, see exl2-format.md §10.6), reproduced number for
number so that measurement files are interchangeable with official ones."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class QParams:
    """`proportions[i]` of the K input rows at `bits[i]` (non-increasing) in groups of `group_sizes[i]` rows."""
    bits: tuple[int, ...]
    proportions: tuple[float, ...]
    group_sizes: tuple[int, ...]
    scale_bits: int = 4

    def desc(self) -> str:
        """ExLlamaV2's notation, e.g. '0.1:4b_128g/0.9:3b_128g s4'."""
        parts = "/".join(f"{p}:{b}b_{g}g" for b, p, g in zip(self.bits, self.proportions, self.group_sizes))
        return f"{parts} s{self.scale_bits}"

    def groups(self, k: int) -> list[tuple[int, int]]:
        """(bits, rows) of every group in stored-row order for k input rows; the last group ends at row k."""
        out, remaining = [], k
        for b, p, gs in zip(self.bits, self.proportions, self.group_sizes):
            n = max(0, math.ceil(min(k * p, remaining) / gs))
            out += [(b, gs)] * n
            remaining -= n * gs
        if remaining > 0:
            raise ValueError(f"{self.desc()} leaves {remaining} of {k} rows without a group")
        clipped, seen = [], 0
        for b, rows in out:
            rows = min(rows, k - seen)
            clipped.append((b, rows))
            seen += rows
        return clipped

    def total_bits(self, k: int, n: int, bias: bool = False) -> int:
        """Bits the packed layer takes (§10.6): codes, q_scale_max, q_groups, q_scale, q_invperm, bias."""
        groups = self.groups(k)
        bits = sum(rows * n * b for b, rows in groups)
        bits += len(groups) * (16 + 32 + self.scale_bits * n) + 32 * k
        return bits + (16 * n if bias else 0)

    def to_dict(self) -> dict:
        """The measurement.json form: group sizes keyed by the width as a string."""
        return {"group_size": {str(b): g for b, g in zip(self.bits, self.group_sizes)},
                "bits": list(self.bits), "bits_prop": list(self.proportions), "scale_bits": self.scale_bits}

    @classmethod
    def from_dict(cls, d: dict) -> "QParams":
        bits = tuple(int(b) for b in d["bits"])
        gs = d["group_size"]
        sizes = tuple(int(gs[str(b)]) for b in bits) if isinstance(gs, dict) else (int(gs),) * len(bits)
        return cls(bits, tuple(float(p) for p in d["bits_prop"]), sizes, int(d.get("scale_bits", 4)))


def qp(group_size: int | tuple[int, ...], bits: tuple[int, ...], proportions: tuple[float, ...]) -> QParams:
    sizes = group_size if isinstance(group_size, tuple) else (group_size,) * len(bits)
    return QParams(bits, proportions, sizes)


# Joint candidates per attention block: (q, k, v, o).
ATTN_CANDIDATES: list[tuple[QParams, ...]] = [
    (qp(64, (3, 2), (0.05, 0.95)), qp(64, (3, 2), (0.05, 0.95)), qp(64, (3, 2), (0.05, 0.95)),
     qp(64, (3, 2), (0.05, 0.95))),
    (qp(64, (3, 2), (0.1, 0.9)), qp(64, (3, 2), (0.1, 0.9)), qp(64, (3, 2), (0.25, 0.75)), qp(64, (3, 2), (0.1, 0.9))),
    (qp(64, (3, 2), (0.1, 0.9)), qp(64, (3, 2), (0.1, 0.9)), qp(128, (4, 3), (0.1, 0.9)), qp(64, (3, 2), (0.1, 0.9))),
    (qp(64, (3, 2), (0.1, 0.9)), qp(64, (3, 2), (0.1, 0.9)), qp(128, (4, 3), (0.1, 0.9)), qp(128, (4, 3), (0.1, 0.9))),
    (qp(128, (4, 3), (0.1, 0.9)), qp(128, (4, 3), (0.1, 0.9)), qp(128, (4, 3), (0.1, 0.9)),
     qp(128, (4, 3), (0.1, 0.9))),
    (qp(128, (4, 3), (0.1, 0.9)), qp(128, (4, 3), (0.1, 0.9)), qp(64, (4, 3), (0.1, 0.9)), qp(128, (4, 3), (0.1, 0.9))),
    (qp(128, (4,), (1,)), qp(128, (4,), (1,)), qp(128, (4,), (1,)), qp(128, (4,), (1,))),
    (qp(128, (4,), (1,)), qp(128, (4,), (1,)), qp(64, (4,), (1,)), qp(128, (4,), (1,))),
    (qp(64, (4,), (1,)), qp(64, (4,), (1,)), qp(32, (4,), (1,)), qp(64, (4,), (1,))),
    (qp(32, (4,), (1,)), qp(32, (4,), (1,)), qp(32, (4,), (1,)), qp(32, (4,), (1,))),
    (qp(128, (5, 4), (0.1, 0.9)), qp(128, (5, 4), (0.1, 0.9)), qp(64, (5, 4), (0.1, 0.9)), qp(128, (5, 4), (0.1, 0.9))),
    (qp(64, (5, 4), (0.1, 0.9)), qp(64, (5, 4), (0.1, 0.9)), qp(32, (5, 4), (0.1, 0.9)), qp(64, (5, 4), (0.1, 0.9))),
    (qp(64, (5, 4), (0.1, 0.9)), qp(64, (5, 4), (0.1, 0.9)), qp(64, (5,), (1,)), qp(64, (5, 4), (0.1, 0.9))),
    (qp(32, (5, 4), (0.1, 0.9)), qp(32, (5, 4), (0.1, 0.9)), qp(32, (5,), (1,)), qp(32, (5, 4), (0.1, 0.9))),
    (qp(128, (6, 5), (0.1, 0.9)), qp(128, (6, 5), (0.1, 0.9)), qp(128, (6,), (1,)), qp(128, (6, 5), (0.1, 0.9))),
    (qp(32, (6, 5), (0.1, 0.9)), qp(32, (6, 5), (0.1, 0.9)), qp(32, (6,), (1,)), qp(32, (6, 5), (0.1, 0.9))),
    (qp(128, (6,), (1,)), qp(128, (6,), (1,)), qp(128, (6,), (1,)), qp(128, (6,), (1,))),
    (qp(32, (6,), (1,)), qp(32, (6,), (1,)), qp(32, (8,), (1,)), qp(32, (6,), (1,))),
    (qp(128, (8,), (1,)), qp(128, (8,), (1,)), qp(128, (8,), (1,)), qp(128, (8,), (1,))),
]

# Joint candidates per MLP block: (gate, up, down).
MLP_CANDIDATES: list[tuple[QParams, ...]] = [
    (qp(64, (3, 2), (0.05, 0.95)), qp(64, (3, 2), (0.05, 0.95)), qp((32, 64, 64), (6, 3, 2), (0.05, 0.2, 0.75))),
    (qp(64, (3, 2), (0.1, 0.9)), qp(64, (3, 2), (0.25, 0.75)), qp((32, 64, 64), (6, 3, 2), (0.05, 0.2, 0.75))),
    (qp(64, (3, 2), (0.1, 0.9)), qp(64, (3, 2), (0.3, 0.7)), qp(32, (5, 3), (0.05, 0.95))),
    (qp(64, (3, 2), (0.1, 0.9)), qp(64, (3, 2), (0.3, 0.7)), qp(32, (5, 4), (0.05, 0.95))),
    (qp(128, (4, 3), (0.1, 0.9)), qp(128, (4, 3), (0.25, 0.75)), qp((32, 128, 128), (8, 4, 3), (0.05, 0.1, 0.85))),
    (qp(32, (4, 3), (0.1, 0.9)), qp(32, (4, 3), (0.25, 0.75)), qp((32, 32, 32), (8, 4, 3), (0.05, 0.1, 0.85))),
    (qp(32, (4, 3), (0.1, 0.9)), qp(32, (4, 3), (0.25, 0.75)), qp((32, 128), (8, 4), (0.05, 0.95))),
    (qp(128, (4,), (1,)), qp(32, (4,), (1,)), qp((32, 128), (8, 4), (0.05, 0.95))),
    (qp(32, (4,), (1,)), qp(32, (4,), (1,)), qp((32, 32), (8, 4), (0.05, 0.95))),
    (qp(128, (5, 4), (0.1, 0.9)), qp(128, (5, 4), (0.25, 0.75)), qp((32, 128, 128), (8, 5, 4), (0.05, 0.1, 0.85))),
    (qp(32, (5, 4), (0.1, 0.9)), qp(32, (5, 4), (0.25, 0.75)), qp((32, 32, 32), (8, 5, 4), (0.05, 0.1, 0.85))),
    (qp(128, (6, 5), (0.1, 0.9)), qp(128, (6, 5), (0.25, 0.75)), qp((32, 128, 128), (8, 6, 5), (0.05, 0.1, 0.85))),
    (qp(32, (6, 5), (0.1, 0.9)), qp(32, (6, 5), (0.25, 0.75)), qp((32, 32, 32), (8, 6, 5), (0.05, 0.1, 0.85))),
    (qp(128, (6,), (1,)), qp(128, (6,), (1,)), qp((32, 128), (8, 6), (0.05, 0.95))),
    (qp(128, (8, 6), (0.1, 0.9)), qp(128, (8, 6), (0.1, 0.9)), qp(128, (8, 6), (0.15, 0.85))),
    (qp(128, (8, 6), (0.1, 0.9)), qp(128, (8, 6), (0.1, 0.9)), qp(128, (8,), (1,))),
    (qp(128, (8,), (1,)), qp(128, (8,), (1,)), qp(128, (8,), (1,))),
]

# `--head-bits` options for lm_head (never measured, never counted in the target).
HEAD_OPTIONS: dict[int, QParams] = {
    2: qp(32, (4, 2), (0.3, 0.7)),
    3: qp(32, (4, 3), (0.15, 0.85)),
    4: qp(32, (6, 4), (0.15, 0.85)),
    5: qp(128, (6, 5), (0.15, 0.85)),
    6: qp(128, (8, 6), (0.15, 0.85)),
    8: qp(128, (8,), (1.0,)),
}


def distinct(candidates: list[tuple[QParams, ...]], position: int) -> list[QParams]:
    """The different settings one projection takes over all joint candidates, in first-use order."""
    out: list[QParams] = []
    for c in candidates:
        if c[position] not in out:
            out.append(c[position])
    return out

"""Launcher of matmul_moe.cu: one projection of every expert of a mixture-of-experts layer in one launch (ExpertMatmul),
for kernels/moe.py. Layouts and plans are quant_matmul.py's."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from . import loader
from .loader import launch
from .lane_layout import LaneLayout
from .quant_matmul import MAX_PARTS, MOE_KERNELS, MOE_RESIDENT_BLOCKS, ROWS_PER_PASS, THREADS, choose_splits, make_plan


class ExpertMatmul:
    """One projection of every expert of an MoE layer (w1 and w3 as two parts of one launch, or w2), run on the rows
    routed to each expert (matmul_moe.cu: qmm::moe_matmul): only the routed experts' weights are read, and nothing
    on the host, so it can be captured in a CUDA graph. experts[e] lists expert e's layouts (taken from its
    QuantMatmul, not copied); every expert has the same parts' formats and shapes.

    Per rows class (1: each expert has at most one row, i.e. one token; 16: passes of up to 16 rows) a Params table
    [E] in device memory, planned like a single weight's launch but for `active` experts sharing the GPU (top_k)."""

    def __init__(self, experts: list[list[LaneLayout]], active: int):
        shapes = {tuple((lay.fmt, lay.k, lay.n, lay.np_) for lay in lays) for lays in experts}
        if len(shapes) != 1 or not 1 <= len(experts[0]) <= 2:
            raise ValueError("the experts of an MoE layer must have one or two parts of equal formats and shapes")
        self.fmt, self.k = experts[0][0].fmt, experts[0][0].k
        self.n = [lay.n for lay in experts[0]]
        self.np_ = max(lay.np_ for lay in experts[0])
        self.strips = max(lay.strips for lay in experts[0])
        self.n_experts = len(experts)
        device = experts[0][0].words.device
        n_sm = torch.cuda.get_device_properties(device).multi_processor_count
        self.tables, self.smem, self.blocks, self.max_splits = {}, {}, {}, {}
        for rows in (1, ROWS_PER_PASS):
            rows_class = 1 if rows == 1 else 16
            slots = max(1, MOE_RESIDENT_BLOCKS[rows_class] * n_sm // active)    # (planned as SMs of one block each)
            splits_of: dict[tuple, list[int]] = {}     # experts with equal widths share a plan
            plans = []
            for lays in experts:
                key = tuple(tuple(lay.chunk_bits) for lay in lays)
                if key not in splits_of:
                    splits_of[key] = choose_splits(lays, rows, slots, 1, rows)
                plans.append(make_plan(MOE_KERNELS[self.fmt, rows_class], lays, [None] * len(lays),
                                       [None] * len(lays), splits_of[key], rows))
            params = np.stack([plan.params for plan in plans])
            self.tables[rows] = torch.from_numpy(params.view(np.uint8).reshape(-1).copy()).to(device)
            self.smem[rows] = max(plan.smem for plan in plans)
            self.blocks[rows] = max(plan.blocks for plan in plans)
            self.max_splits[rows] = max(max(split) for split in splits_of.values())
        self.bytes_per_expert = max(sum(lay.nbytes() for lay in lays) for lays in experts)

    def forward(self, x: Tensor, offsets: Tensor, counts: Tensor, max_rows: int) -> list[Tensor]:
        """x [S, K] fp16, its rows sorted by expert: rows offsets[e] .. + counts[e] - 1 (int32 [E], on the device)
        go to expert e; max_rows: a bound on any count (the tokens of the pass). Returns one [S, n_i] per part."""
        s = x.shape[0]
        rows = 1 if max_rows <= 1 else ROWS_PER_PASS
        passes = -(-max_rows // rows)
        ys = [torch.empty(s, n, dtype=torch.float16, device=x.device) for n in self.n]
        ws_part = self.max_splits[rows] * s * self.np_ if self.max_splits[rows] > 1 else 0
        ws = torch.empty(len(self.n) * ws_part, dtype=torch.float32, device=x.device) if ws_part else None
        counters = loader.counters("matmul_moe", x.device, self.n_experts * passes * MAX_PARTS * self.strips)
        if s:
            launch("matmul_moe", MOE_KERNELS[self.fmt, 1 if rows == 1 else 16],
                   grid=(self.blocks[rows], self.n_experts, passes), block=(THREADS,),
                   args=(self.tables[rows], offsets, counts, s, x.contiguous(), ys[0], ys[1] if len(ys) > 1 else None,
                         ws, np.int64(ws_part), counters, self.strips), shared_mem=self.smem[rows])
        return ys

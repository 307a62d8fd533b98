"""The decode step's one-row quantized matmuls between two attention calls as one persistent launch (megakernel.cu).

How it is used: while a decode step of one sequence is captured (runner.DecodeGraph), the model runs inside
`chaining()`. Then every one-row EXL2 matmul (QuantMatmul._small, through its OneRowMatmul) does not launch its
stage_xs and matmul kernels but appends them to the chain as two ops, and returns its (not yet written) outputs. The
model calls `flush()` before anything else reads them (before RoPE + KV write, after the last block, after a
quantized head): the chain becomes one launch of decode_segment_exl2_<N> (the smallest N of SIZES that holds the
ops), which runs the ops in order, each op's blocks spread over every SM, each op waiting for the one before through
a counter in device memory. For the Llama family that is 8 launches of launch-per-op (o; norm + gate/up; silu * up +
down; the next block's norm + q/k/v) in one.

The schedule (which CTA runs which block, and what it waits on) is plain arithmetic, `schedule()`, printed by
`describe()` (`exl bench --schedule`): virtual block v of op k runs on CTA (first_k + v) % G, and op k starts on the
CTA after the one that ran op k - 1's last block, so that CTAs that got fewer blocks of one op get the first of the
next. G is every CTA that fits the GPU at once (the kernel spins on counters: all of them must be resident).

Off by default: measured on an H200 (2026-12-06) it is 5-10 % slower than launch-per-op (docs/megakernel.md);
`EXL_MEGAKERNEL=1` turns it on, for the work that folds attention in and for comparing. `EXL_MEGAKERNEL=ring` runs
the same segments with a producer warp streaming the weights through shared memory (decode_ring_exl2_<N>, megakernel.cu
RING), where a CTA's shared memory holds a ring of at least MIN_RING_SLOTS slots beside its x; else as `1`.
`EXL_MEGAKERNEL=ring-fold` also drops the stage ops: each matmul block stages the rows of x it reads after its wait
(megakernel.cu FOLDED), one all-to-all wait fewer a matmul. (ring and ring-fold are measured against each other;
the loser goes.)"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .loader import compute_capability, launch, resident_blocks

FAMILY = "megakernel"
SIZES = (2, 4, 8, 12)           # the ops a segment kernel holds (megakernel.cu decode_segment_exl2_<N>)
MAX_OPS = SIZES[-1]
THREADS = 256                   # a CTA: 8 warps, one strip each (qmm::THREADS)
RING_THREADS = THREADS + 32     # RING: the 8 warps and a producer warp
RING_SLOT = 8 * 2048            # RING: a slot, RING_PIECE bytes a consumer warp
MAX_RING_SLOTS, MIN_RING_SLOTS = 8, 3
RING_SMEM = 110 * 1024          # RING: a CTA's dynamic shared memory, two CTAs an SM (H100/H200: 227 KB)
STAGE, MATMUL = 0, 1            # megakernel.cu Kind
MIN_CC = (9, 0)                 # dependent launch (the wait before an op's first read), Hopper's L2

OP_DTYPE = np.dtype([(name, np.uint64) for name in
                     ("x", "up", "residual", "norm_w", "new_residual", "xs", "y0", "y1", "y2", "ws")] +
                    [("eps", np.float32), ("kind", np.int32), ("blocks", np.int32), ("grid_x", np.int32),
                     ("first", np.int32), ("strips_per_block", np.int32), ("params", np.int32), ("pad", np.int32)])


@functools.cache
def segment_dtype(params_dtype: np.dtype, n: int) -> np.dtype:
    """megakernel.cu's Segment<n> for the matmuls' Params struct (quant_matmul.PARAMS_DTYPE): n ops, n / 2 Params
    (a matmul and its stage share theirs)."""
    return np.dtype([("params", params_dtype, (n // 2,)), ("op", OP_DTYPE, (n,)), ("done", np.uint64),
                     ("n_ops", np.int32), ("ring_slots", np.int32), ("xs_smem", np.int32), ("ring_smem", np.int32)],
                    align=True)


def size_for(n_ops: int) -> int:
    """The smallest segment kernel that holds n_ops: every launch carries its whole argument, so a pair of ops
    should not pay for twelve."""
    return next(n for n in SIZES if n >= n_ops)


def slots_for(ops: list[Op]) -> int:
    """The ops a segment kernel must hold for ops: their count, or twice their Params (n / 2 slots) where folded
    ops bring one each."""
    return max(len(ops), 2 * len({id(op.params) for op in ops}))


def kernel_name(n_ops: int, ring: bool = False) -> str:
    return f"decode_{'ring' if ring else 'segment'}_exl2_{size_for(n_ops)}"


@dataclass
class Op:
    """One launch that the segment runs as blocks of its own: STAGE (stage_xs) or MATMUL (exl2_matmul_m1)."""
    kind: int
    blocks: int
    smem: int                   # dynamic shared memory its blocks need
    params: np.ndarray          # the matmul's Params (0-d quant_matmul.PARAMS_DTYPE), passed in the segment
    tensors: dict               # pointer fields of OP_DTYPE -> tensor (or None)
    eps: float = 0.0
    grid_x: int = 1
    name: str = ""              # for describe()
    strips_per_block: int = 0   # MATMUL: the plan's


class OneRowMatmul:
    """A QuantMatmul's one-row launch pair (stage_xs, then the matmul of `plan`, its quant_matmul.Plan for one row)
    as chain ops: the plan's Params (the segment carries them in the constant bank), its split partials. The same
    plan (splits, strips per block) as the launch: the same sums in the same order."""

    def __init__(self, plan, k: int, stage_blocks: int, device: torch.device):
        self.plan, self.k, self.stage_blocks = plan, k, stage_blocks
        self.params = plan.params
        self.ws = torch.empty(plan.ws_floats, dtype=torch.float32, device=device) if plan.ws_floats else None

    def append(self, chain: Chain, x: Tensor, before: tuple, xs: Tensor, ys: list[Tensor]) -> None:
        """x (one row; before: stage_xs's up, residual, norm_w, new_residual, eps) staged into xs, then ys = x @ W^T."""
        up, residual, norm_w, new_residual, eps = before
        name = f"{self.k} x {'+'.join(str(y.shape[-1]) for y in ys)}"
        if chain.folded:            # one op: each matmul block stages the rows it reads (megakernel.cu FOLDED)
            chain.append(Op(MATMUL, self.plan.blocks, (2 * self.k if norm_w is not None else 0) + self.plan.smem,
                            self.params, dict(x=x, up=up, residual=residual, norm_w=norm_w, new_residual=new_residual,
                                              ws=self.ws, **dict(zip(("y0", "y1", "y2"), ys))), eps,
                            strips_per_block=self.plan.threads // 32, name=name + " (staged in its blocks)"))
            return
        chain.append(Op(STAGE, self.stage_blocks * len(ys), 2 * self.k if norm_w is not None else 0, self.params,
                        dict(x=x, up=up, residual=residual, norm_w=norm_w, new_residual=new_residual, xs=xs), eps,
                        self.stage_blocks, name))
        chain.append(Op(MATMUL, self.plan.blocks, self.plan.smem, self.params,
                        dict(xs=xs, ws=self.ws, **dict(zip(("y0", "y1", "y2"), ys))),
                        strips_per_block=self.plan.threads // 32, name=name))


def enabled(device: torch.device) -> bool:
    """EXL_MEGAKERNEL=1 (or ring, ring-fold) on a GPU of compute capability 9.0+ (off by default: launch-per-op is still
    faster, docs/megakernel.md)."""
    return (device.type == "cuda" and os.environ.get("EXL_MEGAKERNEL", "0") in ("1", "ring", "ring-fold")
            and compute_capability(device) >= MIN_CC)


def ring_layout(ops: list[Op]) -> tuple[int, int, int] | None:
    """RING's dynamic shared memory for ops: (x copy offset, ring offset, slots), or None where fewer than
    MIN_RING_SLOTS slots fit beside the ops' own (a stage's row, a matmul's chunk_meta) and the longest split's x
    (64 bytes a chunk)."""
    xs_smem = -(-max(op.smem for op in ops) // 128) * 128
    chunks = max((int(np.diff(part["split_chunk"][:part["n_splits"] + 1]).max())
                  for op in ops if op.kind == MATMUL
                  for part in op.params["part"][:int(op.params["n_parts"])]), default=0)
    ring_smem = xs_smem + -(-64 * chunks // 128) * 128
    slots = min(MAX_RING_SLOTS, (RING_SMEM - ring_smem) // RING_SLOT)
    return (xs_smem, ring_smem, slots) if slots >= MIN_RING_SLOTS else None


_chain: contextvars.ContextVar[Chain | None] = contextvars.ContextVar("exl_megakernel_chain", default=None)


def counters(n_layers: int, device: torch.device) -> Tensor:
    """Zeros for the counters of a decode step's launches (chaining's `done`; made before a graph capture: a
    torch.zeros inside one would be a captured memset replayed every step): one launch ends at each layer's q/k/v,
    one after the last layer, one for a quantized head. Each launch leaves its own zero."""
    return torch.zeros((n_layers + 2) * (MAX_OPS + 1), dtype=torch.int32, device=device)


@contextlib.contextmanager
def chaining(done: Tensor | None):
    """Inside, one-row EXL2 matmuls join a chain that flush() launches as one kernel, each launch taking its
    counters from `done` (counters()); done None: a no-op. What is not flushed when it exits is flushed then."""
    if done is None:
        yield None
        return
    chain = Chain(done)
    token = _chain.set(chain)
    try:
        yield chain
    finally:
        _chain.reset(token)
    chain.flush()


def active() -> Chain | None:
    """The chain one-row matmuls append to now, if any."""
    return _chain.get()


def flush() -> None:
    """Launches what the current chain holds (nothing outside chaining())."""
    chain = _chain.get()
    if chain is not None:
        chain.flush()


class Chain:
    """The ops appended since the last flush; the segments launched so far, each with its slice of `done`."""

    def __init__(self, done: Tensor) -> None:
        self.ring = os.environ.get("EXL_MEGAKERNEL") in ("ring", "ring-fold")
        self.folded = os.environ.get("EXL_MEGAKERNEL") == "ring-fold"     # (ring_layout holds for every segment)
        self.ops: list[Op] = []
        self.done, self.used = done, 0
        self.segments: list[tuple[list[Op], int]] = []      # (ops, grid) of each launch, for describe()
        self.kernels: list[str] = []                         # the kernel of each launch

    def append(self, op: Op) -> None:
        self.ops.append(op)

    def flush(self) -> None:
        ops, self.ops = self.ops, []
        per = MAX_OPS // 2 if self.folded else MAX_OPS          # folded: a Params slot an op
        for start in range(0, len(ops), per):
            self._launch(ops[start:start + per])

    def _launch(self, ops: list[Op]) -> None:
        device = self.done.device
        ring = ring_layout(ops) if self.ring else None
        if ring is None and self.folded:
            raise ValueError("EXL_MEGAKERNEL=ring-fold: this model's x does not fit beside the weight ring in shared "
                             "memory (its stages cannot fold); use EXL_MEGAKERNEL=ring or 1")
        # every ring launch asks for RING_SMEM: the kernel's maximum is a property of the function, which a captured
        # graph's replays of the other launches must not find lowered
        smem = max(op.smem for op in ops) if ring is None else RING_SMEM
        kernel, threads = kernel_name(slots_for(ops), ring is not None), THREADS if ring is None else RING_THREADS
        grid = resident_blocks(FAMILY, kernel, threads, smem) * torch.cuda.get_device_properties(
            device).multi_processor_count
        at = self.used
        if at + len(ops) + 1 > self.done.numel():
            raise ValueError(f"megakernel counters for {len(self.segments)} launches only: make more (counters())")
        done = self.done[at:at + len(ops) + 1]
        self.used += len(ops) + 1
        launch(FAMILY, kernel, grid=(grid,), block=(threads,), args=(segment(ops, grid, done, ring),), shared_mem=smem)
        self.segments.append((ops, grid))
        self.kernels.append(kernel)


def schedule(blocks: list[int], grid: int) -> list[int]:
    """first_k of each op (its block v runs on CTA (first_k + v) % grid): each op starts where the one before ended."""
    firsts, first = [], 0
    for n in blocks:
        firsts.append(first)
        first = (first + n) % grid
    return firsts


def segment(ops: list[Op], grid: int, done: Tensor, ring: tuple[int, int, int] | None = None) -> np.ndarray:
    """The kernel's argument (megakernel.cu Segment) for ops on `grid` CTAs, with counters `done`: each distinct
    Params once (a stage and its matmul share theirs); ring: RING's shared memory (ring_layout)."""
    n = size_for(slots_for(ops))
    s = np.zeros((), segment_dtype(ops[0].params.dtype, n))
    param_slots: dict[int, int] = {}
    for i, (op, first) in enumerate(zip(ops, schedule([op.blocks for op in ops], grid))):
        slot = param_slots.setdefault(id(op.params), len(param_slots))
        if slot >= n // 2:
            raise ValueError(f"a segment of {len(ops)} ops carries at most {n // 2} matmuls' Params")
        s["params"][slot] = op.params
        rec = s["op"][i]
        for field, t in op.tensors.items():
            rec[field] = 0 if t is None else t.data_ptr()
        rec["eps"], rec["kind"], rec["blocks"], rec["grid_x"], rec["first"], rec["strips_per_block"] = \
            op.eps, op.kind, op.blocks, op.grid_x, first, op.strips_per_block
        rec["params"] = slot
    s["done"], s["n_ops"] = done.data_ptr(), len(ops)
    if ring is not None:
        s["xs_smem"], s["ring_smem"], s["ring_slots"] = ring
    return s


def describe(ops: list[Op], grid: int) -> str:
    """The schedule in words: per op, its blocks, the CTAs that run them and what it waits on."""
    lines = [f"one launch of {grid} CTAs ({THREADS} threads), {len(ops)} ops in order:"]
    for k, (op, first) in enumerate(zip(ops, schedule([op.blocks for op in ops], grid))):
        last = (first + op.blocks - 1) % grid
        span = f"CTAs {first}..{last}" if op.blocks <= grid else f"every CTA ({op.blocks / grid:.1f} blocks each)"
        wait = f"waits for op {k - 1} (done[{k - 1}] = {ops[k - 1].blocks})" if k else "waits for the launch before"
        what = "stage x" if op.kind == STAGE else "matmul"
        lines.append(f"  op {k}: {what} {op.name}: {op.blocks} blocks on {span}; {wait}; then done[{k}] += 1 a block")
    return "\n".join(lines)


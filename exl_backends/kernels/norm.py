"""Launchers for norm.cu: rmsnorm and the fused add_rmsnorm (same signatures and roundings as reference.py), and
embed_feed (the first block's norm fed by the embedding gather)."""
from __future__ import annotations

import torch
from torch import Tensor

from .loader import launch

THREADS = 256
VECTORS_PER_THREAD = (1, 2, 4, 8, 16)     # norm.cu's NV variants: a row lives in registers, up to 16 vectors each


def _kernel(name: str, dim: int, *tensors: Tensor) -> str:
    """The variant of `name` for rows of dim elements: 16-byte vectors when every row allows them (whole vectors,
    16-byte aligned rows), and the fewest vectors per thread that hold a row."""
    vec = 8 if dim % 8 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors) else 1
    nv = next((n for n in VECTORS_PER_THREAD if THREADS * vec * n >= dim), None)
    if nv is None:
        raise ValueError(f"{name}: rows of {dim} elements are longer than the kernels hold "
                         f"({THREADS * vec * VECTORS_PER_THREAD[-1]} at most{'' if vec == 8 else ' unaligned'})")
    return f"{name}_f16_v{vec}_n{nv}"


def rmsnorm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """x [T, D] fp16, w [D] fp16 -> [T, D] fp16."""
    x = x.contiguous()
    rows, dim = x.shape
    out = torch.empty_like(x)
    if rows:
        launch("norm", _kernel("rmsnorm", dim, x, w, out), grid=(rows,), block=(THREADS,),
               args=(x, w, out, dim, float(eps)))
    return out


def add_rmsnorm(x: Tensor, residual: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """residual + x -> (rmsnorm of it, the new residual), both [T, D] fp16; the inputs are left unchanged."""
    x, residual = x.contiguous(), residual.contiguous()
    rows, dim = x.shape
    out, new_residual = torch.empty_like(x), torch.empty_like(x)
    if rows:
        launch("norm", _kernel("add_rmsnorm", dim, x, residual, w, out, new_residual), grid=(rows,),
               block=(THREADS,), args=(x, residual, w, out, new_residual, dim, float(eps)))
    return out, new_residual


def embed_feed(ids: Tensor, table: Tensor, feed) -> Tensor:
    """One token's embedding row r = table[ids[0]] [1, D] (the stream's first residual), written in the same launch
    as feed's x with the norm half done (quant_matmul.NormFeed, as a producer launch leaves it), so that the first
    block's q/k/v launch (QuantMatmul.forward_fed) needs neither an embedding launch nor a stage_xs one before it.
    ids: int64 [1] on table's device, a valid row of table (fp16 [vocab, D])."""
    if ids.shape != (1,) or ids.dtype != torch.int64 or table.dtype != torch.float16:
        raise ValueError(f"embed_feed takes one int64 token id and an fp16 table, got ids {tuple(ids.shape)} "
                         f"{ids.dtype} and a {table.dtype} table")
    dim = table.shape[1]
    r = torch.empty(1, dim, dtype=torch.float16, device=table.device)
    launch("norm", "embed_feed", grid=(-(-dim // THREADS),), block=(THREADS,),
           args=(ids, table, dim, feed.w, feed.places, feed.places.shape[0], feed.staged, r, feed.sums))
    return r

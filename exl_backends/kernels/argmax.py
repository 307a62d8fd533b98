"""Launcher for argmax.cu: row_argmax, torch.argmax(-1) of f32 logits rows (greedy decoding) over many blocks a
row, in one launch."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .loader import counters, launch

THREADS = 256
SPAN = 2048                     # logits a block takes at most: 8 loads a thread


def row_argmax(logits: Tensor) -> Tensor:
    """int64 [R]: for each row of f32 logits [R, V] (unit stride along V) the first index of its largest value,
    NaN above every number, as torch.argmax(-1)."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1 or logits.shape[1] == 0:
        raise ValueError(f"row_argmax takes f32 logits [R, V > 0] with unit stride along V, got "
                         f"{logits.dtype} {tuple(logits.shape)} strides {logits.stride()}")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    blocks = -(-vocab // SPAN)
    ws = torch.empty(rows * blocks * 2, dtype=torch.int32, device=logits.device)     # (value, index) a block
    launch("argmax", "row_argmax", grid=(blocks, rows), block=(THREADS,),
           args=(logits, np.int64(logits.stride(0)), vocab, -(-vocab // blocks), out, ws,
                 counters("argmax", logits.device, rows)))
    return out

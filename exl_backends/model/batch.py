"""Batch: the tokens of one forward pass, for any mix of sequences (prefill chunks and decode steps alike).

Tokens of all sequences are packed into one flat row dimension T. Sequence b owns rows cu_seqlens[b] to
cu_seqlens[b+1]; after this pass it has seq_lens[b] tokens in the cache, in the pages block_tables[b]."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class SeqChunk:
    tokens: list[int]        # the new tokens of this sequence in this pass
    start: int               # tokens already in the cache before them (= position of tokens[0])
    pages: list[int]         # the sequence's cache pages, enough for start + len(tokens)


@dataclass
class Batch:
    input_ids: Tensor        # [T] int64
    positions: Tensor        # [T] int64
    slots: Tensor            # [T] int64: cache slot (page * page_size + offset) each token's K/V goes to
    cu_seqlens: Tensor       # [B+1] int32
    seq_lens: Tensor         # [B] int32
    block_tables: Tensor     # [B, max_pages] int32, padded with 0
    logit_rows: Tensor | None   # [R] int64 rows whose logits are wanted; None: every row
    page_size: int
    host_lengths: tuple[list[int], list[int]] | None = None     # cu_seqlens and seq_lens as lists, once known
    # when every sequence has the same number t > 1 of new tokens (speculative verify steps): each row's sequence,
    # int32 [T], so that attention can run short ones as decode rows with no host reads (and in a CUDA graph)
    row_seq: Tensor | None = None
    # Batch.build's packed bytes on the host (see unpack), which tensor parallelism sends the other ranks and a
    # decode graph copies into its inputs at once, without reading anything back from the GPU; None for batches
    # made otherwise, or changed on the device after build
    host: Tensor | None = field(default=None, repr=False, compare=False)
    # input_ids set on the device after build (feed): the host bytes hold placeholders for them
    fed: bool = field(default=False, repr=False, compare=False)
    # index tensors that eager attention derives from the host lengths (a prefill's cache slots, the short rows of
    # a mixed step): every layer needs the same ones, so they are made once per batch (and per device: a copy of
    # the batch on another device starts empty)
    derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def build(cls, chunks: list[SeqChunk], page_size: int, device: torch.device | str = "cpu",
              all_logits: bool = False, logit_rows: list[int] | None = None) -> "Batch":
        """The chunks' batch on device: its index tensors are views of one buffer, copied over in one
        asynchronous copy (a decode step's inputs cost the host no wait for the GPU). Logits rows: every row
        (all_logits), the given ones, or by default each chunk's last."""
        ids, pos, slots, cu, lens = [], [], [], [0], []
        for c in chunks:
            end = c.start + len(c.tokens)
            if (end + page_size - 1) // page_size > len(c.pages):
                raise ValueError(f"{len(c.pages)} pages cannot hold {end} tokens")
            ids += c.tokens
            pos += range(c.start, end)
            for p in range(c.start // page_size, (end - 1) // page_size + 1):    # a run of slots per page
                shift = (c.pages[p] - p) * page_size                             # slot of position i: i + shift
                slots += range(max(c.start, p * page_size) + shift, min(end, (p + 1) * page_size) + shift)
            cu.append(cu[-1] + len(c.tokens))
            lens.append(end)
        width = max(len(c.pages) for c in chunks)
        tables = []
        for c in chunks:
            tables += c.pages
            tables += [0] * (width - len(c.pages))
        rows = [] if all_logits else [e - 1 for e in cu[1:]] if logit_rows is None else list(logit_rows)
        row_seq = uniform_row_seq(cu)
        device = torch.device(device)
        host = pack(ids + pos + slots + rows, cu + lens + tables + (row_seq or []))
        return cls.unpack(upload(host, device), len(ids), len(chunks), width, None if all_logits else len(rows),
                          len(row_seq or []), page_size, (cu, lens), host)

    @classmethod
    def unpack(cls, data: Tensor, t: int, b: int, width: int, n_rows: int | None, n_row_seq: int, page_size: int,
               host_lengths: tuple[list[int], list[int]], host: Tensor | None = None) -> "Batch":
        """A batch of t tokens of b sequences whose index tensors are views of data (uint8): int64 input_ids,
        positions, slots and n_rows logit rows (None: every row's logits, none stored), then int32 cu_seqlens,
        seq_lens, block_tables [b, width] and row_seq (n_row_seq of them: 0 or t)."""
        n_bytes = 8 * (3 * t + (n_rows or 0))
        input_ids, positions, slot_ids, wanted = data[:n_bytes].view(torch.int64).split_with_sizes(
            [t, t, t, n_rows or 0])
        cu_seqlens, seq_lens, block_tables, seqs = data[n_bytes:].view(torch.int32).split_with_sizes(
            [b + 1, b, b * width, n_row_seq])
        return cls(input_ids, positions, slot_ids, cu_seqlens, seq_lens, block_tables.view(b, width),
                   None if n_rows is None else wanted, page_size, host_lengths, seqs if n_row_seq else None, host)

    def feed(self, ids: Tensor) -> None:
        """The input ids from the device (a decode step fed the tokens of the step before, not yet read back): a
        graph then takes everything else from the host bytes in its one copy, and these ids by one more. ids is
        taken as it is, not copied (one launch less a step): it must not change before the step has run."""
        want = self.input_ids
        if ids.shape != want.shape or ids.dtype != want.dtype or ids.device != want.device:
            raise ValueError(f"fed ids {tuple(ids.shape)} {ids.dtype} on {ids.device}: the batch's input ids are "
                             f"{tuple(want.shape)} {want.dtype} on {want.device}")
        self.input_ids = ids
        self.fed = True

    def lengths_on_host(self) -> tuple[list[int], list[int]]:
        """(cu_seqlens, seq_lens) as lists: build() keeps them; otherwise read from the device once (a sync)."""
        if self.host_lengths is None:
            host = torch.cat((self.cu_seqlens, self.seq_lens)).tolist()
            self.host_lengths = (host[:self.n_seqs + 1], host[self.n_seqs + 1:])
        return self.host_lengths

    @property
    def n_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def kv_slots(self, b: int, start: int = 0, end: int | None = None) -> Tensor:
        """Cache slots of positions start .. end - 1 of sequence b (by default all its seq_lens[b]), in order."""
        pos = torch.arange(start, int(self.seq_lens[b]) if end is None else end, device=self.block_tables.device)
        return self.block_tables[b].long()[pos // self.page_size] * self.page_size + pos % self.page_size


def uniform_row_seq(cu_seqlens: list[int]) -> list[int] | None:
    """Batch.row_seq's values when every sequence has the same number t > 1 of new tokens, else None."""
    t = cu_seqlens[1] - cu_seqlens[0]
    if t < 2 or any(b - a != t for a, b in zip(cu_seqlens, cu_seqlens[1:])):
        return None
    rows = []
    for b in range(len(cu_seqlens) - 1):
        rows += [b] * t
    return rows


def pack(longs: list[int], ints: list[int]) -> Tensor:
    """uint8 [8 * len(longs) + 4 * len(ints)] on the CPU: longs as int64, then ints as int32. One buffer makes
    one pinned copy and one upload per batch; through an array it is also ~3x faster than torch.tensor on lists
    (the tensor keeps the bytearray alive)."""
    data = bytearray(array("q", longs))
    data += array("i", ints)
    return torch.frombuffer(data, dtype=torch.uint8)


def upload(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on device, without waiting for the GPU. From pageable memory: CUDA stages such a copy before
    it returns, so the host bytes may go at once; pin_memory() per batch cost ~140 us of host time on the H200
    (a decode step's Batch.build took 160-180 us against ~25 without it), far more than staging a few KB."""
    if device.type == "cpu":    # a copy there too: a batch's tensors never share memory with its host bytes
        return t.clone()
    return t.to(device, non_blocking=True)

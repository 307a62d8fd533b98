"""Batch: the tokens of one forward pass, for any mix of sequences (prefill chunks and decode steps alike).

Tokens of all sequences are packed into one flat row dimension T. Sequence b owns rows cu_seqlens[b] to
cu_seqlens[b+1]; after this pass it has seq_lens[b] tokens in the cache, in the pages block_tables[b]."""
from __future__ import annotations

from dataclasses import dataclass

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

    @classmethod
    def build(cls, chunks: list[SeqChunk], page_size: int, device: torch.device | str = "cpu",
              all_logits: bool = False) -> "Batch":
        ids, pos, slots, cu, lens = [], [], [], [0], []
        for c in chunks:
            if (c.start + len(c.tokens) + page_size - 1) // page_size > len(c.pages):
                raise ValueError(f"{len(c.pages)} pages cannot hold {c.start + len(c.tokens)} tokens")
            p = range(c.start, c.start + len(c.tokens))
            ids += c.tokens
            pos += p
            slots += [c.pages[i // page_size] * page_size + i % page_size for i in p]
            cu.append(cu[-1] + len(c.tokens))
            lens.append(c.start + len(c.tokens))
        width = max(len(c.pages) for c in chunks)
        tables = [c.pages + [0] * (width - len(c.pages)) for c in chunks]
        rows = None if all_logits else torch.tensor([e - 1 for e in cu[1:]], dtype=torch.int64, device=device)

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype, device=device)
        return cls(t(ids, torch.int64), t(pos, torch.int64), t(slots, torch.int64), t(cu, torch.int32),
                   t(lens, torch.int32), t(tables, torch.int32), rows, page_size)

    @property
    def n_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def kv_slots(self, b: int) -> Tensor:
        """Cache slots of positions 0 .. seq_lens[b]-1 of sequence b, in order."""
        pos = torch.arange(int(self.seq_lens[b]), device=self.block_tables.device)
        return self.block_tables[b].long()[pos // self.page_size] * self.page_size + pos % self.page_size

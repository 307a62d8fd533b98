"""batch.Batch.build: every index tensor a step's kernels read, against the per-token definitions, on random chunks
(starts inside pages, several pages, several sequences)."""
from __future__ import annotations

import random

import pytest

from exl_backends.model.batch import Batch, SeqChunk


def random_chunks(rng: random.Random, page_size: int) -> list[SeqChunk]:
    chunks = []
    for _ in range(rng.randint(1, 4)):
        start, n = rng.randint(0, 3 * page_size), rng.randint(1, 3 * page_size)
        pages = rng.sample(range(100), (start + n + page_size - 1) // page_size + rng.randint(0, 1))
        chunks.append(SeqChunk([rng.randrange(1000) for _ in range(n)], start, pages))
    return chunks


@pytest.mark.parametrize("page_size", [16, 32, 256])
def test_build_lays_out_each_tokens_slot_position_and_sequence(page_size):
    rng = random.Random(page_size)
    for _ in range(50):
        chunks = random_chunks(rng, page_size)
        b = Batch.build(chunks, page_size, "cpu")
        positions = [i for c in chunks for i in range(c.start, c.start + len(c.tokens))]
        slots = [c.pages[i // page_size] * page_size + i % page_size
                 for c in chunks for i in range(c.start, c.start + len(c.tokens))]
        assert b.input_ids.tolist() == [t for c in chunks for t in c.tokens]
        assert b.positions.tolist() == positions and b.slots.tolist() == slots
        assert b.seq_lens.tolist() == [c.start + len(c.tokens) for c in chunks]
        assert b.cu_seqlens.tolist()[-1] == len(positions)
        for row, c in zip(b.block_tables.tolist(), chunks):
            assert row[:len(c.pages)] == c.pages
        assert b.logit_rows.tolist() == [x - 1 for x in b.cu_seqlens.tolist()[1:]]
        alike = len({len(c.tokens) for c in chunks}) == 1 and len(chunks[0].tokens) > 1
        expected = [s for s, c in enumerate(chunks) for _ in c.tokens] if alike else None
        assert (None if b.row_seq is None else b.row_seq.tolist()) == expected


def test_build_refuses_chunks_their_pages_cannot_hold():
    with pytest.raises(ValueError, match="2 pages cannot hold 40 tokens"):
        Batch.build([SeqChunk([1] * 8, 32, [3, 4])], 16, "cpu")


def test_feed_takes_the_device_ids_as_they_are_and_refuses_others():
    """feed keeps the tensor it is given as the step's input ids (no copy), and refuses one that cannot be them."""
    import torch
    b = Batch.build([SeqChunk([5], 7, [0]), SeqChunk([9], 3, [1])], 16, "cpu")
    ids = torch.tensor([11, 12])
    b.feed(ids)
    assert b.fed and b.input_ids is ids
    for bad, what in ((torch.tensor([1, 2, 3]), r"\(3,\)"), (torch.tensor([1, 2], dtype=torch.int32), "int32")):
        with pytest.raises(ValueError, match=what):
            Batch.build([SeqChunk([5], 7, [0]), SeqChunk([9], 3, [1])], 16, "cpu").feed(bad)

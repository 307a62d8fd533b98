"""runner.Runner: which steps replay a captured graph (decode, and speculative verify steps where every sequence
adds the same few tokens), and that the graph path (on the CPU its eager stand-in, which fills the same static
inputs, padding sequences included) gives the eager logits. tests/test_gpu_model.py replays real graphs."""
from __future__ import annotations

import pytest
import torch

from exl_backends import generator as generator_module
from exl_backends.batch import Batch, SeqChunk
from exl_backends.cache import KVCache
from exl_backends.config import ModelConfig
from exl_backends.model import Model
from exl_backends.runner import MAX_TOKENS, Runner

from conftest import save_tiny, tiny_config
from test_speculative import repetitive_prompts, run

PAGE = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny(path, tiny_config("llama"))
    return Model.load(path, ModelConfig.from_dir(path), "cpu", torch.float32)


def prefilled(model: Model, lengths: list[int]) -> tuple[KVCache, list[list[int]]]:
    """A cache holding one random prompt per length, and each sequence's pages."""
    cache = KVCache(model.config, 32, PAGE, "fp16", "cpu", torch.float32)
    g = torch.Generator().manual_seed(len(lengths))
    pages = [cache.pool.allocate(4) for _ in lengths]
    chunks = [SeqChunk(torch.randint(0, 500, (n,), generator=g).tolist(), 0, p) for n, p in zip(lengths, pages)]
    model.forward(Batch.build(chunks, PAGE, "cpu"), cache)
    return cache, pages


def verify_batch(lengths: list[int], pages: list[list[int]], tokens: list[int]) -> Batch:
    """Each sequence's next tokens[b] tokens (its newest and drafted ones), logits for every row."""
    g = torch.Generator().manual_seed(sum(tokens))
    chunks = [SeqChunk(torch.randint(0, 500, (t,), generator=g).tolist(), n, p)
              for n, p, t in zip(lengths, pages, tokens)]
    return Batch.build(chunks, PAGE, "cpu", all_logits=True)


@pytest.mark.parametrize("tokens", [1, 3, MAX_TOKENS])
def test_a_step_of_alike_sequences_replays_and_equals_eager(model, tokens):
    """Three sequences (padded to a graph of four) of `tokens` new tokens each, after prompts of other lengths."""
    lengths = [5, 21, 40]
    cache, pages = prefilled(model, lengths)
    batch = verify_batch(lengths, pages, [tokens] * 3)
    assert (batch.row_seq is None) == (tokens == 1)
    eager = model.forward(batch, cache)
    runner = Runner(model, cache, max_batch=8, max_pages=4, eager=False)
    assert runner._graph_shape(batch) == (4, tokens)
    torch.testing.assert_close(runner.forward(batch), eager, rtol=0, atol=0)
    assert list(runner.graphs.by_shape) == [(4, tokens)]


def test_other_steps_run_eagerly(model):
    lengths = [5, 21, 40]
    cache, pages = prefilled(model, lengths)
    runner = Runner(model, cache, max_batch=8, max_pages=4, eager=False)
    assert runner._graph_shape(verify_batch(lengths, pages, [2, 3, 2])) is None          # unlike sequences
    assert runner._graph_shape(verify_batch(lengths, pages, [MAX_TOKENS + 1] * 3)) is None
    chunks = [SeqChunk([1, 2, 3], n, p) for n, p in zip(lengths, pages)]
    assert runner._graph_shape(Batch.build(chunks, PAGE, "cpu")) is None                  # last rows' logits only
    assert Runner(model, cache, 8, 4, eager=True)._graph_shape(verify_batch(lengths, pages, [2] * 3)) is None


@pytest.mark.parametrize("drafting", ["ngram", "draft-model"])
def test_verify_steps_through_graphs_keep_greedy_output(tmp_path, monkeypatch, drafting):
    """The generator drafting, its runner on the graph path: verify steps take graphs of several tokens per
    sequence, a draft model's single-token steps take its own graphs (padding into the target's trash page), and
    the output is plain greedy decoding's."""
    from exl_backends import ExlForCausalLM
    save_tiny(tmp_path / "target", tiny_config("llama"))
    save_tiny(tmp_path / "draft", tiny_config("llama", num_hidden_layers=1), seed=5)
    lm = ExlForCausalLM.from_pretrained(tmp_path / "target", device="cpu")
    prompts = repetitive_prompts(8, seed=4)
    plain = run(generator_module.Generator(lm, page_size=PAGE, cache_tokens=16 * 64), prompts)
    monkeypatch.setattr(generator_module, "Runner", lambda *args, eager: Runner(*args, eager=False))
    kw = dict(ngram_draft=True) if drafting == "ngram" else \
        dict(draft_model=ExlForCausalLM.from_pretrained(tmp_path / "draft", device="cpu"))
    gen = generator_module.Generator(lm, page_size=PAGE, cache_tokens=16 * 64, max_batch_size=2, **kw)
    assert run(gen, prompts) == plain
    assert any(tokens > 1 for _, tokens in gen.runner.graphs.by_shape)
    if drafting == "draft-model":
        assert gen.draft.runner.trash_page == gen.runner.trash_page
        assert gen.draft.runner.graphs.by_shape         # its one-token steps

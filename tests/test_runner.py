"""runner.Runner: which steps replay a captured graph (decode, and speculative verify steps where every sequence
adds the same few tokens), and that the graph path (on the CPU its eager stand-in, which fills the same static
inputs, padding sequences included) gives the eager logits. tests/test_gpu_model.py replays real graphs."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from exl_backends.engine import generator as generator_module
from exl_backends.kernels.attention import ROW_KERNEL_MAX_NEW
from exl_backends.model.batch import Batch, SeqChunk
from exl_backends.model.cache import KVCache
from exl_backends.model.config import ModelConfig
from exl_backends.model.model import Model
from exl_backends.model.runner import MAX_TOKENS, PrefillGraphs, Runner

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
    # fp32 rounding only: the padded step multiplies 4 sequences' rows, and CPU BLAS may sum a row in another order
    # for another row count (seen on AMD EPYC: 1.3e-6 at most); a wrong page or padding row is off by ~1
    torch.testing.assert_close(runner.forward(batch), eager, rtol=1e-5, atol=1e-5)
    assert list(runner.graphs.by_shape) == [(4, tokens)]


@pytest.mark.parametrize("host_bytes", [True, False])
def test_a_smaller_step_after_a_full_one_pads_the_graph_anew(model, host_bytes):
    """Four sequences, then three of them, through one graph of four, equal eager decoding, whether the inputs
    come as Batch.build's host bytes (written into the graph's input image, one copy) or only as tensors (copied
    input by input)."""
    lengths = [5, 21, 40, 9]
    cache, pages = prefilled(model, lengths)
    runner = Runner(model, cache, max_batch=4, max_pages=4, eager=False)
    for n in (4, 3):
        batch = verify_batch(lengths[:n], pages[:n], [1] * n)
        if not host_bytes:
            batch = dataclasses.replace(batch, host=None)
        eager = model.forward(batch, cache)
        torch.testing.assert_close(runner.forward(batch), eager, rtol=1e-5, atol=1e-5)
        lengths = [n + 1 for n in lengths]
    assert list(runner.graphs.by_shape) == [(4, 1)]


def test_a_step_fed_its_ids_on_the_device_takes_them_not_the_placeholders(model):
    """A decode step whose ids are fed on the device after Batch.build (the generator's look-ahead: the tokens of
    the step before, not yet on the host) replays with those ids, the rest from its host bytes, and equals eager
    decoding of the same ids; tensor parallelism, which sends the host bytes, refuses it."""
    from exl_backends.parallel.ranks import _pack
    lengths = [5, 21, 40]
    cache, pages = prefilled(model, lengths)
    runner = Runner(model, cache, max_batch=4, max_pages=4, eager=False)
    real = verify_batch(lengths, pages, [1] * 3)
    fed = Batch.build([SeqChunk([0], n, p) for n, p in zip(lengths, pages)], PAGE, "cpu", all_logits=True)
    fed.feed(real.input_ids)
    assert fed.host is not None and not torch.equal(fed.input_ids, torch.zeros(3, dtype=torch.long))
    eager = model.forward(real, cache)
    torch.testing.assert_close(runner.forward(fed), eager, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(runner.forward(dataclasses.replace(fed, fed=False)), eager, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="host bytes"):
        _pack(fed, [])


def test_other_steps_take_token_pieces(model):
    lengths = [5, 21, 40]
    cache, pages = prefilled(model, lengths)
    runner = Runner(model, cache, max_batch=8, max_pages=4, eager=False)
    assert runner._graph_shape(verify_batch(lengths, pages, [2, 3, 2])) is None          # unlike sequences
    assert runner._graph_shape(verify_batch(lengths, pages, [MAX_TOKENS + 1] * 3)) is None
    chunks = [SeqChunk([1, 2, 3], n, p) for n, p in zip(lengths, pages)]
    assert runner._graph_shape(Batch.build(chunks, PAGE, "cpu")) is None                  # last rows' logits only
    assert Runner(model, cache, 8, 4, eager=True)._graph_shape(verify_batch(lengths, pages, [2] * 3)) is None
    assert Runner(model, cache, 8, 4, eager=True).prefill is None
    assert [PrefillGraphs.size(t) for t in (1, 8, 9, 100, 129, 2048, 2049)] == [8, 8, 16, 104, 144, 2048, None]
    assert all(8 * (PrefillGraphs.size(t) - t) < PrefillGraphs.size(t) for t in range(65, 2049))   # padding < 1/8
    assert MAX_TOKENS <= ROW_KERNEL_MAX_NEW        # captured steps' attention reads nothing on the host


def cache_contents(cache: KVCache) -> list[torch.Tensor]:
    return [t.clone() for layer in cache.layers for t in (layer.k, layer.v)]


LONGROPE = dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
                              "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0],
                              "original_max_position_embeddings": 32}, original_max_position_embeddings=32)


@pytest.mark.parametrize("family,overrides", [("phi3", LONGROPE), ("gemma3", {})], ids=["longrope", "local_rope"])
def test_token_pieces_make_each_ropes_tables_as_eager(tmp_path, family, overrides):
    """Piece 0 makes the rope tables from the step's positions (and for longrope each token's sequence length:
    one sequence here ends past original_max_position 32, the other within it), as an eager forward does; a
    second, shorter step on the same buffers too."""
    save_tiny(tmp_path, tiny_config(family, **overrides))
    model = Model.load(tmp_path, ModelConfig.from_dir(tmp_path), "cpu", torch.float32)
    assert model.long_rope == (family == "phi3")
    lengths = [5, 21, 40]
    cache, pages = prefilled(model, lengths)
    runner = Runner(model, cache, max_batch=8, max_pages=4, eager=False)
    for tokens in ([2, 9, 4], [1, 2, 1]):
        batch = verify_batch(lengths, pages, tokens)
        torch.testing.assert_close(runner.forward(batch), model.forward(batch, cache), rtol=1e-5, atol=1e-5)
        lengths = [n + t for n, t in zip(lengths, tokens)]


@pytest.mark.parametrize("tokens", [[2, 3, 2], [1, 11, 1], [9, 20, 23]])
def test_token_pieces_equal_eager_and_pad_into_the_trash_page(model, tokens):
    """Steps no decode graph takes (unlike sequences, prompt chunks beside decode rows, prompts) through the pieces
    around eager attention (on the CPU their stand-in, on the same static buffers), padded up to a token size: the
    eager logits, and the same cache except for the trash page, which the padding rows write."""
    lengths = [5, 21, 40]
    cache, pages = prefilled(model, lengths)
    runner = Runner(model, cache, max_batch=8, max_pages=4, eager=False)
    batch = verify_batch(lengths, pages, tokens)
    before = cache_contents(cache)
    eager = model.forward(batch, cache)
    after_eager = cache_contents(cache)
    for t, original in zip((t for layer in cache.layers for t in (layer.k, layer.v)), before):
        t.copy_(original)
    torch.testing.assert_close(runner.forward(batch), eager, rtol=1e-5, atol=1e-5)
    trash = slice(runner.trash_page * PAGE, (runner.trash_page + 1) * PAGE)
    for ours, theirs in zip(cache_contents(cache), after_eager):
        torch.testing.assert_close(ours[:trash.start], theirs[:trash.start], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours[trash.stop:], theirs[trash.stop:], rtol=1e-5, atol=1e-5)
    assert sum(tokens) < PrefillGraphs.size(sum(tokens))           # the step was padded
    assert runner.prefill.ropes and runner.graphs.by_shape == {}
    # a second, longer step on the same buffers (stale rows of the first must not matter)
    longer = verify_batch(lengths, pages, [t + 1 for t in tokens])
    torch.testing.assert_close(runner.forward(longer), model.forward(longer, cache), rtol=1e-5, atol=1e-5)


def test_launched_steps_through_graphs_keep_the_output(tmp_path, monkeypatch):
    """The generator's look-ahead on the graph path: a launched step's input tokens are the step before's tokens on
    the device (its argmax, or a sampling job's draw), written into the batch after Batch.build, and the graph
    must take those, not the placeholders Batch.build packed."""
    from exl_backends import ExlForCausalLM, SamplingParams
    save_tiny(tmp_path, tiny_config("llama"))
    lm = ExlForCausalLM.from_pretrained(tmp_path, device="cpu")
    prompts = repetitive_prompts(3, seed=6)
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=1)
    plain = [run(generator_module.Generator(lm, page_size=PAGE, cache_tokens=16 * 64), prompts, sampling=s)
             for s in (None, sampling)]
    launched = []
    launch = generator_module.Generator._launch_next
    monkeypatch.setattr(generator_module.Generator, "_launch_next",
                        lambda self, step: launched.append(step) or launch(self, step))
    monkeypatch.setattr(generator_module, "Runner", lambda *args, eager: Runner(*args, eager=False))
    gen = generator_module.Generator(lm, page_size=PAGE, cache_tokens=16 * 64, max_batch_size=4)
    assert [run(gen, prompts, sampling=s) for s in (None, sampling)] == plain
    assert len(launched) > 20 and list(gen.runner.graphs.by_shape) == [(4, 1)]


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

"""Speculative decoding: greedy output identical to plain decoding (draft model and n-gram drafting), and with
sampling the distribution of every token exactly the model's (rejection sampling), checked by chi-square tests."""
from __future__ import annotations

import importlib.util
import math
import re

import pytest
import torch

from exl_backends import ExlForCausalLM
from exl_backends.engine.generator import Generator
from exl_backends.engine.sampling import SamplerState, SamplingParams, probs
from exl_backends.engine.speculative import NgramIndex, verify
from exl_backends.errors import SamplingError

from conftest import save_tiny, tiny_config

PAGE = 16


def chi_square_ok(counts: torch.Tensor, p: torch.Tensor, alpha_z: float = 3.09) -> tuple[float, float]:
    """Pearson's statistic of counts against p (bins with expected < 5 pooled) and its critical value at
    alpha = 0.001 (Wilson-Hilferty approximation of the chi-square quantile)."""
    n = counts.sum().item()
    expected = n * p.double()
    small = expected < 5
    obs = torch.cat([counts.double()[~small], counts.double()[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    df = keep.sum().item() - 1
    critical = df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


def test_verify_draws_exactly_from_p():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(6, generator=g) ** 2
    q = torch.rand(6, generator=g) ** 2
    p, q = p / p.sum(), q / q.sum()
    rng = torch.Generator().manual_seed(1)
    n = 20000
    drafts = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    counts = torch.bincount(torch.tensor([verify(p, q, d, rng) for d in drafts]), minlength=6)
    stat, critical = chi_square_ok(counts, p)
    assert stat < critical, (stat, critical)
    # a deterministic draft (q one-hot) is kept with probability p[draft]
    counts = torch.bincount(torch.tensor([verify(p, None, 2, rng) for _ in range(n)]), minlength=6)
    stat, critical = chi_square_ok(counts, p)
    assert stat < critical, (stat, critical)
    # the statistic does detect a wrong distribution of this size
    assert chi_square_ok(counts, q)[0] > chi_square_ok(counts, q)[1]


def test_ngram_index_proposes_what_followed():
    index = NgramIndex()
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    assert index.propose(tokens, 3) == [4, 9, 2]         # the longest ending that occurred before: "1 2 3"
    assert index.propose(tokens + [4], 2) == [9, 2]       # "2 3 4"
    assert index.propose([7, 8], 3) == []
    index.truncate(5)
    assert index.propose([1, 2, 3, 4, 9, 9], 2) == [9]    # positions past the rollback are rechecked


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target, draft = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    save_tiny(target, tiny_config("llama"))
    save_tiny(draft, tiny_config("llama", num_hidden_layers=1), seed=5)
    return ExlForCausalLM.from_pretrained(target, device="cpu"), ExlForCausalLM.from_pretrained(draft, device="cpu")


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random phrase, so that n-gram lookup has something to propose."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        phrase = torch.randint(0, 509, (int(torch.randint(3, 9, (), generator=g)),), generator=g).tolist()
        out.append((phrase * 6)[:int(torch.randint(10, 40, (), generator=g))])
    return out


def run(gen: Generator, prompts, **kw) -> list[list[int]]:
    jobs = [gen.submit(p, max_new_tokens=24, stop_token_ids=[], **kw) for p in prompts]
    return [job.result().token_ids for job in jobs]


@pytest.mark.parametrize("drafting", ["ngram", "draft-model", "self-draft"])
def test_speculative_greedy_is_identical(models, drafting):
    target, draft = models
    prompts = repetitive_prompts(20, seed=1)
    plain = run(Generator(target, page_size=PAGE, cache_tokens=20 * 64), prompts)
    kw = {"ngram": dict(ngram_draft=True), "draft-model": dict(draft_model=draft),
          "self-draft": dict(draft_model=target)}[drafting]
    gen = Generator(target, page_size=PAGE, cache_tokens=20 * 64, **kw)
    assert gen.scheduler.n_draft == (7 if drafting == "ngram" else 4)     # the default per way of drafting
    n_forwards = 0
    forward = gen._forward

    def counted(batch):
        nonlocal n_forwards
        n_forwards += 1
        return forward(batch)
    gen._forward = counted
    assert run(gen, prompts) == plain
    if drafting == "self-draft":     # every draft is accepted: 5 tokens per step after the first
        assert n_forwards <= 1 + math.ceil(23 / 5) + 1
    # pages stay consistent with the drafted-then-rejected tokens
    assert gen.pages.n_available == gen.cache.pool.n_pages


@pytest.mark.skipif(importlib.util.find_spec("llguidance") is None, reason="llguidance not installed")
def test_constrained_drafts_keep_the_constraint(models):
    target, draft = models
    pattern = r"[0-9]{2}(-[a-z]{2})+"
    prompts = repetitive_prompts(4, seed=2)
    plain = Generator(target, page_size=PAGE, cache_tokens=4 * 64)
    for kw in (dict(ngram_draft=True), dict(draft_model=draft)):
        gen = Generator(target, page_size=PAGE, cache_tokens=4 * 64, **kw)
        for prompt in prompts:
            r = gen.generate(prompt, max_new_tokens=16, regex=pattern)
            assert re.fullmatch(pattern, r.text) or r.finish_reason == "length"
            assert r.token_ids == plain.generate(prompt, max_new_tokens=16, regex=pattern).token_ids


def test_logprobs_of_sampled_drafts_are_the_models(models):
    target, draft = models
    prompt = repetitive_prompts(1, seed=3)[0]
    gen = Generator(target, page_size=PAGE, cache_tokens=256, draft_model=draft)
    r = gen.generate(prompt, max_new_tokens=12, stop_token_ids=[], logprobs=2,
                     sampling=SamplingParams(temperature=1.0, seed=1))
    logp = torch.log_softmax(target(torch.tensor([prompt + r.token_ids])).logits[0], -1)
    for i, lp in enumerate(r.logprobs):
        row = logp[len(prompt) - 1 + i]
        assert lp.token == r.token_ids[i] and lp.logprob == pytest.approx(row[lp.token].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(2).indices.tolist()


def test_mirostat_is_refused_with_drafting(models):
    target, _ = models
    gen = Generator(target, page_size=PAGE, cache_tokens=256, ngram_draft=True)
    with pytest.raises(SamplingError, match="mirostat"):
        gen.submit([1, 2, 3], max_new_tokens=4, sampling=SamplingParams(temperature=1.0, mirostat_tau=5.0))


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A target and a different draft model over 16 tokens, so distributions can be checked token by token."""
    cfg = dict(vocab_size=16, bos_token_id=14, eos_token_id=15, pad_token_id=None)
    target, draft = tmp_path_factory.mktemp("t16"), tmp_path_factory.mktemp("d16")
    hf = save_tiny(target, tiny_config("llama", **cfg))
    save_tiny(draft, tiny_config("llama", num_hidden_layers=1, **cfg), seed=7)
    return ExlForCausalLM.from_pretrained(target, device="cpu"), ExlForCausalLM.from_pretrained(draft, device="cpu"), hf


def exact_marginals(hf, prompt: list[int], params: SamplingParams, depth: int) -> list[torch.Tensor]:
    """The distributions of new tokens 1 .. depth under params, summed over every earlier choice."""
    marginals, contexts, weights = [], [prompt], torch.ones(1, dtype=torch.float64)
    for _ in range(depth):
        with torch.no_grad():
            logits = hf(torch.tensor(contexts)).logits[:, -1].float()
        rows = torch.stack([probs(logits[i], SamplerState(params, c)).double() for i, c in enumerate(contexts)])
        marginals.append((weights[:, None] * rows).sum(0))
        contexts = [c + [t] for c in contexts for t in range(16)]
        weights = (weights[:, None] * rows).reshape(-1)
    return marginals


@pytest.mark.parametrize("drafting", ["draft-model", "ngram"])
def test_speculative_sampling_keeps_the_distribution(small_vocab, drafting):
    target, draft, hf = small_vocab
    prompt = list(range(14)) + [3, 4]               # every token occurs earlier: n-gram lookup always proposes
    params = SamplingParams(temperature=0.8, top_k=10)
    kw = dict(draft_model=draft) if drafting == "draft-model" else dict(ngram_draft=True)
    gen = Generator(target, page_size=PAGE, cache_tokens=256 * 32, max_batch_size=256, n_draft_tokens=2, **kw)
    n = 1500
    jobs = [gen.submit(prompt, max_new_tokens=4, stop_token_ids=[], sampling=SamplingParams(
        temperature=0.8, top_k=10, seed=i)) for i in range(n)]
    outputs = torch.tensor([job.result().token_ids for job in jobs])     # [n, 4]
    for depth, p in enumerate(exact_marginals(hf, prompt, params, 3)):
        counts = torch.bincount(outputs[:, depth], minlength=16)
        stat, critical = chi_square_ok(counts, p)
        assert stat < critical, (depth, stat, critical)


def test_cli_generate_drafts_as_asked_and_keeps_the_greedy_text(tmp_path, capsys, monkeypatch):
    from exl_backends import cli
    drafted = []
    propose = Generator._propose

    def counted(self, decoders):
        out = propose(self, decoders)
        drafted.append(sum(len(tokens) for tokens, _ in out.values()))
        return out
    monkeypatch.setattr(Generator, "_propose", counted)
    target, draft = tmp_path / "target", tmp_path / "draft"
    save_tiny(target, tiny_config("llama"))
    save_tiny(draft, tiny_config("llama", num_hidden_layers=1), seed=5)
    common = ["generate", "-m", str(target), "-p", "ab cd ab cd ab cd ab", "-n", "16", "--greedy", "--device", "cpu",
              "--max-seq-len", "128"]
    texts, n_drafted = [], []
    for extra in ([], ["--ngram-draft"], ["--draft-model", str(draft)]):
        assert cli.main(common + extra) == 0
        texts.append(capsys.readouterr().out)
        n_drafted.append(sum(drafted))
        drafted.clear()
    assert texts[0] == texts[1] == texts[2] and len(texts[0]) > len("ab cd ab cd ab cd ab")
    assert n_drafted[0] == 0 and n_drafted[1] > 0 and n_drafted[2] > 0

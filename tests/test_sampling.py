"""The sampler against transformers' processors and against straightforward loop references on fixed logits."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers import AutoTokenizer
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper)

from exl_backends.engine import sampling
from exl_backends.engine.sampling import SamplerState, SamplingParams, draw, greedy, probs, sample, sample_rows
from exl_backends.errors import SamplingError

from conftest import TOKENIZER_DIR

V = 1031    # odd, prime: no accidental alignment


def random_logits(seed: int, n: int = V, n_removed: int = 50) -> torch.Tensor:
    """Spread-out logits with a few ties and a few tokens already removed (-inf)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3
    x[torch.randperm(n, generator=g)[:8]] = x[0].item()
    x[torch.randperm(n, generator=g)[:3]] = x.max().item()
    x[torch.randperm(n, generator=g)[:n_removed]] = -math.inf
    return x


def random_history(seed: int, n: int = 300, alphabet: int = 40) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, alphabet, (n,), generator=g).tolist()


def state(history=(), **params) -> SamplerState:
    return SamplerState(SamplingParams(**params), list(history))


def hf(processor, logits, history=(0,)):
    ids = torch.tensor([list(history)])
    return processor(ids, logits.unsqueeze(0).clone())[0]


# ---- transformers' processors -----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_warpers_equal_transformers(seed):
    x = random_logits(seed)
    assert torch.equal(sampling.temperature(x, 0.7), hf(TemperatureLogitsWarper(0.7), x))
    for k in (1, 5, 40, V, V + 10):
        assert torch.equal(sampling.top_k(x, k), hf(TopKLogitsWarper(k), x))
    for p in (0.0, 0.01, 0.2, 0.9, 1.0):
        assert torch.equal(sampling.min_p(x, p), hf(MinPLogitsWarper(p), x))
    # the sorting warpers break ties by index (stable sort, the same on every device); transformers' sort is not
    # stable, so it is compared where nothing ties
    x = x + torch.arange(V) * 1e-3
    for p in (0.0, 0.1, 0.5, 0.9, 0.999, 1.0):
        assert torch.equal(sampling.top_p(x, p), hf(TopPLogitsWarper(p), x))
    for mass in (0.05, 0.5, 0.95):
        assert torch.equal(sampling.typical_p(x, mass), hf(TypicalLogitsWarper(mass), x))


def test_top_p_cuts_ties_in_index_order():
    """Tied tokens at the cut go lowest index first, so top_p=0 over three tied maxima keeps the last of them."""
    x = random_logits(0, n_removed=0)
    x[[3, 500, 993]] = x.max() + 1
    assert torch.isfinite(sampling.top_p(x, 0.0)).nonzero().flatten().tolist() == [993]
    assert sampling.sample_rows(x[None], [state(temperature=2.0, top_p=0.0)]) == [993]


@pytest.mark.parametrize("seed", range(5))
def test_repetition_penalty_equals_transformers(seed):
    x, history = random_logits(seed), random_history(seed, alphabet=V)
    for penalty in (0.8, 1.3, 2.0):
        ours = probs(x, state(history, repetition_penalty=penalty, temperature=0.5))
        theirs = hf(LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty),
                                         TemperatureLogitsWarper(0.5)]), x, history).softmax(-1)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)


@pytest.mark.parametrize("seed", range(5))
def test_chain_equals_transformers(seed):
    """The documented order (penalty, temperature, top-k, top-p, min-p, typical) is transformers' order."""
    x, history = random_logits(seed), random_history(seed, alphabet=V)
    ours = probs(x, state(history, repetition_penalty=1.2, temperature=0.8, top_k=200, top_p=0.95, min_p=0.01,
                          typical_p=0.97))
    chain = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(0.8),
                                 TopKLogitsWarper(200), TopPLogitsWarper(0.95), MinPLogitsWarper(0.01),
                                 TypicalLogitsWarper(0.97)])
    torch.testing.assert_close(ours, hf(chain, x, history).softmax(-1), rtol=0, atol=1e-7)


def test_top_p_edges():
    x = random_logits(0)
    kept = sampling.top_p(x, 0.0).isfinite().nonzero().flatten()
    assert kept.numel() == 1 and x[kept] == x.max()     # one of the tied top tokens
    assert torch.equal(sampling.top_p(x, 1.0), x)


def test_min_p_keeps_ties():
    x = torch.tensor([2.0, 2.0, 1.0, 1.0, 0.0, -math.inf])
    threshold = math.exp(1.0 - 2.0)      # p(1.0) / p(2.0): min_p exactly there keeps the tokens at 1.0
    kept = sampling.min_p(x, threshold - 1e-6).isfinite().tolist()
    assert kept == [True, True, True, True, False, False]
    assert sampling.min_p(x, 1.0).isfinite().tolist() == [True, True, False, False, False, False]


# ---- loop references ------------------------------------------------------------------------------------

def ref_frequency_presence(x, history, frequency, presence):
    out = x.clone()
    for token, count in Counter(history).items():
        out[token] -= count * frequency + presence
    return out


@pytest.mark.parametrize("seed", range(3))
def test_frequency_presence_and_range(seed):
    x, history = random_logits(seed), random_history(seed, alphabet=V)
    for penalty_range in (0, 1, 37):
        window = history[-penalty_range:] if penalty_range else history
        ours = probs(x, state(history, frequency_penalty=0.7, presence_penalty=-0.4, penalty_range=penalty_range))
        expected = ref_frequency_presence(x, window, 0.7, -0.4).softmax(-1)
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-7)


def ref_dry(history, breakers, multiplier, base, allowed_length):
    """text-generation-webui's DRYLogitsProcessor loop, for one row: {token: penalty}."""
    last = history[-1]
    if last in breakers:
        return {}
    lengths = {}
    for i in [i for i, t in enumerate(history[:-1]) if t == last]:
        following = history[i + 1]
        if following in breakers:
            continue
        length = 1
        while length < 50:
            j = i - length
            if j < 0:
                break
            previous = history[-(length + 1)]
            if history[j] != previous or previous in breakers:
                break
            length += 1
        lengths[following] = max(length, lengths.get(following, 0))
    return {t: multiplier * base ** (n - allowed_length) for t, n in lengths.items() if n >= allowed_length}


@pytest.mark.parametrize("seed", range(20))
def test_dry_equals_reference(seed):
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(1, 12, (int(torch.randint(3, 80, (), generator=g)),), generator=g)
    repeated = torch.cat([phrase, torch.randint(1, 12, (7,), generator=g), phrase])[:-1]  # long repeated n-grams
    small_alphabet = torch.randint(1, 4, (200,), generator=g)                              # many short repeats
    for history in (repeated, small_alphabet):
        history = torch.where(torch.rand(history.shape, generator=g) < 0.03, 0, history)  # a few breakers
        for allowed_length in (1, 2, 4):
            ids, penalty = sampling.dry_penalties(history, torch.tensor([0]), 0.8, 1.75, allowed_length)
            expected = ref_dry(history.tolist(), {0}, 0.8, 1.75, allowed_length)
            assert dict(zip(ids.tolist(), penalty.tolist())) == pytest.approx(expected, rel=1e-12)


def test_dry_penalises_the_repeat():
    history = [5, 6, 7, 8, 9, 1, 5, 6, 7, 8]       # "5 6 7 8" repeats: 9 would extend it (length 4)
    ids, penalty = sampling.dry_penalties(torch.tensor(history), torch.tensor([1]), 0.8, 1.75, 2)
    assert ids.tolist() == [9] and penalty.tolist() == pytest.approx([0.8 * 1.75 ** 2])
    ids, _ = sampling.dry_penalties(torch.tensor(history), torch.tensor([7]), 0.8, 1.75, 2)
    assert ids.tolist() == []                      # a breaker inside the repeat cuts it to length 1


def test_dry_through_the_sampler_with_range():
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    params = SamplingParams(dry_multiplier=0.8, dry_range=9)
    s = SamplerState(params, [70, 71, 72, 73, 74, 60, 70, 71, 72, 73], tokenizer)    # letters, no breakers
    assert sorted(tokenizer.decode([t]) for t in s.dry_breakers.tolist()) == sorted(params.dry_sequence_breakers)
    x = random_logits(1, 512, 0)
    expected = x.clone()
    expected[74] -= 0.8 * 1.75 ** 1                # the range drops the first token: the repeat is "71 72 73"
    torch.testing.assert_close(probs(x, s), expected.softmax(-1), rtol=0, atol=1e-7)
    with pytest.raises(SamplingError, match="tokenizer"):
        SamplerState(params, [1, 2])


def ref_dynatemp(x, t, spread, exponent):
    """llama.cpp's llama_sampler_temp_ext_apply over the candidates (finite logits)."""
    cand = x[x.isfinite()].double()
    p = cand.softmax(-1)
    entropy = -sum(float(q) * math.log(float(q)) for q in p if q > 0)
    low, high = max(0.0, t - spread), t + spread
    dyn = low + (high - low) * (entropy / math.log(len(cand))) ** exponent
    return (x.double() / dyn).softmax(-1).float()


@pytest.mark.parametrize("seed", range(3))
def test_dynamic_temperature(seed):
    x = random_logits(seed)
    for t, spread, exponent in ((1.0, 0.5, 1.0), (0.7, 1.0, 2.0), (1.5, 0.2, 0.5)):
        ours = probs(x, state(temperature=t, dynatemp_range=spread, dynatemp_exponent=exponent))
        torch.testing.assert_close(ours, ref_dynatemp(x, t, spread, exponent), rtol=1e-5, atol=1e-7)


def test_top_a():
    x = random_logits(2)
    p = x.softmax(-1)
    expected = torch.tensor([q >= 0.3 * p.max() ** 2 for q in p.tolist()])
    assert torch.equal(sampling.top_a(x, 0.3).isfinite(), expected & x.isfinite())


def ref_xtc_applied(p, threshold):
    """llama.cpp's XTC when the coin says apply: drop every sorted candidate above threshold but the last."""
    order = sorted((i for i in range(len(p)) if p[i] > 0), key=lambda i: -p[i])
    last = 0
    for pos, i in enumerate(order):
        if p[i] >= threshold:
            last = pos
        else:
            break
    out = p.clone()
    out[order[:last]] = 0
    return out / out.sum()


def test_xtc_is_the_mixture():
    x = torch.tensor([3.0, 2.8, 2.5, 1.0, 0.0, -1.0, -math.inf])
    plain = x.softmax(-1)
    for threshold in (0.0, 0.1, 0.2, 0.5):
        ours = probs(x, state(xtc_probability=0.3, xtc_threshold=threshold))
        torch.testing.assert_close(ours, 0.3 * ref_xtc_applied(plain, threshold) + 0.7 * plain)
    always = state(xtc_probability=1.0, xtc_threshold=0.1, seed=3)
    drawn = {sample(x, always).token for _ in range(200)}
    assert 0 not in drawn and 1 not in drawn


def ref_mirostat_truncate(p, mu):
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = [i for i in order if -math.log2(p[i]) <= mu] if p[order[0]] > 0 else []
    keep = keep or order[:1]
    out = torch.zeros_like(p)
    out[keep] = p[keep]
    return out / out.sum()


def test_mirostat_truncation_and_convergence():
    x = -1.1 * torch.log(torch.arange(1, 201, dtype=torch.float32))      # Zipf-like
    s = state(mirostat_tau=3.0, mirostat_eta=0.1, seed=0)
    surprises = []
    for step in range(2000):
        dist = probs(x, s)
        if step < 100:
            torch.testing.assert_close(dist, ref_mirostat_truncate(x.softmax(-1), s.mu))
        token = sample(x, s).token
        surprises.append(-math.log2(dist[token].item()))
        s.accept(token)
    assert abs(sum(surprises[500:]) / 1500 - 3.0) < 0.1      # mirostat holds the mean surprise at tau
    assert abs(sum(-p * math.log2(p) for p in x.softmax(-1).tolist()) - 3.0) > 1     # which it was not


def test_mirostat_mu_rolls_back():
    x = random_logits(0)
    s = state(mirostat_tau=5.0, seed=1)
    mus = [s.mu]
    for _ in range(5):
        s.accept(sample(x, s).token)
        mus.append(s.mu)
    assert len(set(mus)) > 1
    s.rollback(3)
    assert s.mu == mus[2] and s.n_generated == 2
    s.accept(7)                                   # accepted without sample(): mu stays
    assert s.mu == mus[2]


# ---- mask, bias, greedy, drawing, logprobs ------------------------------------------------------------------

def test_mask_bias_and_bans():
    x = random_logits(4, n_removed=0)
    mask = torch.rand(V, generator=torch.Generator().manual_seed(0)) < 0.3
    bias = {3: 2.5, 10: -1.0}
    s = state(logit_bias=bias, banned_token_ids=[int(mask.nonzero()[0])], seed=0)
    expected = x.clone()
    for token, value in bias.items():
        expected[token] += value
    expected[~mask] = -math.inf
    expected[int(mask.nonzero()[0])] = -math.inf
    torch.testing.assert_close(probs(x, s, mask), expected.softmax(-1))
    drawn = torch.tensor([sample(x, s, mask).token for _ in range(300)])
    assert mask[drawn].all() and not (drawn == int(mask.nonzero()[0])).any()
    with pytest.raises(SamplingError, match="no token is allowed"):
        sample(x, s, torch.zeros(V, dtype=torch.bool))
    with pytest.raises(SamplingError, match="outside the vocabulary"):
        sample(x, state(banned_token_ids=[V]))
    for bad in (math.nan, math.inf):            # the model's fault, not the mask's: said so
        broken = x.clone()
        broken[7] = bad
        with pytest.raises(SamplingError, match="logits contain NaN or \\+inf"):
            sample(broken, state(min_p=0.1))


def test_greedy():
    x = random_logits(5)
    history = [int(x.argmax())]
    s = state(history, temperature=0, repetition_penalty=10.0, top_k=5)
    penalised = hf(RepetitionPenaltyLogitsProcessor(10.0), x, history)
    assert sample(x, s).token == int(penalised.argmax()) != int(x.argmax())
    assert torch.equal(probs(x, s), torch.nn.functional.one_hot(penalised.argmax(), V).float())
    batch = torch.stack([random_logits(i) for i in range(4)])
    assert torch.equal(greedy(batch), batch.argmax(-1))
    assert SamplingParams(temperature=0, seed=3).is_plain_greedy and not s.params.is_plain_greedy


def test_draws_follow_probs():
    x = torch.tensor([1.0, 0.0, -0.5, 2.0, -math.inf, 0.3])
    s = state(temperature=1.3, seed=11)
    n = 20000
    counts = torch.bincount(torch.tensor([sample(x, s).token for _ in range(n)]), minlength=6).double()
    expected = probs(x, s).double() * n
    assert counts[4] == 0
    assert ((counts - expected) ** 2 / expected.clamp(min=1)).sum() < 25      # chi-square, 4 dof: p << 1e-3


def test_seeded_reproducibility_independent_of_batching():
    logits = [random_logits(i) for i in range(30)]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    def run(states_in_batch: int) -> list[int]:
        states = [SamplerState(params, [1, 2, 3]) for _ in range(states_in_batch)]
        tokens = []
        for x in logits:
            for s in states:                      # other jobs in the batch draw from their own generators
                token = sample(x, s).token
                s.accept(token)
            tokens.append(states[0].history[-1].item())
        return tokens

    alone = run(1)
    assert alone == run(4)
    assert alone != [sample(x, state(temperature=0.9, top_p=0.95, seed=99)).token for x in logits]


PLAIN = [dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=5), dict(min_p=0.05),
         dict(temperature=0.5, top_k=40, top_p=0.95, min_p=0.01), dict(temperature=2.0, top_p=0.0)]


def test_rows_draw_what_each_row_draws_alone():
    """sample_rows (the engine's pass over many plain-sampling jobs) against the specification row by row
    (probs, then draw), each job with its own seed and settings, over steps with ties and removed tokens."""
    batched = [state([1, 2], seed=i, **p) for i, p in enumerate(PLAIN)]
    alone = [state([1, 2], seed=i, **p) for i, p in enumerate(PLAIN)]
    for step in range(40):
        rows = torch.stack([random_logits(100 * step + i) for i in range(len(PLAIN))])
        assert sample_rows(rows, batched) == [draw(probs(x, s), s.rng) for x, s in zip(rows, alone)]


def test_rows_with_broken_logits_give_none_there_only():
    rows = torch.stack([random_logits(1), torch.full((V,), math.nan), random_logits(2), torch.full((V,), -math.inf)])
    states = [state(seed=9, temperature=0.8) for _ in range(4)]
    tokens = sample_rows(rows, states)
    assert tokens[1] is None and tokens[3] is None
    assert tokens[0] == sample(rows[0], state(seed=9, temperature=0.8)).token
    with pytest.raises(SamplingError, match="NaN"):
        sample(rows[1], state(seed=9, temperature=0.8))
    with pytest.raises(SamplingError, match="plain sampling"):
        sample_rows(rows[:1], [state(temperature=0.8, repetition_penalty=1.2)])
    with pytest.raises(SamplingError, match=r"logits \[2, V\]"):
        sample_rows(rows[:1], states[:2])


def test_logprobs_are_the_raw_log_softmax():
    x = random_logits(6)
    s = state(temperature=0.5, top_k=3, repetition_penalty=1.5, seed=0)
    result = sample(x, s, n_logprobs=5)
    reference = torch.log_softmax(x.double(), -1)
    assert result.logprob == pytest.approx(reference[result.token].item(), abs=1e-5)
    top = torch.topk(reference, 5)
    assert [t for t, _ in result.top] == top.indices.tolist()
    assert [lp for _, lp in result.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert sample(x, s).top == []


def test_history_accept_rollback():
    s = state([4, 5, 6])
    for token in range(100):                      # grows past the initial buffer
        s.accept(token)
    s.rollback(98)
    assert s.history.tolist() == [4, 5, 6, 0, 1] and s.n_generated == 2
    with pytest.raises(SamplingError, match="roll back 3"):
        s.rollback(3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_equal_cpu():
    params = dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.1, seed=5)
    cpu, gpu = state([1, 2, 3], **params), state([1, 2, 3], **params)
    for i in range(20):
        x = random_logits(i)
        a, b = sample(x, cpu, n_logprobs=3), sample(x.cuda(), gpu, n_logprobs=3)
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        cpu.accept(a.token)
        gpu.accept(b.token)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rows_equal_cpu_rows_alone():
    """The engine's batched draw on the GPU gives each job what its row gives alone on the CPU (ties included:
    random_logits has some at the top)."""
    gpu = [state([1, 2], seed=i, **p) for i, p in enumerate(PLAIN)]
    cpu = [state([1, 2], seed=i, **p) for i, p in enumerate(PLAIN)]
    for step in range(20):
        rows = torch.stack([random_logits(100 * step + i) for i in range(len(PLAIN))])
        assert sample_rows(rows.cuda(), gpu) == [sample_rows(x[None], [s])[0] for x, s in zip(rows, cpu)]


# ---- bad input ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.1, r"temperature=-0.1: expected a number >= 0"),
    ("temperature", math.nan, r"temperature=nan"),
    ("top_p", 1.5, r"top_p=1.5: expected a number in \[0, 1\]"),
    ("top_k", -1, r"top_k=-1: expected an integer >= 0"),
    ("top_k", 2.5, r"top_k=2.5"),
    ("top_k", True, r"top_k=True"),
    ("min_p", math.nan, r"min_p=nan"),
    ("xtc_threshold", 0.6, r"xtc_threshold=0.6: expected a number in \[0, 0.5\]"),
    ("dry_base", 0.5, r"dry_base=0.5: expected a number >= 1"),
    ("dry_allowed_length", 0, r"dry_allowed_length=0"),
    ("mirostat_eta", 0.0, r"mirostat_eta=0.0: expected a number in \(0, 1\]"),
    ("repetition_penalty", 0.0, r"repetition_penalty=0.0: expected a number > 0"),
    ("frequency_penalty", math.inf, r"frequency_penalty=inf: expected a finite number"),
    ("penalty_range", -1, r"penalty_range=-1"),
    ("logit_bias", {3: math.nan}, r"logit_bias\[3\]=nan"),
    ("logit_bias", {-2: 1.0}, r"logit_bias: token id -2"),
    ("banned_token_ids", ("7",), r"banned_token_ids: token id '7'"),
    ("seed", -1, r"seed=-1"),
    ("dry_sequence_breakers", ("",), r"dry_sequence_breakers"),
])
def test_bad_parameters(field, value, message):
    with pytest.raises(SamplingError, match=message):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("params, message", [
    (dict(temperature=0, mirostat_tau=5.0), "mirostat_tau=5.0 needs temperature > 0"),
    (dict(temperature=0, xtc_probability=0.5), "xtc_probability=0.5 needs temperature > 0"),
    (dict(temperature=0, dynatemp_range=0.5), "dynatemp_range=0.5 needs temperature > 0"),
    (dict(mirostat_tau=5.0, xtc_probability=0.5), "mirostat .* and XTC .* cannot be combined"),
    (dict(logit_bias={4: 1.0}, banned_token_ids=(4,)), r"tokens \[4\] are both banned and given a logit_bias"),
])
def test_contradictory_parameters(params, message):
    with pytest.raises(SamplingError, match=message):
        SamplingParams(**params)


def test_sampling_error_is_a_value_error():
    assert issubclass(SamplingError, ValueError)
    with pytest.raises(SamplingError, match="n_logprobs=-1"):
        sample(random_logits(0), state(), n_logprobs=-1)
    with pytest.raises(SamplingError, match="mask must be bool"):
        sample(random_logits(0), state(), torch.ones(V))

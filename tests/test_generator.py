"""The generation engine on a tiny random Llama (CPU): agreement with transformers, batching, joining, prefix reuse,
cancellation, queueing for pages, context limits, stop tokens, banned strings, logprobs, threads, constraints."""
from __future__ import annotations

import importlib.util
import math
import re
import threading

import pytest
import torch

from exl_backends import ExlForCausalLM
from exl_backends.engine.generator import Generator, template_stop_ids
from exl_backends.engine.sampling import SamplingParams
from exl_backends.errors import ContextLengthError, SamplingError

from conftest import save_tiny, tiny_config

PAGE = 16
NEW = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    hf = save_tiny(path, tiny_config("llama"))
    return ExlForCausalLM.from_pretrained(path, device="cpu"), hf


def make(model, **kw) -> Generator:
    kw.setdefault("cache_tokens", 4096)
    return Generator(model, page_size=PAGE, **kw)


def random_prompts(n: int, seed: int, low: int = 5, high: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g).tolist()
    return [torch.randint(0, 509, (k,), generator=g).tolist() for k in lengths]


def alone(model, prompt, **kw) -> list[int]:
    """Greedy output of prompt run by itself on a fresh generator, no EOS stop."""
    return make(model).generate(prompt, max_new_tokens=kw.pop("max_new_tokens", NEW), stop_token_ids=[],
                                **kw).token_ids


def counting(gen: Generator) -> list:
    """Records every batch the generator runs through the model."""
    batches = []
    forward = gen._forward

    def wrapped(batch):
        batches.append(batch)
        return forward(batch)
    gen._forward = wrapped
    return batches


def test_greedy_equals_transformers(tiny):
    model, hf = tiny
    gen = make(model)
    for prompt in random_prompts(3, seed=1):
        ours = gen.generate(prompt, max_new_tokens=32)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
        assert ours.token_ids == ref[:len(ours.token_ids)]
        assert len(ours.token_ids) == 32 or ours.token_ids[-1] == 510
        assert ours.text == model.tokenizer.decode(ours.token_ids, skip_special_tokens=True)
        assert str(ours) == ours.text and ours.usage.prompt_tokens == len(prompt)


def test_batched_equals_alone(tiny):
    model, _ = tiny
    prompts = random_prompts(8, seed=2)
    assert len({len(p) for p in prompts}) > 4
    gen = make(model)
    batches = counting(gen)
    jobs = [gen.submit(p, max_new_tokens=NEW, stop_token_ids=[]) for p in prompts]
    results = [job.result() for job in jobs]
    assert max(b.n_seqs for b in batches) == 8
    for prompt, result in zip(prompts, results):
        assert result.token_ids == alone(model, prompt)
        assert result.finish_reason == "length" and result.usage.completion_tokens == NEW


def test_job_joining_midway_changes_nothing(tiny):
    model, _ = tiny
    a, b, c = random_prompts(3, seed=3)
    gen = make(model)
    job_a, job_b = gen.submit(a, max_new_tokens=NEW, stop_token_ids=[]), gen.submit(b, max_new_tokens=NEW,
                                                                                      stop_token_ids=[])
    head = [next(job_a) for _ in range(5)]
    job_c = gen.submit(c, max_new_tokens=NEW, stop_token_ids=[])
    tail = list(job_a)
    assert [t for ch in head + tail for t in ch.token_ids] == alone(model, a)
    assert job_b.result().token_ids == alone(model, b)
    assert job_c.result().token_ids == alone(model, c)


def test_prefix_reuse_computes_the_prefix_once(tiny):
    model, _ = tiny
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, 509, (50,), generator=g).tolist()
    a = prefix + torch.randint(0, 509, (10,), generator=g).tolist()
    b = prefix + torch.randint(0, 509, (8,), generator=g).tolist()
    gen = make(model)
    batches = counting(gen)
    first = gen.generate(a, max_new_tokens=8, stop_token_ids=[])
    assert sum(x.input_ids.numel() for x in batches) == len(a) + 7 and first.usage.cached_tokens == 0
    batches.clear()
    second = gen.generate(b, max_new_tokens=8, stop_token_ids=[])
    shared = 50             # 3 full pages of 16, and the head of the 4th (2 tokens) copied into b's own page
    assert second.usage.cached_tokens == shared
    assert sum(x.input_ids.numel() for x in batches) == len(b) - shared + 7
    assert second.token_ids == alone(model, b, max_new_tokens=8)
    # the next turn of a conversation reuses the finished job's generated tokens too, its partly filled last page
    # included: every token whose K/V the first job computed
    batches.clear()
    turn = a + first.token_ids + [5, 6, 7]
    third = gen.generate(turn, max_new_tokens=8, stop_token_ids=[])
    assert third.usage.cached_tokens == len(a) + 7 == 67
    assert sum(x.input_ids.numel() for x in batches) == len(turn) - 67 + 7
    assert third.token_ids == alone(model, turn, max_new_tokens=8)


@pytest.mark.parametrize("mode", ["fp16", "q4"])
def test_prompts_parting_mid_page_copy_the_common_head(tiny, tmp_path, mode):
    """A prompt that leaves a cached page part-way takes that page's matching head (K/V, and the scales of a
    quantized cache) as a copy in its own page; a head shorter than page_size // 8 is computed again."""
    model, _ = tiny
    if mode != "fp16":          # q4 needs 64-wide K/V rows: 4 kv heads of 16
        save_tiny(tmp_path, tiny_config("llama", num_key_value_heads=4))
        model = ExlForCausalLM.from_pretrained(tmp_path, device="cpu", cache_mode=mode)
    g = torch.Generator().manual_seed(7)
    a = torch.randint(0, 509, (60,), generator=g).tolist()
    gen = make(model)
    gen.generate(a, max_new_tokens=4, stop_token_ids=[])
    batches = counting(gen)
    for common, cached in ((41, 41), (33, 32)):    # 2 full pages + 9 tokens of the 3rd; + 1 token: too few
        b = a[:common] + [(a[common] + 1) % 509] + a[common + 1:50]
        result = gen.generate(b, max_new_tokens=6, stop_token_ids=[])
        assert result.usage.cached_tokens == cached
        assert result.token_ids == make(model).generate(b, max_new_tokens=6, stop_token_ids=[]).token_ids
    assert sum(x.input_ids.numel() for x in batches) == (50 - 41 + 5) + (50 - 32 + 5)
    assert gen.pages.n_available == gen.capacity_pages and not gen.scheduler.copies


def test_a_head_is_copied_only_when_its_page_can_be_held(tiny):
    """The page a head is copied from is held from admission to the copy. A job that needs every page but the
    ones it shares cannot also hold it: it computes the head instead (the source page is evicted for it); with
    one page more it copies. The output is the same either way."""
    model, _ = tiny
    g = torch.Generator().manual_seed(8)
    a = torch.randint(0, 509, (40,), generator=g).tolist()
    for pages, cached in ((5, 32), (6, 43)):
        gen = make(model, cache_tokens=pages * PAGE)
        first = gen.generate(a, max_new_tokens=4, stop_token_ids=[])    # pages 0, 1 full, page 2 holds 11 tokens
        turn = a + first.token_ids[:3] + [9, 8, 7]
        result = gen.generate(turn, max_new_tokens=30, stop_token_ids=[])   # 76 tokens: 5 pages
        assert result.usage.cached_tokens == cached
        assert result.token_ids == alone(model, turn, max_new_tokens=30)


def test_speculative_jobs_copy_heads_into_both_caches(tiny):
    """A draft model shares the page table: a copied head lands in its cache too, so drafting stays exact."""
    model, _ = tiny
    g = torch.Generator().manual_seed(9)
    a = torch.randint(0, 509, (40,), generator=g).tolist()
    gen = make(model, draft_model=model)
    first = gen.generate(a, max_new_tokens=5, stop_token_ids=[])
    turn = a + first.token_ids + [3, 4]
    result = gen.generate(turn, max_new_tokens=12, stop_token_ids=[])
    # a head of page 2 was copied: up to the tokens both caches hold (the draft's may lag the target's by one)
    assert 2 * PAGE < result.usage.cached_tokens <= len(a) + 4
    assert result.token_ids == alone(model, turn, max_new_tokens=12)


def test_cached_pages_are_evicted_when_memory_is_needed(tiny):
    model, _ = tiny
    gen = make(model, cache_tokens=8 * PAGE)
    prompts = random_prompts(6, seed=5, low=30, high=40)
    for p in prompts:                           # each leaves 2 registered pages behind; 8 pages hold 4 such
        assert gen.generate(p, max_new_tokens=8, stop_token_ids=[]).token_ids == alone(model, p, max_new_tokens=8)
    assert gen.pages.n_available == 8
    # least recently used first: the last prompt is still cached, the first one is gone
    assert gen.generate(prompts[-1], max_new_tokens=8, stop_token_ids=[]).usage.cached_tokens > 0
    assert gen.generate(prompts[0], max_new_tokens=8, stop_token_ids=[]).usage.cached_tokens == 0


def test_cancel_frees_pages_at_once(tiny):
    model, _ = tiny
    gen = make(model, cache_tokens=16 * PAGE)
    job = gen.submit(random_prompts(1, seed=6)[0], max_new_tokens=100, stop_token_ids=[])
    next(job)
    assert gen.cache.pool.n_free < 16 and job.pages
    gen.cancel(job)
    assert gen.pages.n_available == 16 and not gen.scheduler.running and not job.pages
    rest = list(job)
    assert rest[-1].finish_reason == "cancelled" and job.is_done
    # closing a stream early cancels its job
    stream = gen.stream(random_prompts(1, seed=7)[0], max_new_tokens=100, stop_token_ids=[])
    next(stream)
    stream.close()
    assert gen.pages.n_available == 16 and not gen.scheduler.running


def test_steps_launched_ahead_change_no_token(tiny, monkeypatch):
    """Decode steps of plain greedy jobs go to the model before the tokens of the step before are read (fed its
    argmax on the device): the same tokens as stepping one at a time, for jobs that stop on a token mid-way, wait
    for min_new_tokens, reach their length, are cancelled mid-stream, or join while others decode and ask for
    logprobs; every page is free again at the end."""
    model, _ = tiny
    prompts = random_prompts(4, seed=21)
    stop = alone(model, prompts[0])[7]

    def run():
        gen = make(model)
        batches = counting(gen)
        jobs = [gen.submit(prompts[0], max_new_tokens=NEW, stop_token_ids=[stop]),
                gen.submit(prompts[1], max_new_tokens=5, stop_token_ids=[]),
                gen.submit(prompts[2], max_new_tokens=NEW, stop_token_ids=[stop], min_new_tokens=4)]
        cancelled = gen.submit(prompts[3], max_new_tokens=NEW, stop_token_ids=[])
        head = next(jobs[0]).token_ids + next(jobs[0]).token_ids
        gen.cancel(cancelled)
        jobs.append(gen.submit(prompts[3], max_new_tokens=9, stop_token_ids=[], logprobs=2))
        results = [job.result() for job in jobs]
        out = [r.token_ids for r in results] + [[(x.token, round(x.logprob, 5)) for x in results[-1].logprobs]]
        out[0] = head + out[0]
        assert [job.n_generated for job in jobs] == [len(tokens) for tokens in out[:4]]    # none after the end
        assert gen.pages.n_available == gen.cache.pool.n_pages and not gen.scheduler.running
        return out, len(batches)

    launched = []
    launch = Generator._launch_next
    monkeypatch.setattr(Generator, "_launch_next", lambda self, step: launched.append(step) or launch(self, step))
    ahead, n_ahead = run()
    assert len(launched) > 10 and ahead[0][-1] == stop and len(ahead[1]) == 5
    monkeypatch.setattr(Generator, "_can_look_ahead", lambda self, jobs, ahead: False)
    plain, n_plain = run()
    assert ahead == plain
    assert n_plain <= n_ahead <= n_plain + 4      # a launched step is wasted at most when a job stops on a token


def test_steps_launched_ahead_for_sampling_and_banned_stops(tiny, monkeypatch):
    """Look-ahead feeds the next step the token the job takes, not the raw argmax: a greedy job whose argmax is a
    stop token that min_new_tokens still bans (the masked argmax), and plain-sampling jobs (drawn on the device,
    one uniform each; one of them waits out min_new_tokens first) give the tokens of stepping one at a time, and
    their steps are launched ahead."""
    model, _ = tiny
    prompts = random_prompts(3, seed=30)
    stops = [alone(model, p)[1] for p in prompts]            # the argmax at the second new token
    greedy_job = [dict(prompt=prompts[0], max_new_tokens=12, stop_token_ids=[stops[0]], min_new_tokens=5)]
    sampling_jobs = [dict(prompt=prompts[1], max_new_tokens=12, stop_token_ids=[],
                          sampling=SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=3)),
                     dict(prompt=prompts[2], max_new_tokens=12, stop_token_ids=[stops[2]], min_new_tokens=4,
                          sampling=SamplingParams(temperature=1.2, min_p=0.05, seed=4))]

    def run(specs):
        gen = make(model)
        jobs = [gen.submit(**spec) for spec in specs]
        return [job.result().token_ids for job in jobs]

    launched = []
    launch = Generator._launch_next
    monkeypatch.setattr(Generator, "_launch_next", lambda self, step: launched.append(step) or launch(self, step))
    ahead = run(greedy_job)
    assert len(launched) >= 9 and ahead[0][1] != stops[0] and len(ahead[0]) == 12
    ahead += run(sampling_jobs)
    assert any(step.sampled for step in launched)
    monkeypatch.setattr(Generator, "_can_look_ahead", lambda self, jobs, ahead: False)
    assert run(greedy_job) + run(sampling_jobs) == ahead


def test_broken_logits_in_a_launched_step_end_that_job_only(tiny, monkeypatch):
    """A plain-sampling job whose row of a launched step's logits turns NaN (or all -inf) ends with the error that
    names it, without the step's logits kept on the side; the other job of the step goes on as if alone."""
    model, _ = tiny
    prompts = random_prompts(2, seed=40)
    spec = dict(max_new_tokens=10, stop_token_ids=[], sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=5))
    gen = make(model)
    healthy = gen.submit(prompts[0], **spec).result().token_ids
    launched = []
    launch = Generator._launch_next
    monkeypatch.setattr(Generator, "_launch_next", lambda self, step: launched.append(step) or launch(self, step))
    for value, message in ((math.nan, "NaN or \\+inf"), (-math.inf, "no token is allowed")):
        gen = make(model)
        forward, calls = gen._forward, [0]

        def breaking(batch, forward=forward, value=value):
            logits = forward(batch)
            calls[0] += 1
            if calls[0] == 4:       # a decode step of both jobs: the second job's row
                logits = logits.clone()
                logits[1] = value
            return logits
        gen._forward = breaking
        jobs = [gen.submit(p, **spec) for p in prompts]
        assert jobs[0].result().token_ids == healthy
        with pytest.raises(SamplingError, match=message):
            jobs[1].result()
        assert any(step.host[1].any() for step in launched)            # a launched step's row broke
        assert all(step.logits is None for step in launched)
        launched.clear()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_token_copies_reach_the_host_on_a_stream_of_their_own(device):
    """TokenCopies: a step's tokens in host memory once their event has passed (on the CPU: the tensor itself, no
    event), copied on a side stream that waited for the step's work, one stream per device, reused."""
    from exl_backends.engine.generator import TokenCopies
    copies = TokenCopies()
    for n in (1, 5):
        t = torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(n)).to(device)
        if device == "cuda":
            t = (t * 3).sub_(7)                     # made by kernels the copy must wait for
        host, done = copies.start(t)
        if device == "cpu":
            assert host is t and done is None
            continue
        done.synchronize()
        assert host.device.type == "cpu" and host.is_pinned() and host.tolist() == t.tolist()
        (stream,) = copies.streams.values()
        assert stream != torch.cuda.current_stream()


def test_more_jobs_than_pages_wait_and_all_finish(tiny):
    model, _ = tiny
    gen = make(model, cache_tokens=8 * PAGE)   # a job of 20 + 20 tokens takes 3 pages: two fit at once
    batches = counting(gen)
    prompts = [p[:20] for p in random_prompts(6, seed=8, low=20, high=30)]
    jobs = [gen.submit(p, max_new_tokens=20, stop_token_ids=[]) for p in prompts]
    results = [job.result() for job in jobs]
    assert max(b.n_seqs for b in batches) == 2
    for p, r in zip(prompts, results):
        assert r.token_ids == alone(model, p, max_new_tokens=20)


def test_prompt_longer_than_context_raises(tiny):
    model, _ = tiny
    gen = make(model, max_seq_len=64, cache_tokens=256)
    with pytest.raises(ContextLengthError, match=r"70 tokens.*max_seq_len is 64"):
        gen.submit(list(range(70)))
    with pytest.raises(ContextLengthError):
        gen.submit(list(range(64)))
    # a prompt that fits gets at most what is left of the context
    r = gen.generate(list(range(60)), max_new_tokens=50, stop_token_ids=[])
    assert r.finish_reason == "length" and len(r.token_ids) == 4
    # a job that could never fit in the cache is refused, not queued forever
    with pytest.raises(ContextLengthError, match="cache_tokens"):
        make(model, cache_tokens=2 * PAGE).submit(list(range(20)), max_new_tokens=20)


def test_prompt_ids_outside_the_vocabulary_raise(tiny):
    model, _ = tiny
    gen = make(model, max_seq_len=64, cache_tokens=256)
    vocab = model.exl_config.vocab_size
    for ids, bad in (([3, -1, 4], -1), ([3, vocab, 2 * vocab], vocab)):
        with pytest.raises(ValueError, match=rf"prompt token id {bad} is outside the vocabulary \(0 to {vocab - 1}\)"):
            gen.submit(ids)
    for ids in ([3, 2.5], [3, "4"], [3, 2 ** 70]):     # not silently truncated or parsed
        with pytest.raises(ValueError, match="prompt token ids must be integers"):
            gen.submit(ids)
    assert gen.generate([3, vocab - 1], max_new_tokens=2, stop_token_ids=[]).token_ids       # the edges are fine
    assert gen.generate(torch.tensor([3, 5]), max_new_tokens=2, stop_token_ids=[]).token_ids     # a tensor of ids


def test_stop_token_and_min_new_tokens(tiny):
    model, _ = tiny
    prompt = random_prompts(1, seed=9)[0]
    free = alone(model, prompt)
    stop = free[5]
    first = free.index(stop)
    r = make(model).generate(prompt, max_new_tokens=NEW, stop_token_ids=[stop])
    assert r.finish_reason == "stop" and r.token_ids == free[:first + 1]
    assert r.text == model.tokenizer.decode(free[:first])
    r = make(model).generate(prompt, max_new_tokens=NEW, stop_token_ids=[stop], min_new_tokens=first + 2)
    assert stop not in r.token_ids[:first + 2] and len(r.token_ids) >= first + 2


def test_chunked_prefill_keeps_decoding_and_matches(tiny):
    model, _ = tiny
    short, long = random_prompts(1, seed=10, high=30)[0], random_prompts(1, seed=11, low=150, high=151)[0]
    gen = make(model, max_step_tokens=32)
    batches = counting(gen)
    job_short = gen.submit(short, max_new_tokens=NEW, stop_token_ids=[])
    head = next(job_short).token_ids
    job_long = gen.submit(long, max_new_tokens=8, stop_token_ids=[])
    assert job_long.result().token_ids == alone(model, long, max_new_tokens=8)
    assert head + job_short.result().token_ids == alone(model, short)
    assert all(b.input_ids.numel() <= 32 for b in batches)
    prefill_steps = [b for b in batches if b.input_ids.numel() > b.n_seqs]
    assert len(prefill_steps) >= 150 // 32 and all(b.n_seqs == 2 for b in prefill_steps[1:])


def test_banned_string_is_never_produced(tiny):
    model, _ = tiny
    tok = model.tokenizer
    prompt = random_prompts(1, seed=12)[0]
    free = make(model).generate(prompt, max_new_tokens=NEW, stop_token_ids=[])
    # ban a piece of the free text that spans a token boundary
    ends = [len(tok.decode(free.token_ids[:i + 1])) for i in range(len(free.token_ids))]
    cut = next(e for e in ends[2:] if 0 < e < len(free.text) - 2)
    banned = free.text[cut - 2:cut + 2]
    gen = make(model)
    r = gen.generate(prompt, max_new_tokens=NEW, stop_token_ids=[], banned_strings=[banned])
    assert banned not in r.text and len(r.token_ids) == NEW
    assert r.text == tok.decode(r.token_ids)
    # the text is the same up to the token in which the banned string started: that token was resampled
    kept = max(e for e in [0] + ends if e <= free.text.index(banned))
    assert r.text[:kept] == free.text[:kept] and r.text[kept:] != free.text[kept:]
    chunks = list(gen.stream(prompt, max_new_tokens=NEW, stop_token_ids=[], banned_strings=[banned]))
    assert "".join(map(str, chunks)) == r.text and [t for c in chunks for t in c.token_ids] == r.token_ids


def test_logprobs_match_the_model(tiny):
    model, hf = tiny
    prompt = random_prompts(1, seed=13)[0]
    r = make(model).generate(prompt, max_new_tokens=8, stop_token_ids=[], logprobs=3)
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompt + r.token_ids])).logits[0].float(), -1)
    assert len(r.logprobs) == 8
    for i, lp in enumerate(r.logprobs):
        row = logp[len(prompt) - 1 + i]
        assert lp.token == r.token_ids[i] == row.argmax().item()
        assert lp.logprob == pytest.approx(row[lp.token].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()


def test_sampling_is_reproducible_by_seed(tiny):
    model, _ = tiny
    prompt = random_prompts(1, seed=14)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    one = make(model).generate(prompt, max_new_tokens=NEW, sampling=params, stop_token_ids=[])
    gen = make(model)               # the same job in a batch with others draws the same tokens
    others = [gen.submit(p, max_new_tokens=NEW, stop_token_ids=[], sampling=SamplingParams(temperature=1.0))
              for p in random_prompts(3, seed=15)]
    two = gen.generate(prompt, max_new_tokens=NEW, sampling=params, stop_token_ids=[])
    assert one.token_ids == two.token_ids and one.token_ids != alone(model, prompt)
    assert all(job.result().finish_reason == "length" for job in others)


def test_threads_share_the_steps(tiny):
    model, _ = tiny
    prompts = random_prompts(4, seed=16)
    gen = make(model)
    out = {}

    def consume(i):
        out[i] = [t for chunk in gen.stream(prompts[i], max_new_tokens=NEW, stop_token_ids=[])
                  for t in chunk.token_ids]
    threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i] for i in range(4)] == [alone(model, p) for p in prompts]


def test_every_consumer_sees_its_chunks_as_its_steps_end(tiny):
    """Eight threads consume eight jobs submitted together: each sees its first token within a few steps of the one
    that made it (the first), not when the thread that keeps stepping lets go. Each step waits 2 ms with the GIL
    released, as a GPU step does."""
    import time
    model, _ = tiny
    prompts = random_prompts(8, seed=17)
    gen = make(model, max_batch_size=8)
    steps = []
    forward = gen._forward

    def slow(batch):
        time.sleep(0.002)
        steps.append(batch.n_seqs)
        return forward(batch)
    gen._forward = slow
    jobs = [gen.submit(p, max_new_tokens=40, min_new_tokens=40) for p in prompts]
    first_seen = {}

    def consume(i):
        for chunk in jobs[i]:
            if chunk.token_ids:
                first_seen.setdefault(i, len(steps))
    threads = [threading.Thread(target=consume, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert steps[0] == 8 and len(steps) == 40           # one step prefills all eight; then 39 decode steps
    assert max(first_seen.values()) <= 4, first_seen    # a plain lock let this reach ~40


def test_cancel_gets_its_turn_while_threads_keep_stepping(tiny):
    model, _ = tiny
    gen = make(model, max_batch_size=4)
    busy = [gen.submit(p, max_new_tokens=200, min_new_tokens=200) for p in random_prompts(3, seed=18)]
    target = gen.submit(random_prompts(1, seed=19)[0], max_new_tokens=200, min_new_tokens=200)
    reasons = []
    threads = [threading.Thread(target=lambda job=job: reasons.append(job.result().finish_reason)) for job in busy]
    for t in threads:
        t.start()
    next(iter(target))                                   # it is running
    gen.cancel(target)
    assert target.result().finish_reason == "cancelled"
    assert not all(job.is_done for job in busy)          # cancelled while the others still ran
    for t in threads:
        t.join()
    assert reasons == ["length"] * 3


def test_text_prompt_and_bos(tiny):
    model, _ = tiny
    tok = model.tokenizer
    gen = make(model)
    ids = tok.encode("Hello world", add_special_tokens=False)
    plain = gen.generate("Hello world", max_new_tokens=4, stop_token_ids=[])
    assert plain.usage.prompt_tokens == len(ids) and plain.token_ids == alone(model, ids, max_new_tokens=4)
    with_bos = gen.generate("Hello world", max_new_tokens=4, stop_token_ids=[], add_bos=True)
    assert with_bos.token_ids == alone(model, [tok.bos_token_id] + ids, max_new_tokens=4)


def test_chat_prompt_uses_the_template_and_its_stop_tokens(tiny):
    model, _ = tiny
    tok = model.tokenizer
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}<|pad|>{% endfor %}"
                         "{% if add_generation_prompt %}>{% endif %}")
    try:
        assert template_stop_ids(tok) == {511}
        r = make(model).generate([{"role": "user", "content": "hello"}], max_new_tokens=4, stop_token_ids=[])
        assert r.usage.prompt_tokens == len(tok.encode("hello<|pad|>>", add_special_tokens=False))
    finally:
        tok.chat_template = None


@pytest.mark.skipif(importlib.util.find_spec("llguidance") is None, reason="llguidance not installed")
@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=1.0, seed=3)])
def test_regex_constraint_holds(tiny, sampling):
    model, _ = tiny
    gen = make(model)
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    for prompt in random_prompts(3, seed=17):
        r = gen.generate(prompt, max_new_tokens=20, regex=pattern, sampling=sampling)
        assert re.fullmatch(pattern, r.text), r.text
        assert r.finish_reason == "stop"


def test_result_after_iterating_says_the_chunks_were_taken(tiny):
    model, _ = tiny
    job = make(model).submit([1, 2, 3], max_new_tokens=3, stop_token_ids=[])
    assert len([t for chunk in job for t in chunk.token_ids]) == 3
    with pytest.raises(RuntimeError, match="already taken by iterating"):
        job.result()


# ---- what needs the tokenizer --------------------------------------------------------------------------------------

@pytest.mark.parametrize("ngram", [False, True])
def test_a_job_without_text_gives_the_same_tokens_and_no_text(tiny, ngram):
    model, _ = tiny
    prompt = random_prompts(1, seed=18)[0]
    with_text = make(model, ngram_draft=ngram).generate(prompt, max_new_tokens=NEW, stop_token_ids=[], logprobs=2)
    chunks = list(make(model, ngram_draft=ngram).stream(prompt, max_new_tokens=NEW, stop_token_ids=[], logprobs=2,
                                                         text=False))
    assert [t for c in chunks for t in c.token_ids] == with_text.token_ids and len(chunks) > 1
    assert [lp for c in chunks for lp in c.logprobs] == with_text.logprobs
    assert all(c.text == "" for c in chunks) and chunks[-1].finish_reason == "length"
    stop = with_text.token_ids[3]
    r = make(model).generate(prompt, max_new_tokens=NEW, stop_token_ids=[stop], text=False)
    assert r.finish_reason == "stop" and r.token_ids == with_text.token_ids[:with_text.token_ids.index(stop) + 1]
    for text_only in (dict(stop="a"), dict(banned_strings=["a"]), dict(stop_check=lambda text: False)):
        with pytest.raises(ValueError, match="text=True"):
            make(model).submit(prompt, text=False, **text_only)


def test_token_id_jobs_without_text_load_no_tokenizer(tiny):
    lazy = ExlForCausalLM.from_pretrained(tiny[0].name_or_path, device="cpu")
    gen = make(lazy)
    gen.generate([1, 2, 3], max_new_tokens=4, stop_token_ids=[510], text=False,
                 sampling=SamplingParams(temperature=1.0, top_k=20, repetition_penalty=1.2, seed=1))
    assert "tokenizer" not in lazy.__dict__ and "tokenizer" not in gen.__dict__ and "eos_ids" not in gen.__dict__
    gen.generate([1, 2, 3], max_new_tokens=4, text=False)          # the default stops: the tokenizer's EOS too
    assert "tokenizer" in lazy.__dict__ and gen.tokenizer is lazy.tokenizer
    dry = make(ExlForCausalLM.from_pretrained(tiny[0].name_or_path, device="cpu"))
    dry.generate([1, 2, 3], max_new_tokens=4, stop_token_ids=[], text=False,
                 sampling=SamplingParams(dry_multiplier=0.8))      # DRY's breakers are tokenized
    assert "tokenizer" in dry.__dict__


def eager_eos_ids(path) -> frozenset[int]:
    """What Generator.__init__ made before the tokenizer loaded lazily: config's EOS ids and the tokenizer's."""
    from transformers import AutoTokenizer
    from exl_backends.model.config import ModelConfig
    eos = AutoTokenizer.from_pretrained(str(path)).eos_token_id
    return frozenset(ModelConfig.from_dir(path).eos_token_ids) | ({eos} if eos is not None else set())


def test_eos_ids_are_the_configs_and_the_tokenizers(tmp_path):
    from conftest import FIXTURES
    save_tiny(tmp_path, tiny_config("llama", eos_token_id=[7, 8]))          # the tokenizer's EOS is 510
    dirs = [tmp_path, *sorted((FIXTURES / "exl2").iterdir()), *sorted((FIXTURES / "hf").iterdir())]
    for path in dirs:
        gen = make(ExlForCausalLM.from_pretrained(path, device="cpu"), cache_tokens=64)
        assert gen.eos_ids == eager_eos_ids(path), path
    assert eager_eos_ids(tmp_path) == {7, 8, 510}


@pytest.mark.slow
def test_eos_ids_of_the_default_model():
    from exl_backends.commands.quickstart import default_model_dir
    path = default_model_dir()
    gen = make(ExlForCausalLM.from_pretrained(path, device="cpu", max_seq_len=64), cache_tokens=64)
    assert gen.eos_ids == eager_eos_ids(path)

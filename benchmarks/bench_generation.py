"""The generation engine's speed claims (issue #6), on a synthetic Llama-3-8B-shape EXL2 model (4.0 bpw body):

  concurrency  aggregate tokens/s of 1, 4, 16 and 64 jobs submitted together (greedy, fixed length; target:
               16 jobs >= 8x one job; `--sampling plain`: every job samples at temperature 0.8, top_p 0.9), over
               the whole run and over its decode phase (from the first job's first token on: the prompts'
               prefill, which 16 jobs pay as one 2048-token step, left out);
  ttft         time to first token of a 2000-token prompt whose first 1900 tokens are in the prefix cache, vs the
               same length uncached (target >= 5x), and the cached step's GPU time alone (the host's queueing
               hidden behind a spin);
  speculative  what a speculative step costs on this device: one graph-replayed decode token vs a verify
               step of 1 + k tokens (graph-replayed as the generator runs it; eager beside it), and a 1B-shape
               draft model's token. Speedup = tokens per step x decode cost /
               step cost. Tokens per step depend on the model and the task, not the device: `--model DIR` measures
               them for n-gram drafting on a real model (e.g. SmolLM2 on the CPU) on a repetitive task (rewriting
               a code block with small edits), with the wall-clock speedup on that device; the table then combines
               them with the GPU step costs (`--tokens-per-step`). Random weights cannot measure acceptance.

    python benchmarks/bench_generation.py                              # GPU: all parts, llama-3-8b shape
    python benchmarks/bench_generation.py --part speculative --model ~/.cache/exl-backends/SmolLM2-135M-Instruct-exl2-4.0bpw --device cpu
    python benchmarks/bench_generation.py --shape tiny --device cpu --levels 1,4 --max-tokens 16   # CPU smoke
    python benchmarks/bench_generation.py --part ttft --profile        # where a cached-prefix first token's time goes
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import math
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import SyntheticLM, WordTokenizer, in_process, random_prompts  # noqa: E402
from shapes import synthetic_model  # noqa: E402

from exl_backends import Generator, SamplingParams
from exl_backends.engine import generator  # noqa: E402
from exl_backends.model.batch import Batch, SeqChunk  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
SAMPLINGS = {"greedy": GREEDY, "plain": SamplingParams(temperature=0.8, top_p=0.9)}
CODE = '''def moving_average(values, window):
    """Average of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            result.append(total / window)
    return result
'''
EDIT_TASK = ("Rewrite this Python function exactly, changing only the variable name `total` to `running_sum`. "
             "Reply with the code only.\n\n" + CODE)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---- concurrency ---------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def step_clock():
    """Per engine step: when it started and how long its host waited for the GPU's tokens (Launched.tokens): a
    step that waits ~0 leaves the GPU waiting for the host instead."""
    starts, waits = [], []
    step, tokens = Generator._step, generator.Launched.tokens

    def timed_step(self):
        starts.append(time.perf_counter())
        return step(self)

    def timed_tokens(self):
        t0 = time.perf_counter()
        if self.done is not None:
            self.done.synchronize()
        waits.append(time.perf_counter() - t0)
        return tokens(self)
    Generator._step, generator.Launched.tokens = timed_step, timed_tokens
    try:
        yield starts, waits
    finally:
        Generator._step, generator.Launched.tokens = step, tokens


def concurrency(lm, levels: list[int], prompt_len: int, max_tokens: int, profile: bool = False,
                sampling: SamplingParams = GREEDY) -> list[dict]:
    seq = prompt_len + max_tokens
    gen = Generator(lm, max_batch_size=max(levels), max_seq_len=seq, cache_tokens=max(levels) * (seq + lm.page_size))
    vocab = lm.exl_config.vocab_size
    rows = []
    for i, n in enumerate(levels):
        in_process(gen, random_prompts(n, prompt_len, vocab, seed=1000 + i), n, max_tokens, sampling)   # warm-up
        with step_clock() as (starts, waits):
            r = in_process(gen, random_prompts(n, prompt_len, vocab, seed=2000 + i), n, max_tokens, sampling)
        gaps = [b - a for a, b in zip(starts[1:], starts[2:])]       # decode steps (the first: the prefill)
        rows.append(dict(jobs=n, tok_s=r["tok_s"], decode_tok_s=r["decode_tok_s"], per_job_tok_s=r["per_request_tok_s"],
                         ttft_ms=r["ttft_ms"], steps=len(starts), step_ms=1000 * statistics.median(gaps or [0]),
                         wait_ms=1000 * statistics.median(waits or [0])))
    if profile:     # the last level's jobs, consumed (so their steps run) in this thread, where cProfile sees them
        n = levels[-1]
        prompts = random_prompts(n, prompt_len, vocab, seed=4000)
        with cProfile.Profile() as profiler:
            jobs = [gen.submit(p, max_new_tokens=max_tokens, min_new_tokens=max_tokens, sampling=sampling)
                    for p in prompts]
            sum(len(c.token_ids) for job in jobs for c in job)
            sync(lm.model.device)
        print(f"== host profile: {n} jobs, {prompt_len}-token prompts, {max_tokens} new tokens ==")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    for r in rows:
        r["vs_one_job"] = r["tok_s"] / rows[0]["tok_s"]
        r["decode_vs_one_job"] = r["decode_tok_s"] / rows[0]["decode_tok_s"]
    return rows


# ---- time to first token with a cached prefix ----------------------------------------------------------------------

def first_token_s(gen: Generator, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and how many prompt tokens came from the prefix cache."""
    t0 = time.perf_counter()
    job = gen.submit(prompt, max_new_tokens=1, sampling=GREEDY)
    chunks = [next(job)]
    seconds = time.perf_counter() - t0
    chunks += list(job)
    return seconds, chunks[-1].usage.cached_tokens


def ttft(lm, prompt_len: int, prefix_len: int, rounds: int, profile: bool = False) -> dict:
    gen = Generator(lm, max_batch_size=4, max_seq_len=prompt_len + 8, cache_tokens=8 * (prompt_len + lm.page_size))
    vocab = lm.exl_config.vocab_size
    cold, warm = [], []
    for r in range(rounds + 1):     # round 0 warms up
        prefix, tail_a, tail_b, fresh = random_prompts(4, prompt_len, vocab, seed=3000 + r)
        first_token_s(gen, prefix[:prefix_len] + tail_a[prefix_len:])      # computes (and caches) the prefix
        w, cached = first_token_s(gen, prefix[:prefix_len] + tail_b[prefix_len:])
        c, _ = first_token_s(gen, fresh)
        if r:
            warm.append(w)
            cold.append(c)
        else:
            first = w               # its step size's prefill graphs captured on the way
    if profile:
        profile_cached(gen, prompt_len, prefix_len, vocab)
    gpu = gpu_only_ms(gen, prompt_len, prefix_len, vocab) if gen.cache.device.type == "cuda" else float("nan")
    to_runner, to_model = lead_in_ms(gen, prompt_len, prefix_len, vocab)
    return dict(prompt=prompt_len, prefix=prefix_len, reused_tokens=cached, cold_ms=1000 * min(cold),
                cached_ms=1000 * min(warm), speedup=min(cold) / min(warm), cached_gpu_ms=gpu, first_ms=1000 * first,
                to_runner_ms=to_runner, to_model_ms=to_model)


def lead_in_ms(gen: Generator, prompt_len: int, prefix_len: int, vocab: int, rounds: int = 5) -> tuple[float, float]:
    """Host time of a cached-prefix first token before its GPU work can start (no profiler, no sync): from submit
    to Runner.forward (the engine: admission, page matching, Batch.build), and to the model's first piece or block
    (the runner's inputs and rope tables). Min over rounds, ms."""
    from exl_backends.model import model as model_module, runner as runner_module
    marks: dict[str, float] = {}
    forward, replay, stage = (runner_module.Runner.forward, runner_module.PrefillGraphs._replay,
                              model_module.Model.stage_forward)

    def mark(name, f):
        def wrapped(*args, **kwargs):
            marks.setdefault(name, time.perf_counter())
            return f(*args, **kwargs)
        return wrapped
    runner_module.Runner.forward = mark("runner", forward)
    runner_module.PrefillGraphs._replay = mark("model", replay)
    model_module.Model.stage_forward = mark("model", stage)
    try:
        times = []
        for r in range(rounds):
            prefix, tail_a, tail_b = random_prompts(3, prompt_len, vocab, seed=7000 + r)
            first_token_s(gen, prefix[:prefix_len] + tail_a[prefix_len:])
            marks.clear()
            t0 = time.perf_counter()
            first_token_s(gen, prefix[:prefix_len] + tail_b[prefix_len:])
            times.append((marks["runner"] - t0, marks["model"] - t0))
    finally:
        runner_module.Runner.forward, runner_module.PrefillGraphs._replay = forward, replay
        model_module.Model.stage_forward = stage
    return 1000 * min(t for t, _ in times), 1000 * min(t for _, t in times)


def gpu_only_ms(gen: Generator, prompt_len: int, prefix_len: int, vocab: int, rounds: int = 3) -> float:
    """A cached-prefix first token's GPU time alone: the GPU held busy (a 50 ms spin) while the host queues the
    whole step, then timed from the spin's end by events. Against the wall time: what the host costs (its work
    before the first kernel, and any kernel that waits for it)."""
    times = []
    for r in range(rounds):
        prefix, tail_a, tail_b = random_prompts(3, prompt_len, vocab, seed=6000 + r)
        first_token_s(gen, prefix[:prefix_len] + tail_a[prefix_len:])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)
        start.record()
        first_token_s(gen, prefix[:prefix_len] + tail_b[prefix_len:])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return min(times)


def timeline(prof) -> None:
    """Where the wall time of a profiled call goes: host work before its first kernel, the GPU's span from first
    kernel to last and its idle time inside it, and the longest idle gaps (with the kernels around them). The
    profiler slows the host (its start alone took ~2.7 ms of the first op on the H200), so these host figures are
    upper bounds; gpu_only_ms measures the host's share without it."""
    cpu = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    if not kernels:
        return
    t0, t1 = min(e.time_range.start for e in cpu), max(e.time_range.end for e in cpu)
    gaps, busy, end = [], 0.0, kernels[0].time_range.start
    for prev, e in zip([None] + kernels, kernels):
        start = max(e.time_range.start, end)
        if e.time_range.start > end and prev is not None:
            gaps.append((e.time_range.start - end, prev.name, e.name))
        busy += max(0.0, e.time_range.end - start)
        end = max(end, e.time_range.end)
    span = end - kernels[0].time_range.start
    print(f"== timeline: host {t1 - t0:.0f} us, first kernel after {kernels[0].time_range.start - t0:.0f} us, "
          f"GPU span {span:.0f} us, busy {busy:.0f}, idle inside {span - busy:.0f}, after the last kernel "
          f"{t1 - end:.0f} us ==")
    for gap, before, after in sorted(gaps, reverse=True)[:12]:
        print(f"  idle {gap:7.1f} us  after {before[:45]:45}  before {after[:45]}")


def profile_cached(gen: Generator, prompt_len: int, prefix_len: int, vocab: int) -> None:
    """Where a cached-prefix first token's time goes: its kernels by GPU time, then the host's functions."""
    from torch.profiler import ProfilerActivity, profile
    prefix, tail_a, tail_b, tail_c = random_prompts(4, prompt_len, vocab, seed=5000)
    first_token_s(gen, prefix[:prefix_len] + tail_a[prefix_len:])
    device = gen.cache.device
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        seconds, _ = first_token_s(gen, prefix[:prefix_len] + tail_b[prefix_len:])
        sync(device)
    timeline(prof)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    rows: dict[str, list[float]] = {}
    for e in kernels:                       # kernels only: an op's device time would count its kernels twice
        row = rows.setdefault(e.name, [0.0, 0])
        row[0] += e.time_range.elapsed_us()
        row[1] += 1
    total = sum(t for t, _ in rows.values())
    print(f"== cached-prefix first token: wall {1000 * seconds:.2f} ms, "
          f"kernels {total / 1e3:.2f} ms ==")
    for k, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:20]:
        print(f"{k[:70]:70} {t:9.1f} us {n:6d} calls {100 * t / total:5.1f} %")
    with cProfile.Profile() as profiler:
        first_token_s(gen, prefix[:prefix_len] + tail_c[prefix_len:])
        sync(device)
    print("== host profile of a cached-prefix first token ==")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)


# ---- speculative decoding: step costs on this device ---------------------------------------------------------------

def step_ms(forward, page_size: int, device, tokens: int, context: int, repeats: int) -> float:
    """forward (a Runner's: a replayed graph on CUDA for up to runner.MAX_TOKENS tokens; or a model's, eager) of
    one sequence's `tokens` new tokens after `context` cached ones, logits for every row: ms per call."""
    pages = list(range(-(-(context + tokens) // page_size)))
    chunk = SeqChunk(list(range(1, tokens + 1)), context, pages)
    batch = Batch.build([chunk], page_size, device, all_logits=True)
    forward(batch)                  # warm-up (and the graph's capture)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        forward(batch)
    sync(device)
    return 1000 * (time.perf_counter() - t0) / repeats


def decode_ms(lm, context: int, tokens: int) -> float:
    """One job's graph-replayed (on CUDA) decode: ms per token."""
    gen = Generator(lm, max_batch_size=1, max_seq_len=context + tokens + 8)
    prompt = random_prompts(1, context, lm.exl_config.vocab_size, seed=5)[0]
    gen.generate(prompt, max_new_tokens=8, min_new_tokens=8, sampling=GREEDY)           # warm-up
    job = gen.submit(prompt, max_new_tokens=tokens, min_new_tokens=tokens, sampling=GREEDY)
    it = iter(job)
    next(it)                                                                             # prefill
    t0 = time.perf_counter()
    n = sum(len(c.token_ids) for c in it)
    return 1000 * (time.perf_counter() - t0) / n


def step_costs(lm, draft_lm, context: int, ks: list[int], repeats: int) -> dict:
    """decode: ms per token of graph-replayed decoding (the generator's); verify: a step of 1 + k tokens as the
    generator runs it (graph-replayed on CUDA); eager: the same step without a graph; draft: a draft model token
    (graph-replayed decoding)."""
    from exl_backends.model.cache import KVCache
    from exl_backends.model.runner import Runner
    pages = -(-(context + max(ks) + 2) // lm.page_size)
    cache = KVCache(lm.exl_config, pages + 1, lm.page_size, lm.cache_mode, lm.device, lm.dtype)
    runner = Runner(lm.model, cache, max_batch=1, max_pages=pages)      # its trash page: the extra one
    step = [0] + ks
    out = dict(decode_ms=decode_ms(lm, context, 64),
               verify_ms={k: step_ms(runner.forward, lm.page_size, lm.device, k + 1, context, repeats) for k in step},
               eager_ms={k: step_ms(lambda b: lm.model.forward(b, cache), lm.page_size, lm.device, k + 1, context,
                                    repeats) for k in step})
    if draft_lm is not None:
        out["draft_ms"] = decode_ms(draft_lm, context, 64)
    return out


def predicted(costs: dict, k: int, tokens_per_step: float | None, alphas=(0.6, 0.7, 0.8)) -> list[str]:
    """Speedup over plain graph decode for a step of k drafted tokens."""
    lines, verify = [], costs["verify_ms"][k]
    if tokens_per_step:
        lines.append(f"n-gram, k={k}: {tokens_per_step:.2f} tokens/step (measured on the real model) -> "
                     f"{tokens_per_step * costs['decode_ms'] / verify:.2f}x")
    if "draft_ms" in costs:
        step = k * costs["draft_ms"] + verify
        for a in alphas:
            expected = (1 - a ** (k + 1)) / (1 - a)
            lines.append(f"draft model, k={k}, acceptance {a:.1f}: {expected:.2f} tokens/step -> "
                         f"{expected * costs['decode_ms'] / step:.2f}x")
    return lines


# ---- n-gram drafting on a real model -------------------------------------------------------------------------------

def count_forwards(gen: Generator) -> list[int]:
    calls = [0]
    forward = gen._forward

    def counted(batch):
        calls[0] += 1
        return forward(batch)
    gen._forward = counted
    return calls


def ngram_on_model(model_dir: str, device: str, max_tokens: int, ks: list[int]) -> dict:
    """Greedy generation of the edit task on a real model, plain and with n-gram drafting of up to k tokens for each
    k: tokens, the text, and per k tokens/step and wall-clock speedup (each run after a warm-up of the whole run,
    so every verify step size is captured: a first capture costs milliseconds)."""
    from exl_backends import ExlForCausalLM
    lm = ExlForCausalLM.from_pretrained(model_dir, device=device, max_seq_len=2048)
    prompt = [{"role": "user", "content": EDIT_TASK}]
    runs = {}
    for k in [0, *ks]:
        gen = Generator(lm, max_batch_size=1, **(dict(ngram_draft=True, n_draft_tokens=k) if k else {}))
        gen.generate(prompt, max_new_tokens=max_tokens, sampling=GREEDY)
        calls = count_forwards(gen)
        sync(lm.device)
        t0 = time.perf_counter()
        result = gen.generate(prompt, max_new_tokens=max_tokens, sampling=GREEDY)
        sync(lm.device)
        runs[k] = dict(text=str(result), tokens=result.usage.completion_tokens, steps=calls[0] - 1,  # less prefill
                       wall_s=time.perf_counter() - t0)
        assert runs[k]["text"] == runs[0]["text"], f"n-gram drafting (k={k}) changed the greedy output"
    plain = runs[0]
    return dict(tokens=plain["tokens"], text=plain["text"], plain_tok_s=plain["tokens"] / plain["wall_s"],
                per_k={k: dict(tokens_per_step=r["tokens"] / max(r["steps"], 1), tok_s=r["tokens"] / r["wall_s"],
                               speedup=plain["wall_s"] / r["wall_s"]) for k, r in runs.items() if k})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["concurrency", "ttft", "speculative", "all"], default="all")
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--draft-shape", default="llama-3.2-1b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cache-mode", default="fp16")
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ttft-prompt", type=int, default=2000)
    ap.add_argument("--ttft-prefix", type=int, default=1900)
    ap.add_argument("--context", type=int, default=1024, help="cached tokens before a speculative step")
    ap.add_argument("--draft-k", default="2,4,7")     # 1 + k <= runner.MAX_TOKENS: a captured verify step
    ap.add_argument("--sampling", choices=list(SAMPLINGS), default="greedy", help="the concurrency jobs' sampling")
    ap.add_argument("--profile", action="store_true", help="cProfile the last level's jobs after the concurrency "
                    "runs; the ttft part: a cached-prefix first token's kernels (torch.profiler) and host functions")
    ap.add_argument("--model", help="a real model directory: measure n-gram tokens/step on it")
    ap.add_argument("--tokens-per-step", type=float, help="n-gram tokens/step measured earlier with --model (every k)")
    args = ap.parse_args()
    parts = ["concurrency", "ttft", "speculative"] if args.part == "all" else [args.part]
    lines = []
    ks = [int(x) for x in args.draft_k.split(",")]
    tokens_per_step = dict.fromkeys(ks, args.tokens_per_step)
    if args.model:
        r = ngram_on_model(args.model, args.device, 400, ks)
        print(r["text"])
        for k, m in r["per_k"].items():
            tokens_per_step[k] = m["tokens_per_step"]
            lines.append(f"n-gram k={k} on {Path(args.model).name} ({args.device}): {r['tokens']} tokens, "
                         f"{m['tokens_per_step']:.2f} tokens/step, {r['plain_tok_s']:.1f} -> {m['tok_s']:.1f} "
                         f"tok/s = {m['speedup']:.2f}x wall clock")
        parts = [p for p in parts if p != "speculative" or args.part == "speculative"]
        if args.device == "cpu" and args.part == "speculative":
            parts = []
    seq = max(args.prompt_len + args.max_tokens, args.ttft_prompt + 8, args.context + 64)
    lm = None
    if parts:
        lm = SyntheticLM(synthetic_model(args.shape, device=args.device), WordTokenizer(), seq, args.cache_mode)
    if "concurrency" in parts:
        for r in concurrency(lm, [int(x) for x in args.levels.split(",")], args.prompt_len, args.max_tokens,
                             args.profile, SAMPLINGS[args.sampling]):
            lines.append(f"{args.shape} {r['jobs']:>3} {args.sampling} jobs: {r['tok_s']:8.1f} tok/s aggregate "
                         f"({r['vs_one_job']:.2f}x one job; decode phase {r['decode_tok_s']:.1f} tok/s = "
                         f"{r['decode_vs_one_job']:.2f}x), {r['per_job_tok_s']:.1f} tok/s per job, "
                         f"TTFT {r['ttft_ms']:.0f} ms; {r['steps']} steps, median {r['step_ms']:.2f} ms apart, "
                         f"the host waiting {r['wait_ms']:.2f} ms of it for the GPU")
    if "ttft" in parts:
        r = ttft(lm, args.ttft_prompt, args.ttft_prefix, rounds=10, profile=args.profile)
        lines.append(f"TTFT {r['prompt']}-token prompt: cold {r['cold_ms']:.1f} ms, {r['prefix']}-token prefix "
                     f"cached ({r['reused_tokens']} tokens reused) {r['cached_ms']:.1f} ms = {r['speedup']:.1f}x"
                     + ("" if math.isnan(r["cached_gpu_ms"]) else
                        f" (its GPU time alone, the host's queueing hidden: {r['cached_gpu_ms']:.1f} ms)")
                     + f"; the first cached-prefix prompt, its step's graphs captured on the way: {r['first_ms']:.0f} ms"
                     + f"; host before the model: {r['to_model_ms']:.2f} ms ({r['to_runner_ms']:.2f} to the runner)")
    if "speculative" in parts:
        draft = SyntheticLM(synthetic_model(args.draft_shape, device=args.device, seed=1), WordTokenizer(), seq,
                            args.cache_mode)
        costs = step_costs(lm, draft, args.context, ks, repeats=20)
        lines.append(f"step costs at context {args.context}: decode (graph) {costs['decode_ms']:.2f} ms/token, "
                     + ", ".join(f"verify 1+{k} {ms:.2f} ms (eager {costs['eager_ms'][k]:.2f})"
                                 for k, ms in costs["verify_ms"].items())
                     + f", draft {args.draft_shape} token {costs['draft_ms']:.2f} ms")
        for k in ks:
            lines.extend(predicted(costs, k, tokens_per_step[k]))
    print("\n== generation benchmarks ==")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

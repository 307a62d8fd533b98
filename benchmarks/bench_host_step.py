"""Host bookkeeping per engine step of Generator, outside the model: what a decode step costs the CPU while the GPU
waits for its next batch (scheduling, Batch.build, choosing and committing tokens, detokenising, queueing chunks).

N greedy jobs (128-token prompts, a fixed number of new tokens: min_new_tokens = max_new_tokens) run together on a
tiny synthetic Llama; every step and every model call is timed, and a decode step's host time is its time less its
model call and the batch argmax (on a GPU: less the wait for them too). The stand-in tokenizer is bench_server's
WordTokenizer, as in bench_generation's GPU runs. Each size runs `--repeats` times on one generator; the table
shows the fastest run (the machine may be shared). `--profile N` cProfiles N jobs with random logits for the model.

    OMP_NUM_THREADS=1 python benchmarks/bench_host_step.py [--jobs 1,16,64] [--new-tokens 96] [--profile 16]
    python benchmarks/bench_host_step.py --device cuda          # with CUDA graphs, as the generator runs there
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import SyntheticLM, WordTokenizer, random_prompts  # noqa: E402
from shapes import synthetic_model  # noqa: E402

import exl_backends.engine.generator  # noqa: E402
from exl_backends import Generator, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
GREEDY_OP = exl_backends.engine.generator.greedy


class StepTimer:
    """Wraps a generator's _step and _forward (instance attributes) and keeps, per decode step, its host time.
    The batch argmax (`greedy`) counts as model time too: on a GPU it is a kernel, and where the host waits."""

    def __init__(self, gen: Generator, device: torch.device):
        self.host_s: list[float] = []       # per all-decode step: step time less model time
        self._forward_s, self._decode = 0.0, False
        forward, step = gen._forward, gen._step

        def timed_forward(batch):
            self._decode = batch.input_ids.numel() == batch.n_seqs
            t0 = time.perf_counter()
            logits = forward(batch)
            self._forward_s += time.perf_counter() - t0
            return logits

        def timed_greedy(logits):
            t0 = time.perf_counter()
            top = GREEDY_OP(logits)
            if device.type == "cuda":       # the wait for the step's kernels, else in the caller's .tolist()
                torch.cuda.synchronize(device)
            self._forward_s += time.perf_counter() - t0
            return top

        def timed_step():
            self._forward_s, self._decode = 0.0, False
            t0 = time.perf_counter()
            progressed = step()
            elapsed = time.perf_counter() - t0
            if self._decode:
                self.host_s.append(elapsed - self._forward_s)
            return progressed

        gen._forward, gen._step = timed_forward, timed_step
        exl_backends.engine.generator.greedy = timed_greedy


def one_round(gen: Generator, prompts: list[list[int]], new_tokens: int) -> None:
    """Runs the jobs to their end, consumed in this thread (each job's iteration steps them all)."""
    jobs = [gen.submit(p, max_new_tokens=new_tokens, min_new_tokens=new_tokens, sampling=GREEDY) for p in prompts]
    for job in jobs:
        job.result()


def measure(lm, n: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    seq = prompt_len + new_tokens
    gen = Generator(lm, max_batch_size=n, max_seq_len=seq, cache_tokens=n * (seq + lm.page_size))
    vocab = lm.exl_config.vocab_size
    one_round(gen, random_prompts(n, prompt_len, vocab, seed=1000 + n), 8)      # warm-up
    best = None
    for r in range(repeats):
        timer = StepTimer(gen, lm.device)
        one_round(gen, random_prompts(n, prompt_len, vocab, seed=2000 + 10 * n + r), new_tokens)
        del gen._forward, gen._step         # back to the class's methods
        exl_backends.engine.generator.greedy = GREEDY_OP
        host = sorted(timer.host_s)
        row = dict(jobs=n, steps=len(host), mean_ms=1000 * sum(host) / len(host), median_ms=1000 * host[len(host) // 2],
                   us_per_token=1e6 * sum(host) / (len(host) * n))
        if best is None or row["mean_ms"] < best["mean_ms"]:
            best = row
    return best


def profile(lm, n: int, prompt_len: int, new_tokens: int) -> None:
    seq = prompt_len + new_tokens
    gen = Generator(lm, max_batch_size=n, max_seq_len=seq, cache_tokens=n * (seq + lm.page_size))
    vocab = lm.exl_config.vocab_size
    one_round(gen, random_prompts(n, prompt_len, vocab, seed=1), 8)
    prompts = random_prompts(n, prompt_len, vocab, seed=2)
    # the model's time would swamp the profile: random logits stand in for it (the bookkeeping does not change)
    gen._forward = lambda batch: torch.randn(batch.logit_rows.numel(), vocab, device=lm.device)
    with cProfile.Profile() as profiler:
        one_round(gen, prompts, new_tokens)
    print(f"\n== host profile: {n} jobs, {prompt_len}-token prompts, {new_tokens} new tokens, no model ==")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", type=int, help="also cProfile a run of this many jobs")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    lm = SyntheticLM(synthetic_model("tiny", device=args.device), WordTokenizer(), args.prompt_len + args.new_tokens,
                     "fp16")
    print(f"host time per decode step outside the model (tiny synthetic Llama, {args.device}, best of "
          f"{args.repeats}):")
    print(f"{'jobs':>5} {'steps':>6} {'mean ms':>8} {'median ms':>10} {'us/token':>9}")
    for n in (int(x) for x in args.jobs.split(",")):
        r = measure(lm, n, args.prompt_len, args.new_tokens, args.repeats)
        print(f"{r['jobs']:>5} {r['steps']:>6} {r['mean_ms']:>8.3f} {r['median_ms']:>10.3f} {r['us_per_token']:>9.1f}")
    if args.profile:
        profile(lm, args.profile, args.prompt_len, args.new_tokens)


if __name__ == "__main__":
    main()

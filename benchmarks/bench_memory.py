"""Peak GPU memory against the memory planner's prediction (issue #4: the 8B shape at 32k context with a q4 cache
within 5 %). Writes the synthetic EXL2 checkpoint that bench_multi_gpu.py uses (once, to --dir), plans it from its
headers exactly as from_pretrained does, then loads it, runs a prompt of the full context through the Generator
(prefill in 2048-token steps) and a few decode steps, then JOBS short jobs at once (a step sampling from 32
rows dequantizes the 6-bit head, the plan's largest scratch tensor), and compares:

  allocated  torch.cuda.max_memory_allocated() over the run (every tensor we and torch make);
  reserved   torch.cuda.max_memory_reserved(): the same plus the caching allocator's unused blocks;
  device     the driver's used-memory rise (mem_get_info) from before loading to the highest seen between steps:
             also cuBLAS workspaces and CuPy's modules; what a user sees in nvidia-smi.

    python benchmarks/bench_memory.py [--shape llama-3-8b] [--tokens 32768] [--cache-mode q4]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_multi_gpu import write_model  # noqa: E402

from exl_backends import ExlForCausalLM, Generator, SamplingParams, formats
from exl_backends.model import planner  # noqa: E402
from exl_backends.model.config import ModelConfig  # noqa: E402

JOBS = 32           # the Generator's default max_batch_size

GIB = 2 ** 30


def with_context(directory: Path, tokens: int) -> None:
    """The synthetic config allows 8192 positions; a long-context run needs more (the weights do not care)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    if config["max_position_embeddings"] < tokens:
        config["max_position_embeddings"] = tokens
        path.write_text(json.dumps(config))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--cache-mode", default="q4")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    directory = Path(args.dir or f"/tmp/exl-bench-{args.shape}")
    write_model(directory, args.shape)
    with_context(directory, args.tokens)

    plan = planner.plan(formats.open_checkpoint(directory), ModelConfig.from_dir(directory), args.tokens,
                        args.cache_mode)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()        # writing the model left blocks in torch's cache: loading would reuse them unseen
    free_before = torch.cuda.mem_get_info()[0]
    torch.cuda.reset_peak_memory_stats()
    lm = ExlForCausalLM.from_pretrained(directory, device="cuda", max_seq_len=args.tokens, cache_mode=args.cache_mode)
    gen = Generator(lm, max_batch_size=JOBS)
    prompt = torch.randint(0, lm.exl_config.vocab_size, (args.tokens - 64,)).tolist()
    low_free = free_before
    # greedy argmax with no stop tokens: 32 steps whatever the random weights' logits are
    job = gen.submit(prompt, max_new_tokens=32, stop_token_ids=[], sampling=SamplingParams(temperature=0.0))
    for _ in job:
        low_free = min(low_free, torch.cuda.mem_get_info()[0])
    # then the plan's other case: a step sampling from >= LARGE_M rows dequantizes the (quantized) head, as JOBS
    # decoding jobs do; submitted together, their prompts also fill most of a prefill chunk
    jobs = [gen.submit(torch.randint(0, lm.exl_config.vocab_size, (96,)).tolist(), max_new_tokens=16,
                       stop_token_ids=[], sampling=SamplingParams(temperature=0.0)) for _ in range(JOBS)]
    for j in jobs:
        for _ in j:
            low_free = min(low_free, torch.cuda.mem_get_info()[0])
    torch.cuda.synchronize()
    allocated = torch.cuda.max_memory_allocated()
    device = free_before - min(low_free, torch.cuda.mem_get_info()[0])
    predicted = plan.total - plan.reserve        # the reserve is headroom the planner keeps free, not a use
    print(f"plan ({args.shape}, {args.tokens} tokens, {args.cache_mode} cache): weights {plan.weights / GIB:.2f} GiB, "
          f"cache {plan.cache / GIB:.2f}, scratch {plan.scratch / GIB:.2f} (+ reserve {plan.reserve / GIB:.2f})")
    print("\n== memory vs plan ==")
    reserved = torch.cuda.max_memory_reserved()
    for name, used in (("allocated (torch peak)", allocated), ("reserved (torch peak)", reserved),
                       ("device (driver, peak)", device)):
        print(f"{name:24s} {used / GIB:7.2f} GiB vs planned {predicted / GIB:.2f} GiB: "
              f"{100 * (used / predicted - 1):+.1f} %")


if __name__ == "__main__":
    main()

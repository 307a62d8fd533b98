"""Decode and prefill speed of synthetic EXL2 models (Llama-3 shapes), side by side with transformers bf16.

Roofline: a decode step at batch 1 must read every weight once plus the KV cache of the context:
    bound (tokens/s) = copy bandwidth / (weight bytes + context x cache bytes per token)
Llama-3-8B shape at 4.0 bpw body + 6-bit head: ~3.9 GB/token -> ~1080 tok/s at 4.2 TB/s (ctx 256).
Llama-3.2-1B shape: ~1.0 GB/token -> ~4000 tok/s; launch-bound in practice (16 layers x ~12 launches).

    python benchmarks/bench_decode.py [--shapes llama-3-8b,llama-3.2-1b] [--contexts 256,4096,32768]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES, synthetic_model, weight_bytes  # noqa: E402

from exl_backends.batch import Batch, SeqChunk  # noqa: E402
from exl_backends.cache import KVCache, bytes_per_token  # noqa: E402
from exl_backends.runner import Runner  # noqa: E402


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    a = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * 2 * 1024**3 / sorted(times)[len(times) // 2]


def fill_cache(cache: KVCache) -> None:
    """Random contents: speed does not depend on them, but zeros could take shortcuts."""
    for layer in cache.layers:
        for t in (layer.k, layer.v):
            if t.dtype == torch.uint8:
                t.random_(0, 256)
            else:
                t.normal_(0, 0.5)
        for s in (layer.k_scales, layer.v_scales):
            if s is not None:
                s.uniform_(0.01, 0.05)


def decode_speed(model, mode: str, ctx: int, steps: int = 64) -> dict:
    ps = 256
    n_pages = -(-(ctx + steps + 1) // ps) + 1
    cache = KVCache(model.config, n_pages + 1, ps, mode, "cuda", torch.float16)
    fill_cache(cache)
    pages = cache.pool.allocate(n_pages)
    runner = Runner(model, cache, max_batch=1, max_pages=n_pages)
    token = 1000

    def step(i):
        batch = Batch.build([SeqChunk([token], ctx + i, pages)], ps, "cuda")
        return runner.forward(batch).argmax(-1)
    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        token = int(step(i))          # one host sync per token, as generation needs
    per_token = (time.perf_counter() - t0) / steps
    graph = runner.graphs[1]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.graph.replay()
    end.record()
    end.synchronize()
    replay = start.elapsed_time(end) / 1e3 / steps
    read = weight_bytes(model) + ctx * bytes_per_token(model.config, mode)
    del runner, cache
    torch.cuda.empty_cache()
    return dict(tok_s=1 / per_token, replay_tok_s=1 / replay, bytes=read)


def prefill_speed(model, n: int = 2048) -> float:
    ps = 256
    cache = KVCache(model.config, n // ps + 2, ps, "fp16", "cuda", torch.float16)
    pages = cache.pool.allocate(n // ps + 1)
    ids = torch.randint(0, model.config.vocab_size, (n,)).tolist()
    batch = Batch.build([SeqChunk(ids, 0, pages)], ps, "cuda")
    for _ in range(2):
        model.forward(batch, cache)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reps = 5
    for _ in range(reps):
        model.forward(batch, cache)
    torch.cuda.synchronize()
    del cache
    return n * reps / (time.perf_counter() - t0)


def transformers_baseline(shape: str, ctx: int = 256, new: int = 64) -> float:
    """transformers bf16 generate with a static cache, same layer shapes, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, ctx), device="cuda")

    def run(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                    pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    run(4)
    tok_s = (new - 1) / (run(new) - run(1))
    del hf
    torch.cuda.empty_cache()
    return tok_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3-8b,llama-3.2-1b")
    ap.add_argument("--contexts", default="256,4096,32768")
    ap.add_argument("--modes", default="fp16,q4")
    ap.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    bw = copy_bandwidth()
    rows = []
    for shape in args.shapes.split(","):
        model = synthetic_model(shape)
        for mode in args.modes.split(","):
            for ctx in map(int, args.contexts.split(",")):
                r = decode_speed(model, mode, ctx)
                bound = bw / r["bytes"]
                rows.append(dict(shape=shape, what=f"decode {mode} ctx {ctx}", tok_s=r["tok_s"],
                                 replay_tok_s=r["replay_tok_s"], bound=bound, pct=100 * r["tok_s"] / bound))
        rows.append(dict(shape=shape, what="prefill 2048", tok_s=prefill_speed(model)))
        del model
        torch.cuda.empty_cache()
        if args.baseline:
            rows.append(dict(shape=shape, what="transformers bf16 static ctx 256", tok_s=transformers_baseline(shape)))
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_decode.json").write_text(json.dumps(dict(copy_bw=bw, rows=rows), indent=1))
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}")
    print(f"{'shape':14} {'what':34} {'tok/s':>9} {'replay':>9} {'bound':>8} {'%':>5}")
    for r in rows:
        print(f"{r['shape']:14} {r['what']:34} {r['tok_s']:9.1f} {r.get('replay_tok_s', float('nan')):9.1f} "
              f"{r.get('bound', float('nan')):8.1f} {r.get('pct', float('nan')):5.1f}")


if __name__ == "__main__":
    main()

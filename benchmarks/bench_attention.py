"""Paged attention speed for the Llama-3-8B shape (32 query heads, 8 kv heads, head_dim 128), one layer.

Decode: one new token per sequence, the call captured in a CUDA graph and replayed (as the decode step runs), for
each cache mode, context and batch size. A decode step must read every cached K/V byte of its sequences once, so
    achieved bandwidth = cache bytes of (batch x context) tokens / time,
set against the device's copy bandwidth (bytes read + written per second by a large copy).
Prefill: one eager call for a fresh prompt (gather + scaled_dot_product_attention), and x32 layers as a share of
the 20,000 tokens/s prefill target.
Step ops: every non-matmul op of a batch-1 decode step (32 layers: 2 add_rmsnorm, rope_attention, silu_mul each),
captured in one CUDA graph and replayed, in all and op by op (the step budget leaves ~0.2 ms for them); and
rope_attention's one launch beside the two it replaces (rope_write, then attention).

    python benchmarks/bench_attention.py [--contexts 256,4096,32768] [--batches 1,16] [--modes fp16,q4]
                                         [--step-contexts 256,4096]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from exl_backends.commands.bench import copy_bandwidth, fill_cache
from exl_backends.kernels import activation, attention, kv_cache, norm
from exl_backends.model import reference
from exl_backends.model.batch import Batch, SeqChunk
from exl_backends.model.cache import KVCache, bytes_per_token
from exl_backends.model.config import ModelConfig

PAGE_SIZE = 256
N_LAYERS = 32                   # Llama-3-8B, for the prefill share
PREFILL_TARGET = 20_000         # tokens/s for the whole model


def llama3_8b_layer(n_layers: int = 1) -> ModelConfig:
    return ModelConfig.from_dict(dict(
        architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, num_hidden_layers=n_layers, vocab_size=128256, rms_norm_eps=1e-5,
        max_position_embeddings=131072))


def setup(config: ModelConfig, mode: str, lengths: list[tuple[int, int]]) -> tuple[KVCache, Batch, torch.Tensor]:
    """A random cache and a batch of (cached, new) token counts on shuffled pages; random queries."""
    needed = [-(-(start + n) // PAGE_SIZE) for start, n in lengths]
    cache = KVCache(config, sum(needed), PAGE_SIZE, mode, "cuda", torch.float16)
    fill_cache(cache)
    order = torch.randperm(sum(needed)).tolist()
    chunks, at = [], 0
    for (start, n), count in zip(lengths, needed):
        chunks.append(SeqChunk([1] * n, start, order[at:at + count]))
        at += count
    batch = Batch.build(chunks, PAGE_SIZE, "cuda")
    q = torch.randn(batch.input_ids.shape[0], config.n_heads, config.head_dim, device="cuda").half()
    return cache, batch, q


def graph_seconds(fn, replays: int = 50) -> float:
    """Seconds per call of fn, captured once in a CUDA graph and replayed (launch overhead excluded)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


def eager_seconds(fn, reps: int = 5) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def decode_row(config: ModelConfig, mode: str, context: int, batch_size: int, copy_bw: float) -> dict:
    cache, batch, q = setup(config, mode, [(context - 1, 1)] * batch_size)
    scale = config.head_dim ** -0.5
    seconds = graph_seconds(lambda: attention.paged_attention(q, cache, 0, batch, scale))
    nbytes = batch_size * context * bytes_per_token(config, mode)
    del cache
    torch.cuda.empty_cache()
    return dict(what="decode", mode=mode, batch=batch_size, context=context, us=seconds * 1e6,
                gb_s=nbytes / seconds / 1e9, pct_copy=100 * nbytes / seconds / copy_bw)


def prefill_row(config: ModelConfig, mode: str, n_tokens: int) -> dict:
    cache, batch, q = setup(config, mode, [(0, n_tokens)])
    scale = config.head_dim ** -0.5
    seconds = eager_seconds(lambda: attention.paged_attention(q, cache, 0, batch, scale))
    model_seconds = n_tokens / PREFILL_TARGET
    del cache
    torch.cuda.empty_cache()
    return dict(what="prefill", mode=mode, batch=1, context=n_tokens, us=seconds * 1e6,
                share_of_target=100 * seconds * N_LAYERS / model_seconds)


def step_rows(mode: str, context: int) -> list[dict]:
    """The non-matmul ops of a batch-1 decode step of Llama-3-8B at a context, graph-replayed: all of them in
    order, then each kind alone (32 or 64 calls), so the split of the total is visible."""
    config = llama3_8b_layer(N_LAYERS)
    cache, batch, q = setup(config, mode, [(context - 1, 1)])
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g).half()
    d, inter, hkv, dh = config.hidden_size, config.intermediate_size, config.n_kv_heads, config.head_dim
    x, residual, w, gate, up = rand(1, d), rand(1, d), rand(d), rand(1, inter), rand(1, inter)
    k, v = rand(1, hkv, dh), rand(1, hkv, dh)
    cos, sin = reference.rope_cos_sin(batch.positions, config.rope.inv_freq(dh).cuda(), 1.0, torch.float16)
    scale, eps = dh ** -0.5, config.rms_norm_eps
    ops = {
        "add_rmsnorm x2": lambda layer: (norm.add_rmsnorm(x, residual, w, eps), norm.add_rmsnorm(x, residual, w, eps)),
        "rope_attention": lambda layer: attention.rope_attention(q, k, v, cos, sin, cache, layer, batch, scale),
        "silu_mul": lambda layer: activation.silu_mul(gate, up),
        "rope_write": lambda layer: kv_cache.rope_write(q, k, v, cos, sin, cache, layer, batch.slots),
        "attention": lambda layer: attention.paged_attention(q, cache, layer, batch, scale),
    }
    step = ["add_rmsnorm x2", "rope_attention", "silu_mul"]     # as the model runs a decode step

    def run(names):
        for layer in range(N_LAYERS):
            for name in names:
                ops[name](layer)
    rows = []
    # the step's ops, each alone, and the two launches that rope_attention's one replaces
    for names in [step, *([name] for name in ops), ["rope_write", "attention"]]:
        rows.append(dict(what="step ops", mode=mode, batch=1, context=context,
                         us=graph_seconds(lambda: run(names)) * 1e6,
                         op="all x32 layers" if names == step else " + ".join(names)))
    del cache
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="256,4096,32768")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--modes", default="fp16,q4")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--step-contexts", default="256,4096", help="contexts of the step-ops rows ('' for none)")
    args = ap.parse_args()
    config = llama3_8b_layer()
    copy_bw = copy_bandwidth(torch.device("cuda"))
    rows = []
    for mode in args.modes.split(","):
        for batch_size in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                rows.append(decode_row(config, mode, context, batch_size, copy_bw))
        rows.append(prefill_row(config, mode, args.prefill))
        for context in filter(None, args.step_contexts.split(",")):
            rows.extend(step_rows(mode, int(context)))
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_attention.json").write_text(json.dumps(dict(copy_bw=copy_bw, rows=rows), indent=1))
    print(f"\nLlama-3-8B attention, one layer; {torch.cuda.get_device_name()}, "
          f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    print("% prefill: 32 layers of this prefill attention as a share of the time the 20,000 tok/s target allows")
    print(f"{'what':8} {'mode':5} {'batch':>5} {'context':>8} {'us':>9} {'GB/s':>8} {'% copy':>7} {'% prefill':>9}")
    for r in rows:
        print(f"{r['what']:8} {r['mode']:5} {r['batch']:5d} {r['context']:8d} {r['us']:9.1f} "
              f"{r.get('gb_s', float('nan')):8.0f} {r.get('pct_copy', float('nan')):7.1f} "
              f"{r.get('share_of_target', float('nan')):9.1f}  {r.get('op', '')}")


if __name__ == "__main__":
    main()

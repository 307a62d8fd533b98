"""MoE decode speed: a Mixtral-8x7B-shape model at 4.0 bpw (synthetic EXL2 weights) at batch 1, against its bound.

A decode step reads, per layer, the attention weights, the router, and only the top_k = 2 experts the token is
routed to (kernels/moe.py), plus the KV cache of its context, and once the head:
    bound (tokens/s) = copy bandwidth / (attention + router + 2 experts per layer + norms + head + context x cache)
Mixtral-8x7B at 4.0 bpw: ~88 MB per expert per layer -> ~5.6 GB of experts + ~0.28 GB attention + ~0.1 GB head
per token -> ~700 tok/s at 4.2 TB/s. Reading all 8 experts would bound it at ~190 tok/s.
Also times one MoE layer alone (graph replay, 1 token) against the bytes of its 2 experts.

    python benchmarks/bench_moe.py [--contexts 256,4096] [--modes fp16,q4] [--layers 32]
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
from shapes import synthetic_moe_model  # noqa: E402

from exl_backends.commands.bench import copy_bandwidth, decode_speed  # noqa: E402
from exl_backends.model.cache import bytes_per_token  # noqa: E402
from exl_backends.model.ops import ops_for  # noqa: E402


def _norm_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def step_bytes(model) -> dict:
    """Bytes one batch-1 decode step reads from the weights, by kind."""
    attention = experts = router = 0
    for b in model.blocks:
        a, m = b.attention, b.mlp
        attention += sum(x.nbytes() for x in (a.q, a.k, a.v, a.o)) + _norm_bytes(b.input_norm, b.post_attn_norm)
        router += m.router.nbytes()
        experts += m.top_k * m.kernel.bytes_per_expert()
    head = model.lm_head.nbytes() + _norm_bytes(model.norm)
    all_experts = sum(len(b.mlp.experts) * b.mlp.kernel.bytes_per_expert() for b in model.blocks)
    return dict(attention=attention, router=router, experts=experts, head=head, all_experts=all_experts,
                total=attention + router + experts + head)


def moe_layer_seconds(model, reps: int = 200) -> float:
    """One MoE layer at one token, captured in a graph and replayed: seconds per call."""
    mlp = model.blocks[0].mlp
    x = (torch.randn(1, model.config.hidden_size, device=model.device) * 0.5).half()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mlp(x, ops_for(torch.device("cuda")))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mlp(x, ops_for(torch.device("cuda")))
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="mixtral-8x7b")
    ap.add_argument("--contexts", default="256,4096")
    ap.add_argument("--modes", default="fp16,q4")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (bytes scale with it)")
    args = ap.parse_args()
    bw = copy_bandwidth(torch.device("cuda"))
    t0 = time.perf_counter()
    model = synthetic_moe_model(args.shape, n_layers=args.layers)
    build_s = time.perf_counter() - t0
    sizes = step_bytes(model)
    layer_s = moe_layer_seconds(model)
    layer_bytes = 2 * model.blocks[0].mlp.kernel.bytes_per_expert()
    rows = []
    for mode in args.modes.split(","):
        for ctx in map(int, args.contexts.split(",")):
            tok_s = decode_speed(model, ctx, mode)["tok_s"]
            total = sizes["total"] + ctx * bytes_per_token(model.config, mode)
            rows.append(dict(what=f"decode {mode} ctx {ctx}", tok_s=tok_s, bytes=total, bound=bw / total,
                             pct=100 * tok_s * total / bw))
    result = dict(device=torch.cuda.get_device_name(), copy_bw=bw, layers=model.config.n_layers, build_s=build_s,
                  bytes=sizes, moe_layer_us=layer_s * 1e6, moe_layer_bytes=layer_bytes,
                  moe_layer_pct=100 * layer_bytes / layer_s / bw, rows=rows)
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_moe.json").write_text(json.dumps(result, indent=1))
    print(f"\n{result['device']}: copy bandwidth {bw / 1e12:.2f} TB/s; {args.shape}, {model.config.n_layers} layers, "
          f"4.0 bpw (built in {build_s:.0f} s)")
    print("bytes per decode step: " + ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in sizes.items()))
    print(f"one MoE layer, 1 token (graph): {layer_s * 1e6:.1f} us for {layer_bytes / 1e6:.1f} MB of 2 experts "
          f"-> {result['moe_layer_pct']:.1f} % of copy bandwidth")
    print(f"{'what':24} {'tok/s':>9} {'bound':>9} {'%':>6}")
    for r in rows:
        print(f"{r['what']:24} {r['tok_s']:9.1f} {r['bound']:9.1f} {r['pct']:6.1f}")


if __name__ == "__main__":
    main()

"""Decode and prefill speed of synthetic EXL2 models (Llama-3 shapes), side by side with transformers bf16.

Roofline: a decode step at batch 1 must read every weight once plus the KV cache of the context:
    bound (tokens/s) = copy bandwidth / (weight bytes + context x cache bytes per token)
Llama-3-8B shape at 4.0 bpw body + 6-bit head: ~3.9 GB/token -> ~1080 tok/s at 4.2 TB/s (ctx 256).
Llama-3.2-1B shape: ~1.0 GB/token -> ~4000 tok/s; launch-bound in practice (16 layers x ~12 launches).

    python benchmarks/bench_decode.py [--shapes llama-3-8b,llama-3.2-1b] [--contexts 256,4096,32768]
        [--megakernel both|on|off|ring|all|PATH,PATH...] [--defines ,MK_POLL_NS=0]

--megakernel both (the default) times each decode row twice in the same process: launch-per-op (EXL_MEGAKERNEL=0)
and the megakernel segments (kernels/megakernel.py), the model built once; ring: launch-per-op and the segments with
their weights through a producer warp's ring (EXL_MEGAKERNEL=ring) and with the stages folded into the matmul blocks
(ring-fold); all: the four; or a list of PATHS' keys (rope-apart: launch-per-op with RoPE and the cache write
a launch of their own, before the attention's, as before 2026-12-06); --defines times each once per variant of
the one-row kernels (matmul_rows.cu and megakernel.cu; comma-separated -D sets, '+' between several; '' the
default).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES, synthetic_model  # noqa: E402
from tune_matmul import use_define  # noqa: E402

PATHS = {"0": "launch-per-op", "1": "megakernel", "ring": "megakernel ring", "ring-fold": "megakernel ring-fold",
         "rope-apart": "launch-per-op, rope_write apart"}
PATH_SETS = {"both": ("0", "1"), "on": ("1",), "off": ("0",), "ring": ("0", "ring", "ring-fold"),
             "all": ("0", "1", "ring", "ring-fold")}

from exl_backends.commands.bench import copy_bandwidth, decode_speed, prefill_speed, run_info  # noqa: E402


def transformers_baseline(shape: str, ctx: int = 256, new: int = 64) -> float:
    """transformers bf16 generate with a static cache, same layer shapes, random weights. Eager: with a static
    cache on CUDA, generate() would torch.compile the forward, and recompile for every new cache length (the
    first run of this benchmark measured that compile: 1.2 tok/s)."""
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
                    pad_token_id=0, disable_compile=True)
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
    ap.add_argument("--megakernel", default="both", help=f"{'|'.join(PATH_SETS)}, or PATH,PATH... of {list(PATHS)}")
    ap.add_argument("--defines", default="", help="kernel variants, e.g. ',MK_POLL_NS=0'")
    args = ap.parse_args()
    paths = PATH_SETS.get(args.megakernel) or tuple(args.megakernel.split(","))
    if not set(paths) <= set(PATHS):
        ap.error(f"--megakernel: {args.megakernel!r} is neither one of {list(PATH_SETS)} nor a list of {list(PATHS)}")
    runs = [(flag, define) for define in args.defines.split(",") for flag in paths]
    bw = copy_bandwidth(torch.device("cuda"))
    rows = []
    for shape in args.shapes.split(","):
        os.environ["EXL_MEGAKERNEL"] = paths[-1]        # (QuantMatmul plans its segments when it is on)
        model = synthetic_model(shape)
        ops = model.ops
        for mode in args.modes.split(","):
            for ctx in map(int, args.contexts.split(",")):
                for flag, define in runs:
                    # read when the runner captures its decode step
                    os.environ["EXL_MEGAKERNEL"] = "0" if flag == "rope-apart" else flag
                    model.ops = dataclasses.replace(ops, rope_attention=None) if flag == "rope-apart" else ops
                    if args.defines:
                        use_define(define, {"matmul_rows", "megakernel", "attention"})
                    r = decode_speed(model, ctx, mode)
                    bound = bw / r["bytes"]
                    if not r["finite"]:
                        print(f"warning: {shape} decode {mode} ctx {ctx} gives NaN/inf logits")
                    rows.append(dict(shape=shape, what=f"decode {mode} ctx {ctx}", bpw=4.0, context=ctx,
                                     cache_mode=mode, batch=1,
                                     path=" ".join(filter(None, [PATHS[flag], define])),
                                     tok_s=r["tok_s"], replay_tok_s=r["replay_tok_s"], bound_tok_s=bound,
                                     pct=100 * r["tok_s"] / bound))
        rows.append(dict(shape=shape, what="prefill 2048", tok_s=prefill_speed(model, 2048)))
        del model
        torch.cuda.empty_cache()
        if args.baseline:
            rows.append(dict(shape=shape, what="transformers bf16 static ctx 256", tok_s=transformers_baseline(shape)))
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_decode.json").write_text(json.dumps(run_info(torch.device("cuda"), bw, rows), indent=1))
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}")
    print(f"{'shape':14} {'what':28} {'path':32} {'tok/s':>9} {'replay':>9} {'bound':>8} {'%':>5}")
    for r in rows:
        print(f"{r['shape']:14} {r['what']:28} {r.get('path', ''):32} {r['tok_s']:9.1f} "
              f"{r.get('replay_tok_s', float('nan')):9.1f} {r.get('bound_tok_s', float('nan')):8.1f} "
              f"{r.get('pct', float('nan')):5.1f}")


if __name__ == "__main__":
    main()

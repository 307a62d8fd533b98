"""What each kernel family costs a graph-replayed decode step, measured by leaving it out: the step's replay time
with the family's launches replaced by nothing (an empty output; the logits are garbage, the timing is not). A
profiler's kernel times overlap under programmatic dependent launch; these differences do not.

    python benchmarks/ablate_decode.py [--shapes llama-3-8b,llama-3.2-1b] [--context 256] [--batch 1,16]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import synthetic_model  # noqa: E402

from exl_backends.commands.bench import decode_speed  # noqa: E402
from exl_backends.kernels import quant_matmul  # noqa: E402

QM = quant_matmul.QuantMatmul


def _no_matmul(self, x, up=None):
    return [torch.empty(*x.shape[:-1], lay.n, dtype=x.dtype, device=x.device) for lay in self.layouts]


def _no_matmul_normed(self, h, residual, w, eps):
    return _no_matmul(self, h), h


def _no_matmul_stored(self, staged):             # o reading attention's output as written (forward_stored)
    return torch.empty(1, self.layouts[0].n, dtype=torch.float16, device=staged.device)


def _no_matmul_feeding(self, staged, residual):   # o and down doing the next norm's work (forward_feeding)
    return torch.empty_like(residual)


def _no_matmul_fed(self):                         # gate/up and q/k/v after them (forward_fed)
    return [torch.empty(1, lay.n, dtype=torch.float16, device=self.fed_by.sums.device) for lay in self.layouts]


def _no_matmul_gated(self):                       # gate/up writing down's x (forward_gated)
    return self.gating.into[0]


def _no_stage(self, x, rows, before):
    cls = quant_matmul.rows_class(rows)
    if cls not in self.staged:          # QuantMatmul._stage's buffer: x rows per part, then float2 corrections
        self.staged[cls] = torch.zeros(len(self.layouts) * cls * (self.k + (self.k // 32) * 4), dtype=torch.float16,
                                       device=x.device)
    return self.staged[cls]


OPS_LEFT_OUT = {          # family -> the Ops fields replaced, each by a launch-free stand-in
    "attention": dict(rope_attention=lambda q, *a, **k: torch.empty_like(q)),   # with RoPE and the cache write
}   # (add_rmsnorm in front of q/k/v and gate/up: for a decode row done by the matmuls on either side of it, else
#    by the stage_xs of the matmul after it, as silu_mul is)
CLASS_LEFT_OUT = {"stage_xs": {"_stage": _no_stage},      # family -> QuantMatmul's methods replaced
                  "matmul": {"forward": _no_matmul, "forward_normed": _no_matmul_normed,
                             "forward_stored": _no_matmul_stored, "forward_feeding": _no_matmul_feeding,
                             "forward_fed": _no_matmul_fed, "forward_gated": _no_matmul_gated}}


@contextlib.contextmanager
def left_out(model, families: list[str]):
    ops = model.ops
    methods = {name: fn for f in families for name, fn in CLASS_LEFT_OUT.get(f, {}).items()}
    patched = {name: getattr(QM, name) for name in methods}
    for name, fn in methods.items():
        setattr(QM, name, fn)
    fields = {k: v for f in families for k, v in OPS_LEFT_OUT.get(f, {}).items()}
    model.ops = dataclasses.replace(ops, **fields)
    try:
        yield
    finally:
        model.ops = ops
        for name, fn in patched.items():
            setattr(QM, name, fn)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3-8b,llama-3.2-1b")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", default="1", help="sequences per step, e.g. 1,16 (each timed)")
    args = ap.parse_args()
    variants = [[]] + [[f] for f in [*OPS_LEFT_OUT, *CLASS_LEFT_OUT]] + [[*OPS_LEFT_OUT, "stage_xs"]]
    for shape in args.shapes.split(","):
        model = synthetic_model(shape)
        for batch in map(int, args.batch.split(",")):
            base = None
            print(f"\n{shape} ctx {args.context}, batch {batch}: graph replay, µs per step")
            print(f"{'left out':50} {'us/step':>8} {'saved':>7}")
            for families in variants:
                with left_out(model, families):
                    speed = decode_speed(model, args.context, "fp16", steps=200, batch=batch)
                us = batch * 1e6 / speed["replay_tok_s"]
                base = us if base is None else base
                print(f"{', '.join(families) or '(nothing)':50} {us:8.1f} {base - us:7.1f}")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Quantization pass (exl2-format.md §10.9): layer by layer over the calibration rows. For each sub-layer the
Hessians come from a forward with the fp16 weights on the quantized model's states, every projection is
quantized and packed, and the sub-layer's output with the quantized weights becomes the next input, so errors
propagate as they will at inference. The per-linear step is a LinearQuantizer: EXL2 here, GPTQ in
gptq_writer.py."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ..errors import ExlError
from ..formats.exl2_writer import linear_tensors, pack_linear
from ..model import reference
from . import forward
from .forward import Context, Head, Layer
from .gptq import EXL2_DAMP, Hessian, Prepared, QuantizedLinear, exl2_scale, prepare, quantize
from .qparams import QParams


class LinearQuantizer(Protocol):
    damp: float
    act_order: bool

    def __call__(self, key: str, qp: QParams | None, weight: Tensor, bias: Tensor | None,
                 prepared: Prepared) -> tuple[dict[str, Tensor], Tensor]:
        """-> (the file tensors of the linear, its dequantized fp16 weight [N, K])."""


@dataclass
class LayerResult:
    tensors: dict[str, Tensor]      # file tensors of the layer's projections
    errors: dict[str, float]        # sub-layer key -> relative output error vs the fp16 weights


def quantize_layer(states: Tensor, layer: Layer, ctx: Context, i: int, quantizer: LinearQuantizer,
                   strategy: dict[str, dict] | None) -> tuple[LayerResult, Tensor]:
    """states [R, L, D]: the quantized model's inputs of layer i. strategy: measurement entry per sub-layer
    (EXL2) or None (GPTQ: one setting everywhere). Returns the packed layer and its quantized outputs."""
    x = states
    result = LayerResult({}, {})
    for sub in layer.sublayers:
        hessians = forward.input_hessians(sub, layer, ctx.device)
        y_ref = forward.run(sub, x, layer, ctx, hessians)
        prepared = {g.keys: prepare(forward.group_hessian(g, hessians), quantizer.damp, quantizer.act_order)
                    for g in sub.groups}
        group_of = {key: g.keys for g in sub.groups for key in g.keys}
        new = {}
        for role in sub.roles:
            qp = QParams.from_dict(strategy[sub.key][role.name]) if strategy else None
            for key, *_ in role.linears:
                linear = layer.linears[key]
                tensors, weight = quantizer(key, qp, linear.weight, linear.bias, prepared[group_of[key]])
                result.tensors.update(tensors)
                new[key] = weight.float()
        layer.set_weights(new)
        x = forward.run(sub, x, layer, ctx)
        result.errors[sub.key] = float(forward.token_errors(x, y_ref).mean())
    return result, x


def quantize_head(states: Tensor, head: Head, ctx: Context, key: str, qp: QParams,
                  quantizer: LinearQuantizer) -> tuple[dict[str, Tensor], float]:
    """lm_head [vocab, D] quantized with H from the final-norm output of the quantized model's states.
    Returns its tensors and its relative weight error."""
    h = Hessian(head.weight.shape[1], ctx.device)
    for rows in forward.chunks(*states.shape[:2]):
        h.add(head.normed(states[rows].to(ctx.device)))
    weight = head.weight
    tensors, dq = quantizer(key, qp, weight, None, prepare(h.value(), quantizer.damp, quantizer.act_order))
    return tensors, float(torch.linalg.vector_norm(dq.float() - weight) / torch.linalg.vector_norm(weight))


class Exl2Quantizer:
    """AdaptiveGPTQ + EXL2 packing, each packed layer checked against the fake-quantized weights (§8.6)."""
    damp = EXL2_DAMP
    act_order = True

    def __call__(self, key: str, qp: QParams | None, weight: Tensor, bias: Tensor | None,
                 prepared: Prepared) -> tuple[dict[str, Tensor], Tensor]:
        n, k = weight.shape
        q = quantize(weight, prepared, [qp.groups(k)], exl2_scale)[0]
        packed = pack_exl2(q, n)            # where the codes are: on the GPU for a GPU conversion
        check_exl2(key, packed, q.weight)
        return linear_tensors(key, packed.to(torch.device("cpu")), bias), q.weight


def pack_exl2(q: QuantizedLinear, n: int):
    return pack_linear(q.codes, q.groups, torch.stack([g["scale_codes"] for g in q.group_data]),
                       torch.stack([g["scale_max"] for g in q.group_data]), q.perm, n)


def check_exl2(key: str, packed, expected: Tensor) -> None:
    """The packed tensors must dequantize (reference.dequant_exl2) to exactly the fake-quantized weights; checked
    where those are (on the GPU for a GPU conversion: dequantizing an 8B layer on the CPU takes seconds)."""
    w = packed.to(expected.device)
    got = reference.dequant_exl2(w.q_weight, w.q_scale, w.q_scale_max, w.q_groups, w.q_invperm, w.out_features)
    if not torch.equal(got, expected):
        diff = float((got.float() - expected.float()).abs().max())
        raise ExlError(f"internal error: packed {key} does not dequantize to the quantized weights "
                       f"(max difference {diff}); please report this")

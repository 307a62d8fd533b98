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

from .. import reference
from ..errors import ExlError
from ..formats.exl2_writer import linear_tensors, pack_linear
from . import forward
from .forward import ATTN, MLP, Context, LayerWeights, layer_key
from .gptq import EXL2_DAMP, Hessian, Prepared, QuantizedLinear, exl2_scale, prepare, quantize
from .measure import hessians, proj_name, sublayer_key
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


def quantize_layer(states: Tensor, lw: LayerWeights, ctx: Context, i: int, quantizer: LinearQuantizer,
                   strategy: dict[str, dict] | None) -> tuple[LayerResult, Tensor]:
    """states [R, L, D]: the quantized model's inputs of layer i. strategy: measurement entry per sub-layer
    (EXL2) or None (GPTQ: one setting everywhere). Returns the packed layer and its quantized outputs."""
    config, x = ctx.config, states
    result = LayerResult({}, {})
    for projections, sublayer in ((ATTN, forward.attention_chunk), (MLP, forward.mlp_chunk)):
        key = sublayer_key(config, i, projections)
        h = hessians(config, projections, ctx.device)
        y_ref = forward.run(sublayer, x, lw, ctx, h)
        shared = [prepare(h[0].value(), quantizer.damp, quantizer.act_order),
                  prepare(h[1].value(), quantizer.damp, quantizer.act_order)]
        new = {}
        for pos, proj in enumerate(projections):
            qp = QParams.from_dict(strategy[key][proj_name(config, proj)]) if strategy else None
            tensors, weight = quantizer(layer_key(config, i, proj), qp, lw.weights[proj], lw.biases.get(proj),
                                        shared[pos == len(projections) - 1])
            result.tensors.update(tensors)
            new[proj] = weight.float()
        lw = lw.with_weights(new)
        x = forward.run(sublayer, x, lw, ctx)
        result.errors[key] = float(forward.token_errors(x, y_ref).mean())
    return result, x


def quantize_head(states: Tensor, norm: Tensor, head: Tensor, ctx: Context, key: str, qp: QParams,
                  quantizer: LinearQuantizer) -> tuple[dict[str, Tensor], float]:
    """lm_head [vocab, D] quantized with H from the final-norm output of the quantized model's states.
    Returns its tensors and its relative output error on the calibration rows."""
    h = Hessian(head.shape[1], ctx.device)
    for rows in forward.chunks(*states.shape[:2]):
        x = states[rows].to(ctx.device)
        h.add(reference.rmsnorm(x.reshape(-1, x.shape[-1]), norm, ctx.config.rms_norm_eps).view(x.shape))
    weight = head.to(ctx.device, torch.float32)
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
        packed = pack_exl2(q, n)
        check_exl2(key, packed, q.weight)
        return linear_tensors(key, packed, bias), q.weight


def pack_exl2(q: QuantizedLinear, n: int):
    return pack_linear(q.codes, q.groups, torch.stack([g["scale_codes"] for g in q.group_data]),
                       torch.stack([g["scale_max"] for g in q.group_data]), q.perm, n)


def check_exl2(key: str, packed, expected: Tensor) -> None:
    """The packed tensors must dequantize (reference.dequant_exl2) to exactly the fake-quantized weights."""
    got = packed.dequantize()
    if not torch.equal(got, expected.cpu()):
        diff = float((got.float() - expected.cpu().float()).abs().max())
        raise ExlError(f"internal error: packed {key} does not dequantize to the quantized weights "
                       f"(max difference {diff}); please report this")

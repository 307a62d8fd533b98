"""Measurement pass (exl2-format.md §10.7): for every attention and MLP sub-layer, quantize each projection under
every setting the candidate table uses, then run the sub-layer with each joint candidate substituted and record
its accuracy 1 - mean_tokens(||y_q - y_ref|| / ||y_ref||) (per token, see forward.token_errors, where ExLlamaV2
averages per row). Inputs are the unquantized model's states, so each layer's measurement is independent of the
others. The result (measurement.json, ExLlamaV2's layout) is reusable for any target."""
from __future__ import annotations

import torch
from torch import Tensor

from ..config import ModelConfig
from ..errors import ExlError
from . import forward
from .forward import ATTN, MLP, Context, LayerWeights, has_bias, projection_shape
from .gptq import EXL2_DAMP, Hessian, exl2_scale, prepare, quantize
from .qparams import ATTN_CANDIDATES, MLP_CANDIDATES, QParams, distinct

# (projections, joint candidates, forward) per sub-layer; the last projection reads the second Hessian.
SUBLAYERS = ((ATTN, ATTN_CANDIDATES, forward.attention_chunk), (MLP, MLP_CANDIDATES, forward.mlp_chunk))


def sublayer_key(config: ModelConfig, i: int, projections: tuple[str, ...]) -> str:
    """'model.layers.{i}.self_attn' or '.mlp', as measurement.json names them."""
    sub = getattr(config.traits.names, projections[0]).rsplit(".", 1)[0]
    return f"{config.traits.names.layer.format(i=i)}.{sub}"


def proj_name(config: ModelConfig, proj: str) -> str:
    """'q_proj', 'down_proj', ...: the key of a projection inside a measurement entry."""
    return getattr(config.traits.names, proj).rsplit(".", 1)[-1]


def candidate_bits(config: ModelConfig, projections: tuple[str, ...], candidate: tuple[QParams, ...]) -> int:
    return sum(qp.total_bits(*projection_shape(config, p), has_bias(config, p))
               for p, qp in zip(projections, candidate))


def hessians(config: ModelConfig, projections: tuple[str, ...], device: torch.device) -> tuple[Hessian, Hessian]:
    return (Hessian(projection_shape(config, projections[0])[0], device),
            Hessian(projection_shape(config, projections[-1])[0], device))


def measure_layer(states: Tensor, lw: LayerWeights, ctx: Context, i: int) -> tuple[dict[str, list], Tensor]:
    """states [R, L, D]: the unquantized inputs of layer i. Returns its measurement entries and its
    unquantized outputs."""
    config, out, x = ctx.config, {}, states
    for projections, candidates, sublayer in SUBLAYERS:
        h = hessians(config, projections, ctx.device)
        y_ref = forward.run(sublayer, x, lw, ctx, h)
        shared = [prepare(h[0].value(), EXL2_DAMP), prepare(h[1].value(), EXL2_DAMP)]
        fake: dict[str, dict[QParams, Tensor]] = {}
        for pos, proj in enumerate(projections):
            settings = distinct(candidates, pos)
            k = projection_shape(config, proj)[0]
            results = quantize(lw.weights[proj], shared[pos == len(projections) - 1],
                               [qp.groups(k) for qp in settings], exl2_scale)
            fake[proj] = {qp: r.weight for qp, r in zip(settings, results)}     # fp16 [N, K]
        entries = []
        for candidate in candidates:
            trial = lw.with_weights({p: fake[p][qp].float() for p, qp in zip(projections, candidate)})
            err = forward.relative_error(sublayer, x, y_ref, trial, ctx)
            entry = {"accuracy": max(1e-6, 1.0 - err), "total_bits": candidate_bits(config, projections, candidate)}
            entry.update({proj_name(config, p): qp.to_dict() for p, qp in zip(projections, candidate)})
            entries.append(entry)
        out[sublayer_key(config, i, projections)] = entries
        x = y_ref
    return out, x


def measurement_file(config: ModelConfig, layers: dict[str, list], n_done: int) -> dict:
    """measurement.json in ExLlamaV2's shape; last_module_idx counts embedding, 2 modules a layer, norm, head."""
    data = {"measurement": dict(layers), "last_module_idx": 2 * n_done}
    if n_done == config.n_layers:
        names = config.traits.names
        data["measurement"][f"{names.final_norm}.norm"] = None
        data["measurement"][f"{names.lm_head}.linear"] = None
        data["last_module_idx"] = 2 * n_done + 2
    return data


def check_measurement(data: dict, config: ModelConfig, source: str) -> dict[str, list]:
    """A reused measurement must cover every layer of this model with candidates of matching sizes."""
    layers = data.get("measurement") if isinstance(data, dict) else None
    if not isinstance(layers, dict):
        raise ExlError(f"{source}: not a measurement file (no 'measurement' object)")
    for i in range(config.n_layers):
        for projections, _, _ in SUBLAYERS:
            key = sublayer_key(config, i, projections)
            entries = layers.get(key)
            if not entries:
                raise ExlError(f"{source}: no measurement for {key}; the file is incomplete or from another model")
            for e in entries:
                try:
                    cand = tuple(QParams.from_dict(e[proj_name(config, p)]) for p in projections)
                    bits, acc = int(e["total_bits"]), float(e["accuracy"])
                except (KeyError, TypeError, ValueError) as err:
                    raise ExlError(f"{source}: malformed entry under {key} ({err!r})") from None
                if bits != candidate_bits(config, projections, cand) or not 0 < acc <= 1:
                    raise ExlError(f"{source}: entry {cand[0].desc()} of {key} has total_bits {bits} / accuracy "
                                   f"{acc}, which do not fit this model's shapes; the measurement is from "
                                   f"another model")
    return layers

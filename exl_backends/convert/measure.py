"""Measurement pass (exl2-format.md §10.7): for every attention and MLP sub-layer, quantize each projection under
every setting the candidate table uses, then run the sub-layer with each joint candidate substituted and record
its accuracy 1 - mean_tokens(||y_q - y_ref|| / ||y_ref||) (per token, see forward.token_errors, where ExLlamaV2
averages per row). In an MoE layer a candidate's w1/w3/w2 settings apply to every expert, each quantized with
the Hessian of the tokens routed to it; the experts are quantized and run one at a time, so the trial
weights alive at once are one expert's, not the layer's. Inputs are the unquantized model's states, so each
layer's measurement is independent of the others. The result (measurement.json, ExLlamaV2's layout) is
reusable for any target."""
from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ExlError
from ..model import reference
from ..model.config import ModelConfig
from ..model.mlp import MoeMlp
from ..model.ops import REFERENCE_OPS
from . import forward
from .forward import Context, Kind, Layer, Sublayer
from .gptq import EXL2_DAMP, Hessian, Prepared, exl2_scale, prepare, quantize
from .qparams import QParams, distinct


def measure_layer(states: Tensor, layer: Layer, ctx: Context, i: int) -> tuple[dict[str, list], Tensor]:
    """states [R, L, D]: the unquantized inputs of layer i. Returns its measurement entries and its
    unquantized outputs."""
    out, x = {}, states
    for sub in layer.sublayers:
        out[sub.key], x = measure_sublayer(sub, x, layer, ctx)
    return out, x


def measure_sublayer(sub: Sublayer, x: Tensor, layer: Layer, ctx: Context) -> tuple[list[dict], Tensor]:
    hessians = forward.input_hessians(sub, layer, ctx.device)
    y_ref = forward.run(sub, x, layer, ctx, hessians)
    if isinstance(layer.block.mlp, MoeMlp) and sub.kind is Kind.MLP:
        errors = _expert_by_expert_errors(sub, x, y_ref, layer, ctx, hessians)
    else:
        errors = _errors(sub, x, y_ref, layer, ctx, trial_weights(sub, layer, hessians))
    entries = []
    for candidate, err in zip(sub.candidates, errors):
        entry = {"accuracy": max(1e-6, 1.0 - err), "total_bits": sub.bits(candidate)}
        entry.update({role.name: qp.to_dict() for role, qp in zip(sub.roles, candidate)})
        entries.append(entry)
    return entries, y_ref


def trial_weights(sub: Sublayer, layer: Layer, hessians: dict[str, Hessian],
                  expert: int | None = None) -> dict[str, dict[QParams, Tensor]]:
    """linear key -> setting -> fake-quantized fp16 weight [N, K] (fp16 to halve memory), under every setting
    the candidates give its projection: for all the sub-layer's linears, or only expert `expert`'s."""
    group_of = {key: g for g in sub.groups for key in g.keys}
    prepared: dict[tuple[str, ...], Prepared] = {}
    fake = {}
    for pos, role in enumerate(sub.roles):
        settings = distinct(sub.candidates, pos)
        for key, k, _, _ in role.linears if expert is None else role.linears[expert: expert + 1]:
            group = group_of[key]
            if group.keys not in prepared:
                prepared[group.keys] = prepare(forward.group_hessian(group, hessians), EXL2_DAMP)
            results = quantize(layer.linears[key].weight, prepared[group.keys], [qp.groups(k) for qp in settings],
                               exl2_scale)
            fake[key] = {qp: r.weight for qp, r in zip(settings, results)}
    return fake


def _errors(sub: Sublayer, x: Tensor, y_ref: Tensor, layer: Layer, ctx: Context,
            fake: dict[str, dict[QParams, Tensor]]) -> list[float]:
    """Relative output error of every joint candidate, the sub-layer run whole with its trial weights."""
    original = layer.weights(fake)
    errors = []
    for candidate in sub.candidates:
        layer.set_weights({key: fake[key][qp].float() for role, qp in zip(sub.roles, candidate)
                           for key, *_ in role.linears})
        errors.append(forward.relative_error(sub, x, y_ref, layer, ctx))
    layer.set_weights(original)
    return errors


def _expert_by_expert_errors(sub: Sublayer, x: Tensor, y_ref: Tensor, layer: Layer, ctx: Context,
                             hessians: dict[str, Hessian]) -> list[float]:
    """_errors for an MoE sub-layer with only one expert's trial weights alive at a time (all of them at once
    are ~39 GB for a Mixtral-8x7B layer). The router stays fp16, so the routing is the same under every
    candidate and a candidate's MoE output is the sum of its experts' weighted outputs: each candidate gets
    an accumulator on the CPU ([R, L, D] f32, like the states), which the experts add into one after
    another, exactly as reference.moe adds them (index order, f32); then the rest of the sub-layer runs on
    each sum. The errors are bit for bit those of _errors."""
    moe, device = layer.block.mlp, ctx.device
    rows = forward.chunks(*x.shape[:2])
    routed = []                                                  # per chunk: (MLP input [T, D], weights, experts)
    for r in rows:
        h = forward.mlp_input(x[r].to(device).flatten(0, 1), layer.block, ctx)
        routed.append((h, *reference.route(moe.router(h), moe.top_k, moe.renormalize)))
    sums = [torch.zeros(x.shape) for _ in sub.candidates]      # on the CPU wherever the states are
    for e, expert in enumerate(moe.experts):
        fake = trial_weights(sub, layer, hessians, expert=e)
        original = layer.weights(fake)
        for c, candidate in enumerate(sub.candidates):
            layer.set_weights({role.linears[e][0]: fake[role.linears[e][0]][qp].float()
                               for role, qp in zip(sub.roles, candidate)})
            for r, (h, weights, selected) in zip(rows, routed):
                tokens, slot = torch.where(selected == e)
                if tokens.numel():
                    out = expert(h[tokens], REFERENCE_OPS).float() * weights[tokens, slot, None]
                    sums[c][r].flatten(0, 1).index_add_(0, tokens.cpu(), out.cpu())
        layer.set_weights(original)
        del fake, original                                      # before the next expert's are made
    errors = []
    for total in sums:
        y = torch.empty_like(x)
        for r in rows:
            xr, m = x[r].to(device).flatten(0, 1), total[r].to(device).flatten(0, 1)
            y[r] = forward.mlp_output(xr, m, layer.block, ctx).view(y[r].shape).to(y.device)
        errors.append(float(forward.token_errors(y, y_ref).mean()))
    return errors


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
        for sub in forward.sublayers(config, i):
            entries = layers.get(sub.key)
            if not entries:
                raise ExlError(f"{source}: no measurement for {sub.key}; the file is incomplete or from another "
                               f"model")
            for e in entries:
                try:
                    cand = tuple(QParams.from_dict(e[role.name]) for role in sub.roles)
                    bits, acc = int(e["total_bits"]), float(e["accuracy"])
                except (KeyError, TypeError, ValueError) as err:
                    raise ExlError(f"{source}: malformed entry under {sub.key} ({err!r})") from None
                if bits != sub.bits(cand) or not 0 < acc <= 1:
                    raise ExlError(f"{source}: entry {cand[0].desc()} of {sub.key} has total_bits {bits} / accuracy "
                                   f"{acc}, which do not fit this model's shapes; the measurement is from "
                                   f"another model")
    return layers

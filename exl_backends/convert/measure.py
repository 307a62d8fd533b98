"""Measurement pass (exl2-format.md §10.7): for every attention and MLP sub-layer, quantize each projection under
every setting the candidate table uses, then run the sub-layer with each joint candidate substituted and record
its accuracy 1 - mean_tokens(||y_q - y_ref|| / ||y_ref||) (per token, see forward.token_errors, where ExLlamaV2
averages per row). In an MoE layer a candidate's w1/w3/w2 settings apply to every expert, each quantized with
the Hessian of the tokens routed to it. Inputs are the unquantized model's states, so each layer's measurement
is independent of the others. The result (measurement.json, ExLlamaV2's layout) is reusable for any target."""
from __future__ import annotations

from torch import Tensor

from ..config import ModelConfig
from ..errors import ExlError
from . import forward
from .forward import Context, Layer, Sublayer
from .gptq import EXL2_DAMP, exl2_scale, prepare, quantize
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
    prepared = {g.keys: prepare(forward.group_hessian(g, hessians), EXL2_DAMP) for g in sub.groups}
    group_of = {key: g.keys for g in sub.groups for key in g.keys}
    fake: dict[str, dict[QParams, Tensor]] = {}         # linear key -> setting -> fake-quantized fp16 weight
    for pos, role in enumerate(sub.roles):
        settings = distinct(sub.candidates, pos)
        for key, k, _, _ in role.linears:
            results = quantize(layer.linears[key].weight, prepared[group_of[key]],
                               [qp.groups(k) for qp in settings], exl2_scale)
            fake[key] = {qp: r.weight for qp, r in zip(settings, results)}     # [N, K], fp16 to halve memory
    original = layer.weights(fake)
    entries = []
    for candidate in sub.candidates:
        layer.set_weights({key: fake[key][qp].float() for role, qp in zip(sub.roles, candidate)
                           for key, *_ in role.linears})
        err = forward.relative_error(sub, x, y_ref, layer, ctx)
        entry = {"accuracy": max(1e-6, 1.0 - err), "total_bits": sub.bits(candidate)}
        entry.update({role.name: qp.to_dict() for role, qp in zip(sub.roles, candidate)})
        entries.append(entry)
    layer.set_weights(original)
    return entries, y_ref


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

"""Mixture-of-experts MLPs on CUDA (ops.moe, same signature and result as reference.moe).

Routing is torch on the device (reference.route: softmax, top-k, renormalisation), then the token rows are sorted
by expert on the device and each quantized projection runs as one launch over all experts
(matmul_moe.ExpertMatmul): w1 and w3 together, the activation, then w2; each expert reads its weights only if some
row was routed to it. Nothing is read on the host, so a decode step with MoE layers is captured in a CUDA graph like
any other. Bytes read per token at decode (batch 1): top_k experts x (w1 + w3 + w2 packed bytes, with their scale
records), plus the router ([E, D] fp16, or packed): for Mixtral-8x7B at 4.0 bpw, 2 x 3 x 4096 x 14336 x ~0.5 B =
~176 MB per layer instead of ~705 MB for all 8 experts.

For passes of many tokens (prefill), where every expert has many rows, the experts run one by one on their rows
(reference.moe, one host sync for the routing), so each expert's matmul can take the dequantize + cuBLAS path.
Experts with dense weights (fp16 checkpoints) have no expert-indexed kernel; for few tokens all experts run on all
rows, weighted by zero where not routed (graph safe, E / top_k times the bytes), else reference.moe."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..model import reference
from .matmul_moe import ExpertMatmul

DEVICE_TOKENS = 128       # up to this many tokens (the largest decode batch Runner captures) routing stays on device


class MoeKernel:
    """The expert-indexed launches of one MoE layer whose experts are quantized and placed on CUDA."""

    def __init__(self, gate_up: ExpertMatmul, down: ExpertMatmul, act: Callable[[Tensor, Tensor], Tensor]):
        self.gate_up, self.down, self.act = gate_up, down, act

    def bytes_per_expert(self) -> int:
        return self.gate_up.bytes_per_expert + self.down.bytes_per_expert


def prepare(experts: Sequence, act: Callable[[Tensor, Tensor], Tensor], top_k: int) -> MoeKernel | None:
    """experts: the layer's mlp.Mlp objects; act: the gated activation act(gate, up) on CUDA (activation.silu_mul,
    activation.gelu_tanh_mul). The kernel when every expert's gate/up is one fused quantized launch
    and its down quantized too (QuantLinear on CUDA), all alike in format and shape; else None."""
    gate_ups = [getattr(e.gate_up, "kernel", None) for e in experts]
    downs = [getattr(e.down, "kernel", None) for e in experts]
    if any(k is None for k in gate_ups + downs):
        return None
    layouts_up = [k.layouts for k in gate_ups]
    layouts_down = [k.layouts for k in downs]
    if len({tuple((lay.fmt, lay.k, lay.n) for lay in lays) for lays in layouts_up}) != 1 or \
            len({tuple((lay.fmt, lay.k, lay.n) for lay in lays) for lays in layouts_down}) != 1:
        return None
    if any(k.biases != [None] * len(k.biases) for k in gate_ups + downs):
        return None                  # no MoE architecture has expert biases; the MoE launches take none
    return MoeKernel(ExpertMatmul(layouts_up, top_k), ExpertMatmul(layouts_down, top_k), act)


def moe(x: Tensor, router_logits: Tensor, experts: Sequence[Callable[[Tensor], Tensor]], top_k: int,
        renormalize: bool) -> Tensor:
    """x [T, D] fp16, router_logits [T, E] -> [T, D] fp16 (reference.moe). experts: as reference.moe takes them;
    its `kernel` attribute (mlp.Experts), when not None, is the layer's MoeKernel."""
    tokens = x.shape[0]
    few = tokens <= DEVICE_TOKENS or torch.cuda.is_current_stream_capturing()
    kernel = getattr(experts, "kernel", None)
    if not few:
        return reference.moe(x, router_logits, experts, top_k, renormalize)
    weights, selected = reference.route(router_logits, top_k, renormalize)       # f32 [T, k], int64 [T, k]
    if kernel is None:
        return _all_experts(x, weights, selected, experts)
    return _routed(x, weights, selected, kernel, len(experts))


def _routed(x: Tensor, weights: Tensor, selected: Tensor, kernel: MoeKernel, n_experts: int) -> Tensor:
    """Slot s = t * top_k + j is token t's j-th expert. Slots sorted by expert; each projection one launch."""
    tokens, top_k = selected.shape
    flat = selected.flatten()                                                    # [S] expert of each slot
    order = torch.sort(flat, stable=True).indices                                # sorted position -> slot
    counts = torch.zeros(n_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offsets = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    counts = counts.to(torch.int32)
    xs = x[order // top_k]                                                       # [S, D] rows in expert order
    gate, up = kernel.gate_up.forward(xs, offsets, counts, tokens)               # [S, I] each
    (y,) = kernel.down.forward(kernel.act(gate, up), offsets, counts, tokens)    # [S, D], expert order
    per_slot = torch.empty_like(y).index_copy_(0, order, y)                      # [S, D], slot order
    return (per_slot.view(tokens, top_k, -1).float() * weights[..., None]).sum(1).to(x.dtype)


def _all_experts(x: Tensor, weights: Tensor, selected: Tensor, experts: Sequence) -> Tensor:
    """Dense experts, few tokens: every expert on every row, its output weighted by the token's routing weight for
    it (0 when not routed); summed in expert order in f32 as reference.moe does."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, expert in enumerate(experts):
        w = (weights * (selected == e)).sum(-1, keepdim=True)                    # [T, 1] f32
        out += expert(x).float() * w
    return out.to(x.dtype)

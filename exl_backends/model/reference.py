"""The CPU reference of every op, in plain torch. This file is the specification: each CUDA kernel is tested
against the function of the same name here. Written for clarity and exactness, not speed."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

# ----------------------------------------------------------------------------------------------- block ops


def embedding(ids: Tensor, table: Tensor) -> Tensor:
    """ids [T] -> rows of table [T, D]."""
    return table[ids]


def rmsnorm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """x [T, D]: normalised in f32, cast back, then scaled by w (transformers' order of roundings)."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return w.to(x.dtype) * normed


def add_rmsnorm(x: Tensor, residual: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """residual += x; returns (rmsnorm(residual), residual). The fused form the block uses between sublayers."""
    residual = residual + x
    return rmsnorm(residual, w, eps), residual


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """positions [T] -> cos, sin [T, Dh] in dtype: angles in f32, both halves repeated (HF's rotate_half layout)."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, Dh]: x·cos + rotate_half(x)·sin, rotate_half(x) = [-x2, x1] over the two halves of Dh."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def gelu_tanh_mul(gate: Tensor, up: Tensor) -> Tensor:
    """Gemma's gated MLP: GELU with the tanh approximation (transformers' gelu_pytorch_tanh) of gate, times up."""
    return F.gelu(gate, approximate="tanh") * up


def softcap(x: Tensor, cap: float) -> Tensor:
    """cap * tanh(x / cap): squashes x smoothly into (-cap, cap) (Gemma's logit soft-capping)."""
    return torch.tanh(x / cap) * cap


def attention(q: Tensor, k: Tensor, v: Tensor, q_positions: Tensor, scale: float, window: int | None = None,
              softcap: float | None = None) -> Tensor:
    """One sequence. q [Tq, H, Dh] at absolute positions q_positions [Tq]; k, v [Tk, Hkv, Dh] for positions
    0..Tk-1. Causal (key j visible to the query at p iff j <= p), grouped-query (H/Hkv query heads per kv head).
    window: sliding-window attention, key j visible only if also j > p - window. softcap: scores (already
    scaled) become softcap * tanh(scores / softcap) before masking, as Gemma 2 does.
    Scores, softmax and the weighted sum in f32; result [Tq, H, Dh] in q's dtype."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    group = n_heads // n_kv
    qf = q.float().transpose(0, 1)                                          # [H, Tq, Dh]
    kf = k.float().transpose(0, 1).repeat_interleave(group, dim=0)          # [H, Tk, Dh]
    vf = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
    scores = (qf @ kf.transpose(1, 2)) * scale                              # [H, Tq, Tk]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    keys, p = torch.arange(k.shape[0])[None, :], q_positions.cpu()[:, None]
    visible = keys <= p
    if window is not None:
        visible &= keys > p - window
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf                                # [H, Tq, Dh]
    return out.transpose(0, 1).to(q.dtype)


def paged_attention(q: Tensor, cache, layer: int, batch, scale: float, window: int | None = None,
                    softcap: float | None = None) -> Tensor:
    """q [T, H, Dh] for a packed batch (batch.Batch); each sequence attends over its cached K/V (cache.read).
    window, softcap: as in attention (the cache keeps every position; the window only masks)."""
    out = torch.empty_like(q)
    cu = batch.cu_seqlens.tolist()
    for b in range(batch.n_seqs):
        rows = slice(cu[b], cu[b + 1])
        k, v = cache.read(layer, batch.kv_slots(b))
        out[rows] = attention(q[rows], k, v, batch.positions[rows], scale, window, softcap)
    return out


def route(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """MoE routing: router_logits [T, E] -> (weights f32 [T, k], experts int64 [T, k]): the softmax over all
    experts (in f32), its k largest entries, rescaled to sum to 1 when renormalize."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def moe(x: Tensor, router_logits: Tensor, experts: Sequence[Callable[[Tensor], Tensor]], top_k: int,
        renormalize: bool) -> Tensor:
    """A mixture of experts: x [T, D] -> [T, D], each token the weighted sum of the outputs of the top_k
    experts route() picks for it. experts[e] maps rows [t, D] -> [t, D] (expert e's MLP). Sums in f32, expert
    by expert in index order (as transformers adds them)."""
    weights, selected = route(router_logits, top_k, renormalize)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, expert in enumerate(experts):
        rows, slot = torch.where(selected == e)
        if rows.numel():
            out.index_add_(0, rows, expert(x[rows]).float() * weights[rows, slot, None])
    return out.to(x.dtype)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [T, K] @ weight[N, K]^T (+ bias)."""
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


# ----------------------------------------------------------------------------------------------- bit packing


def unpack_bits(words: Tensor, bits: int, rows: int) -> Tensor:
    """words int32 [W, N], each column a little-endian bit stream down dim 0 -> codes int64 [rows, N].
    Code j occupies stream bits [j*bits, j*bits + bits); a code may straddle two words (3, 5, 6 bits)."""
    if bits < 32 and 32 % bits == 0:      # no code straddles two words: one shift a code
        shift = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)[:, None]
        codes = (words.to(torch.int32)[:, None, :] >> shift) & ((1 << bits) - 1)          # [W, 32 / bits, N]
        return codes.reshape(-1, words.shape[1])[:rows].to(torch.int64)
    # 32 codes fill `bits` words exactly: code j of each such group at the same word and shift, one slice each
    # (2-3x faster than gathering every code's 64-bit window)
    n_words, n = words.shape
    groups = -(-n_words // bits)
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = torch.cat((w, w.new_zeros(groups * bits - n_words, n))).view(groups, bits, n)
    codes = torch.empty(groups, 32, n, dtype=torch.int64, device=words.device)
    for j in range(32):
        word, shift = divmod(j * bits, 32)
        v = w[:, word] >> shift
        if shift + bits > 32:
            v = v | w[:, word + 1] << (32 - shift)
        codes[:, j] = v & ((1 << bits) - 1)
    return codes.view(groups * 32, n)[:rows]


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Inverse of unpack_bits: codes [R, N] (R*bits a multiple of 32) -> int32 [R*bits/32, N]."""
    rows, n = codes.shape
    if rows * bits % 32:
        raise ValueError(f"{rows} rows of {bits}-bit codes do not fill whole 32-bit words")
    c = codes.to(torch.int64)
    start = torch.arange(rows, dtype=torch.int64, device=codes.device) * bits
    idx, shift = start // 32, start % 32
    n_words = rows * bits // 32
    out = torch.zeros(n_words + 1, n, dtype=torch.int64, device=codes.device)
    out.index_add_(0, idx, (c << shift[:, None]) & 0xFFFFFFFF)
    spill = shift + bits > 32
    out.index_add_(0, idx[spill] + 1, c[spill] >> (32 - shift[spill])[:, None])
    out = out[:n_words]
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


# ----------------------------------------------------------------------------------------------- EXL2


def exl2_groups(q_groups: Tensor, k: int) -> list[tuple[int, int, int]]:
    """q_groups int16 [2G] -> [(bits, qrow_start, rows)] per group; the last group ends at row k."""
    pairs = q_groups.to(torch.int64).view(-1, 2).tolist()
    out, seen = [], 0
    for g, (bits, qrow) in enumerate(pairs):
        rows = (pairs[g + 1][1] - qrow) * 32 // bits if g + 1 < len(pairs) else k - seen
        out.append((bits, qrow, rows))
        seen += rows
    return out


def exl2_scales(q_scale: Tensor, q_scale_max: Tensor) -> Tensor:
    """Per-group, per-column fp16 scales [G, Np]: fp16((c+1)^2 * fp16(q_scale_max * 2^-8)), two roundings."""
    nibbles = unpack_bits(q_scale.T.contiguous(), 4, q_scale.shape[1] * 8).T   # [G, Np]
    m = (q_scale_max.float() * 2.0**-8).half().float()                           # may be subnormal
    return ((nibbles + 1).float().pow(2) * m[:, None]).half()                     # exact in f32, one rounding


def exl2_runs(groups: list[tuple[int, int, int]]) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Consecutive groups whose codes are one bit stream (same width, each ending on a word boundary where the
    next starts) as (bits, first word row, [(group, rows)]): unpacked at once, a load's CPU dequantization takes one
    unpack per width instead of one per group; the GPU repack (lane_layout.exl2_layout) one launch per run."""
    runs = []
    for g, (bits, qrow, rows) in enumerate(groups):
        if runs and runs[-1][0] == bits and runs[-1][3] == qrow * 32:
            runs[-1][2].append((g, rows))
            runs[-1][3] += rows * bits if rows * bits % 32 == 0 else -1     # a partial last word ends the run
        else:
            runs.append([bits, qrow, [(g, rows)], qrow * 32 + rows * bits if rows * bits % 32 == 0 else -1])
    return [(bits, qrow, members) for bits, qrow, members, _ in runs]


def dequant_exl2(q_weight: Tensor, q_scale: Tensor, q_scale_max: Tensor, q_groups: Tensor,
                 q_invperm: Tensor, out_features: int) -> Tensor:
    """EXL2 packed tensors -> fp16 weight [out_features, K] in HF layout, bit-exact with ExLlamaV2."""
    k = q_invperm.shape[0]
    scales = exl2_scales(q_scale, q_scale_max).float()
    rows_out = []
    for bits, qrow, groups in exl2_runs(exl2_groups(q_groups, k)):
        rows = sum(n for _, n in groups)
        codes = unpack_bits(q_weight[qrow: qrow + (rows * bits + 31) // 32], bits, rows)
        group_of_row = torch.repeat_interleave(torch.tensor([g for g, _ in groups]),
                                               torch.tensor([n for _, n in groups]))
        rows_out.append(((codes - 2 ** (bits - 1)).float() * scales[group_of_row]).half())    # one rounding
    stored = torch.cat(rows_out)                                             # [K, Np], stored (permuted) rows
    return stored[q_invperm.long()][:, :out_features].T.contiguous()        # W[k] = stored[invperm[k]]


# ----------------------------------------------------------------------------------------------- GPTQ

GPTQ_V1_WORD_OFFSET = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}


def gptq_zeros(qzeros: Tensor, bits: int, n: int, v2: bool) -> Tensor:
    """qzeros int32 [G, N*bits/32] -> true zero points int64 [G, N]. v1 ("gptq") stores zero - 1: 2/4/8-bit
    words get +0x55../0x11../0x01.. mod 2^32 (GPTQModel's exact inverse), 3-bit fields (field + 1) & 7."""
    words = qzeros.to(torch.int64) & 0xFFFFFFFF
    if not v2 and bits in GPTQ_V1_WORD_OFFSET:
        words = (words + GPTQ_V1_WORD_OFFSET[bits]) & 0xFFFFFFFF
    fields = unpack_bits(words.T.contiguous(), bits, n).T                    # [G, N]
    if not v2 and bits == 3:
        fields = (fields + 1) & 7
    return fields


def dequant_gptq(qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int,
                 v2: bool = False) -> Tensor:
    """GPTQ packed tensors -> fp16 weight [N, K] (HF layout): W[k, n] = fp16((q - z[g_idx[k], n]) * s[g_idx[k], n])."""
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    codes = unpack_bits(qweight, bits, k)                                    # [K, N]
    zeros = gptq_zeros(qzeros, bits, n, v2)                                  # [G, N]
    g = g_idx.long()
    return ((codes - zeros[g]).float() * scales.half().float()[g]).half().T.contiguous()


# ----------------------------------------------------------------------------------------------- KV cache quant

KV_CHUNK = 64   # elements rotated together (two interleaved 32-point Hadamard transforms)
KV_GROUP = 32   # elements per scale


def _hadamard32(x: Tensor) -> Tensor:
    """Unnormalised 32-point Walsh-Hadamard transform over the last dim (Sylvester order)."""
    h = x.clone()
    span = 1
    while span < 32:
        h = h.view(*h.shape[:-1], 32 // (2 * span), 2, span)
        a, b = h[..., 0, :], h[..., 1, :]
        h = torch.stack((a + b, a - b), dim=-2).reshape(*x.shape)
        span *= 2
    return h


def _rotate(x: Tensor) -> Tensor:
    """x [..., 64k] f32: the even and the odd elements of each 64-chunk each get a 32-point transform."""
    c = x.reshape(*x.shape[:-1], -1, 32, 2)
    return torch.stack((_hadamard32(c[..., 0]), _hadamard32(c[..., 1])), dim=-1).reshape(x.shape)


def quantize_kv(x: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """x [T, E] (one token's K or V for all kv heads, E % 64 == 0) -> codes uint8 [T, E] (8-bit) or [T, E/2]
    (4-bit, element e in byte e/2, even e in the low nibble) and fp16 scales [T, E/32]."""
    half = 2 ** (bits - 1)
    y = _rotate(x.float())
    groups = y.view(y.shape[0], -1, KV_GROUP)
    amax = groups.abs().amax(-1, keepdim=True)
    scale = (amax / half).half()
    inv = torch.where(amax > 0, half / amax, torch.zeros_like(amax))
    q = torch.clamp(torch.round(groups * inv + half), 0, 2 * half - 1).to(torch.uint8).view(y.shape)
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    return q, scale.view(y.shape[0], -1)


def dequantize_kv(codes: Tensor, scales: Tensor, bits: int, dtype: torch.dtype) -> Tensor:
    """Inverse of quantize_kv (up to the rounding of the codes): [T, E] in dtype."""
    half = 2 ** (bits - 1)
    if bits == 4:
        codes = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)
    y = (codes.float() - half).view(codes.shape[0], -1, KV_GROUP) * scales.float()[..., None]
    return (_rotate(y.view(codes.shape[0], -1)) / 32).to(dtype)


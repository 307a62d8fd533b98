"""Attention of a few new tokens after a long cached prefix (the cached-prefix first token's attention: 100 new tokens
after 1,900 took ~80 us a layer of the 8B shape by varlen flash, ~25 by the dense call: docs/attention.md), by the
candidates torch has, one layer
of the Llama-3-8B shape (32 query heads, 8 kv heads, head_dim 128), K/V already gathered to fp16:

- flash varlen: what exl_backends runs for several prompts at once (`aten._flash_attention_forward`, causal aligned
  bottom-right; one prompt without a window takes the dense call, as `sdpa flash` below: docs/attention.md);
- SDPA efficient / cudnn / flash: `scaled_dot_product_attention` with `causal_lower_right` (GQA by enable_gqa, or
  the kv heads repeated where the backend needs it), each backend forced;
- gather + sdpa flash: the path an fp16 cache takes, K/V first gathered from 256-key pages scattered over a pool
  (torch indexing, standing in for kv_cache.read), then the dense call (torch 2.11's varlen flash takes no block
  table, so the gather stays: docs/attention.md);
- split: the prefix cut into pieces of --piece keys as extra varlen sequences (non-causal), one causal call over the
  new keys, merged by log-sum-exp in torch (the variant docs/attention.md measured and reverted, for the floor).

Each is timed graph-replayed (us a call) and checked against an fp32 reference (max abs error).

    python benchmarks/bench_prompt_attention.py [--cases 16x1792,100x1900,208x1792,100x8000] [--piece 512]
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from bench_attention import graph_seconds

HEADS, KV_HEADS, DH = 32, 8, 128


def reference(q, k, v, scale):
    """fp32 causal attention aligned bottom-right: q [n, H, Dh], k/v [keys, Hkv, Dh] -> [n, H, Dh]."""
    n, keys = q.shape[0], k.shape[0]
    rep = HEADS // KV_HEADS
    kf, vf = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = torch.einsum("nhd,khd->hnk", q.float(), kf) * scale
    visible = torch.arange(keys, device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None] + keys - n
    s = s.masked_fill(~visible, -math.inf)
    return torch.einsum("hnk,khd->nhd", s.softmax(-1), vf)


def flash_varlen(q, k, v, scale):
    n, keys = q.shape[0], k.shape[0]
    cu_q = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, keys], dtype=torch.int32, device=q.device)
    return lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, n, keys, 0.0, True, False,
                                                           scale=scale)[0]


def sdpa(backend, q, k, v, scale):
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))          # [1, heads, len, Dh]
    bias = causal_lower_right(q.shape[0], k.shape[0])

    def call():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=scale,
                                                  enable_gqa=True)[0].transpose(0, 1)
    return call


def paged_pool(k, v, page):
    """k, v [keys, Hkv, Dh] in pages of `page` keys, scattered over a pool three pages larger: (pool_k, pool_v,
    block table int32 [1, pages])."""
    keys = k.shape[0]
    pages = -(-keys // page)
    order = torch.randperm(pages + 3, device=k.device)[:pages]
    pools = []
    for x in (k, v):
        pool = torch.zeros(pages + 3, page, KV_HEADS, DH, dtype=x.dtype, device=x.device)
        pool.view(-1, KV_HEADS, DH)[(order[:, None] * page + torch.arange(page, device=x.device)).flatten()[:keys]] = x
        pools.append(pool)
    return pools[0], pools[1], order.int()[None]


def gather_then_flash(q, k, v, scale):
    keys = k.shape[0]
    pool_k, pool_v, table = paged_pool(k, v, 256)

    def call():
        kg, vg = (pool[table[0].long()].view(-1, KV_HEADS, DH)[:keys] for pool in (pool_k, pool_v))
        return sdpa(SDPBackend.FLASH_ATTENTION, q, kg, vg, scale)()
    return call


def per_sequence(lse, m, n):
    """Varlen flash's log-sum-exp as [m, H, n]: it comes as [H, m n] (unpadded) or [m, H, max_q], by version."""
    return lse.view(HEADS, m, n).transpose(0, 1) if lse.dim() == 2 else lse[:, :, :n]


def split(q, k, v, scale, piece):
    """The prefix's pieces as non-causal varlen sequences (each with all n queries), the new keys causal; merged."""
    n, keys = q.shape[0], k.shape[0]
    prefix = keys - n
    bounds = list(range(0, prefix, piece)) + [prefix]
    m = len(bounds) - 1
    qs = q.repeat(m, 1, 1)
    cu_q = torch.arange(0, (m + 1) * n, n, dtype=torch.int32, device=q.device)
    cu_k = torch.tensor(bounds, dtype=torch.int32, device=q.device)
    cu_new = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    cu_newk = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))

    def call():
        o1, lse1 = torch.ops.aten._flash_attention_forward(qs, k[:prefix], v[:prefix], cu_q, cu_k, n, longest, 0.0,
                                                           False, False, scale=scale)[:2]
        o2, lse2 = torch.ops.aten._flash_attention_forward(q, k[prefix:], v[prefix:], cu_new, cu_newk, n, n, 0.0,
                                                           True, False, scale=scale)[:2]
        os = torch.cat([o1.view(m, n, HEADS, DH), o2.unsqueeze(0)]).float()           # [m + 1, n, H, Dh]
        lses = torch.cat([per_sequence(lse1, m, n), per_sequence(lse2, 1, n)])          # [m + 1, H, n]
        w = torch.softmax(lses, 0).permute(0, 2, 1).unsqueeze(-1)                      # [m + 1, n, H, 1]
        return (os * w).sum(0).half()
    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="16x1792,100x1900,208x1792,100x8000", help="NEWxCACHED token counts")
    ap.add_argument("--piece", type=int, default=512, help="prefix keys per piece of the split variant")
    args = ap.parse_args()
    torch.manual_seed(0)
    scale = DH ** -0.5
    print(f"{'case':>10} {'candidate':>16} {'us':>8} {'max err':>9}")
    for case in args.cases.split(","):
        n, cached = map(int, case.split("x"))
        q = torch.randn(n, HEADS, DH, device="cuda").half()
        k = torch.randn(cached + n, KV_HEADS, DH, device="cuda").half()
        v = torch.randn(cached + n, KV_HEADS, DH, device="cuda").half()
        ref = reference(q, k, v, scale)
        candidates = {"flash varlen": flash_varlen(q, k, v, scale),
                      "sdpa efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION, q, k, v, scale),
                      "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, scale),
                      "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, scale),
                      f"split {args.piece}": split(q, k, v, scale, args.piece),
                      "gather + sdpa flash": gather_then_flash(q, k, v, scale)}
        for name, call in candidates.items():
            try:
                err = (call().float() - ref).abs().max().item()
                us = graph_seconds(call) * 1e6
                print(f"{case:>10} {name:>16} {us:8.1f} {err:9.1e}", flush=True)
            except Exception as e:          # a backend that does not take these inputs here
                print(f"{case:>10} {name:>16} {'-':>8} {type(e).__name__}: {str(e)[:80]}", flush=True)


if __name__ == "__main__":
    main()

"""The three weight files of the exl2-ref fixtures that are not stored (tests/fixtures/exl2-ref/README.md): the fp16
source models and the hand-packed GPTQ checkpoint follow a recipe from a seed, so they are rebuilt here, once per
clone, and must come out byte for byte as recorded in SHA256SUMS. ExLlamaV2's own files are stored as they were."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, INTERMEDIATE, VOCAB, LAYERS, Q_OUT, KV_OUT = 256, 768, 512, 2, 256, 128
GPTQ_GROUP = 64


def source_weights(seed: int, qkv_bias: bool) -> dict[str, torch.Tensor]:
    """fp32 normal draws from one seeded generator, in the README's order, cast to fp16."""
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return (torch.randn(shape, generator=gen) * std).half()

    def norm():
        return (1 + 0.05 * torch.randn((HIDDEN,), generator=gen)).half()

    t = {"model.embed_tokens.weight": normal((VOCAB, HIDDEN), 0.2)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm()
        for name, out in (("q", Q_OUT), ("k", KV_OUT), ("v", KV_OUT)):
            t[p + f"self_attn.{name}_proj.weight"] = normal((out, HIDDEN), 0.05)
        if qkv_bias:
            for name, out in (("q", Q_OUT), ("k", KV_OUT), ("v", KV_OUT)):
                t[p + f"self_attn.{name}_proj.bias"] = normal((out,), 0.05)
        t[p + "self_attn.o_proj.weight"] = normal((HIDDEN, Q_OUT), 0.05)
        t[p + "post_attention_layernorm.weight"] = norm()
        t[p + "mlp.gate_proj.weight"] = normal((INTERMEDIATE, HIDDEN), 0.05)
        t[p + "mlp.up_proj.weight"] = normal((INTERMEDIATE, HIDDEN), 0.05)
        t[p + "mlp.down_proj.weight"] = normal((HIDDEN, INTERMEDIATE), 0.05)
    t["model.norm.weight"] = norm()
    t["lm_head.weight"] = normal((VOCAB, HIDDEN), 0.2)
    return t


def _int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit words -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def gptq_pack(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Round-to-nearest 4-bit asymmetric GPTQ v1 of one [out, in] fp16 weight, groups of 64 input rows."""
    w = weight.float().T                                   # [in, out]
    k, n = w.shape
    groups = w.view(k // GPTQ_GROUP, GPTQ_GROUP, n)
    hi, lo = groups.amax(1).clamp(min=0), groups.amin(1).clamp(max=0)
    scale = (hi - lo) / 15
    scale = torch.where(scale == 0, torch.ones_like(scale), scale).half()
    zero = torch.clamp(torch.round(-lo / scale.float()), 0, 15)
    q = torch.clamp(torch.round(groups / scale.float()[:, None]) + zero[:, None], 0, 15).long().view(k, n)
    qweight = sum(q[j::8] << (4 * j) for j in range(8))
    stored_zero = (zero.long() - 1) & 15                  # v1 stores zero - 1
    qzeros = sum(stored_zero[:, j::8] << (4 * j) for j in range(8))
    return {"qweight": _int32(qweight), "qzeros": _int32(qzeros), "scales": scale,
            "g_idx": torch.arange(k, dtype=torch.int32) // GPTQ_GROUP}


def gptq_weights(source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every decoder linear packed; embeddings, norms and lm_head stay fp16."""
    out = {}
    for name, t in source.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            base = name.removesuffix(".weight")
            out.update({f"{base}.{part}": v for part, v in gptq_pack(t).items()})
        else:
            out[name] = t
    return out


RECIPES = {
    "hf/llama_tiny/model.safetensors": lambda: source_weights(1001, qkv_bias=False),
    "hf/qwen2_tiny/model.safetensors": lambda: source_weights(2002, qkv_bias=True),
    "gptq/llama_tiny_gptq4_g64/model.safetensors": lambda: gptq_weights(source_weights(1001, qkv_bias=False)),
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def materialize(root: Path) -> None:
    """Writes each missing recipe file under root; a file that does not hash as SHA256SUMS records is an error
    (a torch whose seeded generator draws differently would otherwise change every reference silently)."""
    sums = root / "SHA256SUMS"
    if not sums.is_file():
        return
    expected = dict(reversed(line.split()) for line in sums.read_text().splitlines() if line.strip())
    for rel, build in RECIPES.items():
        target = root / rel
        if target.is_file() or not target.parent.is_dir():
            continue
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")    # parallel test workers: write, then rename
        save_file(build(), str(tmp), metadata={"format": "pt"})
        got, want = _sha256(tmp), expected.get(f"./{rel}")
        if got != want:
            tmp.unlink()
            raise RuntimeError(f"rebuilt {target} hashes {got}, SHA256SUMS records {want}: this torch's seeded "
                               f"normal draws differ from those the fixtures were made with (torch 2.11 and 2.13 "
                               f"agree); copy the file from the original fixtures")
        tmp.replace(target)

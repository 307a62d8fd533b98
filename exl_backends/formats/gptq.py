"""GPTQ linear layers (AutoGPTQ / GPTQModel / Optimum layout). Layout: shared/design/gptq-format.md."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .. import reference
from ..errors import CheckpointError
from ..linear import QuantLinear
from ..tensors import TensorStore

GPTQ_BITS = (2, 3, 4, 8)


@dataclass
class GptqWeight:
    qweight: Tensor     # int32 [K*bits/32, N]
    qzeros: Tensor      # int32 [G, N*bits/32]
    scales: Tensor      # fp16 [G, N]
    g_idx: Tensor       # int32 [K]
    bits: int
    v2: bool            # checkpoint_format gptq_v2: zeros stored as is (v1 stores zero - 1)
    in_features: int
    out_features: int

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def tensors(self) -> dict[str, Tensor]:
        return {"qweight": self.qweight, "qzeros": self.qzeros, "scales": self.scales, "g_idx": self.g_idx}

    def dequantize(self) -> Tensor:
        t = {k: v.cpu() for k, v in self.tensors().items()}
        return reference.dequant_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], self.bits,
                                      self.v2).to(self.device)

    def to(self, device: torch.device) -> "GptqWeight":
        return GptqWeight(**{k: v.to(device) for k, v in self.tensors().items()}, bits=self.bits, v2=self.v2,
                          in_features=self.in_features, out_features=self.out_features)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def settings(directory: Path) -> dict:
    """The quantization config: quantize_config.json, quant_config.json, or config.json's block."""
    for name in ("quantize_config.json", "quant_config.json"):
        if (directory / name).is_file():
            return json.loads((directory / name).read_text())
    raw = json.loads((directory / "config.json").read_text())
    return raw.get("quantization_config") or {}


def check(store: TensorStore, key: str, k: int, n: int, bias: bool) -> tuple[int, int]:
    """Validates shapes; returns (bits, groups)."""
    sc = store.expect(f"{key}.scales", None, (torch.float16, torch.bfloat16, torch.float32))
    qz = store.expect(f"{key}.qzeros", None, (torch.int32,))
    qw = store.expect(f"{key}.qweight", None, (torch.int32,))
    if len(sc.shape) != 2 or sc.shape[1] != n or len(qz.shape) != 2 or qz.shape[0] != sc.shape[0]:
        raise CheckpointError(f"{sc.file}: {key}: scales {list(sc.shape)} / qzeros {list(qz.shape)} do not "
                              f"match out_features {n}")
    bits = 32 * qz.shape[1] // n
    if bits not in GPTQ_BITS or qz.shape[1] * 32 != bits * n:
        raise CheckpointError(f"{qz.file}: {key}: qzeros {list(qz.shape)} imply {32 * qz.shape[1] / n} bits; "
                              f"supported GPTQ widths: {list(GPTQ_BITS)}")
    store.expect(f"{key}.qweight", (k * bits // 32, n), (torch.int32,))
    if f"{key}.g_idx" in store:
        store.expect(f"{key}.g_idx", (k,), (torch.int32, torch.int64))
    if bias:
        store.expect(f"{key}.bias", (n,), (torch.float16, torch.bfloat16, torch.float32))
    del qw
    return bits, sc.shape[0]


def load(store: TensorStore, key: str, k: int, n: int, bias: bool) -> QuantLinear:
    bits, groups = check(store, key, k, n, bias)
    cfg = settings(store.directory)
    v2 = (cfg.get("checkpoint_format") or cfg.get("format") or "gptq") == "gptq_v2"
    if f"{key}.g_idx" in store:
        g_idx = store.get(f"{key}.g_idx").to(torch.int32)
    else:
        g_idx = (torch.arange(k) // -(-k // groups)).to(torch.int32)
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise CheckpointError(f"{store.info(key + '.g_idx').file}: {key}.g_idx holds group indices outside "
                              f"0..{groups - 1}; the checkpoint is corrupt")
    w = GptqWeight(store.get(f"{key}.qweight"), store.get(f"{key}.qzeros"), store.get(f"{key}.scales").half(),
                   g_idx, bits, v2, k, n)
    b = store.get(f"{key}.bias") if bias else None
    return QuantLinear(w, b)

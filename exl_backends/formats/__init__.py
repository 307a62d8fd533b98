"""Checkpoint formats. A directory's format is detected once (`open_checkpoint`): fp16/bf16/fp32, EXL2 or GPTQ,
from the quantization config or, failing that, from the tensor names; formats we do not load (AWQ, GGUF, FP8,
EXL3, legacy GPTQ-marlin, ...) are refused there with a message saying what is supported.

Each linear layer's kind is then decided by which tensors exist under its key, as ExLlamaV2 does:
`<key>.q_weight` -> EXL2, `<key>.qweight` -> GPTQ, `<key>.weight` -> dense. So fp16 layers left in place in a
quantized checkpoint (and GPTQModel's `dynamic` exclusions) load as dense layers."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..errors import CheckpointError, UnsupportedFormatError
from ..model.linear import Linear, QuantLinear
from . import exl2, gptq
from .tensors import FLOAT_DTYPES, TensorStore

SUPPORTED = "fp16/bf16/fp32 safetensors, EXL2 (ExLlamaV2) and GPTQ (2/3/4/8-bit, v1 or v2 zeros)"
DENSE_FORMATS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# quant_method values we know but do not load, with what to tell the user
REFUSED_METHODS = {
    "awq": "AWQ checkpoints pack their codes along the output dimension with their own zero layout and are not "
           "supported; use a GPTQ or EXL2 quant of this model, or its fp16 original",
    "exl3": "EXL3 (ExLlamaV3 trellis codes) is not supported; use an EXL2 quant of this model (ExLlamaV2), "
            "or convert the fp16 original with `exl convert`",
    "fp8": "FP8 checkpoints are not supported; use the bf16/fp16 original, or an EXL2/GPTQ quant",
    "fbgemm_fp8": "FP8 checkpoints are not supported; use the bf16/fp16 original, or an EXL2/GPTQ quant",
    "marlin": "legacy GPTQ 'marlin' checkpoints (Marlin's runtime layout on disk) are not supported; use the "
              "plain GPTQ version of this model, or an EXL2 quant",
}


@dataclass(frozen=True)
class Checkpoint:
    """A model directory's tensors and the facts about their format that every layer needs, read once."""
    store: TensorStore
    format: str                             # "exl2", "gptq", or the dense dtype "fp16" / "bf16" / "fp32"
    gptq_settings: gptq.GptqSettings | None   # when any layer is GPTQ: bits, group size, zero convention, overrides

    @property
    def directory(self) -> Path:
        return self.store.directory


def detect_format(directory: str | Path) -> str:
    """The directory's format: "exl2", "gptq", "fp16", "bf16" or "fp32"; UnsupportedFormatError otherwise."""
    return open_checkpoint(directory).format


def open_checkpoint(directory: str | Path) -> Checkpoint:
    directory = Path(directory)
    _refuse_gguf(directory)
    cfg, source = gptq.quant_config(directory)
    method = _quant_method(cfg, source) if cfg is not None else None
    store = TensorStore(directory)
    fmt = method or _format_from_tensors(store)
    settings = None
    if fmt == "gptq" or any(name.endswith(".qweight") for name in store.names()):
        # validates the block too: refuses marlin / bitblas layouts, widths other than 2/3/4/8
        settings = gptq.GptqSettings.from_dict(cfg if method == "gptq" else {}, source or str(directory))
    return Checkpoint(store, fmt, settings)


def _refuse_gguf(directory: Path) -> None:
    ggufs = [directory] if directory.suffix == ".gguf" else sorted(directory.glob("*.gguf"))
    if ggufs and not list(directory.glob("*.safetensors")):
        raise UnsupportedFormatError(
            f"{ggufs[0]}: GGUF files are not loaded directly; import it first with "
            f"`exl import-gguf {ggufs[0]} OUT_DIR` (writes an fp16 safetensors directory) and load OUT_DIR. "
            f"Supported: {SUPPORTED}")


def _quant_method(cfg: dict, source: str) -> str:
    """"exl2" or "gptq" from a quantization config block; refuses every other method."""
    method = str(cfg.get("quant_method") or cfg.get("method") or "").lower()
    if not method and source.endswith(gptq.CONFIG_FILES):
        # AutoGPTQ's own files predate the key; AutoAWQ's quant_config.json has `version: gemm` / `zero_point`
        awq = str(cfg.get("version", "")).lower() in ("gemm", "gemv", "gemv_fast") or "zero_point" in cfg
        method = "awq" if awq else "gptq"
    if method in ("exl2", "gptq"):
        return method
    why = REFUSED_METHODS.get(method, f"quantization method {method or '(none given)'!r} is not supported")
    raise UnsupportedFormatError(f"{source}: {why}. Supported: {SUPPORTED}")


def _format_from_tensors(store: TensorStore) -> str:
    names = store.names()
    if any(n.endswith(".q_weight") for n in names):
        return "exl2"
    if any(n.endswith((".trellis", ".suh")) for n in names):
        raise UnsupportedFormatError(f"{store.directory}: {REFUSED_METHODS['exl3']}. Supported: {SUPPORTED}")
    qweights = [n.removesuffix(".qweight") for n in names if n.endswith(".qweight")]
    if qweights:
        key = qweights[0]
        if f"{key}.scales" in store and store.info(f"{key}.qweight").shape[-1] != store.info(f"{key}.scales").shape[-1]:
            raise UnsupportedFormatError(f"{store.info(key + '.qweight').file}: '{key}.qweight' is packed along "
                                         f"the output dimension: {REFUSED_METHODS['awq']}. Supported: {SUPPORTED}")
        return "gptq"
    fp8 = [n for n in names if store.info(n).dtype in FP8_DTYPES]
    if fp8:
        raise UnsupportedFormatError(f"{store.info(fp8[0]).file}: tensor '{fp8[0]}' is FP8: "
                                     f"{REFUSED_METHODS['fp8']}. Supported: {SUPPORTED}")
    dtypes = Counter(store.info(n).dtype for n in names
                     if n.endswith(".weight") and len(store.info(n).shape) == 2 and store.info(n).dtype in FLOAT_DTYPES)
    if not dtypes:
        raise CheckpointError(f"{store.directory}: no linear weights found (files: {store.files()}); "
                              f"is this a model directory?")
    return DENSE_FORMATS[dtypes.most_common(1)[0][0]]


# ----------------------------------------------------------------------------------------------- one layer


def linear_kind(store: TensorStore, key: str) -> str:
    if f"{key}.q_weight" in store:
        return "exl2"
    if f"{key}.qweight" in store:
        return "gptq"
    if f"{key}.weight" in store:
        return "dense"
    raise CheckpointError(f"tensor {key}.weight (or a quantized {key}.q_weight / {key}.qweight) is missing "
                          f"from {store.directory} (files: {store.files()})")


def _gptq_settings(ckpt: Checkpoint) -> gptq.GptqSettings:
    return ckpt.gptq_settings or gptq.GptqSettings(str(ckpt.directory))


def check_linear(ckpt: Checkpoint, key: str, in_features: int, out_features: int, bias: bool) -> None:
    """Validates a linear layer's tensors (names, shapes, dtypes) without reading its data. `bias`: the
    architecture requires one; a bias the file holds is used either way."""
    store, kind = ckpt.store, linear_kind(ckpt.store, key)
    if kind == "dense":
        store.expect(f"{key}.weight", (out_features, in_features), FLOAT_DTYPES)
    elif kind == "exl2":
        exl2.check(store, key, in_features, out_features)
    else:
        gptq.check(store, _gptq_settings(ckpt), key, in_features, out_features)
    if f"{key}.bias" in store or bias:
        b = store.expect(f"{key}.bias", None, FLOAT_DTYPES)
        allowed = ((out_features,), (exl2.padded(out_features),)) if kind == "exl2" else ((out_features,),)
        if b.shape not in allowed:
            raise CheckpointError(f"{b.file}: tensor '{key}.bias' has shape {list(b.shape)}, expected "
                                  f"{list(allowed[0])} from config.json")


def load_linear(ckpt: Checkpoint, key: str, in_features: int, out_features: int, bias: bool,
                device: torch.device, dtype: torch.dtype) -> Linear | QuantLinear:
    check_linear(ckpt, key, in_features, out_features, bias)
    store, kind = ckpt.store, linear_kind(ckpt.store, key)
    b = _bias(store, key, out_features)
    if kind == "dense":
        return Linear(store.get(f"{key}.weight"), b).to(device, dtype)
    if kind == "exl2":
        weight = exl2.load(store, key, in_features, out_features)
    else:
        weight = gptq.load(store, _gptq_settings(ckpt), key, in_features, out_features)
    return QuantLinear(weight, b).to(device, dtype)


def _bias(store: TensorStore, key: str, n: int) -> Tensor | None:
    """The layer's bias (EXL2 pads it to 32: sliced), or None when absent or all zeros (some GPTQ tools write
    zero biases for layers that have none)."""
    if f"{key}.bias" not in store:
        return None
    b = store.get(f"{key}.bias")[:n]
    return b if bool(b.any()) else None


def linear_nbytes(ckpt: Checkpoint, key: str, in_features: int, out_features: int, dtype: torch.dtype) -> int:
    """Bytes load_linear keeps for this layer on the device, from the headers alone: packed tensors as stored
    (GPTQ scales as fp16, g_idx as int32), dense weights and biases in the compute dtype. A bias of zeros
    counts too (only reading it would tell)."""
    store, kind = ckpt.store, linear_kind(ckpt.store, key)
    bias = out_features * dtype.itemsize if f"{key}.bias" in store else 0
    if kind == "dense":
        return out_features * in_features * dtype.itemsize + bias

    def stored(name):
        info = store.info(f"{key}.{name}")
        return math.prod(info.shape) * info.dtype.itemsize
    if kind == "exl2":
        return sum(stored(t) for t in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")) + bias
    scales = math.prod(store.info(f"{key}.scales").shape) * torch.float16.itemsize
    return stored("qweight") + stored("qzeros") + scales + in_features * torch.int32.itemsize + bias

"""Checkpoint formats. Each linear layer's kind is decided by which tensors exist under its key, as ExLlamaV2
does: `<key>.q_weight` -> EXL2, `<key>.qweight` -> GPTQ, `<key>.weight` -> dense."""
from __future__ import annotations

import torch

from ..errors import CheckpointError
from ..linear import Linear, QuantLinear
from ..tensors import FLOAT_DTYPES, TensorStore
from . import exl2, gptq

READERS = {"exl2": exl2, "gptq": gptq}


def linear_kind(store: TensorStore, key: str) -> str:
    if f"{key}.q_weight" in store:
        return "exl2"
    if f"{key}.qweight" in store:
        return "gptq"
    if f"{key}.weight" in store:
        return "dense"
    raise CheckpointError(f"tensor {key}.weight (or a quantized {key}.q_weight / {key}.qweight) is missing "
                          f"from {store.directory} (files: {store.files()})")


def check_linear(store: TensorStore, key: str, in_features: int, out_features: int, bias: bool) -> None:
    """Validates a linear layer's tensors (names, shapes, dtypes) without reading its data."""
    kind = linear_kind(store, key)
    if kind == "dense":
        store.expect(f"{key}.weight", (out_features, in_features), FLOAT_DTYPES)
        if bias:
            store.expect(f"{key}.bias", (out_features,), FLOAT_DTYPES)
        return
    READERS[kind].check(store, key, in_features, out_features, bias)


def load_linear(store: TensorStore, key: str, in_features: int, out_features: int, bias: bool,
                device: torch.device, dtype: torch.dtype) -> Linear | QuantLinear:
    kind = linear_kind(store, key)
    if kind == "dense":
        b = store.get(f"{key}.bias").to(device, dtype) if bias else None
        return Linear(store.get(f"{key}.weight").to(device, dtype), b)
    layer = READERS[kind].load(store, key, in_features, out_features, bias)
    return layer.to(device, dtype)

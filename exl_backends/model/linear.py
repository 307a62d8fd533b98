"""Linear layers: a dense one and QuantLinear (a packed weight), both `y = x @ W^T (+ bias)`.

QuantLinear's forward is chosen once, when the layer is placed on a device: on CPU the reference (dequantize
once, then matmul), on CUDA the quantized-matmul kernels. Model code never knows which it holds."""
from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from . import reference


class QuantizedWeight(Protocol):
    """A packed weight as a format stores it (EXL2, GPTQ). `dequantize()` is the exact reference."""
    in_features: int
    out_features: int
    device: torch.device

    def dequantize(self) -> Tensor: ...          # fp16 [out_features, in_features]
    def to(self, device: torch.device) -> "QuantizedWeight": ...
    def nbytes(self) -> int: ...                 # bytes of the packed tensors


class Linear:
    """A dense linear layer (fp16/bf16/fp32 weight [N, K])."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        self.weight, self.bias = weight, bias
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def __call__(self, x: Tensor) -> Tensor:
        return reference.linear(x, self.weight, self.bias)

    def to(self, device: torch.device, dtype: torch.dtype) -> "Linear":
        bias = None if self.bias is None else self.bias.to(device, dtype)
        return Linear(self.weight.to(device, dtype), bias)

    def dense_weight(self) -> Tensor:
        return self.weight

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.bias) if t is not None)


class QuantLinear:
    """A linear layer with a packed weight; computes in the activations' dtype. On CUDA the weight is repacked
    once for the kernels (quant_matmul.prepare) and the packed original is not kept, so it costs memory once."""

    def __init__(self, weight: QuantizedWeight, bias: Tensor | None = None, device: torch.device | None = None):
        """device: where the layer runs (default: the weight's device); a CUDA device repacks the weight there."""
        self.bias = bias
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self._dense: Tensor | None = None       # CPU path: the dequantized weight, kept once made ...
        self.keep_dense = True                  # ... unless memory is short (keep_dense_weights)
        device = weight.device if device is None else torch.device(device)
        if device.type == "cuda":
            from ..kernels import quant_matmul    # importing it compiles nothing
            self.weight, self.kernel = None, quant_matmul.prepare(weight, bias, device)
            self._forward = self.kernel
        else:
            self.weight, self.kernel = weight, None
            self._forward = self._reference_forward

    def __call__(self, x: Tensor) -> Tensor:
        return self._forward(x)

    def _reference_forward(self, x: Tensor) -> Tensor:
        return reference.linear(x, self.dense(x.dtype), self.bias)

    def dense(self, dtype: torch.dtype) -> Tensor:
        """The dequantized weight in dtype (CPU path), kept for the next call when keep_dense."""
        if self._dense is not None and self._dense.dtype == dtype:
            return self._dense
        weight = self.weight.dequantize().to(dtype)
        if self.keep_dense:
            self._dense = weight
        return weight

    def dense_nbytes(self, dtype: torch.dtype) -> int:
        return self.in_features * self.out_features * dtype.itemsize

    def to(self, device: torch.device, dtype: torch.dtype) -> "QuantLinear":
        if self.weight is None:
            raise ValueError("a QuantLinear already placed on the GPU cannot move; load the model again")
        bias = None if self.bias is None else self.bias.to(device, dtype)
        if torch.device(device).type == "cuda":             # repacked from where the weight is (exl2_layout)
            return QuantLinear(self.weight, bias, device)
        return QuantLinear(self.weight.to(device), bias)

    def dense_weight(self) -> Tensor:
        """The exact fp16 weight [N, K] (dequantized)."""
        return self.weight.dequantize() if self.kernel is None else self.kernel.dequantize()

    def nbytes(self) -> int:
        if self.kernel is not None:
            return self.kernel.nbytes()
        return self.weight.nbytes() + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


class FusedLinear:
    """Several linear layers applied to the same x (q/k/v, gate/up): returns one output per layer. Quantized
    layers placed on CUDA with one format and K run as one kernel launch (quant_matmul.fuse, sharing their
    repacked weights). Quantized layers on the CPU run as one matmul over their dequantized weights stacked (made
    on first use, instead of each layer's own: the same bytes; at batch 1 a matmul's fixed cost is a good part of
    its time). Otherwise each layer runs on its own."""

    def __init__(self, layers: list[Linear | QuantLinear]):
        self.layers = layers
        kernels = [getattr(layer, "kernel", None) for layer in layers]
        self.kernel = None
        if all(k is not None for k in kernels):
            from ..kernels import quant_matmul
            self.kernel = quant_matmul.fuse(kernels)
        self.stacks = all(isinstance(layer, QuantLinear) and layer.kernel is None for layer in layers)
        self._stacked: tuple[Tensor, Tensor | None] | None = None
        self.keep_dense = True                  # as QuantLinear.keep_dense

    def __call__(self, x: Tensor) -> list[Tensor]:
        if self.kernel is not None:
            return self.kernel.forward(x)
        if self.stacks:
            weight, bias = self._stacked_weight(x.dtype)
            return list(reference.linear(x, weight, bias).split([layer.out_features for layer in self.layers], -1))
        return [layer(x) for layer in self.layers]

    def _stacked_weight(self, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """The layers' dequantized weights [sum N, K] and biases (zeros where a layer has none) in dtype, kept
        for the next call when keep_dense."""
        if self._stacked is not None and self._stacked[0].dtype == dtype:
            return self._stacked
        weight = torch.cat([layer.weight.dequantize().to(dtype) for layer in self.layers])
        bias = None
        if any(layer.bias is not None for layer in self.layers):
            bias = torch.cat([torch.zeros(layer.out_features, dtype=dtype) if layer.bias is None
                              else layer.bias.to(dtype) for layer in self.layers])
        if self.keep_dense:
            self._stacked = weight, bias
        return weight, bias

    def dense_nbytes(self, dtype: torch.dtype) -> int:
        return sum(layer.dense_nbytes(dtype) for layer in self.layers)

    def dense(self, dtype: torch.dtype) -> Tensor:
        return self._stacked_weight(dtype)[0]


    def after_norm(self, h: Tensor | None, residual: Tensor | None, w: Tensor, eps: float,
                   ops) -> tuple[list[Tensor], Tensor]:
        """(self(x), r) for the block's norm in front of these layers: x, r = ops.norm_residual(h, residual, w, eps).
        A fused quantized launch on CUDA normalises x as it stages it (QuantMatmul.forward_normed). h None: the
        launch before has fed this one's x (QuantMatmul.forward_feeding) and residual is r already."""
        if h is None:
            return self.kernel.forward_fed(), residual
        if self.kernel is not None:
            return self.kernel.forward_normed(h, residual, w, eps)
        x, residual = ops.norm_residual(h, residual, w, eps)
        return self(x), residual


def cpu_quantized(linears: list) -> list["QuantLinear | FusedLinear"]:
    """Of a model's linears (FusedLinear, QuantLinear, Linear), the units that dequantize on the CPU: stacking
    FusedLinears, and QuantLinears on the CPU (those of a FusedLinear that does not stack included)."""
    out = []
    for unit in linears:
        if isinstance(unit, FusedLinear) and unit.stacks:
            out.append(unit)
        elif isinstance(unit, FusedLinear):
            out += cpu_quantized(unit.layers)
        elif isinstance(unit, QuantLinear) and unit.kernel is None:
            out.append(unit)
    return out


def keep_dense_weights(units: list["QuantLinear | FusedLinear"], dtype: torch.dtype, available: int | None) -> bool:
    """The CPU path's choice, once at load: when the dequantized weights of units (in dtype) fit in 80 % of the
    available memory, dequantize them all now, once; otherwise dequantize each at every call and keep none (slow,
    but a model whose packed weights fit still runs). available: bytes free (None: unknown, taken as enough)."""
    need = sum(unit.dense_nbytes(dtype) for unit in units)
    keep = available is None or need <= 0.8 * available
    for unit in units:
        unit.keep_dense = keep
        if keep:
            unit.dense(dtype)
    return keep


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux: MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None

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

    def __init__(self, weight: QuantizedWeight, bias: Tensor | None = None):
        self.bias = bias
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self._dense: Tensor | None = None       # CPU path: the dequantized weight, made on first use
        if weight.device.type == "cuda":
            from .kernels import quant_matmul    # importing it compiles nothing
            self.weight, self.kernel = None, quant_matmul.prepare(weight, bias)
            self._forward = self.kernel
        else:
            self.weight, self.kernel = weight, None
            self._forward = self._reference_forward

    def __call__(self, x: Tensor) -> Tensor:
        return self._forward(x)

    def _reference_forward(self, x: Tensor) -> Tensor:
        if self._dense is None or self._dense.dtype != x.dtype:
            self._dense = self.weight.dequantize().to(x.dtype)
        return reference.linear(x, self._dense, self.bias)

    def to(self, device: torch.device, dtype: torch.dtype) -> "QuantLinear":
        if self.weight is None:
            raise ValueError("a QuantLinear already placed on the GPU cannot move; load the model again")
        bias = None if self.bias is None else self.bias.to(device, dtype)
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
            from .kernels import quant_matmul
            self.kernel = quant_matmul.fuse(kernels)
        self.stacks = all(isinstance(layer, QuantLinear) and layer.kernel is None for layer in layers)
        self._stacked: tuple[Tensor, Tensor | None] | None = None

    def __call__(self, x: Tensor) -> list[Tensor]:
        if self.kernel is not None:
            return self.kernel.forward(x)
        if self.stacks:
            weight, bias = self._stacked_weight(x.dtype)
            return list(reference.linear(x, weight, bias).split([layer.out_features for layer in self.layers], -1))
        return [layer(x) for layer in self.layers]

    def _stacked_weight(self, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """The layers' dequantized weights [sum N, K] and biases (zeros where a layer has none) in dtype."""
        if self._stacked is None or self._stacked[0].dtype != dtype:
            weight = torch.cat([layer.weight.dequantize().to(dtype) for layer in self.layers])
            bias = None
            if any(layer.bias is not None for layer in self.layers):
                bias = torch.cat([torch.zeros(layer.out_features, dtype=dtype) if layer.bias is None
                                  else layer.bias.to(dtype) for layer in self.layers])
            self._stacked = weight, bias
        return self._stacked

    def after_norm(self, h: Tensor, residual: Tensor | None, w: Tensor, eps: float, ops) -> tuple[list[Tensor], Tensor]:
        """(self(x), r) for the block's norm in front of these layers: x, r = ops.norm_residual(h, residual, w, eps).
        A fused quantized launch on CUDA normalises x as it stages it (QuantMatmul.forward_normed)."""
        if self.kernel is not None:
            return self.kernel.forward_normed(h, residual, w, eps)
        x, residual = ops.norm_residual(h, residual, w, eps)
        return self(x), residual

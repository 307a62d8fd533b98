"""Helpers of the kernel tests (tests/kernels): the GPU marker, poisoned allocations, small model configs."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from exl_backends.model.config import ModelConfig

needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None, reason="needs CUDA and CuPy")]


def on_gpu(test):
    """needs_gpu as a decorator, for files that mix GPU tests with others."""
    for mark in needs_gpu:
        test = mark(test)
    return test


def poison_allocator() -> None:
    """Fills freed blocks of torch's caching allocator (small and large pools) with NaN, so that a kernel output
    the kernel fails to write holds NaN instead of a lucky earlier result."""
    blocks = [torch.full((n,), float("nan"), dtype=torch.float16, device="cuda")
              for n in (2**k for k in range(6, 27)) for _ in range(2)]
    del blocks
    torch.cuda.synchronize()


def attention_config(n_heads: int, n_kv_heads: int, head_dim: int, n_layers: int = 1) -> ModelConfig:
    return ModelConfig.from_dict(dict(
        architectures=["LlamaForCausalLM"], hidden_size=n_heads * head_dim, intermediate_size=256,
        num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, head_dim=head_dim,
        num_hidden_layers=n_layers, vocab_size=256, rms_norm_eps=1e-5, max_position_embeddings=65536))

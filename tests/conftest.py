"""Shared test helpers: tiny random models built with transformers, and the reference fixtures."""
from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import pytest
import torch

from exl2_ref import materialize

REPO = Path(__file__).resolve().parent.parent
# ExLlamaV2-made reference checkpoints and logits (tests/fixtures/exl2-ref/README.md); EXL_FIXTURES may name another
# copy in the same layout (the original, untrimmed set, or one with further variants)
FIXTURES = Path(os.environ.get("EXL_FIXTURES", REPO / "tests" / "fixtures" / "exl2-ref"))
TOKENIZER_DIR = FIXTURES / "hf" / "llama_tiny"     # byte-level BPE, vocab 512, no automatic BOS
WIKITEXT = REPO / "tests" / "fixtures" / "wikitext-2"   # excerpts of the valid and test splits (its README.md)
materialize(FIXTURES)                                # the seeded weight files the fixtures do not store


def needs_fixtures():
    return pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"{FIXTURES} not present")


def tiny_config(arch: str = "llama", **overrides):
    """A 2-layer random config of the given family; overrides go to the transformers config. head_dim is
    pinned to hidden / heads (16) for the families whose default is larger; MoE families get 4 experts, top 2."""
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig,
                              Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig)
    base = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                bos_token_id=509, eos_token_id=510, pad_token_id=511, tie_word_embeddings=False)
    family = {"gemma2": dict(head_dim=16), "gemma3": dict(head_dim=16), "qwen3": dict(head_dim=16),
              "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
              "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)}
    base.update(family.get(arch, {}))
    base.update(overrides)
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig, "phi3": Phi3Config, "mixtral": MixtralConfig,
           "qwen3_moe": Qwen3MoeConfig}[arch]
    return cls(**base)


def save_tiny(directory: Path, config, seed: int = 0, dtype=torch.float32):
    """Builds a random model for config, saves it with the fixtures' tokenizer; returns the HF model (f32)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():   # wider weights than the default init, so logits are not all alike
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif "norm" in name:          # around 1, not exactly 1, so a missing norm weight shows
                p.normal_(1, 0.1)
            else:
                p.normal_(0, 0.05)
    model.to(dtype).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, directory / name)
    return model.float()


@pytest.fixture
def tiny_llama(tmp_path):
    model = save_tiny(tmp_path, tiny_config("llama"))
    return tmp_path, model


def unlink_norms(model) -> None:
    """The model without its stage-free norms (Model.link_norms): every norm staged by its own stage_xs, the bits of
    the path the megakernel's segments and the fixtures' bit-for-bit tests compare against."""
    for unit in model.linears():
        kernel = getattr(unit, "kernel", None)
        if kernel is not None:
            kernel.feeding = kernel.fed_by = kernel.gating = None


@pytest.fixture(params=["", "ATT_TILE_BEFORE_WAIT=1"])
def attention_probe(request, monkeypatch):
    """attention.cu as built, and with its probe's define (TILE BEFORE WAIT): until the test ends, attention.cu is
    compiled with it for every launch, other families as built. The loader looks kernels up once per process, so
    its lookups are cleared at both ends."""
    from exl_backends.kernels import loader
    if request.param:
        original = loader.module

        @functools.cache
        def module(name, cc):
            return loader.compile_module(name, cc, (request.param,)) if name == "attention" else original(name, cc)
        monkeypatch.setattr(loader, "module", module)
        loader._function.cache_clear()
    yield request.param
    if request.param:
        monkeypatch.undo()
        loader._function.cache_clear()

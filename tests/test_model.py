"""The CPU reference decoder against transformers (both f32): prefill logits, incremental decode, variants."""
from __future__ import annotations

import pytest
import torch

from exl_backends import ExlForCausalLM
from exl_backends.model.batch import Batch, SeqChunk
from exl_backends.model.cache import KVCache

from conftest import save_tiny, tiny_config

VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 32}}),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "llama-yarn-rope": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 64}}),
    "llama-head-dim": ("llama", {"head_dim": 32}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {"num_key_value_heads": 1}),
}
PREFILL, DECODE = 37, 16


def assert_close(ours, ref):
    tol = 1e-4 * ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= tol, f"max |diff| {(ours - ref).abs().max().item():.3g} > {tol:.3g}"


@pytest.fixture(params=list(VARIANTS))
def variant(request, tmp_path):
    arch, overrides = VARIANTS[request.param]
    hf = save_tiny(tmp_path, tiny_config(arch, **overrides), seed=hash(request.param) % 1000)
    return ExlForCausalLM.from_pretrained(tmp_path, device="cpu"), hf


def test_prefill_logits_equal_transformers(variant):
    ours, hf = variant
    ids = torch.randint(0, 509, (2, PREFILL), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    assert_close(ours(ids).logits, ref)


def test_incremental_decode_equals_transformers(variant):
    ours, hf = variant
    ids = torch.randint(0, 509, (PREFILL + DECODE,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    page = 16
    cache = KVCache(ours.exl_config, n_pages=8, page_size=page, device="cpu", dtype=torch.float32)
    pages = [5, 2, 7, 0]                       # deliberately not contiguous
    step = ours.model.forward(Batch.build([SeqChunk(ids[:PREFILL].tolist(), 0, pages)], page, all_logits=True),
                              cache)
    assert_close(step, ref[:PREFILL])
    for t in range(PREFILL, PREFILL + DECODE):
        logits = ours.model.forward(Batch.build([SeqChunk([int(ids[t])], t, pages)], page), cache)
        assert_close(logits[0], ref[t])


def test_left_padded_batch_matches_unpadded(tiny_llama):
    path, hf = tiny_llama
    ours = ExlForCausalLM.from_pretrained(path, device="cpu")
    a, b = list(range(10, 30)), list(range(40, 47))
    ids = torch.tensor([a, [511] * (len(a) - len(b)) + b])
    mask = torch.tensor([[1] * len(a), [0] * (len(a) - len(b)) + [1] * len(b)])
    out = ours(ids, attention_mask=mask).logits
    assert_close(out[1, -len(b):], ours(torch.tensor([b])).logits[0])
    assert torch.all(out[1, : len(a) - len(b)] == 0)


def test_greedy_generate_equals_transformers(variant):
    ours, hf = variant
    prompt = torch.randint(0, 509, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=511)
    out = ours.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=511)
    assert out.tolist() == ref.tolist()


@pytest.mark.parametrize("mode", ["fp16", "q4", "q6"])
def test_cache_copy_moves_slots_in_every_layer_only(mode):
    """KVCache.copy (a reused prefix's partial page into a job's own) in every layer, every field; nothing else
    changes. The layers are views into one tensor per field, so the copy must index the right dimension."""
    from exl_backends.model.config import ModelConfig
    config = ModelConfig.from_dict(dict(
        architectures=["LlamaForCausalLM"], hidden_size=128, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_hidden_layers=3, vocab_size=256, rms_norm_eps=1e-5,
        max_position_embeddings=512))
    cache = KVCache(config, n_pages=4, page_size=8, mode=mode, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    fields = [t for c in cache.layers for t in (c.k, c.v, c.k_scales, c.v_scales) if t is not None]
    for t in fields:
        t.copy_(torch.randint(0, 256, t.shape, generator=gen) if t.dtype == torch.uint8
                else torch.randn(t.shape, generator=gen).to(t.dtype))
    before = [t.clone() for t in fields]
    cache.copy(source=9, target=26, n=5)
    for t, old in zip(fields, before):
        expected = old.clone()
        expected[26:31] = old[9:14]
        assert torch.equal(t, expected)

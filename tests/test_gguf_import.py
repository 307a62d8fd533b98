"""exl import-gguf: the llama fast path writes exactly what transformers' own GGUF loader writes (the default
model's import, tests/test_smollm2.py and the quickstart rely on those weights), on a tiny llama GGUF made here."""
import filecmp

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")
from safetensors.torch import load_file  # noqa: E402

from exl_backends.formats import gguf as gguf_import  # noqa: E402

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN = 2, 64, 4, 2, 128


def _byte_level_tokens() -> tuple[list[str], list[str]]:
    """GPT-2's byte-to-unicode alphabet, two merges and the chat markers the default model uses."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e"]
    return ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet, "Ġt", "he"], merges


def _write_llama_gguf(path, tied: bool):
    """A 2-layer llama in the quant types of the default model's file (Q4_1 matrices, a Q8_0 tensor, F32 norms)."""
    rng = np.random.default_rng(0)
    tokens, merges = _byte_level_tokens()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def add(name, shape, qtype):
        values = rng.standard_normal(shape, dtype=np.float32) * 0.1
        writer.add_tensor(name, gguf.quantize(values, qtype), raw_dtype=qtype)

    Q4_1, Q8_0, F32 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
    add("token_embd.weight", (len(tokens), HIDDEN), Q8_0)
    add("output_norm.weight", (HIDDEN,), F32)
    if not tied:
        add("output.weight", (len(tokens), HIDDEN), Q4_1)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), F32)
        add(f"blk.{i}.attn_q.weight", (HIDDEN, HIDDEN), Q4_1)
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * head_dim, HIDDEN), Q4_1)
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * head_dim, HIDDEN), Q4_1)
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HIDDEN), Q4_1)
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), F32)
        add(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN), Q4_1)
        add(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN), Q4_1)
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN), Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("tied", [True, False])
def test_llama_fast_path_writes_what_transformers_writes(tmp_path, monkeypatch, tied):
    file = _write_llama_gguf(tmp_path / "tiny.gguf", tied)
    fast = gguf_import.import_gguf(file, tmp_path / "fast")
    monkeypatch.setattr(gguf_import, "_llama_model", lambda file, config: None)   # transformers' loader
    monkeypatch.setattr(gguf_import, "_llama_config", lambda file: None)          # and its config
    reference = gguf_import.import_gguf(file, tmp_path / "reference")

    names = sorted(p.name for p in fast.iterdir())
    assert names == sorted(p.name for p in reference.iterdir())
    for name in names:
        if name != "model.safetensors":
            assert filecmp.cmp(fast / name, reference / name, shallow=False), name
    ours, theirs = load_file(fast / "model.safetensors"), load_file(reference / "model.safetensors")
    assert ours.keys() == theirs.keys() and ("lm_head.weight" in ours) is not tied
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype == torch.float16
        assert torch.equal(ours[key].view(torch.int16), theirs[key].view(torch.int16)), key


@pytest.mark.parametrize("tied", [True, False])
def test_llama_fast_path_is_taken(tmp_path, tied):
    """The fast path must not quietly fall back (a renamed transformers module would make the import 3x slower):
    the config from the header alone is AutoConfig's, and the model is made from it."""
    from transformers import AutoConfig

    file = _write_llama_gguf(tmp_path / "tiny.gguf", tied=tied)
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=file.name)
    ours = gguf_import._llama_config(file)
    assert ours is not None and ours.to_dict() == config.to_dict() and ours.tie_word_embeddings is tied
    assert gguf_import._llama_model(file, ours) is not None


def test_gguf_names_match_transformers_map():
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, get_gguf_hf_weights_map

    config = LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = get_gguf_hf_weights_map(model, LlamaTensorProcessor(config=config.to_dict()))
    assert gguf_import.gguf_to_hf_names(config, model.state_dict()) == expected

"""ExlForCausalLM as a transformers model (generate's contract, streamers, stop strings, generation_config, scores,
pipeline, HF-facing attributes) and the "exl2" quantizer plugin for stock AutoModelForCausalLM, each against
transformers itself on the same weights."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import (AutoModelForCausalLM, GenerationConfig, LlamaConfig, LogitsProcessorList,
                          TemperatureLogitsWarper, TextIteratorStreamer, TextStreamer, pipeline)

from exl_backends import ExlForCausalLM
from exl_backends.model.config import ModelConfig

from conftest import FIXTURES, REPO, save_tiny, tiny_config

PAD = 511
EXL2_DIR = FIXTURES / "exl2" / "llama_tiny_exl2_4.0bpw_h6"


@pytest.fixture(scope="module")
def fp16_tiny(tmp_path_factory):
    """A tiny random Llama saved in fp16: ours (f32 compute on CPU) and transformers' (f32) on the same weights."""
    path = tmp_path_factory.mktemp("tiny_fp16")
    save_tiny(path, tiny_config("llama"), seed=3, dtype=torch.float16)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ExlForCausalLM.from_pretrained(path, device="cpu"), hf


def left_padded(tokenizer, texts: list[str]) -> dict:
    tokenizer.pad_token_id = PAD
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True)


TEXTS = ["The teacher asked the class", "Computers process numbers by following simple instructions, and",
         "moon"]


def test_batched_greedy_equals_transformers_on_fp16_model(fp16_tiny):
    ours, hf = fp16_tiny
    batch = left_padded(ours.tokenizer, TEXTS)
    assert (batch.attention_mask[:, 0] == 0).any()          # really padded
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    with torch.no_grad():
        ref = hf.generate(**batch, **kw)
    assert torch.equal(ours.generate(**batch, **kw), ref)
    # max_length counts the prompt, and eos_token_id may be a list (a row ending early is padded after it)
    eos = [int(ref[0, batch.input_ids.shape[1] + 2]), 510]
    with torch.no_grad():
        ref = hf.generate(**batch, max_length=batch.input_ids.shape[1] + 12, eos_token_id=eos, pad_token_id=PAD)
    out = ours.generate(**batch, max_length=batch.input_ids.shape[1] + 12, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(out, ref) and (out[0, batch.input_ids.shape[1] + 3:] == PAD).all()


def test_return_dict_scores_and_logits_equal_transformers(fp16_tiny):
    ours, hf = fp16_tiny
    batch = left_padded(ours.tokenizer, TEXTS[:2])
    kw = dict(max_new_tokens=6, pad_token_id=PAD, return_dict_in_generate=True, output_scores=True,
              output_logits=True, repetition_penalty=1.3)
    with torch.no_grad():
        ref = hf.generate(**batch, **kw)
    out = ours.generate(**batch, **kw)
    assert type(out) is type(ref) and torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == len(out.logits) == 6
    for a, b in zip(out.scores + out.logits, ref.scores + ref.logits):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4)
    assert isinstance(ours.generate(**batch, max_new_tokens=2, pad_token_id=PAD), torch.Tensor)


def test_sampling_settings_and_seed(fp16_tiny):
    ours, _ = fp16_tiny
    ids = ours.tokenizer("The moon", return_tensors="pt").input_ids
    kw = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, max_new_tokens=12)
    torch.manual_seed(1)
    one = ours.generate(ids, **kw)
    torch.manual_seed(1)
    assert torch.equal(one, ours.generate(ids, **kw))
    torch.manual_seed(1)
    many = ours.generate(ids, num_return_sequences=3, **kw)
    assert many.shape[0] == 3 and len({tuple(r.tolist()) for r in many}) > 1


def test_text_streamers_yield_the_generated_text(fp16_tiny, capsys):
    ours, _ = fp16_tiny
    tok = ours.tokenizer
    ids = tok("The teacher asked", return_tensors="pt").input_ids
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=ours.generate(ids, max_new_tokens=20,
                                                                             streamer=streamer)))
    thread.start()
    pieces = list(streamer)
    thread.join()
    expected = tok.decode(result["out"][0, ids.shape[1]:], skip_special_tokens=True)
    assert len(pieces) > 1 and "".join(pieces) == expected
    ours.generate(ids, max_new_tokens=20, streamer=TextStreamer(tok, skip_prompt=True))
    assert capsys.readouterr().out.strip() == expected.strip()


def test_stop_strings_and_stopping_criteria_as_transformers(fp16_tiny):
    ours, hf = fp16_tiny
    tok = ours.tokenizer
    ids = tok("The teacher asked the class", return_tensors="pt").input_ids
    free = ours.generate(ids, max_new_tokens=30)
    text = tok.decode(free[0, ids.shape[1]:])
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip()
    kw = dict(max_new_tokens=30, stop_strings=[stop], tokenizer=tok, pad_token_id=PAD)
    with torch.no_grad():
        ref = hf.generate(ids, **kw)
    out = ours.generate(ids, **kw)
    assert torch.equal(out, ref) and out.shape[1] < free.shape[1]
    with pytest.raises(ValueError, match="tokenizer"):
        ours.generate(ids, max_new_tokens=4, stop_strings=["x"])


def test_generation_config_priority(fp16_tiny):
    ours, _ = fp16_tiny
    ids = ours.tokenizer("The moon", return_tensors="pt").input_ids
    assert isinstance(ours.generation_config, GenerationConfig)
    assert ours.generate(ids).shape[1] == 20                                  # transformers' default max_length
    config = GenerationConfig(max_new_tokens=5)
    assert ours.generate(ids, generation_config=config).shape[1] == ids.shape[1] + 5
    assert ours.generate(ids, generation_config=config, max_new_tokens=3).shape[1] == ids.shape[1] + 3
    ours.generation_config.max_new_tokens = 4                                 # the model's own defaults count too
    try:
        assert ours.generate(ids).shape[1] == ids.shape[1] + 4
    finally:
        ours.generation_config.max_new_tokens = None


GENERATION_FILES = {
    "llama3": {"bos_token_id": 7, "eos_token_id": [8, 9], "do_sample": True, "temperature": 0.6, "top_p": 0.9,
               "max_length": 64, "transformers_version": "4.40.0"},
    "written by save_pretrained": {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2,
                                   "output_attentions": False, "output_hidden_states": False, "pad_token_id": 2,
                                   "transformers_version": "5.25.0", "use_cache": True},
    "a None": {"eos_token_id": 2, "top_k": None, "max_new_tokens": 12},
}
CALLS = [{}, {"max_new_tokens": 3}, {"do_sample": True, "temperature": 0.7, "top_k": 5, "min_p": 0.1},
         {"eos_token_id": None, "max_length": 30, "repetition_penalty": 1.2, "use_cache": True},
         {"num_return_sequences": 2, "do_sample": True, "return_dict_in_generate": True, "output_scores": True}]


@pytest.mark.parametrize("file", sorted(GENERATION_FILES))
def test_generate_settings_without_transformers_equal_its_own(fp16_tiny, tmp_path, file):
    """generate() resolves its settings without transformers when the directory's generation_config.json and the
    kwargs hold only fields it implements: the same values transformers' GenerationConfig resolves (read through a
    model whose generation_config was made, the path that imports transformers); transformers' defaults too."""
    from exl_backends.adapters import hf as adapter
    ours, _ = fp16_tiny
    for f in Path(ours.name_or_path).iterdir():
        if f.name != "generation_config.json":
            (tmp_path / f.name).symlink_to(f)
    (tmp_path / "generation_config.json").write_text(json.dumps(GENERATION_FILES[file]))
    plain, full = (ExlForCausalLM.from_pretrained(tmp_path, device="cpu") for _ in range(2))
    assert isinstance(full.generation_config, GenerationConfig)           # now in full.__dict__: transformers' path
    for call in CALLS:
        a, b = plain._resolve_config(None, dict(call)), full._resolve_config(None, dict(call))
        assert not isinstance(a, GenerationConfig) and isinstance(b, GenerationConfig)
        assert {k: getattr(a, k) for k in adapter.DEFAULTS} == {k: getattr(b, k) for k in adapter.DEFAULTS}, call
    fresh = GenerationConfig()
    fresh.update(**GenerationConfig._get_default_generation_params())
    assert adapter.DEFAULTS == {k: getattr(fresh, k) for k in adapter.DEFAULTS}


def test_generate_settings_that_only_transformers_can_judge_take_its_path(fp16_tiny, tmp_path):
    """A file entry or kwarg generate() does not implement, or no generation_config.json at all, goes through
    transformers' GenerationConfig (its errors, its derivation from config.json)."""
    from exl_backends.adapters import hf as adapter
    ours, _ = fp16_tiny
    (tmp_path / "generation_config.json").write_text(json.dumps({"num_beams": 1, "eos_token_id": 2}))
    assert adapter._plain_settings(adapter.saved_settings(tmp_path), {}) is None
    (tmp_path / "generation_config.json").write_text(json.dumps({"output_attentions": True}))
    assert adapter._plain_settings(adapter.saved_settings(tmp_path), {}) is None
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert adapter._plain_settings(adapter.saved_settings(tmp_path), {"num_beams": 2}) is None
    assert adapter._plain_settings(adapter.saved_settings(tmp_path), {"max_new_tokens": 2}).max_new_tokens == 2
    with pytest.raises(ValueError, match="max_new_tokens"):
        adapter._plain_settings(adapter.saved_settings(tmp_path), {"max_new_tokens": 0})
    (tmp_path / "generation_config.json").unlink()
    assert adapter._plain_settings(adapter.saved_settings(tmp_path), {}) is None
    with pytest.raises(ValueError, match="max_new_tokens"):
        ours.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=0)


def test_unsupported_arguments_raise(fp16_tiny):
    ours, hf = fp16_tiny
    ids = torch.tensor([[1, 2, 3]])
    for kwargs in ({"num_beams": 2}, {"no_repeat_ngram_size": 3}, {"output_attentions": True},
                   {"assistant_model": hf}, {"logits_processor": LogitsProcessorList([TemperatureLogitsWarper(0.5)])},
                   {"not_an_option": 1}):
        with pytest.raises(TypeError):
            ours.generate(ids, max_new_tokens=2, **kwargs)
    with pytest.raises(ValueError, match="(?i)greedy"):
        ours.generate(ids, max_new_tokens=2, num_return_sequences=2)
    with pytest.raises(TypeError):
        ExlForCausalLM.from_pretrained(ours.name_or_path, quantization_config={})


def test_transformers_facing_attributes(fp16_tiny):
    ours, _ = fp16_tiny
    assert isinstance(ours.config, LlamaConfig) and isinstance(ours.exl_config, ModelConfig)
    assert ours.config.vocab_size == ours.exl_config.vocab_size == 512
    assert ours.device == torch.device("cpu") and ours.dtype == torch.float32
    assert ours.can_generate() and ours.eval() is ours and ours.main_input_name == "input_ids"
    assert ours.to("cpu") is ours and ours.to(torch.float32) is ours
    with pytest.raises(ValueError, match="cannot move"):
        ours.to("cuda")
    assert ExlForCausalLM.from_pretrained(ours.name_or_path, device_map="cpu", torch_dtype="float32").dtype == \
        torch.float32


def test_pipeline_text_generation_equals_transformers(fp16_tiny):
    ours, hf = fp16_tiny
    kw = dict(max_new_tokens=10, do_sample=False, return_full_text=False)
    ref = pipeline("text-generation", model=hf, tokenizer=ours.tokenizer)("The teacher asked", **kw)
    out = pipeline("text-generation", model=ours, tokenizer=ours.tokenizer)("The teacher asked", **kw)
    assert out == ref and out[0]["generated_text"]


# ---- the quantizer plugin --------------------------------------------------------------------------------------


def test_auto_model_loads_exl2_onto_our_layers():
    import exl_backends  # noqa: F401  (registers the plugin; already imported here, as it is in any user's code)
    from exl_backends.adapters.hf_quantizer import Exl2Config, Exl2Linear
    hf = AutoModelForCausalLM.from_pretrained(EXL2_DIR, dtype=torch.float32)
    assert hf.is_quantized and isinstance(hf.config.quantization_config, Exl2Config)
    assert isinstance(hf.model.layers[0].mlp.down_proj, Exl2Linear) and isinstance(hf.lm_head, Exl2Linear)
    assert_matches_ours(hf, EXL2_DIR)


def assert_matches_ours(hf, path) -> None:
    """transformers' model of an EXL2 directory gives ExlForCausalLM's logits and greedy tokens."""
    ours = ExlForCausalLM.from_pretrained(path, device="cpu")
    ids = torch.tensor([[509, 84, 104, 101, 32, 116, 101, 97, 99, 104, 101, 114, 300, 200]])
    with torch.no_grad():
        ref = hf(ids).logits
    assert (ours(ids).logits - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    with torch.no_grad():
        assert torch.equal(hf.generate(ids, max_new_tokens=12, do_sample=False), ours.generate(ids, max_new_tokens=12))


@pytest.fixture(scope="module")
def tied_exl2(tmp_path_factory):
    """A tiny Llama with tie_word_embeddings: true (as SmolLM2, the default model), converted to EXL2 4.0 bpw by our
    converter, which quantizes the head on its own (6 bits) and keeps the config's tie flag."""
    from exl_backends.convert.pipeline import convert
    from test_convert import calibration_text, options
    base = tmp_path_factory.mktemp("tied")
    save_tiny(base / "fp16", tiny_config("llama", tie_word_embeddings=True), seed=5, dtype=torch.float16)
    return convert(options(base / "fp16", base / "q", 4.0, calibration_text(base / "cal.txt"), rows=2, length=32))


def test_auto_model_loads_a_tied_quantized_head_and_equals_ours(tied_exl2):
    """transformers marks the tied head's `weight` when it builds the model, before our layers replace it: loading
    once failed with "Exl2Linear has no attribute `weight`". The head stays the checkpoint's quantized tensor."""
    import exl_backends  # noqa: F401
    from exl_backends.adapters.hf_quantizer import Exl2Linear
    from exl_backends.formats.tensors import read_header
    assert json.loads((tied_exl2 / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.q_weight" in read_header(tied_exl2 / "output.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(tied_exl2, dtype=torch.float32)
    assert isinstance(hf.lm_head, Exl2Linear) and not hf.all_tied_weights_keys
    assert_matches_ours(hf, tied_exl2)


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})


def test_without_the_import_transformers_refuses_exl2_loudly():
    """What a user sees without `import exl_backends`: a warning naming exl2, then an error (ExLlamaV2 names its
    file output.safetensors) - never a silently random model."""
    done = run_python(f"from transformers import AutoModelForCausalLM\n"
                      f"AutoModelForCausalLM.from_pretrained({str(EXL2_DIR)!r})")
    assert done.returncode != 0
    assert "Unknown quantization type, got exl2" in done.stderr and "no file named model.safetensors" in done.stderr


def test_registration_is_lazy_and_order_free():
    done = run_python(
        "import sys, exl_backends\n"
        "assert not any(m in sys.modules for m in ('torch', 'transformers', 'cupy')), 'import must stay cheap'\n"
        "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING, AUTO_QUANTIZATION_CONFIG_MAPPING\n"
        "assert 'exl2' in AUTO_QUANTIZER_MAPPING and 'exl2' in AUTO_QUANTIZATION_CONFIG_MAPPING\n"
        "assert AUTO_QUANTIZER_MAPPING['gptq'].__module__.startswith('transformers'), 'gptq stays transformers own'\n")
    assert done.returncode == 0, done.stderr
    done = run_python("import transformers.quantizers.auto as auto\nimport exl_backends\n"
                      "assert 'exl2' in auto.AUTO_QUANTIZER_MAPPING")
    assert done.returncode == 0, done.stderr


# ---- the real default model ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_chat_pipeline_and_greedy_batch_equal_transformers():
    from exl_backends.commands.quickstart import default_model_dir
    path = default_model_dir()
    ours = ExlForCausalLM.from_pretrained(path, device="cpu", max_seq_len=512)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = ours.tokenizer
    tok.padding_side = "left"
    chats = [[{"role": "user", "content": "What is the capital of France?"}], [{"role": "user", "content": "Hi"}]]
    prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        ref = hf.generate(**batch, max_new_tokens=8, do_sample=False)
    assert torch.equal(ours.generate(**batch, max_new_tokens=8, do_sample=False), ref)
    answer = pipeline("text-generation", model=ours, tokenizer=tok)(chats[0], max_new_tokens=12, do_sample=False)
    assert "Paris" in answer[0]["generated_text"][-1]["content"]

"""The memory planner and `exl info`: weight bytes equal what the loader really keeps, cache bytes follow the
cache layout's formula (and equal a real allocation), the GPU refusal carries numbers and ways out, and info's
per-layer bits equal what ExLlamaV2's converter logged for the same checkpoints."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors import safe_open

from exl_backends import ExlForCausalLM, formats
from exl_backends.commands import info
from exl_backends.errors import OutOfMemoryPlanError
from exl_backends.model import planner
from exl_backends.model.cache import KVCache
from exl_backends.model.config import ModelConfig
from exl_backends.model.linear import Linear
from exl_backends.model.model import Model

from conftest import FIXTURES, save_tiny, tiny_config
from quant_helpers import quantize_dir

MIB = 2**20
EXL2_FIXTURES = sorted((FIXTURES / "exl2").glob("*"))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Tiny checkpoints of every kind: fp16 (tied head), EXL2 (qkv biases, quantized odd-vocab head, an fp16
    layer left in place), GPTQ (act-order, with a zero bias written for a layer that has none)."""
    root = tmp_path_factory.mktemp("planner")
    out = {}
    out["fp16-tied"] = root / "fp16"
    save_tiny(out["fp16-tied"], tiny_config("llama", head_dim=32, tie_word_embeddings=True), dtype=torch.float16)
    src = root / "qwen2"
    save_tiny(src, tiny_config("qwen2", vocab_size=500, head_dim=32, pad_token_id=499, bos_token_id=497,
                               eos_token_id=498), dtype=torch.float16)
    out["exl2"] = root / "exl2"
    quantize_dir(src, out["exl2"], "exl2", quant_config={"quant_method": "exl2"}, head=True,
                 keep_dense=("layers.0.mlp.up_proj",))
    out["gptq"] = root / "gptq"
    quantize_dir(src, out["gptq"], "gptq", quant_config={"quant_method": "gptq", "bits": 4, "group_size": 32},
                 bits=4, group_size=32, act_order=True)
    return out


def loaded_bytes(m: Model) -> int:
    """Bytes of every tensor the loaded model holds (a tied head shares the embedding's)."""
    tensors = {id(m.embed): m.embed, id(m.norm): m.norm}
    layers = [m.lm_head]
    for b in m.blocks:
        tensors.update({id(b.input_norm): b.input_norm, id(b.post_attn_norm): b.post_attn_norm})
        a, f = b.attention, b.mlp
        layers += [a.q, a.k, a.v, a.o, f.gate, f.up, f.down]
    for layer in layers:
        held = [layer.weight] if isinstance(layer, Linear) else list(layer.weight.tensors().values())
        tensors.update({id(t): t for t in held + [layer.bias] if t is not None})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def all_dirs(dirs):
    gptq = [p for p in (FIXTURES / "gptq").glob("*") if p.is_dir()]
    return list(dirs.values()) + EXL2_FIXTURES + gptq


def test_weight_bytes_equal_the_loaded_tensors(dirs):
    for d in all_dirs(dirs):
        config = ModelConfig.from_dir(d)
        fp = planner.footprint(formats.open_checkpoint(d), config)
        real = loaded_bytes(Model.load(d, config, "cpu", torch.float16))
        assert fp.tensor_bytes == real, d.name
        n_quantized_rows = sum(k for key, k, _, _ in _all_linears(config, d)
                               if formats.linear_kind(formats.open_checkpoint(d).store, key) != "dense")
        assert fp.weights == real + planner.PREPARE_BYTES_PER_ROW * n_quantized_rows


def _all_linears(config, d):
    from exl_backends.model import model
    out = list(model.linears(config))
    if not model.head_is_tied(formats.open_checkpoint(d).store, config):
        out.append(("lm_head", config.hidden_size, config.vocab_size, False))
    return out


@pytest.mark.parametrize("mode,k_bytes,v_bytes", [("fp16", 2, 2), ("q8", 1 + 2 / 32, 1 + 2 / 32),
                                                  ("q6", 1 + 2 / 32, 0.5 + 2 / 32), ("q4", 0.5 + 2 / 32, 0.5 + 2 / 32)])
def test_cache_bytes_follow_the_formula_and_the_allocation(dirs, mode, k_bytes, v_bytes):
    """layers x kv heads x head dim x (K + V bytes per element, scales included) x tokens in whole pages."""
    d = dirs["fp16-tied"]
    config = ModelConfig.from_dir(d)
    p = planner.plan(formats.open_checkpoint(d), config, 1000, mode)
    tokens = 1024                                                    # 1000 rounded up to pages of 256
    formula = config.n_layers * config.n_kv_heads * config.head_dim * (k_bytes + v_bytes) * tokens
    assert p.cache == formula
    assert p.cache == KVCache(config, tokens // 256, 256, mode, "cpu", torch.float16).nbytes()


def test_scratch_grows_with_the_prefill_chunk_only(dirs):
    """Activations for a prefill chunk, logits for at most LOGIT_ROWS rows (an engine step samples from a row or
    a few per job, not from every prompt token), the largest linear dequantized, the prefill graphs' buffers."""
    d = dirs["exl2"]
    config = ModelConfig.from_dir(d)
    fp = planner.footprint(formats.open_checkpoint(d), config)
    c = config
    per_token = (2 * c.hidden_size + (2 * c.n_heads + 2 * c.n_kv_heads) * c.head_dim + 3 * c.intermediate_size) * 2
    per_row = c.vocab_size * (2 + 4)
    largest = max(k * ((n + 31) // 32 * 32) for _, k, n, _ in _all_linears(config, d)) * 2
    largest += 2048 * (2 * c.hidden_size + 2 * c.n_heads * c.head_dim) * 2       # the prefill graphs' buffers
    assert fp.plan(100).scratch == 100 * (per_token + per_row) + largest
    full_chunk = planner.PREFILL_CHUNK * per_token + planner.LOGIT_ROWS * per_row + largest
    assert fp.plan(10**6).scratch == fp.plan(planner.PREFILL_CHUNK).scratch == full_chunk


def test_largest_context_is_the_last_page_that_fits(dirs):
    d = dirs["gptq"]
    fp = planner.footprint(formats.open_checkpoint(d), ModelConfig.from_dir(d), "q4")
    budget = 300 * MIB + 12345
    n = fp.max_tokens(budget)
    assert n % 256 == 0 and n > 0
    assert fp.plan(n).total <= budget < fp.plan(n + 256).total
    assert fp.max_tokens(100 * MIB) == 0                              # below the reserve: nothing fits


def test_refusal_carries_the_numbers_and_ways_out(dirs):
    d = dirs["exl2"]
    ckpt, config = formats.open_checkpoint(d), ModelConfig.from_dir(d)
    p = planner.plan(ckpt, config, 500_000, "fp16")
    with pytest.raises(OutOfMemoryPlanError) as e:
        planner.fit_context(ckpt, config, 500_000, "fp16", 400 * MIB, "cuda:0")
    msg = str(e.value)
    assert f"needs {planner.gib(p.total)}" in msg and "0.39 GiB are free" in msg
    assert f"KV cache {planner.gib(p.cache)} for 500000 tokens" in msg and "weights" in msg and "scratch" in msg
    fits = planner.footprint(ckpt, config).max_tokens(400 * MIB)
    assert f"max_seq_len={fits}" in msg and "cache_mode='q4' (fits 500000 tokens)" in msg
    assert planner.fit_context(ckpt, config, None, "fp16", 400 * MIB, "cuda:0") == min(
        fits, config.max_position_embeddings)


def test_from_pretrained_on_cuda_refuses_before_allocating(dirs, monkeypatch):
    """The plan is checked against free memory first: nothing is loaded (here there is not even a GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(planner, "free_memory", lambda device: 300 * MIB)
    monkeypatch.setattr(Model, "load", classmethod(lambda *a, **k: pytest.fail("loaded before the check")))
    with pytest.raises(OutOfMemoryPlanError, match="does not fit on cuda.*max_seq_len="):
        ExlForCausalLM.from_pretrained(dirs["gptq"], device="cuda", max_seq_len=400_000)


# ----------------------------------------------------------------------------------------------- exl info


def test_describe(dirs):
    text = info.describe(dirs["exl2"], max_seq_len=4096, gpu_memory_gib=0.5)
    config = ModelConfig.from_dir(dirs["exl2"])
    p = planner.plan(formats.open_checkpoint(dirs["exl2"]), config, 4096)
    assert "format        EXL2" in text and "Qwen2ForCausalLM: 2 layers, hidden 64" in text
    n_params = sum(math.prod(shape) for shape in _source_shapes(dirs["exl2"].parent / "qwen2"))
    assert f"({n_params:,})" in text
    assert re.search(r"0-1\s+\d+\.\d\d\s+\d+\.\d\d", text) and "average" in text and "lm_head" in text
    assert f"total        {p.total / MIB:.2f} MiB" in text
    assert "largest context that fits" in text
    assert "GPTQ 4-bit, group size 32" in info.describe(dirs["gptq"], gpu_memory_gib=80)
    assert "tied to the embeddings" in info.describe(dirs["fp16-tied"])


def _source_shapes(d):
    with safe_open(d / "model.safetensors", "pt") as f:
        return [f.get_slice(n).get_shape() for n in f.keys()]


@pytest.mark.parametrize("variant", [d.name for d in EXL2_FIXTURES])
def test_bits_per_linear_equal_exllamav2s_convert_log(variant):
    """convert.log lists `-- Linear: <key> -> <mix>, 3.66 bpw` for every linear the converter wrote."""
    d = FIXTURES / "exl2" / variant
    config, ckpt = ModelConfig.from_dir(d), formats.open_checkpoint(d)
    shapes = {key: (k, n) for key, k, n, _ in _all_linears(config, d)}
    logged = re.findall(r"Linear: (\S+) -> .*, ([\d.]+) bpw", (d / "convert.log").read_text())
    assert len(logged) == len(shapes)
    for key, bpw in logged:
        assert abs(info.linear_bpw(ckpt, key, *shapes[key]) - float(bpw)) <= 0.005, key
    size = (d / "output.safetensors").stat().st_size
    assert re.search(rf"files +1 file, .* \({size:,} bytes\)", info.describe(d))


def test_plot(dirs, tmp_path):
    info.plot(dirs["exl2"], tmp_path / "bits.png")
    (dirs["exl2"] / info.QUALITY_FILE).write_text(json.dumps(
        {"layers": {"model.layers.0.self_attn": {"error": 0.07}, "model.layers.0.mlp": {"error": 0.1},
                    "model.layers.1.mlp": 0.03}}))
    assert info.layer_errors(dirs["exl2"], 2) == [0.1, 0.03]
    info.plot(dirs["exl2"], tmp_path / "bits_and_error.png")
    for name in ("bits.png", "bits_and_error.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (dirs["exl2"] / info.QUALITY_FILE).unlink()


def test_exl_info_command(dirs, tmp_path, capsys):
    from exl_backends import cli
    assert cli.main(["info", str(dirs["gptq"]), "--max-seq-len", "2048", "--cache-mode", "q8", "--gpu-memory", "0.3",
                     "--plot", str(tmp_path / "b.png")]) == 0
    out = capsys.readouterr().out
    assert "GPTQ 4-bit" in out and "2048-token context, q8 cache" in out and (tmp_path / "b.png").is_file()
    assert cli.main(["info", str(tmp_path / "missing")]) == 1


def test_exl_info_names_the_converter(tmp_path, capsys):
    """ExLlamaV2's version field is a bare number, ours names the tool."""
    import json
    import shutil
    from exl_backends import cli
    src = FIXTURES / "exl2" / "llama_tiny_exl2_4.0bpw_h6"
    assert cli.main(["info", str(src)]) == 0
    assert "converted by ExLlamaV2 0.3.2: target 4.0 bpw" in capsys.readouterr().out
    ours = tmp_path / "ours"
    shutil.copytree(src, ours)
    config = json.loads((ours / "config.json").read_text())
    config["quantization_config"]["version"] = "exl-backends 0.1.0"
    (ours / "config.json").write_text(json.dumps(config))
    assert cli.main(["info", str(ours)]) == 0
    assert "converted by exl-backends 0.1.0: target 4.0 bpw" in capsys.readouterr().out

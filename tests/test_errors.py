"""Bad input gets the project's own errors, naming what is wrong — never a traceback from deep inside torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from exl_backends import ExlForCausalLM
from exl_backends.errors import CheckpointError, ConfigError, ContextLengthError, UnsupportedArchitectureError

from conftest import REPO, save_tiny, tiny_config


@pytest.fixture
def model_dir(tmp_path):
    save_tiny(tmp_path, tiny_config("llama"))
    return tmp_path


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_config(model_dir):
    (model_dir / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json not found"):
        ExlForCausalLM.from_pretrained(model_dir, device="cpu")


def test_unknown_architecture_lists_supported(model_dir):
    edit_config(model_dir, architectures=["MambaForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match="MambaForCausalLM.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        ExlForCausalLM.from_pretrained(model_dir, device="cpu")


def test_missing_config_field(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        ExlForCausalLM.from_pretrained(model_dir, device="cpu")


def rewrite_weights(path, change):
    file = path / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)
    return file


def test_missing_tensor_names_tensor_and_file(model_dir):
    rewrite_weights(model_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj.*model\.safetensors"):
        ExlForCausalLM.from_pretrained(model_dir, device="cpu")


def test_wrong_shape_names_tensor(model_dir):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16]
    rewrite_weights(model_dir, shrink)
    with pytest.raises(CheckpointError, match=r"k_proj\.weight.*shape \[16, 64\].*\[32, 64\]"):
        ExlForCausalLM.from_pretrained(model_dir, device="cpu")


def test_wrong_dtype_names_tensor(model_dir):
    def to_int(t):
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.int32)
    rewrite_weights(model_dir, to_int)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*dtype"):
        ExlForCausalLM.from_pretrained(model_dir, device="cpu")


@pytest.mark.parametrize("keep", [4, 100, -1000])
def test_truncated_safetensors(model_dir, keep):
    file = model_dir / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:keep] if keep > 0 else data[:keep])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        ExlForCausalLM.from_pretrained(model_dir, device="cpu")


def test_prompt_longer_than_context(model_dir):
    model = ExlForCausalLM.from_pretrained(model_dir, device="cpu", max_seq_len=32)
    with pytest.raises(ContextLengthError, match="33 tokens.*32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_generator_prompt_longer_than_context(model_dir):
    from exl_backends import Generator
    model = ExlForCausalLM.from_pretrained(model_dir, device="cpu", max_seq_len=32)
    with pytest.raises(ContextLengthError):
        Generator(model).generate(list(range(40)), max_new_tokens=4)


def test_unknown_cache_mode(model_dir):
    with pytest.raises(ConfigError, match="q3"):
        ExlForCausalLM.from_pretrained(model_dir, device="cpu", cache_mode="q3")


# ---- the `exl` command: one line saying what to install or pass, no traceback ----------------------------------


def exl_subprocess(*args: str, setup: str = "") -> subprocess.CompletedProcess:
    code = f"import sys\n{setup}\nfrom exl_backends.cli import main\nsys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})


def assert_one_line_error(done: subprocess.CompletedProcess, *phrases: str):
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and all(p in lines[0] for p in phrases), done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a usable CUDA GPU")
def test_generate_on_cuda_without_a_gpu(model_dir):
    done = exl_subprocess("generate", "-m", str(model_dir), "-p", "Hi", "-n", "2", "--device", "cuda")
    assert_one_line_error(done, "exl generate: error: device cuda", "--device cpu")
    if torch.version.cuda is None:
        assert "CPU-only build" in done.stderr


def test_serve_without_the_server_extra(model_dir):
    """sys.modules[name] = None: what an import of a package that is not installed does."""
    done = exl_subprocess("serve", "-m", str(model_dir), setup="sys.modules['fastapi'] = None")
    assert_one_line_error(done, "exl serve: error:", "server extra", "'fastapi'", "pip install 'exl-backends[server]'")

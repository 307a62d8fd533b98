"""What makes the first run fast: the CPU path's stacked q/k/v and gate/up weights (logits as before), calibration
rows read from a .safetensors file (the quickstart's shipped rows), and `exl warmup` (parallel, interruptible)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from exl_backends import ExlForCausalLM
from exl_backends.adapters.hf import load_tokenizer
from exl_backends.commands import warmup
from exl_backends.commands.quickstart import CALIBRATION, CALIBRATION_ROWS
from exl_backends.convert import calibration
from exl_backends.errors import ExlError
from exl_backends.kernels import loader
from exl_backends.model.linear import FusedLinear, QuantLinear, cpu_quantized, keep_dense_weights

from conftest import save_tiny, tiny_config
from quant_helpers import hf_with_weights, quantize_dir, rel_err


@pytest.fixture(scope="module")
def exl2_qwen2(tmp_path_factory):
    """A tiny EXL2 model with q/k/v biases (qwen2), up_proj left dense (so gate/up cannot stack), a quantized head;
    and transformers on the same dequantized weights."""
    tmp = tmp_path_factory.mktemp("exl2")
    save_tiny(tmp / "hf", tiny_config("qwen2"), dtype=torch.float16)
    expected = quantize_dir(tmp / "hf", tmp / "q", "exl2", quant_config={"quant_method": "exl2", "bits": 4.0},
                            keep_dense=("layers.1.mlp.up_proj",), head=True)
    return tmp / "q", hf_with_weights(tmp / "hf", expected)


def test_a_tokenizer_loads_as_autotokenizer_and_then_without_it(tmp_path, monkeypatch):
    """qwen2_tiny's tokenizer_config names the generic class, but AutoTokenizer picks Qwen2Tokenizer from the model
    type (which splits digits differently): the remembered class is AutoTokenizer's, and a changed file or another
    transformers version asks AutoTokenizer again."""
    from transformers import AutoTokenizer

    from exl_backends.model import loading
    from conftest import FIXTURES
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = tmp_path / "qwen2"
    shutil.copytree(FIXTURES / "hf" / "qwen2_tiny", model, ignore=shutil.ignore_patterns("*.safetensors"))
    text = "Tabs\tand 123456 digits, ünïcödé 漢字 don't"
    expected = AutoTokenizer.from_pretrained(str(model))
    asked = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: asked.append(a) or real(*a, **k))
    first, again = load_tokenizer(model), load_tokenizer(model)
    assert len(asked) == 1                              # the second load took the remembered class
    for tok in (first, again):
        assert type(tok) is type(expected) and tok(text).input_ids == expected(text).input_ids
    assert json.loads((tmp_path / "cache" / "exl-backends" / "tokenizer-classes.json").read_text()).popitem()[1] \
        == type(expected).__name__
    (model / "tokenizer_config.json").write_text((model / "tokenizer_config.json").read_text() + "\n")
    load_tokenizer(model)
    assert len(asked) == 2                              # a changed file: AutoTokenizer again
    monkeypatch.setattr(loading, "_tokenizer_key", lambda path: "another transformers|" + str(path))
    load_tokenizer(model)
    assert len(asked) == 3


# transformers' generation utilities import accelerate, the hub's kernels and (where installed) scikit-learn and
# torchvision, with it torch._dynamo: 4.5 s of the 8B shape's warm first token on the H100 at 01c8965
HEAVY_MODULES = ("transformers.models.auto.modeling_auto", "torch.distributed.tensor", "torch.nn.attention.bias",
                 "torch._dynamo", "transformers.generation.utils", "transformers.generation.stopping_criteria",
                 "accelerate")


def test_a_load_and_its_first_tokens_import_none_of_transformers_model_chain(tmp_path):
    """What a warm first load must not import (BENCHMARKS.md, first run on a GPU machine: seconds each there):
    from_pretrained, then a Generator's decode and transformers-style generate(), in a fresh process whose cache
    remembers the tokenizer's class; transformers' config objects still come when read."""
    from conftest import FIXTURES
    probe = ("import sys, torch\n"
             "from exl_backends import ExlForCausalLM, Generator\n"
             f"m = ExlForCausalLM.from_pretrained({str(FIXTURES / 'exl2' / 'llama_tiny_exl2_4.0bpw_h6')!r}, "
             "device='cpu')\n"
             "Generator(m).submit([1, 2, 3, 4], max_new_tokens=2).result()\n"
             "m.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=2, do_sample=False)\n"
             f"print([name for name in {HEAVY_MODULES!r} if name in sys.modules])\n"
             "print(type(m.config).__name__, type(m.generation_config).__name__)\n")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    for _ in range(2):                  # the first run remembers the tokenizer's class
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    imported, config = out.stdout.strip().splitlines()[-2:]
    assert imported == "[]"
    assert config == "LlamaConfig GenerationConfig"


def test_a_generation_config_without_its_file_is_the_one_transformers_derives(tmp_path):
    """Made from config.json's dict (no model-config class imported); transformers derives it from its config
    object. They may differ only where one says None and the other False."""
    from conftest import FIXTURES
    from transformers import AutoConfig, GenerationConfig
    from exl_backends import ExlForCausalLM
    for name in ("llama_tiny_exl2_4.0bpw_h6", "qwen2_tiny_exl2_4.0bpw_h6"):
        model = tmp_path / name
        shutil.copytree(FIXTURES / "exl2" / name, model)
        (model / "generation_config.json").unlink(missing_ok=True)
        ours = ExlForCausalLM.from_pretrained(model, device="cpu").generation_config.to_dict()
        theirs = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model)).to_dict()
        assert ours["eos_token_id"] is not None
        assert [k for k in ours | theirs if ours.get(k) != theirs.get(k) and (ours.get(k) or theirs.get(k))] == []


def test_a_tokenizer_loads_where_its_class_cannot_be_remembered(tmp_path, monkeypatch):
    from conftest import TOKENIZER_DIR
    cache = tmp_path / "cache"
    cache.write_text("a file where the cache folder should be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    assert load_tokenizer(TOKENIZER_DIR)("hello world").input_ids


def test_stacked_cpu_linears_keep_the_logits_of_transformers(exl2_qwen2):
    path, hf = exl2_qwen2
    ours = ExlForCausalLM.from_pretrained(path, device="cpu")
    blocks = ours.model.blocks
    assert blocks[0].attention.qkv.stacks and blocks[0].mlp.gate_up.stacks
    assert not blocks[1].mlp.gate_up.stacks                  # a dense up_proj: each layer on its own
    ids = torch.randint(0, 509, (1, 23), generator=torch.Generator().manual_seed(0))
    first = ours(ids).logits                                 # stacks the weights
    again = ours(ids).logits                                 # reuses them
    with torch.no_grad():
        ref = hf(ids).logits
    assert torch.equal(first, again)
    assert rel_err(first, ref) < 1e-5


def test_stacked_outputs_equal_each_layer_alone(exl2_qwen2):
    path, _ = exl2_qwen2
    qkv = ExlForCausalLM.from_pretrained(path, device="cpu").model.blocks[0].attention.qkv
    x = torch.randn(5, qkv.layers[0].in_features, generator=torch.Generator().manual_seed(1))
    alone = [layer(x) for layer in qkv.layers]
    assert any(layer.bias is not None for layer in qkv.layers)
    for stacked, ref in zip(qkv(x), alone):
        assert stacked.shape == ref.shape
        torch.testing.assert_close(stacked, ref, rtol=1e-6, atol=1e-6)
    assert isinstance(qkv, FusedLinear) and qkv._stacked[0].dtype == torch.float32


def kept(unit) -> bool:
    return (unit._dense if isinstance(unit, QuantLinear) else unit._stacked) is not None


def test_dequantized_once_at_load_or_per_call_when_memory_is_short(exl2_qwen2, monkeypatch):
    path, _ = exl2_qwen2
    roomy = ExlForCausalLM.from_pretrained(path, device="cpu")
    units = cpu_quantized(roomy.model.linears())
    assert len(units) == 2 * 4 + 1     # per layer q/k/v, o, gate/up (layer 1: gate alone), down; lm_head
    assert all(kept(u) for u in units)                      # dequantized at load
    monkeypatch.setattr("exl_backends.model.model.available_memory", lambda: 1000)
    short = ExlForCausalLM.from_pretrained(path, device="cpu")
    ids = torch.randint(0, 509, (1, 17), generator=torch.Generator().manual_seed(4))
    assert torch.equal(short(ids).logits, roomy(ids).logits)
    assert not any(kept(u) for u in cpu_quantized(short.model.linears()))   # none kept, even after a forward
    assert keep_dense_weights(units, torch.float32, available=None)


# ----------------------------------------------------------------------------------------------- calibration rows


@pytest.fixture
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama[0])


def rows_file(path, quant, held_out):
    save_file({"quant": quant, "eval": held_out}, path)
    return str(path)


def test_rows_file_gives_its_rows(tmp_path, tokenizer):
    quant = torch.randint(0, 500, (6, 40), generator=torch.Generator().manual_seed(2))
    held_out = torch.randint(0, 500, (3, 40), generator=torch.Generator().manual_seed(3))
    source = rows_file(tmp_path / "rows.safetensors", quant.to(torch.uint16), held_out)
    cal = calibration.from_source(source, tokenizer, rows=4, measure_rows=2, length=32, eval_rows=8, seed=0)
    assert torch.equal(cal.quant, quant[:4, :32]) and cal.quant.dtype == torch.int64
    assert torch.equal(cal.measure, quant[:2, :32])
    assert torch.equal(cal.eval, held_out[:, :32])
    assert cal.dataset == "rows.safetensors"


@pytest.mark.parametrize("quant, held_out, match", [
    (torch.zeros(2, 40, dtype=torch.int64), torch.zeros(1, 40, dtype=torch.int64), "needs 4 rows of 32"),
    (torch.zeros(6, 16, dtype=torch.int64), torch.zeros(1, 40, dtype=torch.int64), "needs 4 rows of 32"),
    (torch.full((6, 40), 9000), torch.zeros(1, 40, dtype=torch.int64), "another tokenizer"),
    (torch.zeros(6, 40, dtype=torch.int64), torch.zeros(40, dtype=torch.int64), "2-d token tensors"),
])
def test_rows_file_refused_with_the_reason(tmp_path, tokenizer, quant, held_out, match):
    source = rows_file(tmp_path / "rows.safetensors", quant, held_out)
    with pytest.raises(ExlError, match=match):
        calibration.from_source(source, tokenizer, rows=4, measure_rows=1, length=32, eval_rows=2, seed=0)


def test_rows_file_missing_or_not_safetensors(tmp_path, tokenizer):
    with pytest.raises(ExlError, match="not found"):
        calibration.from_source(str(tmp_path / "none.safetensors"), tokenizer, 4, 1, 32, 2, 0)
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ExlError, match="cannot read calibration rows"):
        calibration.from_source(str(tmp_path / "bad.safetensors"), tokenizer, 4, 1, 32, 2, 0)


SMOLLM2_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "head_dim": 64,
                  "intermediate_size": 1536, "num_attention_heads": 9, "num_hidden_layers": 30,
                  "num_key_value_heads": 3, "vocab_size": 49152, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                  "max_position_embeddings": 8192, "rope_theta": 100000.0}


def test_quickstart_measurement_fits_its_model(tmp_path, monkeypatch):
    """The shipped measurement, as the quickstart unpacks it, passes the converter's own check against SmolLM2's
    shapes (every sub-layer, every candidate's bit count), so `--measurement` takes it."""
    from exl_backends.commands import quickstart
    from exl_backends.convert.measure import check_measurement
    from exl_backends.model.config import ModelConfig
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = quickstart.default_measurement()
    assert path.parent == tmp_path / "exl-backends" and not list(path.parent.glob("*.partial"))
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    layers = check_measurement(json.loads(path.read_text()), ModelConfig.from_dir(tmp_path), str(path))
    assert len(layers) == 62                                # 30 x (attention, MLP), final norm, head


def test_the_quickstart_prompt_runs_on_every_core_and_its_steps_on_one():
    """On the CPU the quickstart's prompt runs on torch's threads and the one-row steps after the first token on one
    (_chat's decode_threads); run() restores the threads after."""
    from exl_backends.commands import quickstart
    from conftest import FIXTURES
    model = ExlForCausalLM.from_pretrained(FIXTURES / "exl2" / "llama_tiny_exl2_4.0bpw_h6", device="cpu")
    model.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    forward, threads_seen = model.model.forward, []

    def counting(*args, **kwargs):
        threads_seen.append(torch.get_num_threads())
        return forward(*args, **kwargs)
    model.model.forward = counting
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        quickstart._chat(model, "hello world", 4, quickstart.Clock(), decode_threads=1)
    finally:
        torch.set_num_threads(threads)
    assert threads_seen[0] == 2 and len(threads_seen) >= 3 and set(threads_seen[1:]) == {1}


def test_quickstart_rows_cover_its_calibration():
    saved = load_file(CALIBRATION_ROWS)
    assert saved["quant"].shape == (CALIBRATION["rows"], CALIBRATION["length"])
    assert saved["eval"].shape[1] == CALIBRATION["length"] and saved["eval"].shape[0] >= 1
    assert max(int(saved[k].long().max()) for k in ("quant", "eval")) < 49152      # SmolLM2's vocabulary


# ----------------------------------------------------------------------------------------------- warm-up


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(warmup.loader, "compute_capability", lambda device=None: (8, 0))


def test_warmup_compiles_each_family_once_in_parallel(fake_gpu):
    running, peak, lock, calls = [0], [0], threading.Lock(), []

    def compile_family(family, cc):
        with lock:
            calls.append((family, cc))
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
    seconds = warmup.warmup(compile_family=compile_family)
    assert sorted(calls) == sorted((f, (8, 0)) for f in warmup.families_for(None))
    assert list(seconds) == list(warmup.families_for(None))
    assert peak[0] == len(calls)                            # all at once


def test_warmup_raises_a_family_error(fake_gpu):
    def compile_family(family, cc):
        if family == "rope":
            raise RuntimeError("rope.cu: error")
    with pytest.raises(RuntimeError, match="rope.cu"):
        warmup.warmup(compile_family=compile_family)


def test_warmup_families_follow_the_format(exl2_qwen2, tiny_llama):
    assert "matmul_rows" in warmup.families_for(exl2_qwen2[0])
    assert "matmul_rows" not in warmup.families_for(tiny_llama[0])
    assert set(warmup.families_for(tiny_llama[0])) < set(warmup.families_for(None))


def test_warmup_families_are_the_kernel_sources():
    """Each family warm-up compiles is a kernels/<family>.cu (a renamed family must not be compiled in vain)."""
    assert all((loader.KERNEL_DIR / f"{family}.cu").is_file() for family in warmup.families_for(None))


def test_warmup_without_a_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    out = subprocess.run([sys.executable, "-m", "exl_backends.cli", "warmup"], capture_output=True, text=True)
    assert out.returncode == 1
    assert "no CUDA GPU" in out.stderr and "Traceback" not in out.stderr


# The cache warmup writes through is CuPy's: an entry appears only by a rename of a finished temporary file, and an
# entry whose SHA-1 does not match is ignored (recompiled). An interrupted warm-up relies on exactly that.
CACHE_WRITER = """
import sys, time
from cupy.cuda._compiler_cache import DiskKernelCacheBackend
backend = DiskKernelCacheBackend(sys.argv[1])
print("writing", flush=True)
backend.save("entry.cubin", b"x" * 400_000_000, "source")
"""


def test_kernel_cache_entry_is_whole_or_absent(tmp_path):
    cache = pytest.importorskip("cupy.cuda._compiler_cache", reason="CuPy not installed")
    proc = subprocess.Popen([sys.executable, "-c", CACHE_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    time.sleep(0.3)                                          # inside the 400 MB write
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    backend = cache.DiskKernelCacheBackend(str(tmp_path))
    entry = tmp_path / "entry.cubin"
    assert not entry.exists() or backend.load("entry.cubin") == b"x" * 400_000_000
    backend.save("entry.cubin", b"cubin", "source")         # the rerun
    assert backend.load("entry.cubin") == b"cubin"
    entry.write_bytes(entry.read_bytes()[:-2])              # a damaged entry is not used
    assert backend.load("entry.cubin") is None

"""The converter end to end on tiny random models (CPU): targets hit, results load and track the fp16 model,
resume gives the same files, measurements are reusable, the layout matches ExLlamaV2's, bad input is refused."""
from __future__ import annotations

import errno
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from exl_backends import ExlForCausalLM, formats
from exl_backends.commands.evaluate import kl_divergence
from exl_backends.convert import calibration, job as job_module, pipeline
from exl_backends.convert.pipeline import ConvertOptions, convert, written_bpw
from exl_backends.errors import ExlError, UnsupportedArchitectureError
from exl_backends.formats import exl2_writer
from exl_backends.formats.tensors import TensorStore
from exl_backends.model.config import ModelConfig

from conftest import FIXTURES, TOKENIZER_DIR, tiny_config

WORDS = ("the of and a to in is was for on that with as by at from his an were are which this be or has had "
         "first new one their after its who two also time moon clock students teacher night sky number "
         "computers process simple instructions river city war season album song game film king church").split()
ROWS, LENGTH = 4, 64


def calibration_text(path: Path, n_words: int = 6000, seed: int = 0) -> Path:
    rng = random.Random(seed)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 18))).capitalize() + "."
                 for _ in range(n_words // 12)]
    path.write_text("\n".join(" ".join(sentences[i: i + 5]) for i in range(0, len(sentences), 5)))
    return path


def options(src: Path, out: Path, bits: float, cal: Path | None, **kw) -> ConvertOptions:
    return ConvertOptions(src, out, bits, calibration=str(cal) if cal else None, rows=kw.pop("rows", ROWS),
                          length=kw.pop("length", LENGTH), device="cpu", **kw)


def save_model(directory: Path, seed: int = 3) -> Path:
    """A 2-layer fp16 Llama (hidden 128, head_dim 32) with weights drawn like the fixtures' (linears N(0, 0.05²),
    embeddings and head N(0, 0.2²), norms 1 + 0.05 N(0, 1)), so its next-token distributions are peaked and
    quantization error shows in them."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", hidden_size=128, intermediate_size=256))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.05 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2 if "embed" in name or "lm_head" in name else 0.05)
    model.half().save_pretrained(directory)
    shutil.copy(TOKENIZER_DIR / "tokenizer.json", directory)
    shutil.copy(TOKENIZER_DIR / "tokenizer_config.json", directory)
    return directory


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The tiny model and a calibration text file."""
    base = tmp_path_factory.mktemp("convert")
    return save_model(base / "fp16"), calibration_text(base / "cal.txt")


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    """bpw -> output dir: 4.0 measured from scratch, 3.0 and 6.0 reusing its measurement."""
    src, cal = source
    base = tmp_path_factory.mktemp("out")
    out = {4.0: convert(options(src, base / "q4.0", 4.0, cal))}
    for bits in (3.0, 6.0):
        out[bits] = convert(options(src, base / f"q{bits}", bits, cal, measurement=out[4.0] / "measurement.json"))
    return out


def held_out(out: Path) -> torch.Tensor:
    return job_module.Job(Path(f"{out}.job"), {}).load_tensors("calibration.safetensors")["eval"]


def test_targets_are_hit_and_the_models_track_fp16(source, converted):
    src, _ = source
    ref = ExlForCausalLM.from_pretrained(src, device="cpu")
    config = ModelConfig.from_dir(src)
    kls = {}
    for bits, out in converted.items():
        quality = json.loads((out / "quality.json").read_text())
        assert abs(quality["bpw"] - bits) <= 0.02
        assert quality["bpw"] == pytest.approx(written_bpw(TensorStore(out), config))
        model = ExlForCausalLM.from_pretrained(out, device="cpu")
        assert formats.open_checkpoint(out).format == "exl2"
        tokens = held_out(out).flatten()
        kls[bits] = kl_divergence(model, ref, tokens, ctx=LENGTH).mean_kl
        # the receipt's layer-by-layer evaluation agrees with the engine on the same rows
        assert quality["kl_divergence"] == pytest.approx(kls[bits], rel=1e-3)
    assert kls[3.0] > kls[4.0] > kls[6.0] > 0
    assert kls[6.0] < 0.02 and kls[4.0] < 0.15


def test_quality_receipt_describes_the_conversion(converted):
    quality = json.loads((converted[4.0] / "quality.json").read_text())
    assert quality["calibration"]["rows"] == ROWS and quality["calibration"]["length"] == LENGTH
    assert quality["calibration"]["dataset"] == "cal.txt" and quality["calibration"]["seed"] == 0
    assert quality["perplexity"] > 1 and quality["perplexity_fp16"] > 1 and 0 < quality["top1_agreement"] <= 1
    assert set(quality["layers"]) == {f"model.layers.{i}.{s}" for i in range(2) for s in ("self_attn", "mlp")}
    layer = quality["layers"]["model.layers.0.mlp"]
    assert set(layer["settings"]) == {"gate_proj", "up_proj", "down_proj"} and 0 < layer["error"] < 1
    assert quality["head"]["settings"] == "0.15:8b_128g/0.85:6b_128g s4" and quality["head"]["error"] < 0.05


def test_measurement_is_reused_for_another_target(converted):
    job = json.loads(Path(f"{converted[3.0]}.job/job.json").read_text())
    assert "measure_layer" not in job and "measure" not in job["seconds"]
    assert (converted[3.0] / "measurement.json").read_text() == (converted[4.0] / "measurement.json").read_text()
    m = json.loads((converted[4.0] / "measurement.json").read_text())
    assert m["last_module_idx"] == 6 and len(m["measurement"]["model.layers.1.self_attn"]) == 19
    assert len(m["measurement"]["model.layers.1.mlp"]) == 17


def _files(directory: Path) -> dict[str, bytes]:
    out = {}
    for f in sorted(directory.iterdir()):
        data = f.read_bytes()
        if f.name == "quality.json":
            q = json.loads(data)
            q.pop("conversion_seconds")
            data = json.dumps(q).encode()
        out[f.name] = data
    return out


class Interrupt(Exception):
    pass


def _interrupt_once(monkeypatch, module, name, when):
    """Replaces module.name by a wrapper that raises Interrupt the first time when(*args) holds."""
    original, fired = getattr(module, name), []

    def wrapper(*args, **kwargs):
        if not fired and when(*args):
            fired.append(True)
            raise Interrupt
        return original(*args, **kwargs)
    monkeypatch.setattr(module, name, wrapper)


@pytest.mark.parametrize("where", ["measure", "quantize", "compile", "receipt"])
def test_resume_after_an_interruption_gives_the_same_files(source, converted, tmp_path, monkeypatch, where):
    src, cal = source
    opts = options(src, tmp_path / "q4.0", 4.0, cal)
    if where == "measure":
        _interrupt_once(monkeypatch, pipeline, "measure_layer", lambda states, lw, ctx, i: i == 1)
    elif where == "quantize":
        _interrupt_once(monkeypatch, pipeline, "quantize_layer", lambda states, lw, ctx, i, *rest: i == 1)
    elif where == "compile":
        _interrupt_once(monkeypatch, exl2_writer, "save_file",
                        lambda tensors, file, *rest: file.endswith("output.safetensors.tmp"))
    else:
        _interrupt_once(monkeypatch, pipeline.receipt, "evaluate", lambda *args: True)
    with pytest.raises(Interrupt):
        convert(opts)
    assert not opts.output_dir.exists()                          # nothing that looks finished
    assert convert(opts) == opts.output_dir
    assert _files(opts.output_dir) == _files(converted[4.0])
    assert convert(opts) == opts.output_dir                      # a finished job: nothing to do


@pytest.mark.parametrize("model", ["llama_tiny", "qwen2_tiny"])
def test_output_has_exactly_the_layout_exllamav2_wrote(tmp_path, model):
    """The fixtures' models converted with ExLlamaV2's own measurement.json: same tensor names (Qwen2's padded
    q/k/v biases included), dtypes, shape rules and config block as ExLlamaV2's conversion of the same model,
    and the same files."""
    theirs_dir = FIXTURES / "exl2" / f"{model}_exl2_4.0bpw_h6"
    cal = calibration_text(tmp_path / "cal.txt")
    out = convert(options(FIXTURES / "hf" / model, tmp_path / "q", 4.0, cal, rows=2, length=32,
                          measurement=theirs_dir / "measurement.json"))
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [p.name for p in theirs_dir.iterdir() if p.name != "convert.log"] + ["quality.json"])
    ours, theirs = (safe_open(str(d / "output.safetensors"), "pt") for d in (out, theirs_dir))
    assert sorted(ours.keys()) == sorted(theirs.keys())
    for name in theirs.keys():
        a, b = ours.get_slice(name), theirs.get_slice(name)
        assert a.get_dtype() == b.get_dtype(), name
        if not name.endswith((".q_weight", ".q_scale", ".q_scale_max", ".q_groups")):
            assert a.get_shape() == b.get_shape(), name                  # group counts follow the bit mix
        else:
            assert a.get_shape()[1:] == b.get_shape()[1:], name
    cfg, ref = (json.loads((d / "config.json").read_text()) for d in (out, theirs_dir))
    assert cfg["quantization_config"].keys() == ref["quantization_config"].keys()
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == \
        {k: v for k, v in ref.items() if k != "quantization_config"}
    quality = json.loads((out / "quality.json").read_text())
    assert abs(quality["bpw"] - 4.0) <= 0.02
    assert quality["bpw"] == pytest.approx(written_bpw(TensorStore(out), ModelConfig.from_dir(out)))


def test_default_calibration_samples_the_model_deterministically(source, tmp_path):
    src, _ = source
    config = ModelConfig.from_dir(src)
    from exl_backends.adapters.hf import load_tokenizer
    tok = load_tokenizer(src)
    a = calibration.sampled(src, config, tok, 2, 1, 24, 1, 7, torch.device("cpu"))
    b = calibration.sampled(src, config, tok, 2, 1, 24, 1, 7, torch.device("cpu"))
    assert torch.equal(a.quant, b.quant) and torch.equal(a.eval, b.eval) and a.eval.shape == (1, 24)
    assert len(set(a.quant.flatten().tolist())) > 10
    out = convert(options(src, tmp_path / "q", 4.0, None, rows=2, length=32))
    quality = json.loads((out / "quality.json").read_text())
    assert quality["calibration"]["dataset"] == "(default)" and abs(quality["bpw"] - 4.0) <= 0.02


@pytest.mark.parametrize("bits,group_size,act_order", [(4, 64, True), (8, 128, False)])
def test_gptq_format(source, tmp_path, bits, group_size, act_order):
    src, cal = source
    out = convert(options(src, tmp_path / "g", bits, cal, format="gptq", group_size=group_size,
                          act_order=act_order))
    ckpt = formats.open_checkpoint(out)
    assert ckpt.format == "gptq" and (out / "model.safetensors").is_file()
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == json.loads((out / "quantize_config.json").read_text())
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["desc_act"], qc["sym"]) == \
        ("gptq", bits, group_size, act_order, True)
    store = ckpt.store
    key = "model.layers.0.mlp.down_proj"                                 # K = 256, N = 128
    assert store.info(f"{key}.qweight").shape == (256 * bits // 32, 128)
    assert store.info(f"{key}.qzeros").shape == (256 // group_size, 128 * bits // 32)
    assert store.info(f"{key}.scales").dtype == torch.float16 and store.info(f"{key}.g_idx").dtype == torch.int32
    g_idx = store.get(f"{key}.g_idx")
    assert bool((g_idx[1:] < g_idx[:-1]).any()) == act_order
    assert "lm_head.weight" in store
    quality = json.loads((out / "quality.json").read_text())
    assert quality["kl_divergence"] < (0.1 if bits == 4 else 0.005)


def test_rtn_baseline_is_worse_than_gptq(source, tmp_path):
    src, cal = source
    kl = {}
    for rtn in (False, True):
        out = convert(options(src, tmp_path / f"g{rtn}", 4, cal, format="gptq", group_size=128, act_order=False,
                              rtn=rtn))
        kl[rtn] = json.loads((out / "quality.json").read_text())["kl_divergence"]
    assert kl[True] > kl[False]


# ----------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("arch,match", [("GPT2LMHeadModel", "not supported")])
def test_unsupported_architecture(source, tmp_path, arch, match):
    src, cal = source
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = [arch]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match=match):
        convert(options(bad, tmp_path / "q", 4.0, cal))
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.job").exists()


@pytest.mark.parametrize("bits", [1.9, 8.5])
def test_target_out_of_range(source, tmp_path, bits):
    src, cal = source
    with pytest.raises(ExlError, match="out of range"):
        convert(options(src, tmp_path / "q", bits, cal))
    assert not (tmp_path / "q").exists()


def test_target_out_of_reach_for_this_model(source, converted, tmp_path):
    src, cal = source
    with pytest.raises(ExlError, match="out of reach"):
        convert(options(src, tmp_path / "q", 2.2, cal, measurement=converted[4.0] / "measurement.json"))
    assert not (tmp_path / "q").exists()


def test_empty_or_too_short_calibration_file(source, tmp_path):
    src, _ = source
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ExlError, match="holds no text"):
        convert(options(src, tmp_path / "q1", 4.0, empty))
    short = calibration_text(tmp_path / "short.txt", n_words=60)
    with pytest.raises(ExlError, match="too short"):
        convert(options(src, tmp_path / "q2", 4.0, short))
    assert not (tmp_path / "q1").exists() and not (tmp_path / "q2").exists()


def test_jsonl_calibration(source, tmp_path):
    src, cal = source
    tok = __import__("exl_backends.adapters.hf", fromlist=["load_tokenizer"]).load_tokenizer(src)
    lines = cal.read_text().splitlines()
    jsonl = tmp_path / "cal.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": line, "id": i}) for i, line in enumerate(lines)))
    c = calibration.from_source(str(jsonl), tok, 4, 1, 64, 2, 0)
    assert c.quant.shape == (4, 64) and c.eval.shape == (2, 64) and c.dataset == "cal.jsonl"
    rows = {tuple(r) for r in c.quant.tolist()}
    assert not rows & {tuple(r) for r in c.eval.tolist()}                # held out means disjoint


def test_output_dir_not_writable_or_not_empty(source, tmp_path):
    src, cal = source
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ExlError, match="cannot"):
        convert(options(src, blocker / "q", 4.0, cal))
    full = tmp_path / "full"
    full.mkdir()
    (full / "something").write_text("x")
    with pytest.raises(ExlError, match="not empty"):
        convert(options(src, full, 4.0, cal))


def test_disk_full_is_a_clear_error_and_leaves_nothing_finished(source, converted, tmp_path, monkeypatch):
    src, cal = source
    opts = options(src, tmp_path / "q", 6.0, cal, measurement=converted[4.0] / "measurement.json")

    def full(tensors, filename, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(exl2_writer, "save_file", full)
    with pytest.raises(ExlError, match="disk full"):
        convert(opts)
    assert not opts.output_dir.exists()


def test_a_job_dir_with_other_options_is_refused(source, converted, tmp_path):
    src, cal = source
    job_dir = Path(f"{converted[4.0]}.job")
    with pytest.raises(ExlError, match="other options"):
        convert(options(src, tmp_path / "q", 5.0, cal, job_dir=job_dir))


def test_already_quantized_input_is_refused(converted, tmp_path):
    with pytest.raises(ExlError, match="already quantized"):
        convert(options(converted[4.0], tmp_path / "q", 4.0, None))


def test_cli_convert(source, converted, tmp_path, capsys):
    from exl_backends.cli import main
    src, cal = source
    args = ["convert", "-i", str(src), "-o", str(tmp_path / "q"), "-b", "5.0", "-c", str(cal), "--rows", str(ROWS),
            "--length", str(LENGTH), "--device", "cpu", "--measurement", str(converted[4.0] / "measurement.json")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {tmp_path / 'q'}: ") and abs(float(out.split(": ")[1].split()[0]) - 5.0) <= 0.02
    assert main(args[:6] + ["9"] + args[7:]) == 1
    assert "out of range" in capsys.readouterr().err


def test_optimizer_finds_the_best_combination_in_the_window():
    """Against brute force on small random instances: the chosen combination lies within [target - 0.02,
    target] bpw and, for the chosen eta, no combination in the window has a smaller sum of err^eta."""
    import itertools
    from exl_backends.convert.optimize import Option, optimize
    rng = random.Random(5)
    n_weights = 10_000
    for _ in range(20):
        slots = [[Option(rng.randint(20_000, 80_000), rng.uniform(0.001, 0.2)) for _ in range(5)] for _ in range(3)]
        target = rng.uniform(7.0, 20.0)
        combos = [c for c in itertools.product(range(5), repeat=3)
                  if target - 0.02 <= sum(slots[i][j].bits for i, j in enumerate(c)) / n_weights <= target]
        if not combos:
            with pytest.raises(ExlError):
                optimize(slots, n_weights, target)
            continue
        sol = optimize(slots, n_weights, target)
        assert target - 0.02 <= sol.bpw <= target + 1e-9
        best = min(sum(slots[i][j].err ** sol.eta for i, j in enumerate(c)) for c in combos)
        assert sum(slots[i][j].err ** sol.eta for i, j in enumerate(sol.choice)) == pytest.approx(best)
        assert optimize(slots, n_weights, target) == sol


def test_parquet_calibration(source, tmp_path):
    """Every string column of each row joined with spaces (ExLlamaV2's rule); without pyarrow, a clear error."""
    from exl_backends.adapters.hf import load_tokenizer
    src, cal = source
    tok = load_tokenizer(src)
    file = tmp_path / "cal.parquet"
    lines = cal.read_text().splitlines()
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        file.write_bytes(b"PAR1")
        with pytest.raises(ExlError, match="pip install pyarrow"):
            calibration.from_source(str(file), tok, 4, 1, 64, 2, 0)
        return
    pq.write_table(pyarrow.table({"title": [f"T{i}" for i in range(len(lines))], "text": lines,
                                  "n": list(range(len(lines)))}), file)
    c = calibration.from_source(str(file), tok, 4, 1, 64, 2, 0)
    assert c.quant.shape == (4, 64) and c.dataset == "cal.parquet"
    assert calibration.read_text(file).startswith(f"T0 {lines[0]}\n\nT1 ")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_converts_on_cuda(source, converted, tmp_path):
    """The same conversion on the GPU: on target, close to the fp16 model, loadable; and the GPTQ format too."""
    src, cal = source
    out = convert(ConvertOptions(src, tmp_path / "q", 4.0, calibration=str(cal), rows=ROWS, length=LENGTH,
                                 device="cuda"))
    quality = json.loads((out / "quality.json").read_text())
    cpu = json.loads((converted[4.0] / "quality.json").read_text())
    assert abs(quality["bpw"] - 4.0) <= 0.02
    assert quality["kl_divergence"] < 2 * cpu["kl_divergence"]
    gptq = convert(ConvertOptions(src, tmp_path / "g", 4, calibration=str(cal), rows=ROWS, length=LENGTH,
                                  device="cuda", format="gptq"))
    assert json.loads((gptq / "quality.json").read_text())["kl_divergence"] < 0.1
    model = ExlForCausalLM.from_pretrained(out, device="cuda")
    assert torch.isfinite(model(held_out(out)[:1, :16].cuda()).logits).all()


def test_mistral_sliding_window_matches_the_engine(source, converted, tmp_path):
    """A window shorter than the calibration rows: the converter's layer-by-layer forward must window its
    attention as the engine does, or the receipt would disagree with the engine on the same rows."""
    src, cal = source
    mistral = tmp_path / "mistral"
    shutil.copytree(src, mistral)
    cfg = json.loads((mistral / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=16)
    (mistral / "config.json").write_text(json.dumps(cfg))
    out = convert(options(mistral, tmp_path / "q", 4.0, cal, measurement=converted[4.0] / "measurement.json"))
    quality = json.loads((out / "quality.json").read_text())
    engine = kl_divergence(ExlForCausalLM.from_pretrained(out, device="cpu"),
                           ExlForCausalLM.from_pretrained(mistral, device="cpu"), held_out(out).flatten(), ctx=LENGTH)
    assert quality["kl_divergence"] == pytest.approx(engine.mean_kl, rel=1e-3)
    assert quality["perplexity_fp16"] != pytest.approx(
        json.loads((converted[4.0] / "quality.json").read_text())["perplexity_fp16"], rel=1e-3)

"""`exl convert`: the conversion as resumable stages (job.py): calibrate -> measure -> optimize -> quantize ->
compile -> receipt. Run the same command again after an interruption and it continues; the output directory
appears (by one rename) only when everything, quality.json included, is written."""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import torch
from tqdm import tqdm

from .. import formats
from ..errors import DeviceError, ExlError, UnsupportedArchitectureError
from ..model.config import ModelConfig
from ..formats.exl2_writer import (copy_file, copy_support_files, exl2_config, with_top_level_rope, write_json,
                                   write_shards)
from ..formats.tensors import TensorStore
from ..model.loading import load_tokenizer
from ..model.model import attention_linears, mlp_linears, norm_names, validate
from . import calibration, forward, receipt
from .forward import Context, quantized_linears
from .gptq_writer import GptqQuantizer
from .job import Job, Stage, StatesWriter, job_stage, load_states, states_file
from .measure import check_measurement, measure_layer, measurement_file
from .optimize import Option, optimize
from .qparams import HEAD_OPTIONS, QParams
from .quantize import Exl2Quantizer, quantize_head, quantize_layer

log = logging.getLogger(__name__)

BPW_RANGE = (2.0, 8.0)
MEASURE_FRACTION = 0.16          # measurement rows per quantization row given by --rows (ExLlamaV2: 16 of 100)
# (rows, length, measurement rows, held-out rows) by device. On CPU small enough that SmolLM2-135M converts in
# minutes on two cores; on CUDA ExLlamaV2's defaults. Sampled calibration decodes token by token, so it is
# shorter on CUDA.
DEFAULTS = {("cpu", "file"): (32, 512, 4, 8), ("cpu", "sampled"): (32, 512, 4, 8),
            ("cuda", "file"): (100, 2048, 16, 16), ("cuda", "sampled"): (64, 1024, 10, 8)}
QUANT_DIR = "quant"


@dataclass(frozen=True)
class ConvertOptions:
    input_dir: Path
    output_dir: Path
    bits: float                         # EXL2: target bpw of the decoder layers; GPTQ: code width (4 or 8)
    head_bits: int = 6                  # EXL2 lm_head option (HEAD_OPTIONS)
    calibration: str | None = None      # file or dataset name; None: sampled from the model
    rows: int | None = None             # quantization rows (None: DEFAULTS)
    length: int | None = None           # tokens per row (None: DEFAULTS)
    device: str | None = None           # None: cuda if available, else cpu
    job_dir: Path | None = None         # None: <output_dir>.job
    measurement: Path | None = None     # reuse a measurement.json (EXL2)
    seed: int = 0
    format: str = "exl2"                # or "gptq"
    group_size: int = 128               # GPTQ
    act_order: bool = True              # GPTQ
    rtn: bool = False                   # GPTQ: round-to-nearest baseline (no Hessian), for comparisons


@dataclass
class Run:
    """What every stage reads: options resolved, the source model, the device."""
    options: ConvertOptions
    config: ModelConfig
    ckpt: formats.Checkpoint
    device: torch.device
    rows: int
    length: int
    measure_rows: int
    eval_rows: int
    job: Job

    @property
    def store(self) -> TensorStore:
        return self.ckpt.store

    @property
    def output_dir(self) -> Path:
        return Path(self.options.output_dir)

    @property
    def partial_dir(self) -> Path:
        return self.output_dir.with_name(self.output_dir.name + ".partial")

    def quantizer(self):
        o = self.options
        if o.format == "gptq":
            return GptqQuantizer(int(o.bits), o.group_size, o.act_order, rtn=o.rtn)
        return Exl2Quantizer()


def convert(options: ConvertOptions) -> Path:
    """Converts (or resumes converting) options.input_dir into options.output_dir; returns the output dir."""
    run = _start(options)
    stages = {Stage.CALIBRATE: _calibrate, Stage.MEASURE: _measure, Stage.OPTIMIZE: _optimize,
              Stage.QUANTIZE: _quantize, Stage.COMPILE: _compile, Stage.RECEIPT: _receipt}
    while run.job.stage != Stage.DONE:
        stages[run.job.stage](run)
    return run.output_dir


def _start(o: ConvertOptions) -> Run:
    _check_options(o)
    device = _device(o.device)
    config = ModelConfig.from_dir(o.input_dir)
    ckpt = formats.open_checkpoint(o.input_dir)
    _check_source(ckpt, config, o)
    rows, length, measure_rows, eval_rows = DEFAULTS[(device.type, "file" if o.calibration else "sampled")]
    if o.rows:
        rows, measure_rows = o.rows, max(1, math.ceil(o.rows * MEASURE_FRACTION))
    length = o.length or length
    if rows < 1 or length < 16:
        raise ExlError(f"need --rows >= 1 and --length >= 16 (got {rows}, {length})")
    identity = _identity(o) | {"rows": rows, "length": length, "measure_rows": measure_rows, "eval_rows": eval_rows}
    return Run(o, config, ckpt, device, rows, length, measure_rows, eval_rows, _open_job(o, identity))


def _identity(o: ConvertOptions) -> dict:
    """What makes a job this job: the options, paths absolute; not the device or where the job lives."""
    identity = {k: v for k, v in asdict(o).items() if k not in ("device", "job_dir")}
    for k in ("input_dir", "output_dir", "measurement", "calibration"):
        if identity[k] and (k != "calibration" or Path(identity[k]).exists()):
            identity[k] = str(Path(identity[k]).resolve())
    return identity


def _open_job(o: ConvertOptions, identity: dict) -> Job:
    """The job to run (new or resumed), after checking the output directory can be written and is free."""
    output = Path(o.output_dir)
    job_dir = Path(o.job_dir) if o.job_dir else output.with_name(output.name + ".job")
    _check_writable(output)
    finished = (output / "quality.json").is_file() and job_stage(job_dir) in (Stage.RECEIPT, Stage.DONE)
    if output.exists() and any(output.iterdir()) and not finished:
        raise ExlError(f"output directory {output} exists and is not empty; choose another -o or delete it")
    job = Job.open(job_dir, identity)
    if job.stage == Stage.DONE and not finished:
        raise ExlError(f"the job in {job_dir} finished, but {output} is missing or incomplete; delete {job_dir} "
                       f"to convert again")
    if job.stage == Stage.DONE:
        log.info("%s is already converted (job %s)", output, job_dir)
    return job


def _check_options(o: ConvertOptions) -> None:
    if o.format not in ("exl2", "gptq"):
        raise ExlError(f"--format must be exl2 or gptq, not {o.format!r}")
    if o.format == "exl2":
        if not BPW_RANGE[0] <= o.bits <= BPW_RANGE[1]:
            raise ExlError(f"target bpw {o.bits} is out of range: EXL2 targets lie in {BPW_RANGE[0]} to {BPW_RANGE[1]}")
        if o.head_bits not in HEAD_OPTIONS:
            raise ExlError(f"--head-bits must be one of {sorted(HEAD_OPTIONS)}, not {o.head_bits}")
    else:
        GptqQuantizer(int(o.bits), o.group_size, o.act_order)            # validates bits and group size
        if o.bits != int(o.bits):
            raise ExlError(f"GPTQ bits must be a whole number (4 or 8), not {o.bits}")
        if o.measurement:
            raise ExlError("--measurement applies to EXL2 conversions only")
    if not Path(o.input_dir).is_dir():
        raise ExlError(f"input directory {o.input_dir} not found")


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError("--device cuda was asked for, but torch sees no CUDA GPU; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"--device must be cpu or cuda, not {name!r}")
    return device


def _check_source(ckpt: formats.Checkpoint, config: ModelConfig, o: ConvertOptions) -> None:
    names = config.traits.names
    if o.format == "gptq" and (names.qkv or names.gate_up):
        raise UnsupportedArchitectureError(
            f"{o.input_dir}: {config.architecture} keeps q/k/v and gate/up fused (qkv_proj, gate_up_proj); a GPTQ "
            f"checkpoint would quantize them fused, which the runtime does not load. Convert to EXL2 instead "
            f"(--format exl2 stores the projections split)")
    if ckpt.format in ("exl2", "gptq"):
        raise ExlError(f"{o.input_dir} is already quantized ({ckpt.format}); convert from the fp16/bf16 checkpoint")
    validate(ckpt, config)
    for key, k, _, _ in quantized_linears(config):
        if k % 32:
            raise ExlError(f"{key} has {k} input features; EXL2 and GPTQ pack input rows in runs of 32, so this "
                           f"model cannot be converted")


def _check_writable(output: Path) -> None:
    parent = output.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        probe = parent / f".{output.name}.write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ExlError(f"cannot write the output next to {output} ({e.strerror or e}); choose a writable "
                       f"output directory") from None


# ----------------------------------------------------------------------------------------------- stages


def _calibrate(run: Run) -> None:
    o, job = run.options, run.job
    tokenizer = load_tokenizer(Path(o.input_dir))
    measure_rows = run.measure_rows
    if o.calibration:
        cal = calibration.from_source(o.calibration, tokenizer, run.rows, measure_rows, run.length,
                                      run.eval_rows, o.seed)
    else:
        cal = calibration.sampled(Path(o.input_dir), run.config, tokenizer, run.rows, measure_rows, run.length,
                                  run.eval_rows, o.seed, run.device)
    job.save_tensors("calibration.safetensors", cal.tensors())
    info = {"dataset": cal.dataset, "source": cal.description, "rows": run.rows, "measurement_rows": measure_rows,
            "length": run.length, "eval_rows": int(cal.eval.shape[0]), "seed": o.seed}
    nxt = Stage.QUANTIZE if o.format == "gptq" else Stage.OPTIMIZE if o.measurement else Stage.MEASURE
    job.advance(nxt, calibration=info)


def _measure(run: Run) -> None:
    job, config, n = run.job, run.config, run.config.n_layers
    start = job.state.get("measure_layer", 0)
    layers = json.loads(job.path("measurement.json").read_text())["measurement"] if start else {}
    tokens = job.load_tensors("calibration.safetensors")["measure"]
    states = forward.embed(run.store, config, tokens) if start == 0 else load_states(job, "measure", start)
    states = states.to(forward.states_device(states, run.device))
    ctx = Context.build(config, tokens.shape[1], run.device)
    with StatesWriter(job, "measure", Stage.MEASURE, "measure_layer") as writer:
        for i in tqdm(range(start, n), initial=start, total=n, desc="measuring", unit="layer"):
            entries, states = measure_layer(states, forward.load_layer(run.ckpt, config, i, run.device), ctx, i)
            layers.update(entries)
            write_json(measurement_file(config, layers, i + 1), job.path("measurement.json"))
            writer.put(i + 1, states)
        writer.flush()
    job.advance(Stage.OPTIMIZE)
    job.remove(states_file("measure", n))


def _optimize(run: Run) -> None:
    o, job, config = run.options, run.job, run.config
    source = Path(o.measurement) if o.measurement else job.path("measurement.json")
    try:
        data = json.loads(source.read_text())
    except (OSError, ValueError) as e:
        raise ExlError(f"cannot read measurement file {source}: {e}") from None
    layers = check_measurement(data, config, str(source))
    if o.measurement:
        write_json(data, job.path("measurement.json"))
    keys = [sub.key for i in range(config.n_layers) for sub in forward.sublayers(config, i)]
    slots = [[Option(int(e["total_bits"]), 1.0 - float(e["accuracy"])) for e in layers[key]] for key in keys]
    n_weights = sum(k * n for _, k, n, _ in quantized_linears(config))
    solution = optimize(slots, n_weights, o.bits)
    strategy = {key: layers[key][c] for key, c in zip(keys, solution.choice)}
    log.info("optimizer: %.4f bpw, max expected error %.5f (eta %.2f)", solution.bpw, solution.max_err,
             solution.eta)
    job.advance(Stage.QUANTIZE, strategy=strategy, planned_bpw=solution.bpw)


def _quantize(run: Run) -> None:
    o, job, config, n = run.options, run.job, run.config, run.config.n_layers
    quantizer = run.quantizer()
    strategy = job.state.get("strategy")
    start = job.state.get("quant_layer", 0)
    tokens = job.load_tensors("calibration.safetensors")["quant"]
    states = forward.embed(run.store, config, tokens) if start == 0 else load_states(job, "quant", start)
    states = states.to(forward.states_device(states, run.device))
    ctx = Context.build(config, tokens.shape[1], run.device)
    errors = job.state.setdefault("errors", {})
    job.path(QUANT_DIR).mkdir(exist_ok=True)
    with StatesWriter(job, "quant", Stage.QUANTIZE, "quant_layer") as writer:
        for i in tqdm(range(start, n), initial=start, total=n, desc="quantizing", unit="layer"):
            result, states = quantize_layer(states, forward.load_layer(run.ckpt, config, i, run.device), ctx, i,
                                            quantizer, strategy)
            job.save_tensors(f"{QUANT_DIR}/layer-{i:04d}.safetensors", result.tensors)
            errors.update(result.errors)
            writer.put(i + 1, states)
        writer.flush()
    if o.format == "exl2":
        head = config.traits.names.lm_head
        tensors, errors[head] = quantize_head(states, forward.load_head(run.ckpt, config, run.device), ctx, head,
                                              HEAD_OPTIONS[o.head_bits], quantizer)
        job.save_tensors(f"{QUANT_DIR}/head.safetensors", tensors)
    job.advance(Stage.COMPILE)
    job.remove(states_file("quant", n))


def _compile(run: Run) -> None:
    o, job, config = run.options, run.job, run.config
    partial = run.partial_dir
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    quant = TensorStore(job.path(QUANT_DIR))
    entries = _file_entries(run, quant)
    with tqdm(total=len(entries), desc="writing shards", unit="tensor") as bar:
        files = write_shards(partial, entries, prefix="output" if o.format == "exl2" else "model",
                             progress=bar.update)
    cal = job.state["calibration"]
    if o.format == "exl2":
        cfg = exl2_config(config.raw, o.bits, o.head_bits, cal["rows"], cal["length"], cal["dataset"],
                          f"exl-backends {_version()}")
        copy_file(job.path("measurement.json"), partial / "measurement.json")
    else:
        cfg = with_top_level_rope(config.raw)
        cfg["quantization_config"] = run.quantizer().config()
        write_json(cfg["quantization_config"], partial / "quantize_config.json")
        if len(files) > 1:
            write_json(_index(entries, partial), partial / "model.safetensors.index.json")
    write_json(cfg, partial / "config.json")
    copy_support_files(Path(o.input_dir), partial)
    job.advance(Stage.RECEIPT, bpw=written_bpw(TensorStore(partial), config), files=files)


def _file_entries(run: Run, quant: TensorStore) -> list:
    """(name, nbytes, load) for every output tensor, layer by layer: fp16 embedding, norms (as in the source) and
    MoE routers from the source, packed linears from the job's quant files (Phi-3's split), lm_head quantized
    (EXL2) or as in the source (GPTQ)."""
    config, store, names = run.config, run.store, run.config.traits.names
    quantized = {key for key, *_ in quantized_linears(config)}

    def source(name):
        return (name, math.prod(store.info(name).shape) * 2, lambda: store.get(name).half())

    def packed(prefix):
        return [(n, math.prod(quant.info(n).shape) * quant.info(n).dtype.itemsize, lambda n=n: quant.get(n))
                for n in quant.names() if n.startswith(prefix + ".")]

    entries = [source(f"{names.embed}.weight")]
    for i in range(config.n_layers):
        entries += [source(name) for name, _ in norm_names(config, i)]
        for key, *_ in attention_linears(config, i) + mlp_linears(config, i):
            entries += packed(key) if key in quantized else [source(f"{key}.weight")]
    entries.append(source(f"{names.final_norm}.weight"))
    if run.options.format == "exl2":
        entries += packed(names.lm_head)
    elif f"{names.lm_head}.weight" in store:
        entries.append(source(f"{names.lm_head}.weight"))
    return entries


def _index(entries: list, directory: Path) -> dict:
    """model.safetensors.index.json of a sharded GPTQ checkpoint (the HF layout)."""
    infos = TensorStore(directory).infos
    return {"metadata": {"total_size": sum(nbytes for _, nbytes, _ in entries)},
            "weight_map": {name: infos[name].file.name for name in sorted(infos)}}


def written_bpw(store: TensorStore, config: ModelConfig) -> float:
    """Bits per weight of the decoder linears as written, counted as exl2-format.md §10.6 counts them: every
    tensor of a quantized linear (a bias as 16 bits per output), over the sum of K*N. lm_head not counted."""
    by_key: dict[str, int] = {}
    for name, info in store.infos.items():
        key, suffix = name.rsplit(".", 1)
        if suffix != "bias":
            by_key[key] = by_key.get(key, 0) + math.prod(info.shape) * info.dtype.itemsize * 8
    bits, weights = 0, 0
    for key, k, n, bias in quantized_linears(config):
        bits += by_key[key] + (16 * n if bias else 0)
        weights += k * n
    return bits / weights


def _receipt(run: Run) -> None:
    job, config = run.job, run.config
    partial, output = run.partial_dir, run.output_dir
    if not partial.is_dir() and (output / "quality.json").is_file():
        job.advance(Stage.DONE)                       # killed after the final rename
        return
    tokens = job.load_tensors("calibration.safetensors")["eval"]
    scores = receipt.evaluate(run.ckpt, formats.open_checkpoint(partial), config, tokens, run.device)
    job.save()
    quality = _quality(run, scores)
    write_json(quality, partial / "quality.json")
    if output.exists():
        output.rmdir()                                # empty (checked at start); rename needs it gone or empty
    os.replace(partial, output)
    job.advance(Stage.DONE)
    job.remove(QUANT_DIR)
    log.info("wrote %s: %.3f bpw, perplexity %.3f (fp16 %.3f), KL %.5f, top-1 %.3f", output, quality["bpw"],
             scores.perplexity, scores.ref_perplexity, scores.mean_kl, scores.top1_agreement)


def _quality(run: Run, scores) -> dict:
    o, job, config = run.options, run.job, run.config
    state = job.state
    errors = state.get("errors", {})
    layers = {}
    for i in range(config.n_layers):
        for sub in forward.sublayers(config, i):
            entry = {"error": errors.get(sub.key)}
            if o.format == "exl2":
                chosen = state["strategy"][sub.key]
                settings = {role.name: QParams.from_dict(chosen[role.name]).desc() for role in sub.roles}
                entry.update(settings=settings, bpw=chosen["total_bits"] / sub.n_weights,
                             expected_error=1.0 - chosen["accuracy"])
            layers[sub.key] = entry
    quality = {
        "format": o.format,
        "bits": o.bits,
        "bpw": state["bpw"],
        "calibration": state["calibration"],
        "evaluation": {"text": "held-out rows of the calibration source", "rows": state["calibration"]["eval_rows"],
                       "ctx": run.length, "tokens": scores.tokens},
        "perplexity": scores.perplexity,
        "perplexity_fp16": scores.ref_perplexity,
        "kl_divergence": scores.mean_kl,
        "top1_agreement": scores.top1_agreement,
        "layers": layers,
        "conversion_seconds": round(job.total_seconds(), 1),
        "converter": f"exl-backends {_version()}",
    }
    if o.format == "exl2":
        head = config.traits.names.lm_head
        quality.update(head_bits=o.head_bits, planned_bpw=state["planned_bpw"],
                       head={"settings": HEAD_OPTIONS[o.head_bits].desc(), "error": errors.get(head)})
    else:
        quality.update(group_size=o.group_size, act_order=o.act_order and not o.rtn, rtn=o.rtn)
    return quality


def _version() -> str:
    try:
        return metadata.version("exl-backends")
    except metadata.PackageNotFoundError:
        return "0.1.0"

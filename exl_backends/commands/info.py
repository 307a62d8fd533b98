"""`exl info`: what a model directory holds (format, architecture, size, bits per layer) and its memory plan.
Reads headers and JSON only; no tensor data.

The plot can add the converter's per-layer error from QUALITY_FILE in the model directory: a JSON object whose
"layers" entry (or the object itself) maps module names containing `layers.<i>` to a number or to an object
with an "error" number; a layer's error is the largest among its modules."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import formats
from ..errors import ConfigError
from ..model import model, planner
from ..model.config import ModelConfig

QUALITY_FILE = "quality.json"


@dataclass(frozen=True)
class BitsReport:
    layers: list[float]         # bits per weight of each decoder layer's linears together
    average: float              # over all decoder-layer linears
    head: float | None          # lm_head; None when tied to the embeddings


def linear_bpw(ckpt: formats.Checkpoint, key: str, k: int, n: int) -> float:
    """Stored bits per weight of one linear's matrix, as ExLlamaV2's converter reports them: every tensor of the
    packed matrix (codes, scales, groups, permutation; not the bias) over in x out weights."""
    return _linear_bits(ckpt, key) / (k * n)


def _linear_bits(ckpt: formats.Checkpoint, key: str) -> int:
    store = ckpt.store
    names = {"exl2": ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm"),
             "gptq": ("qweight", "qzeros", "scales", "g_idx"),
             "dense": ("weight",)}[formats.linear_kind(store, key)]
    infos = [store.info(f"{key}.{name}") for name in names if f"{key}.{name}" in store]
    return sum(math.prod(i.shape) * i.dtype.itemsize * 8 for i in infos)


def bits_report(ckpt: formats.Checkpoint, config: ModelConfig) -> BitsReport:
    linears = model.linears(config, ckpt.store)
    per_layer = []                                          # (bits, weights) of each decoder layer
    for i in range(config.n_layers):
        prefix = config.traits.names.layer.format(i=i) + "."
        mine = [(key, k, n) for key, k, n, _ in linears if key.startswith(prefix)]
        per_layer.append((sum(_linear_bits(ckpt, key) for key, _, _ in mine), sum(k * n for _, k, n in mine)))
    head = None
    if not model.head_is_tied(ckpt.store, config):
        head = linear_bpw(ckpt, config.traits.names.lm_head, config.hidden_size, config.vocab_size)
    average = sum(b for b, _ in per_layer) / sum(w for _, w in per_layer)
    return BitsReport([b / w for b, w in per_layer], average, head)


def parameter_count(config: ModelConfig, ckpt: formats.Checkpoint) -> int:
    d = config.hidden_size
    n = config.vocab_size * d + (2 * config.n_layers + 1) * d
    n += sum(k * m + (m if f"{key}.bias" in ckpt.store else 0) for key, k, m, _ in model.linears(config, ckpt.store))
    if not model.head_is_tied(ckpt.store, config):
        n += config.vocab_size * d
    return n


def describe(path: str | Path, max_seq_len: int | None = None, cache_mode: str = "fp16",
             gpu_memory_gib: float | None = None) -> str:
    """The text `exl info` prints. The plan is for the GPU (fp16 compute); GPU memory is `gpu_memory_gib`, else
    the free memory of the current CUDA device, else unknown."""
    path = Path(path)
    config = ModelConfig.from_dir(path)
    ckpt = formats.open_checkpoint(path)
    files = sorted({info.file for info in ckpt.store.infos.values()})
    size = sum(f.stat().st_size for f in files)
    bits = bits_report(ckpt, config)
    lines = [f"model         {path}",
             f"format        {_format_line(ckpt, config)}",
             f"architecture  {config.architecture}: {config.n_layers} layers, hidden {config.hidden_size}, "
             f"{config.n_heads} heads / {config.n_kv_heads} kv heads x {config.head_dim}, intermediate "
             f"{config.intermediate_size}, vocab {config.vocab_size}, context {config.max_position_embeddings}",
             f"parameters    {_count(parameter_count(config, ckpt))}",
             f"files         {len(files)} file{'s' if len(files) > 1 else ''}, {_bytes(size)} ({size:,} bytes)",
             "",
             "bits per weight by decoder layer (all linears of the layer, scales and permutations included)"]
    for start in range(0, len(bits.layers), 8):
        row = "  ".join(f"{b:5.2f}" for b in bits.layers[start:start + 8])
        lines.append(f"  {start:>4}-{min(start + 8, len(bits.layers)) - 1:<4} {row}")
    head = "tied to the embeddings" if bits.head is None else f"{bits.head:.2f}"
    lines += [f"  average {bits.average:.2f}   lm_head {head}", ""]
    lines += _plan_lines(ckpt, config, max_seq_len or config.max_position_embeddings, cache_mode, gpu_memory_gib)
    return "\n".join(lines)


def _format_line(ckpt: formats.Checkpoint, config: ModelConfig) -> str:
    q = config.raw.get("quantization_config") or {}
    if ckpt.format == "exl2":
        if q.get("quant_method") != "exl2":
            return "EXL2 (no quantization_config: detected from the tensor names)"
        cal = q.get("calibration") or {}
        version = str(q.get("version", "?"))
        tool = version if version[:1].isalpha() else f"ExLlamaV2 {version}"   # ours writes "exl-backends X.Y.Z"
        return (f"EXL2, converted by {tool}: target {q.get('bits', '?')} bpw, head "
                f"{q.get('head_bits', '?')} bits, calibration {cal.get('rows', '?')} rows x "
                f"{cal.get('length', '?')} tokens of {cal.get('dataset', '?')}")
    if ckpt.format == "gptq":
        s = ckpt.gptq_settings
        cfg, _ = formats.gptq.quant_config(ckpt.directory)
        cfg = cfg or {}
        sym = {True: "sym", False: "asym"}.get(cfg.get("sym"), "sym unknown")
        group = "?" if s.group_size is None else ("none (per channel)" if s.group_size == -1 else s.group_size)
        return (f"GPTQ {s.bits or '?'}-bit, group size {group}, {sym}, desc_act {bool(cfg.get('desc_act'))}, "
                f"{'v2' if s.v2 else 'v1'} zero points ({s.source})")
    return f"{ckpt.format} (not quantized)"


def _plan_lines(ckpt: formats.Checkpoint, config: ModelConfig, tokens: int, cache_mode: str,
                gpu_memory_gib: float | None) -> list[str]:
    fp = planner.footprint(ckpt, config, cache_mode)
    p = fp.plan(tokens)
    lines = [f"memory plan (GPU, fp16 compute, {tokens}-token context, {cache_mode} cache)",
             f"  weights      {_bytes(p.weights)}",
             f"  KV cache     {_bytes(p.cache)}  ({fp.bytes_per_token} bytes/token, whole pages of "
             f"{planner.PAGE_SIZE})",
             f"  scratch      {_bytes(p.scratch)}",
             f"  reserve      {_bytes(p.reserve)}",
             f"  total        {_bytes(p.total)}"]
    budget, where = _gpu_budget(gpu_memory_gib)
    if budget is None:
        return lines + ["  GPU memory   not detected (no CUDA device); pass --gpu-memory GiB"]
    fits = fp.max_tokens(budget)
    verdict = "fits" if p.total <= budget else "does NOT fit"
    lines += [f"  GPU memory   {_bytes(budget)} {where}: this plan {verdict}",
              f"  largest context that fits: {fits} tokens (the model's own limit is "
              f"{config.max_position_embeddings})"]
    if p.total > budget:
        lines.append(f"  try: {'; '.join(planner.suggestions(ckpt, config, fp, tokens, budget))}")
    return lines


def _gpu_budget(gpu_memory_gib: float | None) -> tuple[int | None, str]:
    if gpu_memory_gib is not None:
        return int(gpu_memory_gib * planner.GIB), "(given)"
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        return planner.free_memory(device), f"free on {device} ({torch.cuda.get_device_name(device)})"
    return None, ""


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n:,})"
    return str(n)


def layer_errors(path: Path, n_layers: int) -> list[float | None] | None:
    """Per-layer error from the converter's QUALITY_FILE, or None when the directory has none."""
    file = path / QUALITY_FILE
    if not file.is_file():
        return None
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e}); fix or delete it") from None
    entries = raw.get("layers", raw) if isinstance(raw, dict) else {}
    errors: list[float | None] = [None] * n_layers
    for name, value in entries.items():
        m = re.search(r"layers\.(\d+)", name)
        err = value.get("error") if isinstance(value, dict) else value
        if m and int(m.group(1)) < n_layers and isinstance(err, (int, float)):
            i = int(m.group(1))
            errors[i] = max(err, errors[i] or 0.0)
    return errors


def plot(path: str | Path, file: str | Path) -> Path:
    """Draws bits per decoder layer (and the converter's per-layer error, when QUALITY_FILE exists) to file."""
    from matplotlib.figure import Figure     # the `dev` extra; only this command needs it
    from matplotlib.ticker import MaxNLocator

    path, file = Path(path), Path(file)
    config = ModelConfig.from_dir(path)
    bits = bits_report(formats.open_checkpoint(path), config)
    errors = layer_errors(path, config.n_layers)
    fig = Figure(figsize=(max(6.0, 0.18 * config.n_layers + 3), 6 if errors else 3.5))
    axes = fig.subplots(2 if errors else 1, 1, sharex=True, squeeze=False)[:, 0]
    x = list(range(config.n_layers))
    axes[0].bar(x, bits.layers, color="tab:blue")
    axes[0].axhline(bits.average, color="tab:red", linestyle="--", label=f"average {bits.average:.2f}")
    axes[0].set_ylabel("bits per weight")
    head = "tied" if bits.head is None else f"{bits.head:.2f} bpw"
    axes[0].set_title(f"{path.name}\nbits per decoder layer (lm_head {head})", fontsize=10)
    axes[0].legend()
    if errors:
        axes[1].bar(x, [e or 0.0 for e in errors], color="tab:orange")
        axes[1].set_ylabel(f"error ({QUALITY_FILE})")
    axes[-1].set_xlabel("layer")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(file)
    return file

"""EXL2 writer: packs one quantized linear into the q_* tensors and writes a model directory that ExLlamaV2
loads. Layout: shared/design/exl2-format.md §1-§8 (checklist §8)."""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from torch import Tensor

from ..errors import ExlError
from ..model import reference
from .exl2 import EXL2_BITS, Exl2Weight, padded

MAX_SHARD_BYTES = 8192 * 1024 * 1024      # ExLlamaV2's default -ss 8192 (MiB)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json", ".bin.index.json")
NOT_COPIED = {"config.json", "measurement.json", "quality.json", "quantize_config.json", "quant_config.json"}


def pack_linear(codes: Tensor, groups: list[tuple[int, int]], scale_codes: Tensor, scale_max: Tensor,
                perm: Tensor, out_features: int) -> Exl2Weight:
    """Packs one linear (§3-§6).

    codes        [K, N] unsigned codes in stored-row order (row k' is original input row perm[k'])
    groups       (bits, rows) per group in stored order, widths non-increasing, rows multiples of 32
    scale_codes  [G, N] scale codes qs in 1..16 (the nibble stored is qs - 1)
    scale_max    [G] fp16 per-group maximum scale
    perm         [K] act-order permutation
    Columns are padded to a multiple of 32 with zero weights (code = zero point, qs = 1). Packs where codes are
    (a GPU conversion packs on the GPU: an 8B layer's codes are ~0.5 GB as int64)."""
    k, n = codes.shape
    np_ = padded(n)
    _check_groups(groups, k)
    if scale_codes.shape != (len(groups), n) or scale_max.shape != (len(groups),):
        raise ValueError(f"scale_codes {list(scale_codes.shape)} / scale_max {list(scale_max.shape)} do not match "
                         f"{len(groups)} groups of {n} columns")
    if int(scale_codes.min()) < 1 or int(scale_codes.max()) > 16:
        raise ValueError("scale codes must lie in 1..16")
    dev = codes.device
    codes = codes.to(torch.int64)
    words, q_groups, row, qrow = [], [], 0, 0
    for bits, rows in groups:
        block = torch.full((rows, np_), 2 ** (bits - 1), dtype=torch.int64, device=dev)     # padding columns: 0
        block[:, :n] = codes[row: row + rows]
        if int(block.min()) < 0 or int(block.max()) >= 2 ** bits:
            raise ValueError(f"codes of rows {row}..{row + rows - 1} do not fit {bits} bits")
        words.append(reference.pack_bits(block, bits))                           # [rows*bits/32, Np]
        q_groups += [bits, qrow]
        row, qrow = row + rows, qrow + rows * bits // 32
    nibbles = torch.zeros(len(groups), np_, dtype=torch.int64, device=dev)
    nibbles[:, :n] = scale_codes.to(dev, torch.int64) - 1
    perm = perm.to(dev, torch.int64)
    return Exl2Weight(
        q_weight=torch.cat(words),
        q_scale=reference.pack_bits(nibbles.T.contiguous(), 4).T.contiguous(),  # [G, Np/8], 8 columns a word
        q_scale_max=scale_max.to(dev, torch.float16),
        q_groups=torch.tensor(q_groups, dtype=torch.int16, device=dev),
        q_invperm=torch.argsort(perm).to(torch.int32),
        in_features=k, out_features=n)


def _check_groups(groups: list[tuple[int, int]], k: int) -> None:
    if sum(rows for _, rows in groups) != k:
        raise ValueError(f"groups cover {sum(r for _, r in groups)} rows, the layer has {k}")
    widths = [b for b, _ in groups]
    if any(b not in EXL2_BITS for b in widths) or any(a < b for a, b in zip(widths, widths[1:])):
        raise ValueError(f"group widths {widths} must come from {EXL2_BITS} in non-increasing order")
    if any(rows <= 0 or rows % 32 for _, rows in groups):
        raise ValueError("every group must hold a positive multiple of 32 rows")


def linear_tensors(key: str, weight: Exl2Weight, bias: Tensor | None = None) -> dict[str, Tensor]:
    """The file tensors of one linear under its HF module key (§2); bias fp16, padded to Np."""
    out = {f"{key}.{name}": t.contiguous() for name, t in weight.tensors().items()}
    if bias is not None:
        b = torch.zeros(padded(weight.out_features), dtype=torch.float16)
        b[:weight.out_features] = bias.to(torch.float16).cpu()
        out[f"{key}.bias"] = b
    return out


def matrix_bits(tensors: dict[str, Tensor]) -> int:
    """Bits one packed linear takes in the file, counted as §10.6 counts them (bias excluded)."""
    return sum(t.numel() * t.element_size() * 8 for name, t in tensors.items()
               if name.rsplit(".", 1)[-1] in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm"))


# ----------------------------------------------------------------------------------------------- files


def save_tensors(tensors: dict[str, Tensor], file: Path) -> None:
    """safetensors file written whole or not at all: to a temporary name, then renamed over `file`."""
    tmp = file.with_name(file.name + ".tmp")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        os.chmod(tmp, 0o644)                      # safetensors creates files readable by the owner only
        os.replace(tmp, file)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _write_error(file, e) from None


def write_json(data: dict, file: Path) -> None:
    """JSON file written whole or not at all (temporary name, then rename)."""
    tmp = file.with_name(file.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, file)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _write_error(file, e) from None


def _write_error(file: Path, e: OSError) -> ExlError:
    if e.errno == errno.ENOSPC:
        return ExlError(f"disk full while writing {file}: free some space, then run the same command again "
                        f"(the job resumes where it stopped)")
    return ExlError(f"cannot write {file}: {e.strerror or e}")


def write_shards(out_dir: Path, entries: list[tuple[str, int, Callable[[], Tensor]]], prefix: str = "output",
                 max_bytes: int = MAX_SHARD_BYTES, progress: Callable[[int], None] | None = None) -> list[str]:
    """Writes (name, nbytes, load) entries in order into shards of at most max_bytes (a larger tensor gets a
    shard of its own), loading one shard's tensors at a time. Returns the file names."""
    shards: list[list[tuple[str, Callable[[], Tensor]]]] = [[]]
    size = 0
    for name, nbytes, load in entries:
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, load))
        size += nbytes
    names = shard_names(len(shards), prefix)
    for shard, file in zip(shards, names):
        save_tensors({name: load() for name, load in shard}, out_dir / file)
        if progress:
            progress(len(shard))
    return names


def shard_names(n_shards: int, prefix: str = "output") -> list[str]:
    """ExLlamaV2's naming: output.safetensors, or output-00001-of-00003.safetensors ... (5 digits, 1-based)."""
    if n_shards == 1:
        return [f"{prefix}.safetensors"]
    return [f"{prefix}-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]


def exl2_config(source: dict, bits: float, head_bits: int, rows: int, length: int, dataset: str,
                version: str) -> dict:
    """config.json of the output: the source config plus quantization_config (§1) and, for ExLlamaV2, the
    rope settings at the top level as well (§8.5: it reads only top-level rope_theta / rope_scaling)."""
    config = with_top_level_rope(source)
    config["quantization_config"] = {
        "quant_method": "exl2",
        "version": version,
        "bits": float(bits),
        "head_bits": int(head_bits),
        "calibration": {"rows": int(rows), "length": int(length), "dataset": dataset},
    }
    return config


def with_top_level_rope(source: dict) -> dict:
    config = dict(source)
    config.pop("quantization_config", None)
    params = dict(config.get("rope_parameters") or {})
    if "rope_theta" in params and "rope_theta" not in config:
        config["rope_theta"] = params["rope_theta"]
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") != "default" and not config.get("rope_scaling"):
        config["rope_scaling"] = scaling
    return config


def copy_support_files(source_dir: Path, out_dir: Path) -> list[str]:
    """Tokenizer, generation config, chat template and other non-weight files, as ExLlamaV2's converter does;
    weights, weight indices and config.json (written separately) are left out."""
    copied = []
    for f in sorted(Path(source_dir).iterdir()):
        if f.is_file() and f.name not in NOT_COPIED and not f.name.endswith(WEIGHT_SUFFIXES):
            copy_file(f, out_dir / f.name)
            copied.append(f.name)
    return copied


def copy_file(source: Path, target: Path) -> None:
    try:
        shutil.copyfile(source, target)
    except OSError as e:
        raise _write_error(target, e) from None

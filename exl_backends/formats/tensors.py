"""Sharded safetensors access: every header is validated before any tensor is read; tensors load lazily."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import CheckpointError

DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8), "I32": (torch.int32, 4), "I16": (torch.int16, 2), "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1), "U16": (torch.uint16, 2), "U32": (torch.uint32, 4), "U64": (torch.uint64, 8),
    "BOOL": (torch.bool, 1), "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1),
}
MAX_HEADER_BYTES = 100 * 1024 * 1024
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parses and checks one safetensors header against the file's real size (catches truncation)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: not a safetensors file (only {size} bytes); re-download or re-convert it")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{file}: corrupt safetensors header (claims {n} bytes, file has {size}); "
                                      f"the file is truncated or not a safetensors file")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read: {e}") from None
    except (ValueError, RecursionError) as e:   # bad UTF-8 or JSON, absurd nesting or integer lengths
        raise CheckpointError(f"{file}: corrupt safetensors header ({e}); re-download or re-convert it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    data_bytes = size - 8 - n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = _check_entry(file, name, entry, data_bytes)
    return out


def _check_entry(file: Path, name: str, entry, data_bytes: int) -> TensorInfo:
    def bad(why):
        return CheckpointError(f"{file}: tensor {name!r}: {why}; re-download or re-convert the checkpoint")
    if not isinstance(entry, dict):
        raise bad("header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise bad(f"invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise bad(f"invalid data_offsets {offsets!r}")
    torch_dtype, itemsize = DTYPES[dtype]
    numel = 1
    for d in shape:
        numel *= d
    begin, end = offsets
    if not 0 <= begin <= end or end - begin != numel * itemsize:
        raise bad(f"data_offsets {offsets} do not match shape {shape} and dtype {dtype}")
    if end > data_bytes:
        raise bad(f"data ends at byte {end} but the file holds only {data_bytes} data bytes (truncated file)")
    return TensorInfo(name, file, torch_dtype, tuple(shape))


def weight_files(directory: Path) -> list[Path]:
    """The shards to read: those of model.safetensors.index.json when it is present and complete, else all."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e}); delete it or re-download the checkpoint") from None
        if files and all(f.is_file() for f in files):
            return files
        # A stale index (converters copy the source model's) is ignored, as ExLlamaV2 does.
    return sorted(directory.glob("*.safetensors"))


class TensorStore:
    """Every tensor of a checkpoint directory, by name; reads only what is asked for."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        files = weight_files(self.directory)
        if not files:
            raise CheckpointError(f"{self.directory}: no *.safetensors files found (only safetensors checkpoints "
                                  f"are read; convert .bin/.pt files with transformers' save_pretrained)")
        self.infos: dict[str, TensorInfo] = {}
        for file in files:
            for name, info in read_header(file).items():
                if name in self.infos:
                    raise CheckpointError(f"tensor {name!r} is in both {self.infos[name].file} and {file}")
                self.infos[name] = info
        self._handles: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def files(self) -> str:
        return ", ".join(sorted({i.file.name for i in self.infos.values()}))

    def names(self) -> list[str]:
        return list(self.infos)

    def info(self, name: str) -> TensorInfo:
        if name not in self.infos:
            raise CheckpointError(f"tensor {name!r} is missing from {self.directory} (files: {self.files()})")
        return self.infos[name]

    def expect(self, name: str, shape: tuple[int, ...] | None = None,
               dtypes: tuple[torch.dtype, ...] | None = None) -> TensorInfo:
        """Checks presence, shape and dtype without reading data."""
        info = self.info(name)
        if shape is not None and info.shape != tuple(shape):
            raise CheckpointError(f"{info.file}: tensor {name!r} has shape {list(info.shape)}, expected "
                                  f"{list(shape)} from config.json; the checkpoint and its config disagree")
        if dtypes is not None and info.dtype not in dtypes:
            raise CheckpointError(f"{info.file}: tensor {name!r} has dtype {info.dtype}, expected one of "
                                  f"{[str(d) for d in dtypes]}")
        return info

    def get(self, name: str) -> torch.Tensor:
        info = self.info(name)
        handle = self._handles.get(info.file)
        if handle is None:
            try:
                handle = self._handles[info.file] = safe_open(str(info.file), framework="pt")
            except Exception as e:  # safetensors raises its own SafetensorError
                raise CheckpointError(f"{info.file}: cannot open: {e}") from None
        try:
            return handle.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{info.file}: cannot read tensor {name!r}: {e}") from None

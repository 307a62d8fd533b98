"""GPTQ linear layers (AutoGPTQ / GPTQModel / Optimum layout): the quantize config and the packed tensors.
Layout: shared/design/gptq-format.md."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..errors import CheckpointError, UnsupportedFormatError
from ..model import reference
from .tensors import FLOAT_DTYPES, TensorStore

GPTQ_BITS = (2, 3, 4, 8)
CONFIG_FILES = ("quantize_config.json", "quant_config.json")   # AutoGPTQ's search order, then config.json


@dataclass
class GptqWeight:
    qweight: Tensor     # int32 [K*bits/32, N]
    qzeros: Tensor      # int32 [G, N*bits/32]
    scales: Tensor      # fp16 [G, N]
    g_idx: Tensor       # int32 [K]
    bits: int
    v2: bool            # checkpoint_format gptq_v2: zeros stored as is (v1 stores zero - 1)
    in_features: int
    out_features: int

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def tensors(self) -> dict[str, Tensor]:
        return {"qweight": self.qweight, "qzeros": self.qzeros, "scales": self.scales, "g_idx": self.g_idx}

    def dequantize(self) -> Tensor:
        t = {k: v.cpu() for k, v in self.tensors().items()}
        return reference.dequant_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], self.bits,
                                      self.v2).to(self.device)

    def to(self, device: torch.device) -> "GptqWeight":
        return GptqWeight(**{k: v.to(device) for k, v in self.tensors().items()}, bits=self.bits, v2=self.v2,
                          in_features=self.in_features, out_features=self.out_features)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


@dataclass(frozen=True)
class ModuleSettings:
    """What the quantize config says about one module; None fields are not stated (the shapes decide)."""
    bits: int | None
    group_size: int | None      # -1: one group over all of K


@dataclass(frozen=True)
class GptqSettings:
    """A directory's GPTQ quantize config, read once and passed to every layer."""
    source: str                                        # the file it came from, for messages
    bits: int | None = None
    group_size: int | None = None
    v2: bool = False                                   # checkpoint_format "gptq_v2": qzeros hold the zero itself
    dynamic: tuple[tuple[re.Pattern, bool, ModuleSettings], ...] = ()   # (pattern, excluded, overrides)

    @classmethod
    def from_dict(cls, cfg: dict, source: str) -> "GptqSettings":
        fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
        if fmt == "marlin" or cfg.get("is_marlin_format"):
            raise UnsupportedFormatError(
                f"{source}: this is a legacy GPTQ 'marlin' checkpoint (Marlin's tiled runtime layout stored on "
                f"disk), which is not supported; use the plain GPTQ ('gptq' or 'gptq_v2' format) version of the "
                f"model, or an EXL2 quant")
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedFormatError(f"{source}: GPTQ checkpoint_format {fmt!r} is not supported; supported: "
                                         f"'gptq' (v1) and 'gptq_v2'")
        pack_dtype = str(cfg.get("pack_dtype") or "int32").removeprefix("torch.")
        if pack_dtype != "int32":
            raise UnsupportedFormatError(f"{source}: GPTQ pack_dtype {pack_dtype!r} is not supported; only int32 "
                                         f"words (the default of every GPTQ tool) are read")
        bits, group_size = _module_fields(cfg, source, "")
        rules = cfg.get("dynamic") or {}
        if not isinstance(rules, dict):
            raise UnsupportedFormatError(f"{source}: 'dynamic' must be an object of pattern -> overrides")
        dynamic = []
        for pattern, overrides in rules.items():
            excluded = pattern.startswith("-:")
            raw = pattern[2:] if pattern.startswith(("-:", "+:")) else pattern
            try:
                compiled = re.compile(raw)
            except re.error as e:
                raise UnsupportedFormatError(f"{source}: dynamic pattern {pattern!r} is not a valid regex ({e})") \
                    from None
            if not isinstance(overrides, dict):
                raise UnsupportedFormatError(f"{source}: dynamic[{pattern!r}] must be an object")
            dynamic.append((compiled, excluded, ModuleSettings(*_module_fields(overrides, source, pattern))))
        return cls(source, bits, group_size, fmt == "gptq_v2", tuple(dynamic))

    def for_module(self, key: str) -> ModuleSettings | None:
        """This module's bits and group size: the first matching `dynamic` rule wins (GPTQModel's rule);
        None when a '-:' rule says the module is not quantized."""
        for pattern, excluded, overrides in self.dynamic:
            if pattern.match(key):
                if excluded:
                    return None
                return ModuleSettings(overrides.bits or self.bits,
                                      self.group_size if overrides.group_size is None else overrides.group_size)
        return ModuleSettings(self.bits, self.group_size)


def _module_fields(cfg: dict, source: str, where: str) -> tuple[int | None, int | None]:
    """bits and group_size of a config block (AutoGPTQ also accepts AWQ-style w_bit / q_group_size)."""
    at = f"{source}" + (f" (dynamic {where!r})" if where else "")
    bits = _integer(cfg.get("bits", cfg.get("w_bit")))
    group_size = _integer(cfg.get("group_size", cfg.get("q_group_size")))
    if bits is not None and (not isinstance(bits, int) or bits not in GPTQ_BITS):
        raise UnsupportedFormatError(f"{at}: GPTQ bits = {bits!r} is not supported; supported widths: "
                                     f"{list(GPTQ_BITS)}")
    if group_size is not None and (not isinstance(group_size, int) or (group_size <= 0 and group_size != -1)):
        raise UnsupportedFormatError(f"{at}: GPTQ group_size = {group_size!r} is invalid; expected -1 or a "
                                     f"positive size")
    return bits, group_size


def _integer(value):
    """JSON writers sometimes emit 4.0 for 4."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def quant_config(directory: Path) -> tuple[dict | None, str | None]:
    """The quantization config block and the file it came from (None, None when the directory has none)."""
    for name in (*CONFIG_FILES, "config.json"):
        file = directory / name
        if not file.is_file():
            continue
        try:
            raw = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{file}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{file}: must hold a JSON object")
        block = raw if name != "config.json" else raw.get("quantization_config")
        if block is not None:
            if not isinstance(block, dict):
                raise CheckpointError(f"{file}: quantization_config must be an object")
            return block, str(file)
    return None, None


# ----------------------------------------------------------------------------------------------- one layer


@dataclass(frozen=True)
class Layout:
    """A layer's shapes as the file holds them, checked against config.json and the quantize config."""
    bits: int
    groups: int
    group_size: int             # the rows of one group when g_idx is absent


def check(store: TensorStore, settings: GptqSettings, key: str, k: int, n: int) -> Layout:
    """Validates names, shapes and dtypes of one layer's packed tensors without reading data."""
    sc = store.expect(f"{key}.scales", None, FLOAT_DTYPES)
    qz = store.expect(f"{key}.qzeros", None, (torch.int32,))
    store.expect(f"{key}.qweight", None, (torch.int32,))
    if len(sc.shape) != 2 or sc.shape[1] != n or sc.shape[0] == 0:
        raise CheckpointError(f"{sc.file}: tensor '{key}.scales' has shape {list(sc.shape)}, expected "
                              f"[groups, {n}] for out_features {n} from config.json")
    groups = sc.shape[0]
    if len(qz.shape) != 2 or qz.shape[0] != groups or qz.shape[1] * 32 % n:
        raise CheckpointError(f"{qz.file}: tensor '{key}.qzeros' has shape {list(qz.shape)}, expected "
                              f"[{groups}, {n}*bits/32] to match '{key}.scales' {list(sc.shape)}")
    bits = qz.shape[1] * 32 // n
    if bits not in GPTQ_BITS:
        raise CheckpointError(f"{qz.file}: tensor '{key}.qzeros' {list(qz.shape)} implies {bits}-bit codes; "
                              f"supported GPTQ widths: {list(GPTQ_BITS)}")
    stated = settings.for_module(key)
    if stated is not None and stated.bits is not None and stated.bits != bits:
        raise CheckpointError(f"{qz.file}: tensor '{key}.qzeros' {list(qz.shape)} implies {bits}-bit codes but "
                              f"{settings.source} says {stated.bits} bits for this module")
    if k * bits % 32:
        raise CheckpointError(f"{qz.file}: {key}: in_features {k} from config.json cannot be packed at {bits} "
                              f"bits (in_features * bits must be a multiple of 32)")
    store.expect(f"{key}.qweight", (k * bits // 32, n), (torch.int32,))
    group_size = stated.group_size if stated is not None and stated.group_size is not None else -(-k // groups)
    expected_groups = 1 if group_size == -1 else -(-k // group_size)
    if groups != expected_groups:
        raise CheckpointError(f"{sc.file}: tensor '{key}.scales' has {groups} groups but {settings.source} says "
                              f"group_size {group_size}, i.e. {expected_groups} groups for in_features {k}")
    if f"{key}.g_idx" in store:
        store.expect(f"{key}.g_idx", (k,), (torch.int32, torch.int64))
    return Layout(bits, groups, k if group_size == -1 else group_size)


def load(store: TensorStore, settings: GptqSettings, key: str, k: int, n: int) -> GptqWeight:
    layout = check(store, settings, key, k, n)
    if f"{key}.g_idx" in store:
        g_idx = store.get(f"{key}.g_idx")
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= layout.groups:
            raise CheckpointError(f"{store.info(key + '.g_idx').file}: tensor '{key}.g_idx' holds group indices "
                                  f"outside 0..{layout.groups - 1}; the checkpoint is corrupt, re-download it")
        g_idx = g_idx.to(torch.int32)
    else:   # very old files: groups are consecutive runs of group_size rows
        g_idx = (torch.arange(k) // layout.group_size).to(torch.int32)
    scales = store.get(f"{key}.scales").half()   # a few tools save fp32/bf16 scales; the format's maths is fp16
    if not torch.isfinite(scales).all():
        raise CheckpointError(f"{store.info(key + '.scales').file}: tensor '{key}.scales' holds inf/NaN (or values "
                              f"beyond fp16's range); the checkpoint is corrupt")
    return GptqWeight(store.get(f"{key}.qweight"), store.get(f"{key}.qzeros"), scales, g_idx, layout.bits,
                      settings.v2, k, n)

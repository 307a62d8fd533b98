"""Layer split: which device holds which decoder layers when one model spans several GPUs.

Layers stay in order; device g holds a contiguous run of them with their KV cache (each layer's cache lives with
the layer), the embedding goes with layer 0 and the final norm + lm_head with the last layer. Every device that
holds a layer also pays the scratch of a prefill chunk (the head's logits only on the last) and the reserve.

gpu_split="auto" balances: it finds the smallest fraction f such that filling the devices in order, each up to f
times its free memory, places every layer; so every device ends up about equally full relative to its size. An
explicit split (GiB per device) fills device 0 up to its number, then device 1, and so on, as ExLlamaV2 does. Both
refuse before anything is loaded, with the numbers per device, when the model and the context do not fit."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from .. import formats
from ..errors import ConfigError, OutOfMemoryPlanError
from . import cache as kv_cache
from . import model, planner
from .config import ModelConfig
from .model import Stage

log = logging.getLogger(__name__)
MORE_SPLIT = "larger numbers in gpu_split (or gpu_split='auto')"


@dataclass(frozen=True)
class SplitCosts:
    """Bytes each part of the model costs on the device that holds it, for one context."""
    tokens: int
    cache_mode: str
    layers: tuple[int, ...]     # per decoder layer: its weights (+ kernel metadata) and its KV cache
    cache: tuple[int, ...]      # ... of which the KV cache
    embedding: int              # with layer 0
    head: int                   # final norm + lm_head, with the last layer
    scratch: int                # on every device that holds a layer: activations of a prefill chunk + dequant
    logits: int                 # on the last device only: the head's output (planner.Footprint.logits)
    reserve: int                # on every device used

    def item(self, i: int) -> int:
        """Layer i with what travels with it (the embedding with the first, the head with the last)."""
        return self.layers[i] + (self.embedding if i == 0 else 0) + \
            (self.head + self.logits if i == len(self.layers) - 1 else 0)

    @property
    def fixed(self) -> int:
        """What every device that holds a layer pays besides its layers."""
        return self.scratch + self.reserve


def split_costs(ckpt: formats.Checkpoint, config: ModelConfig, tokens: int, cache_mode: str = "fp16",
                dtype: torch.dtype = torch.float16) -> SplitCosts:
    """From the checkpoint's headers alone (the same accounting as planner.footprint, per layer)."""
    kv_cache.check_mode(cache_mode, config)
    store, d, item = ckpt.store, config.hidden_size, dtype.itemsize
    pages = -(-tokens // planner.PAGE_SIZE)
    cache_per_layer = pages * planner.PAGE_SIZE * kv_cache.bytes_per_token(config, cache_mode, item) // config.n_layers
    layers, dequant = [], 0
    for i in range(config.n_layers):
        weights = sum(size * item for _, size in model.norm_names(config, i))
        for key, k, n, _ in model.attention_linears(config, i, store) + model.mlp_linears(config, i, store):
            weights += formats.linear_nbytes(ckpt, key, k, n, dtype)
            if formats.linear_kind(store, key) != "dense":
                weights += planner.PREPARE_BYTES_PER_ROW * k
                dequant = max(dequant, k * formats.exl2.padded(n) * 2)
        layers.append(weights + cache_per_layer)
    head = d * item
    if model.head_is_tied(store, config):
        head += config.vocab_size * d * item         # a copy of the embedding when the head is on another device
    else:
        key = config.traits.names.lm_head
        head += formats.linear_nbytes(ckpt, key, d, config.vocab_size, dtype)
        if formats.linear_kind(store, key) != "dense":
            head += planner.PREPARE_BYTES_PER_ROW * d
            dequant = max(dequant, d * formats.exl2.padded(config.vocab_size) * 2)
    fp = planner.Footprint(config, cache_mode, dtype, 0, 0, dequant, 0, 0, 0)
    logits = fp.logits(tokens)
    return SplitCosts(tokens, cache_mode, tuple(layers), (cache_per_layer,) * config.n_layers,
                      config.vocab_size * d * item, head, fp.scratch(tokens) - logits, logits, planner.RESERVE_BYTES)


# ----------------------------------------------------------------------------------------------- placing


def fill_in_order(costs: SplitCosts, caps: list[float]) -> list[range]:
    """Layers in order onto devices, each taking layers while its total stays within its cap (bytes): the layer
    ranges per device (empty for a device left unused); layers past the last range did not fit."""
    ranges, i, n = [], 0, len(costs.layers)
    for cap in caps:
        start, used = i, costs.fixed
        while i < n and used + costs.item(i) <= cap:
            used += costs.item(i)
            i += 1
        ranges.append(range(start, i))
    return ranges


def fill(costs: SplitCosts, caps: list[float]) -> list[range] | None:
    """fill_in_order, or None when some layers are left over."""
    ranges = fill_in_order(costs, caps)
    return ranges if ranges[-1].stop == len(costs.layers) else None


def balanced(costs: SplitCosts, budgets: list[int]) -> list[range] | None:
    """The fill with every device at the smallest common fraction f of its budget that still places all layers
    (bisection on f: the fill only gains layers as f grows)."""
    if fill(costs, budgets) is None:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if fill(costs, [mid * b for b in budgets]) is None:
            lo = mid
        else:
            hi = mid
    return fill(costs, [hi * b for b in budgets])


def device_bytes(costs: SplitCosts, layers: range) -> int:
    """What a device holding `layers` uses in all (0 when it holds none)."""
    return sum(costs.item(i) for i in layers) + costs.fixed if layers else 0


def place(costs: SplitCosts, budgets: list[int], names: list[str], auto: bool) -> list[range]:
    """Layer ranges per device, or OutOfMemoryPlanError with each device's numbers. names: the devices, for
    messages; auto: balance (else fill in order up to each budget)."""
    ranges = balanced(costs, budgets) if auto else fill(costs, budgets)
    if ranges is None:
        raise OutOfMemoryPlanError(refusal(costs, budgets, names, auto))
    return ranges


def refusal(costs: SplitCosts, budgets: list[int], names: list[str], auto: bool) -> str:
    """Why the model does not fit: the in-order fill at full budgets, device by device, and what is left over."""
    ranges, n = fill_in_order(costs, budgets), len(costs.layers)
    i = ranges[-1].stop
    gib = planner.gib
    lines = []
    for name, budget, r in zip(names, budgets, ranges):
        held = f"layers {r.start}-{r.stop - 1}" if r else "no layer"
        lines.append(f"{name}: {gib(budget)} {'free' if auto else 'allowed'}, holds {held} = "
                     f"{gib(device_bytes(costs, r))} (of which scratch {gib(costs.scratch)} + reserve "
                     f"{gib(costs.reserve)}; next layer {gib(costs.item(r.stop)) if r.stop < n else '-'})")
    need = sum(costs.item(j) for j in range(n)) + costs.fixed * len(budgets)
    return (f"the model does not fit on {len(budgets)} device(s) for {costs.tokens} tokens ({costs.cache_mode} "
            f"cache): layers {i}-{n - 1} of {n} are left over. It needs about {gib(need)} in all (weights + KV "
            f"cache {gib(sum(costs.cache))} + scratch and reserve per device) against {gib(sum(budgets))}. "
            f"Per device: {'; '.join(lines)}. Try: a shorter max_seq_len, cache_mode='q4', a lower-bpw quant of "
            f"this model, {'more GPUs' if auto else MORE_SPLIT}")


def fit_tokens(ckpt: formats.Checkpoint, config: ModelConfig, cache_mode: str, dtype: torch.dtype,
               budgets: list[int], auto: bool) -> int:
    """The longest context (whole pages, up to max_position_embeddings) whose split fits; 0 if none does."""
    def fits(pages: int) -> bool:
        costs = split_costs(ckpt, config, pages * planner.PAGE_SIZE, cache_mode, dtype)
        return (balanced(costs, budgets) if auto else fill(costs, budgets)) is not None
    lo, hi = 0, -(-config.max_position_embeddings // planner.PAGE_SIZE)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo * planner.PAGE_SIZE


# ----------------------------------------------------------------------------------------------- devices


@dataclass(frozen=True)
class Placement:
    devices: tuple[torch.device, ...]   # one per device used, in order
    ranges: tuple[range, ...]           # the layers each holds
    tokens: int                         # the context planned for
    used: tuple[int, ...]               # bytes planned per device

    def stages(self) -> list[Stage]:
        return [Stage(d, r) for d, r in zip(self.devices, self.ranges)]

    def describe(self) -> str:
        lines = [f"layer split over {len(self.devices)} devices ({self.tokens} tokens of context):"]
        for device, r, used in zip(self.devices, self.ranges, self.used):
            lines.append(f"  {device_name(device)}: layers {r.start}-{r.stop - 1} ({len(r)}), "
                         f"{planner.gib(used)} planned")
        note = device_order_note(self.devices)
        return "\n".join(lines + ([f"  {note}"] if note else []))


def device_name(device: torch.device) -> str:
    """cuda:1 -> 'cuda:1 = GPU 3 (PCI 0000:41:00, NVIDIA H200, 139.8 GiB)': the physical GPU behind a logical
    index (CUDA_VISIBLE_DEVICES renumbers them)."""
    if device.type != "cuda":
        return str(device)
    index = device.index or 0
    p = torch.cuda.get_device_properties(index)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")] if visible else None
    physical = ids[index] if ids and index < len(ids) else str(index)
    return (f"cuda:{index} = GPU {physical} (PCI {pci_bus_id(p)}, {p.name}, {p.total_memory / planner.GIB:.1f} "
            f"GiB)")


def pci_bus_id(props) -> str:
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}"


def device_order_note(devices: tuple[torch.device, ...]) -> str | None:
    """CUDA numbers GPUs fastest-first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, so cuda:N may not be nvidia-smi's
    GPU N; say so when several GPUs are in use and the variable is unset."""
    gpus = [d for d in devices if d.type == "cuda"]
    if len(set(gpus)) < 2 or os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":
        return None
    return ("CUDA_DEVICE_ORDER is not PCI_BUS_ID: cuda:N may not be nvidia-smi's GPU N; set "
            "CUDA_DEVICE_ORDER=PCI_BUS_ID so both count GPUs the same way")


def devices_for(split, devices: list[torch.device] | None) -> list[torch.device]:
    """The devices a split runs on: those given, else every visible GPU (or the first len(split) of them)."""
    if devices is not None:
        return [torch.device(d) for d in devices]
    n = torch.cuda.device_count()
    if n == 0:
        raise ConfigError("gpu_split needs CUDA GPUs and none is visible (check the driver and "
                          "CUDA_VISIBLE_DEVICES); on CPU pass the devices to split over, e.g. device=['cpu', 'cpu']")
    count = n if split == "auto" else len(split)
    if count > n:
        raise ConfigError(f"gpu_split {list(split)} names {count} GPUs but {n} are visible (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    return [torch.device("cuda", i) for i in range(count)]


def budgets_for(split, devices: list[torch.device]) -> list[int]:
    """Bytes each device may use: an explicit split's GiB (checked against free memory on GPUs), else the free
    memory of each GPU (CPU devices: the host's memory, shared equally)."""
    if split != "auto":
        if len(split) != len(devices):
            raise ConfigError(f"gpu_split {list(split)} has {len(split)} entries for {len(devices)} devices")
        if any(g <= 0 for g in split):
            raise ConfigError(f"gpu_split {list(split)}: every entry must be a positive number of GiB")
        budgets = [int(g * planner.GIB) for g in split]
        for d, b in zip(devices, budgets):
            if d.type == "cuda" and b > planner.free_memory(d):
                raise OutOfMemoryPlanError(f"gpu_split gives {device_name(d)} {planner.gib(b)}, but only "
                                           f"{planner.gib(planner.free_memory(d))} are free there; lower it")
        return budgets
    if all(d.type == "cuda" for d in devices):
        return [planner.free_memory(d) for d in devices]
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return [host // len(devices)] * len(devices)


def plan(ckpt: formats.Checkpoint, config: ModelConfig, split, devices: list[torch.device] | None,
         requested: int | None, cache_mode: str, dtype: torch.dtype) -> Placement:
    """The placement for from_pretrained: split is "auto" or GiB per device; requested: max_seq_len (None: the
    model's max_position_embeddings, shortened to what fits)."""
    auto = split == "auto"
    devices = devices_for(split, devices)
    types = {d.type for d in devices}
    if len(types) > 1:
        raise ConfigError(f"a layer split runs on one kind of device, got {[str(d) for d in devices]}")
    budgets = budgets_for(split, devices)
    names = [device_name(d) for d in devices]
    tokens = requested or config.max_position_embeddings
    costs = split_costs(ckpt, config, tokens, cache_mode, dtype)
    ranges = balanced(costs, budgets) if auto else fill(costs, budgets)
    if ranges is None and requested is None:
        fits = fit_tokens(ckpt, config, cache_mode, dtype, budgets, auto)
        if fits >= min(tokens, planner.PAGE_SIZE):
            log.warning("context shortened from %d to %d tokens to fit the split (pass max_seq_len to choose)",
                        tokens, fits)
            tokens = fits
            costs = split_costs(ckpt, config, tokens, cache_mode, dtype)
    ranges = place(costs, budgets, names, auto)
    used = [(d, r, device_bytes(costs, r)) for d, r in zip(devices, ranges) if r]
    placement = Placement(tuple(d for d, _, _ in used), tuple(r for _, r, _ in used), tokens,
                          tuple(b for _, _, b in used))
    log.info("%s", placement.describe())
    note = device_order_note(placement.devices)
    if note:
        log.warning("%s", note)
    return placement

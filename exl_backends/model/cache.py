"""The KV cache: fixed-size pages shared by all sequences, in fp16 or quantized (q8, q6, q4) form.

Per layer, K and V are stored by slot (page * page_size + offset). fp16: [slots, n_kv_heads, head_dim]. The layers on
one device are views into one tensor per field ([layers, slots, ...]), so that a copy in every layer is one launch.
Quantized: codes uint8 [slots, E] (8-bit) or [slots, E/2] (4-bit) and fp16 scales [slots, E/32], with
E = n_kv_heads * head_dim, in the rotated layout of reference.quantize_kv (ExLlamaV2's Q-cache scheme)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ConfigError
from . import reference
from .config import ModelConfig

# mode -> (K bits, V bits); None: fp16. q6 is ExLlamaV2's "Q6": K at 8 bits, V at 4.
CACHE_MODES: dict[str, tuple[int, int] | None] = {"fp16": None, "q8": (8, 8), "q6": (8, 4), "q4": (4, 4)}


def check_mode(mode: str, config: ModelConfig) -> None:
    if mode not in CACHE_MODES:
        raise ConfigError(f"cache mode {mode!r} is not supported; choose one of {', '.join(CACHE_MODES)}")
    width = config.n_kv_heads * config.head_dim
    if CACHE_MODES[mode] and width % reference.KV_CHUNK:
        raise ConfigError(f"cache mode {mode!r} needs n_kv_heads * head_dim to be a multiple of "
                          f"{reference.KV_CHUNK} (this model has {width}); use cache_mode='fp16'")


def bytes_per_token(config: ModelConfig, mode: str, dtype_bytes: int = 2) -> int:
    """Cache bytes one token takes over all layers, K and V, scales included (fp16 mode: dtype_bytes each)."""
    width = config.n_kv_heads * config.head_dim
    bits = CACHE_MODES[mode]
    if bits is None:
        per_layer = 2 * width * dtype_bytes
    else:
        per_layer = sum(width * b // 8 + width // reference.KV_GROUP * 2 for b in bits)
    return config.n_layers * per_layer


@dataclass
class LayerCache:
    """One layer's fields (or, in KVCache.stacks, one device's layers', with a leading layer dimension)."""
    k: Tensor                 # fp16 mode: [slots, Hkv, Dh]; quantized: codes [slots, E*bits/8]
    v: Tensor
    k_scales: Tensor | None   # quantized only: fp16 [slots, E/32]
    v_scales: Tensor | None


class PagePool:
    """Which pages are free. Pages are handed out whole; a sequence owns a list of them."""

    def __init__(self, n_pages: int):
        self.n_pages = n_pages
        self.free = list(range(n_pages - 1, -1, -1))

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise MemoryError(f"{n} cache pages requested, {len(self.free)} free")
        return [self.free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self.free.extend(reversed(pages))

    @property
    def n_free(self) -> int:
        return len(self.free)


class KVCache:
    """Pages for every layer. Unquantized ("fp16") pages hold the model's compute dtype (f32 on CPU).
    layer_devices: in a layer split, the device of each layer (its pages live with its weights); page numbers
    and slots are the same on every device."""

    def __init__(self, config: ModelConfig, n_pages: int, page_size: int = 256, mode: str = "fp16",
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float16,
                 layer_devices: list[torch.device] | None = None):
        check_mode(mode, config)
        self.config, self.mode, self.page_size, self.dtype = config, mode, page_size, dtype
        self.device = torch.device(device)
        self.layer_devices = [torch.device(d) for d in layer_devices] if layer_devices is not None \
            else [self.device] * config.n_layers
        self.bits = CACHE_MODES[mode]
        self.pool = PagePool(n_pages)
        self._write = self._write_reference
        if self.device.type == "cuda":
            from ..kernels import attention, kv_cache   # importing them compiles nothing
            attention.check_cache(self)
            self._write = kv_cache.writer(self.bits)
        slots, hkv, dh = n_pages * page_size, config.n_kv_heads, config.head_dim
        # the layers on one device are views into one tensor per field, so that copying slots in every layer
        # (cache.copy, before a reused prefix's first forward) is one launch per field, not one per layer and field
        self.stacks: list[LayerCache] = []
        self.layers: list[LayerCache] = [None] * config.n_layers
        for device in dict.fromkeys(self.layer_devices):
            ids = [i for i, d in enumerate(self.layer_devices) if d == device]
            stack = self._stack(len(ids), slots, hkv, dh, device)
            self.stacks.append(stack)
            for j, i in enumerate(ids):
                self.layers[i] = LayerCache(*(None if t is None else t[j] for t in
                                              (stack.k, stack.v, stack.k_scales, stack.v_scales)))

    def _stack(self, n: int, slots: int, hkv: int, dh: int, device: torch.device) -> LayerCache:
        """Zeroed fields of n layers, [n, ...] each."""
        if self.bits is None:
            def kv():
                return torch.zeros(n, slots, hkv, dh, dtype=self.dtype, device=device)
            return LayerCache(kv(), kv(), None, None)
        width = hkv * dh

        def codes(bits):
            return torch.zeros(n, slots, width * bits // 8, dtype=torch.uint8, device=device)

        def scales():
            return torch.zeros(n, slots, width // reference.KV_GROUP, dtype=torch.float16, device=device)
        return LayerCache(codes(self.bits[0]), codes(self.bits[1]), scales(), scales())

    @property
    def max_tokens(self) -> int:
        return self.pool.n_pages * self.page_size

    def write(self, layer: int, k: Tensor, v: Tensor, slots: Tensor) -> None:
        """k, v [T, Hkv, Dh] -> their slots (quantized on the way in for q modes). On CUDA: kv_cache.cu."""
        self._write(self.layers[layer], k, v, slots)

    def _write_reference(self, c: LayerCache, k: Tensor, v: Tensor, slots: Tensor) -> None:
        if self.bits is None:
            c.k[slots] = k.to(self.dtype)
            c.v[slots] = v.to(self.dtype)
            return
        for codes, scales, x, bits in ((c.k, c.k_scales, k, self.bits[0]), (c.v, c.v_scales, v, self.bits[1])):
            q, s = reference.quantize_kv(x.reshape(x.shape[0], -1), bits)
            codes[slots], scales[slots] = q, s

    def copy(self, source: int, target: int, n: int) -> None:
        """Slots source.. source + n - 1 into target.., in every layer (a shared prefix's head into a job's page)."""
        for c in self.stacks:
            for t in (c.k, c.v, c.k_scales, c.v_scales):
                if t is not None:
                    t[:, target:target + n].copy_(t[:, source:source + n])

    def read(self, layer: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        """The K, V [L, Hkv, Dh] stored at slots, dequantized (reference path)."""
        c = self.layers[layer]
        if self.bits is None:
            return c.k[slots], c.v[slots]
        shape = (slots.shape[0], self.config.n_kv_heads, self.config.head_dim)
        k = reference.dequantize_kv(c.k[slots], c.k_scales[slots], self.bits[0], self.dtype)
        v = reference.dequantize_kv(c.v[slots], c.v_scales[slots], self.bits[1], self.dtype)
        return k.view(shape), v.view(shape)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.stacks
                   for t in (c.k, c.v, c.k_scales, c.v_scales) if t is not None)

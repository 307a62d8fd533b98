"""`exl warmup`: compiles the kernel families a model launches, all at once, into CuPy's disk cache, so that the
first token does not wait for NVRTC (~20-35 s one family after another on first use).

Each family compiles in its own thread (NVRTC releases the GIL, so they run in parallel) through loader.module,
the same call a first launch makes: the cache entry is exactly the one later processes look up. The threads are
daemons: Ctrl-C ends the command at once, dropping the compiles in flight. That cannot leave a broken cache: CuPy
writes an entry to a temporary file and renames it into place, and checks each entry's SHA-1 when it reads it
(cupy/cuda/_compiler_cache.py), so an interrupted warm-up leaves finished families cached and no others, and the
next run compiles what is missing."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from ..kernels import loader

# What every decoder launches on CUDA (norms, rope + cache write, attention, SiLU/GELU and soft-caps), and what a
# quantized one adds (EXL2/GPTQ matmuls: one-row to 16-row, the tiled GEMMs, dequantization for long prompts). A
# dense fp16 model's linears are torch's. lane_layout (the EXL2 repack) comes first: a load waits for it.
# (Mixture-of-experts' matmul_moe compiles on first use.)
DECODER_FAMILIES = ("norm", "rope", "kv_cache", "attention", "activation", "argmax")
QUANTIZED_FAMILIES = ("lane_layout", "matmul_rows", "gemm", "wgmma", "dequant")


def families_for(model_dir: str | Path | None) -> tuple[str, ...]:
    """The kernel families a model directory's model launches (every family when no directory is given)."""
    if model_dir is None:
        return QUANTIZED_FAMILIES + DECODER_FAMILIES
    from ..formats import detect_format
    quantized = detect_format(Path(model_dir)) in ("exl2", "gptq")
    return (QUANTIZED_FAMILIES if quantized else ()) + DECODER_FAMILIES


def warmup(model_dir: str | Path | None = None, device: torch.device | str | None = None,
           compile_family=None) -> dict[str, float]:
    """Compiles the families model_dir needs for device's GPU (default: the current one), in parallel; returns
    the seconds each took (a cached family: the time to read it back). compile_family(family, cc) does one
    family's work (default loader.module, which compiles and caches)."""
    compile_family = compile_family or loader.module
    cc = loader.compute_capability(torch.device(device) if device is not None else None)
    families = families_for(model_dir)
    seconds: dict[str, float] = {}
    errors: list[BaseException] = []

    def work(family: str) -> None:
        start = time.perf_counter()
        try:
            compile_family(family, cc)
        except BaseException as e:          # re-raised in the caller's thread
            errors.append(e)
        seconds[family] = time.perf_counter() - start

    threads = [threading.Thread(target=work, args=(f,), name=f"compile {f}", daemon=True) for f in families]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.1)                     # short joins keep the main thread free to take Ctrl-C
    if errors:
        raise errors[0]
    return {f: seconds[f] for f in families}


def in_background(model_dir: str | Path | None = None, device: torch.device | str | None = None):
    """Starts warmup() in a daemon thread, to overlap CPU work (the quickstart's GGUF import); returns a function
    that waits for it and returns its timings (or raises its error). Wait before capturing CUDA graphs (the
    converter's GPTQ steps, the decode graphs): loading a module during another thread's capture is not known to
    be safe."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["seconds"] = warmup(model_dir, device)
        except BaseException as e:          # re-raised by wait()
            outcome["error"] = e

    thread = threading.Thread(target=run, name="kernel warm-up", daemon=True)
    thread.start()

    def wait() -> dict[str, float]:
        while thread.is_alive():
            thread.join(0.1)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["seconds"]
    return wait

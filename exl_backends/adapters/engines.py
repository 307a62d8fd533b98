"""One Generator per model directory and load options, made on first use and shared by every adapter object in the
process (LangChain's ChatExl/ExlLLM and LlamaIndex's Exl construct cheaply and may be built many times: the
weights load once)."""
from __future__ import annotations

import threading
from pathlib import Path

_lock = threading.Lock()
_generators: dict[tuple, object] = {}


def shared_generator(model_dir: str | Path, device: str | None = None, max_seq_len: int | None = None,
                     cache_mode: str = "fp16", max_batch_size: int = 8):
    """The process's Generator for these options, loading the model the first time (thread-safe)."""
    key = (str(Path(model_dir).resolve()), device, max_seq_len, cache_mode, max_batch_size)
    with _lock:
        gen = _generators.get(key)
        if gen is None:
            from ..engine.generator import Generator
            from .hf import ExlForCausalLM
            model = ExlForCausalLM.from_pretrained(model_dir, device=device, max_seq_len=max_seq_len,
                                                   cache_mode=cache_mode)
            gen = _generators[key] = Generator(model, max_batch_size=max_batch_size)
        return gen

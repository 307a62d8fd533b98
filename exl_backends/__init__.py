"""exl-backends: EXL2 and GPTQ inference with runtime-compiled CUDA kernels and a CPU reference path.

Importing this package defines names and registers the "exl2" quantizer plugin with transformers (lazily: see
hf_registration.py); it imports no CuPy, torch or transformers, compiles nothing and touches no GPU."""
from importlib import import_module

from .adapters import hf_registration

__all__ = ["ExlForCausalLM", "Generator", "SamplingParams"]
_HOMES = {"ExlForCausalLM": "adapters.hf", "Generator": "engine.generator", "SamplingParams": "engine.sampling"}


def __getattr__(name):
    if name in _HOMES:
        return getattr(import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module 'exl_backends' has no attribute {name!r}")


hf_registration.install()

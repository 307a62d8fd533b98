"""Registers the "exl2" quantizer plugin (hf_quantizer.py) with transformers, cheaply.

transformers' quantizer registry lives in `transformers.quantizers.auto`, whose import costs seconds; importing
exl_backends must stay instant and must not import torch or transformers. So `install()` (run when exl_backends is
imported) registers at once only if transformers already imported that module; otherwise it puts a finder first on
`sys.meta_path` that lets the default machinery find the module and registers the plugin right after the module
has run. The finder removes itself on first use."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

REGISTRY_MODULE = "transformers.quantizers.auto"


def install() -> None:
    if REGISTRY_MODULE in sys.modules:
        _register()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


def _register() -> None:
    from .hf_quantizer import register
    register()


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != REGISTRY_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register()
        spec.loader.exec_module = exec_module
        return spec

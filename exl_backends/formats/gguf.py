"""GGUF -> a Hugging Face fp16 safetensors directory (config, weights, tokenizer, chat template), through
transformers' GGUF loader (which needs the `gguf` and `accelerate` packages: the `gguf` extra)."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError


def import_gguf(file: str | Path, out_dir: str | Path) -> Path:
    """Dequantizes every tensor of `file` to fp16 and writes an HF directory at out_dir (atomically: a
    half-written directory never appears under out_dir's name)."""
    file, out_dir = Path(file), Path(out_dir)
    if not file.is_file():
        raise CheckpointError(f"{file}: no such GGUF file")
    try:
        import gguf  # noqa: F401  (transformers needs it; fail here with the fix)
        import accelerate  # noqa: F401
    except ImportError:
        raise ConfigError("importing a GGUF file needs the `gguf` extra: pip install 'exl-backends[gguf]'") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
    except (ValueError, OSError, KeyError) as e:
        raise CheckpointError(f"{file}: transformers cannot read this GGUF file ({e})") from None
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.to(torch.float16).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir

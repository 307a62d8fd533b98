"""What ExlForCausalLM.from_pretrained and the tensor-parallel ranks share before a model loads: the device and dtype
from our arguments or transformers' spellings of them, and the directory's tokenizer."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import ConfigError, DeviceError
from ..paths import cache_dir


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """fp16 on the GPU (what the kernels compute in); f32 on CPU (exact reference, and CPU fp16 is slow)."""
    return torch.float16 if device.type == "cuda" else torch.float32


def hf_loading_arguments(device, dtype, hf_kwargs: dict) -> tuple[torch.device, torch.dtype | None]:
    """device and dtype from our arguments or transformers' spellings of them; other kwargs raise."""
    hf_kwargs = dict(hf_kwargs)
    torch_dtype = hf_kwargs.pop("torch_dtype", None)
    device_map = hf_kwargs.pop("device_map", None)
    for harmless in ("local_files_only", "trust_remote_code", "low_cpu_mem_usage"):
        hf_kwargs.pop(harmless, None)
    if hf_kwargs:
        raise TypeError(f"ExlForCausalLM.from_pretrained: unsupported argument(s) {sorted(hf_kwargs)}")
    dtype = dtype if dtype is not None else torch_dtype
    if isinstance(dtype, str):
        dtype = None if dtype == "auto" else getattr(torch, dtype)
    if device_map is not None:
        if device is not None:
            raise ValueError("pass device or device_map, not both")
        if isinstance(device_map, dict):
            if set(device_map) != {""}:
                raise ValueError(f"device_map={device_map}: ExlForCausalLM runs on one device; use {{'': 0}}, "
                                 f"'cuda:0' or 'auto'")
            device_map = device_map[""]
        device = None if device_map == "auto" else (f"cuda:{device_map}" if isinstance(device_map, int) else device_map)
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        why = (f"this torch ({torch.__version__}) is a CPU-only build: install one built for CUDA"
               if torch.version.cuda is None else "torch sees no CUDA GPU (check the driver and CUDA_VISIBLE_DEVICES)")
        raise DeviceError(f"device {device} was asked for, but {why}; or run on the CPU (device='cpu', "
                          f"--device cpu)")
    return device, dtype


def load_tokenizer(path: Path):
    """The directory's tokenizer, as AutoTokenizer loads it. AutoTokenizer picks the class from the model's config
    (importing transformers' model-config chain: modeling_auto, torch.distributed.tensor, with a CUDA torch also
    dynamo; 2.9 s against 0.95 s for the class itself on the 2-core CPU machine), so the class it picked is
    remembered (tokenizer-classes.json in the user's cache, keyed by transformers' version and the tokenizer
    files' sizes and times) and later loads of the same files take it directly."""
    key = _tokenizer_key(path)
    try:
        cls = _remembered_class(key)
        if cls is None:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(str(path))
            _remember_class(key, type(tokenizer))
            return tokenizer
        return cls.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise tokenizer_error(path, e) from None
    except Exception as e:
        if type(e) is not Exception:    # the tokenizers library reports a broken tokenizer.json as a bare Exception
            raise
        raise tokenizer_error(path, e) from None


def tokenizer_error(path: Path, why) -> ConfigError:
    return ConfigError(f"{path}: cannot load the tokenizer ({why}); the directory needs tokenizer.json (or the "
                       f"tokenizer files of its Hugging Face model)")


# Vocabulary files that AutoTokenizer loads from (tokenizer.json; sentencepiece; Mistral's tekken; BPE or WordPiece
# vocabularies): a directory with none of them has no tokenizer, which from_pretrained says before loading weights.
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "tekken.json", "vocab.json", "vocab.txt", "spiece.model")


def check_tokenizer_files(path: Path) -> None:
    """load_tokenizer's error for a directory without a tokenizer, found without importing transformers (the
    tokenizer itself loads when first used; a broken file fails then, with load_tokenizer's message)."""
    if not any((path / name).is_file() for name in VOCAB_FILES):
        raise tokenizer_error(path, f"it has none of {', '.join(VOCAB_FILES)}")


REMEMBERED = 256                # tokenizer classes kept in tokenizer-classes.json
TOKENIZER_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
                   "tokenizer.model", "chat_template.jinja")


def _tokenizer_key(path: Path) -> str:
    """What AutoTokenizer's choice depends on: transformers' version and the files it reads (by path, size, time).
    (transformers.__version__, not importlib.metadata's lookup: that scans every installed package's metadata, which
    took seconds on the GPU machine; transformers is imported for the tokenizer anyway.)"""
    import transformers
    stamps = []
    for name in TOKENIZER_FILES:
        try:
            st = (path / name).stat()
            stamps.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            pass
    return "|".join([transformers.__version__, str(path.resolve()), *stamps])


def _classes_file() -> Path:
    return cache_dir() / "tokenizer-classes.json"


def _read_classes() -> dict:
    try:
        classes = json.loads(_classes_file().read_text())
    except (OSError, ValueError):
        return {}
    return classes if isinstance(classes, dict) else {}


def _remembered_class(key: str):
    name = _read_classes().get(key)
    if not isinstance(name, str):
        return None
    import transformers
    cls = getattr(transformers, name, None)
    return cls if isinstance(cls, type) else None


def _remember_class(key: str, cls: type) -> None:
    """Kept only for a class transformers exports by name; a cache that cannot be written is left alone."""
    import transformers
    if getattr(transformers, cls.__name__, None) is not cls:
        return
    file = _classes_file()
    classes = _read_classes()
    classes.pop(key, None)
    classes[key] = cls.__name__
    classes = dict(list(classes.items())[-REMEMBERED:])        # the newest: temporary directories come and go
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(classes, indent=0))
        tmp.replace(file)
    except OSError:
        pass

"""What ExlForCausalLM.from_pretrained and the tensor-parallel ranks share before a model loads: the device and dtype
from our arguments or transformers' spellings of them, and the directory's tokenizer."""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..errors import ConfigError, DeviceError


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


def tokenizer_beside(path: Path) -> Callable:
    """Starts load_tokenizer(path) in a thread and returns what waits for it (raising its error), so that the
    tokenizer loads beside the weights: AutoTokenizer's config lookup imports much of transformers once per process
    (1.1 s on the 2-core CPU machine; with a CUDA build of torch also torch.distributed, FSDP and dynamo, ~3 s)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="exl-tokenizer")
    future = pool.submit(load_tokenizer, path)
    pool.shutdown(wait=False)               # the thread ends with the load
    return future.result


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot load the tokenizer ({e}); the directory needs tokenizer.json "
                          f"(or the tokenizer files of its Hugging Face model)") from None

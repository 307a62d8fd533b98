"""ExlForCausalLM: the model as transformers users know it (from_pretrained, __call__ -> .logits, generate)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .batch import Batch, SeqChunk
from .cache import KVCache, check_mode
from .config import ModelConfig
from .errors import ConfigError, ContextLengthError
from .model import Model


@dataclass
class CausalLMOutput:
    logits: Tensor          # f32 [batch, seq, vocab]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """fp16 on the GPU (what the kernels compute in); f32 on CPU (exact reference, and CPU fp16 is slow)."""
    return torch.float16 if device.type == "cuda" else torch.float32


class ExlForCausalLM:
    main_input_name = "input_ids"
    page_size = 256

    def __init__(self, model: Model, tokenizer, path: Path, max_seq_len: int, cache_mode: str):
        self.model, self.tokenizer, self.name_or_path = model, tokenizer, str(path)
        self.exl_config: ModelConfig = model.config
        self.max_seq_len, self.cache_mode = max_seq_len, cache_mode

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device | None = None,
                        max_seq_len: int | None = None, cache_mode: str = "fp16",
                        dtype: torch.dtype | None = None) -> "ExlForCausalLM":
        path = Path(path)
        config = ModelConfig.from_dir(path)
        check_mode(cache_mode, config)
        device = torch.device(device) if device is not None else default_device()
        max_seq_len = max_seq_len or config.max_position_embeddings
        if max_seq_len <= 0:
            raise ConfigError(f"max_seq_len must be positive, got {max_seq_len}")
        model = Model.load(path, config, device, dtype or default_dtype(device))
        return cls(model, load_tokenizer(path), path, max_seq_len, cache_mode)

    @property
    def config(self) -> ModelConfig:
        return self.exl_config

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def new_cache(self, max_tokens: int) -> KVCache:
        """A cache with room for max_tokens tokens (rounded up to whole pages)."""
        n_pages = -(-max_tokens // self.page_size)
        return KVCache(self.exl_config, n_pages, self.page_size, self.cache_mode, self.device, self.dtype)

    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> CausalLMOutput:
        """Full forward of [batch, seq] ids (left or right padding marked by attention_mask = 0):
        logits [batch, seq, vocab] f32, zero at padded positions."""
        ids = torch.as_tensor(input_ids).long()
        if ids.dim() == 1:
            ids = ids[None]
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask).bool()
        batch_size, seq = ids.shape
        if seq > self.max_seq_len:
            raise ContextLengthError(f"input of {seq} tokens is longer than max_seq_len {self.max_seq_len}; "
                                     f"shorten it or load the model with a larger max_seq_len")
        pages_per_seq = -(-seq // self.page_size)
        cache = self.new_cache(batch_size * pages_per_seq * self.page_size)
        chunks = [SeqChunk(ids[b][mask[b].bool()].tolist(), 0,
                           list(range(b * pages_per_seq, (b + 1) * pages_per_seq))) for b in range(batch_size)]
        if any(not c.tokens for c in chunks):
            raise ValueError("a row of input_ids has no unmasked tokens")
        batch = Batch.build(chunks, self.page_size, self.device, all_logits=True)
        flat = self.model.forward(batch, cache)
        logits = torch.zeros(batch_size, seq, flat.shape[-1], dtype=torch.float32, device=flat.device)
        logits[mask.bool().to(flat.device)] = flat
        return CausalLMOutput(logits)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot load the tokenizer ({e}); the directory needs tokenizer.json "
                          f"(or the tokenizer files of its Hugging Face model)") from None

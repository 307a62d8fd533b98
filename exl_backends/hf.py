"""ExlForCausalLM: the model as transformers users know it (from_pretrained, __call__ -> .logits, generate)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from . import formats, planner
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
        checkpoint = formats.open_checkpoint(path)      # refuses AWQ, GGUF, FP8, EXL3, ... with what to do
        device = torch.device(device) if device is not None else default_device()
        dtype = dtype or default_dtype(device)
        if device.type == "cuda":                       # before anything is allocated
            max_seq_len = planner.fit_context(checkpoint, config, max_seq_len, cache_mode,
                                              planner.free_memory(device), str(device), dtype)
        max_seq_len = max_seq_len or config.max_position_embeddings
        if max_seq_len <= 0:
            raise ConfigError(f"max_seq_len must be positive, got {max_seq_len}")
        model = Model.load(path, config, device, dtype)
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

    def generate(self, input_ids: Tensor, attention_mask: Tensor | None = None, max_new_tokens: int = 20,
                 min_new_tokens: int = 0, do_sample: bool = False, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                 eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None, streamer=None,
                 stopping_criteria=None) -> Tensor:
        """transformers' generate: ids [batch, prompt] (left padding marked by attention_mask = 0) -> LongTensor
        [batch, prompt + new]. Greedy unless do_sample. A row ends at eos_token_id (default: the model's EOS
        tokens; not before min_new_tokens), kept in the output, or when stopping_criteria(ids, None) flags it;
        later columns of a finished row hold pad_token_id (default: the first EOS). streamer gets
        put(input_ids), put(column) per new column, end(). Sampling seeds come from torch's global generator,
        so transformers.set_seed applies."""
        from .sampling import SamplingParams
        ids = torch.as_tensor(input_ids).long()
        if ids.dim() == 1:
            ids = ids[None]
        mask = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else \
            torch.as_tensor(attention_mask).bool().to(ids.device)
        if (mask[:, 1:] < mask[:, :-1]).any():
            raise ValueError("generate takes left-padded input (attention_mask 0s, then 1s): set "
                             "tokenizer.padding_side = 'left'")
        eos = list(self.exl_config.eos_token_ids) if eos_token_id is None else \
            [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else None)
        seed = int(torch.randint(0, 2**62, ()))
        sampling = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                   repetition_penalty=repetition_penalty, seed=seed + b) if do_sample else
                    SamplingParams(temperature=0.0, repetition_penalty=repetition_penalty)
                    for b in range(ids.shape[0])]
        prompts = [row[m].tolist() for row, m in zip(ids, mask)]
        gen = self._generator_for(len(prompts), ids.shape[1] + max_new_tokens)
        jobs = [gen.submit(p, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, sampling=s,
                           stop_token_ids=eos)
                for p, s in zip(prompts, sampling)]
        if streamer is not None:
            streamer.put(ids.cpu())
        try:
            columns = _generate_columns(gen, ids, jobs, max_new_tokens, set(eos), pad, streamer, stopping_criteria)
        finally:
            for job in jobs:
                gen.cancel(job)
        if streamer is not None:
            streamer.end()
        return torch.cat([ids, _as_rows(columns, ids)], dim=1)

    def _generator_for(self, batch_size: int, seq_len: int):
        """A generator with room for batch_size sequences of seq_len tokens, kept for the next call."""
        from .generator import Generator
        gen = getattr(self, "_generator", None)
        pages = -(-seq_len // self.page_size)
        if gen is None or gen.scheduler.max_batch_size < batch_size or gen.cache.pool.n_pages < batch_size * pages:
            gen = self._generator = Generator(self, max_batch_size=batch_size,
                                              cache_tokens=batch_size * pages * self.page_size)
        return gen


def _generate_columns(gen, ids: Tensor, jobs: list, max_new_tokens: int, eos: set[int], pad: int | None, streamer,
                      stopping_criteria) -> list[list[int]]:
    """transformers' step order over the generator's jobs: column t holds every row's t-th new token (pad for
    finished rows); a row finishes on EOS or when stopping_criteria flags it."""
    received: list[list[int]] = [[] for _ in jobs]
    done = [False] * len(jobs)
    columns: list[list[int]] = []
    while not all(done) and len(columns) < max_new_tokens:
        t = len(columns)
        for b, job in enumerate(jobs):
            while not done[b] and len(received[b]) <= t:
                chunk = next(job, None)
                if chunk is None:           # ended at max_seq_len
                    done[b] = True
                else:
                    received[b] += chunk.token_ids
        if all(done):
            break
        if any(done) and pad is None:
            raise ValueError("rows of this batch finish at different lengths: pass pad_token_id")
        column = [pad if done[b] else received[b][t] for b in range(len(jobs))]
        columns.append(column)
        done = [d or c in eos for d, c in zip(done, column)]
        if streamer is not None:
            streamer.put(torch.tensor(column, dtype=torch.long))
        if stopping_criteria is not None:
            flags = stopping_criteria(torch.cat([ids, _as_rows(columns, ids)], dim=1), None)
            for b, flag in enumerate(torch.as_tensor(flags).bool().expand(len(jobs)).tolist()):
                if flag and not done[b]:
                    done[b] = True
                    gen.cancel(jobs[b])
    return columns


def _as_rows(columns: list[list[int]], ids: Tensor) -> Tensor:
    """Columns of new tokens -> LongTensor [batch, len(columns)] on the device of ids."""
    return torch.tensor(columns, dtype=torch.long).reshape(len(columns), ids.shape[0]).T.to(ids.device)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot load the tokenizer ({e}); the directory needs tokenizer.json "
                          f"(or the tokenizer files of its Hugging Face model)") from None

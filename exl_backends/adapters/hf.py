"""ExlForCausalLM: the model as transformers users know it (from_pretrained, __call__ -> .logits, generate), so that
code written for a transformers model (pipeline("text-generation"), streamers, stopping criteria, llama-index's
HuggingFaceLLM, langchain-huggingface) runs on our engine by changing the class it loads with.

generate follows transformers' contract (argument priority: kwargs > generation_config argument > the model's
generation_config > transformers' defaults; output = prompt + new tokens, finished rows padded). Decoding runs on
our Generator; anything transformers would do that we do not (beam search, assisted decoding, custom logits
processors, most GenerationConfig fields) raises instead of being ignored."""
from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor

from .. import formats
from ..errors import ConfigError, ContextLengthError
from ..model import planner
from ..model.batch import Batch, SeqChunk
from ..model.cache import KVCache, check_mode
from ..model.config import ModelConfig
from ..model.loading import check_tokenizer_files, default_dtype, hf_loading_arguments, load_tokenizer
from ..model.model import Model
from ..model.placement import plan as plan_split


@dataclass
class CausalLMOutput:
    logits: Tensor          # f32 [batch, seq, vocab]


class ExlForCausalLM:
    main_input_name = "input_ids"
    input_modalities = ("text",)
    output_modalities = ("text",)
    page_size = 256

    def __init__(self, model: Model, tokenizer, path: Path, max_seq_len: int, cache_mode: str):
        """tokenizer None: the directory's, loaded when first read."""
        self.model, self.name_or_path = model, str(path)
        if tokenizer is not None:
            self.tokenizer = tokenizer
        self.exl_config: ModelConfig = model.config
        self.max_seq_len, self.cache_mode = max_seq_len, cache_mode
        self.placement = None           # a layer split's placement.Placement (which device holds which layers)

    # The tokenizer, loaded when first read (text prompts, decoding text, chat templates): transformers'
    # AutoModelForCausalLM loads none either, and decoding from token ids (generate(input_ids)) never needs it.
    # Loaded eagerly it took 0.96-1.68 s of an 8B warm load on the H100, mostly `import transformers`; the
    # tokenizer's classes and file were 0.17 s of SmolLM2's from_pretrained on the 2-core CPU machine.
    # from_pretrained checks that its files exist. Assignable.
    @functools.cached_property
    def tokenizer(self):
        return load_tokenizer(Path(self.name_or_path))

    # transformers' config objects, made when first read: a model-config class's module imports transformers'
    # auto-model chain (its docstring decorator reaches modeling_auto, and with it torch.distributed.tensor), seconds
    # that a load which decodes through the Generator (the quickstart, the server) never needs. Assignable.
    @functools.cached_property
    def config(self):
        """transformers' PretrainedConfig of the directory."""
        return hf_config(Path(self.name_or_path), self.exl_config.raw)

    @functools.cached_property
    def generation_config(self):
        # from config.json's fields as written unless self.config is already made (same fields, without its import)
        return load_generation_config(Path(self.name_or_path), self.__dict__.get("config", self.exl_config.raw))

    @functools.cached_property
    def _saved_settings(self) -> dict | None:
        return saved_settings(Path(self.name_or_path))

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device | list | None = None,
                        max_seq_len: int | None = None, cache_mode: str = "fp16",
                        dtype: torch.dtype | str | None = None, gpu_split: str | list[float] | None = None,
                        tensor_parallel: int | None = None, **hf_kwargs) -> "ExlForCausalLM":
        """Loads a model directory (fp16/bf16/fp32, EXL2 or GPTQ safetensors). transformers' spellings are
        accepted too: torch_dtype= (for dtype), device_map= (one device: "auto", "cuda:0", {"": 0}); and
        local_files_only= / trust_remote_code=, which change nothing (nothing is downloaded, no code is run).
        The tokenizer (.tokenizer) loads when first read; a directory without tokenizer files fails here.

        Several GPUs: gpu_split="auto" (or GiB per GPU, e.g. [20, 24]) places the layers in order over the visible
        GPUs, planned against their free memory (device: the list of devices to split over, default every visible
        GPU); tensor_parallel=N shards every layer over N processes, one per GPU (parallel/; each rank's share
        is planned against its GPU's free memory first; under torchrun, ranks other than 0 serve rank 0's forward
        calls and decode-graph replays inside this call and then exit)."""
        if tensor_parallel is not None and tensor_parallel > 1:
            if gpu_split is not None:
                raise ConfigError("choose gpu_split or tensor_parallel, not both")
            from .. import parallel
            return parallel.from_pretrained(cls, path, tensor_parallel, device, max_seq_len, cache_mode, dtype,
                                            **hf_kwargs)
        devices = None
        if gpu_split is not None and isinstance(device, (list, tuple)):
            devices, device = [torch.device(d) for d in device], device[0]
        elif isinstance(device, (list, tuple)):
            raise ConfigError("a list of devices needs gpu_split ('auto' or GiB per device)")
        device, dtype = hf_loading_arguments(device, dtype, hf_kwargs)
        path = Path(path)
        config = ModelConfig.from_dir(path)
        check_tokenizer_files(path)                     # the tokenizer itself loads when first used
        check_mode(cache_mode, config)
        checkpoint = formats.open_checkpoint(path)      # refuses AWQ, GGUF, FP8, EXL3, ... with what to do
        dtype = dtype or default_dtype(device)
        placement = None
        if gpu_split is not None:                       # before anything is allocated
            placement = plan_split(checkpoint, config, gpu_split, devices, max_seq_len, cache_mode, dtype)
            max_seq_len, device = placement.tokens, placement.devices[0]
        elif device.type == "cuda":
            max_seq_len = planner.fit_context(checkpoint, config, max_seq_len, cache_mode,
                                              planner.free_memory(device), str(device), dtype)
        max_seq_len = max_seq_len or config.max_position_embeddings
        if max_seq_len <= 0:
            raise ConfigError(f"max_seq_len must be positive, got {max_seq_len}")
        model = Model.load(path, config, device, dtype, None if placement is None else placement.stages())
        loaded = cls(model, None, path, max_seq_len, cache_mode)
        loaded.placement = placement
        return loaded

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def can_generate(self) -> bool:
        return True

    def eval(self) -> "ExlForCausalLM":
        return self

    def to(self, *args, **kwargs) -> "ExlForCausalLM":
        """Accepted when it asks for the device and dtype the model already has (pipelines call it); moving a
        loaded model is not supported: load it with from_pretrained(device=..., dtype=...)."""
        for target in list(args) + list(kwargs.values()):
            wanted = target if isinstance(target, torch.dtype) else torch.device(target)
            same = wanted == self.dtype if isinstance(wanted, torch.dtype) else \
                wanted.type == self.device.type and wanted.index in (None, self.device.index)
            if not same:
                raise ValueError(f"ExlForCausalLM cannot move to {target} (it is on {self.device}, {self.dtype}); "
                                 f"load it with ExlForCausalLM.from_pretrained(path, device=..., dtype=...)")
        return self

    def load_draft(self, path: str | Path) -> "ExlForCausalLM":
        """A draft model for speculative decoding (Generator's draft_model) from path, on this model's device with
        its context length and cache mode."""
        return type(self).from_pretrained(path, device=self.device, max_seq_len=self.max_seq_len,
                                          cache_mode=self.cache_mode)

    def new_cache(self, max_tokens: int) -> KVCache:
        """A cache with room for max_tokens tokens (rounded up to whole pages)."""
        n_pages = -(-max_tokens // self.page_size)
        return KVCache(self.exl_config, n_pages, self.page_size, self.cache_mode, self.device, self.dtype,
                       layer_devices=self.model.block_devices)

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

    @torch.inference_mode()
    def generate(self, inputs: Tensor | None = None, generation_config=None, logits_processor=None,
                 stopping_criteria=None, prefix_allowed_tokens_fn=None, synced_gpus=None, assistant_model=None,
                 streamer=None, negative_prompt_ids=None, negative_prompt_attention_mask=None, custom_generate=None,
                 **kwargs):
        """transformers' generate. input_ids [batch, prompt] (left padding marked by attention_mask = 0; or
        `inputs`) -> LongTensor [batch * num_return_sequences, prompt + new], or with return_dict_in_generate a
        GenerateDecoderOnlyOutput(sequences, scores, logits).

        Any GenerationConfig field may be a kwarg; supported: max_new_tokens, max_length, min_new_tokens,
        min_length, do_sample, temperature, top_k, top_p, min_p, typical_p, repetition_penalty, eos_token_id (int
        or list), pad_token_id, bos_token_id, stop_strings (with tokenizer=), num_return_sequences (sampling),
        use_cache, return_dict_in_generate, output_scores, output_logits. Others raise. A row ends at an EOS token
        (kept) or when stopping_criteria(ids, None) flags it; later columns of a finished row hold pad_token_id
        (default: the first EOS). streamer gets put(prompt ids), put(column) per new column, end(). Sampling
        seeds come from torch's global generator, so transformers.set_seed makes runs repeatable. scores/logits
        are recomputed after decoding by one forward over the output (raw logits, then transformers' own
        processors for scores)."""
        _refuse_unsupported(logits_processor=logits_processor, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
                            synced_gpus=synced_gpus, assistant_model=assistant_model,
                            negative_prompt_ids=negative_prompt_ids,
                            negative_prompt_attention_mask=negative_prompt_attention_mask,
                            custom_generate=custom_generate)
        ids, mask = self._prompt_tensors(inputs, kwargs)
        tokenizer = kwargs.pop("tokenizer", None)
        gc = self._resolve_config(generation_config, kwargs)
        eos = self._eos_ids(gc)
        pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else None)
        max_new = gc.max_new_tokens if gc.max_new_tokens is not None else gc.max_length - ids.shape[1]
        if max_new < 1:
            raise ValueError(f"nothing to generate: the prompt has {ids.shape[1]} tokens and max_length is "
                             f"{gc.max_length}; set max_new_tokens")
        min_new = max(gc.min_new_tokens or 0, (gc.min_length or 0) - ids.shape[1], 0)
        criteria = _stopping_criteria(stopping_criteria, gc.stop_strings, tokenizer)
        n_ret = gc.num_return_sequences or 1
        if n_ret > 1:
            if not gc.do_sample:
                raise ValueError("num_return_sequences > 1 needs do_sample=True (greedy rows would be identical)")
            ids, mask = ids.repeat_interleave(n_ret, 0), mask.repeat_interleave(n_ret, 0)
        prompts = [row[m].tolist() for row, m in zip(ids, mask)]
        gen = self._generator_for(len(prompts), ids.shape[1] + max_new)
        jobs = [gen.submit(p, max_new_tokens=max_new, sampling=s, stop_token_ids=eos,
                           min_new_tokens=min(min_new, max_new), text=False)
                for p, s in zip(prompts, _sampling_params(gc, len(prompts)))]
        if streamer is not None:
            streamer.put(ids.cpu())
        try:
            columns = _generate_columns(gen, ids, jobs, max_new, set(eos), pad, streamer, criteria)
        finally:
            for job in jobs:
                gen.cancel(job)
        if streamer is not None:
            streamer.end()
        sequences = torch.cat([ids, _as_rows(columns, ids)], dim=1)
        if not gc.return_dict_in_generate:
            return sequences
        return self._output_dict(sequences, mask, ids.shape[1], gc, min_new, eos)

    def _prompt_tensors(self, inputs, kwargs) -> tuple[Tensor, Tensor]:
        """input_ids [B, T] long and attention_mask [B, T] bool, left padding checked."""
        if inputs is not None and "input_ids" in kwargs:
            raise ValueError("pass the prompt once: as inputs or as input_ids")
        raw = inputs if inputs is not None else kwargs.pop("input_ids", None)
        if raw is None:
            raise ValueError("generate needs input_ids (or inputs): the prompt's token ids, shape [batch, length]")
        ids = torch.as_tensor(raw).long()
        if ids.dim() == 1:
            ids = ids[None]
        attention_mask = kwargs.pop("attention_mask", None)
        mask = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else \
            torch.as_tensor(attention_mask).bool().to(ids.device)
        if (mask[:, 1:] < mask[:, :-1]).any():
            raise ValueError("generate takes left-padded input (attention_mask 0s, then 1s): set "
                             "tokenizer.padding_side = 'left'")
        if not mask.any(dim=1).all():
            raise ValueError("a row of input_ids has no unmasked tokens")
        return ids, mask

    def _resolve_config(self, generation_config, kwargs):
        """kwargs > generation_config > self.generation_config > transformers' defaults, as one GenerationConfig,
        or, where nothing needs transformers to decide, the same values without it (_plain_settings, over the
        directory's generation_config.json as read once); a kwarg that is no GenerationConfig field, or a field we
        do not implement, raises."""
        if generation_config is None and "generation_config" not in self.__dict__:
            plain = _plain_settings(self._saved_settings, kwargs)
            if plain is not None:
                return _checked(plain)
        from transformers import GenerationConfig
        gc = copy.deepcopy(generation_config if generation_config is not None else self.generation_config)
        unknown = gc.update(**kwargs)
        if unknown:
            raise TypeError(f"generate() got unsupported argument(s) {sorted(unknown)}")
        defaults = GenerationConfig._get_default_generation_params()
        fresh = GenerationConfig().to_dict()
        for name, value in gc.to_dict().items():
            if name in SUPPORTED_FIELDS or name.startswith("_") or name in ("transformers_version", "use_cache"):
                continue
            if value not in (None, False, fresh.get(name), defaults.get(name)):
                raise TypeError(f"generate(): {name}={value!r} is not supported by ExlForCausalLM (supported: "
                                 f"{sorted(SUPPORTED_FIELDS)}); leave it unset")
        for name, value in defaults.items():
            if getattr(gc, name, None) is None:
                setattr(gc, name, value)
        return _checked(gc)

    def _eos_ids(self, gc) -> list[int]:
        eos = gc.eos_token_id
        if eos is None:
            return list(self.exl_config.eos_token_ids)
        return [int(eos)] if isinstance(eos, int) or torch.is_tensor(eos) and eos.dim() == 0 else \
            [int(e) for e in eos]

    def _output_dict(self, sequences: Tensor, mask: Tensor, n_prompt: int, gc, min_new: int, eos: list[int]):
        """GenerateDecoderOnlyOutput; scores/logits come from one forward over the finished sequences: raw
        logits of each step (output_logits), and those logits through transformers' processors (output_scores)."""
        from transformers.generation.utils import GenerateDecoderOnlyOutput
        scores = logits = None
        if gc.output_scores or gc.output_logits:
            full_mask = torch.cat([mask, torch.ones_like(sequences[:, n_prompt:], dtype=torch.bool)], dim=1)
            raw = self(sequences[:, :-1], full_mask[:, :-1]).logits[:, n_prompt - 1:].to(sequences.device)
            steps = range(sequences.shape[1] - n_prompt)
            if gc.output_logits:
                logits = tuple(raw[:, t] for t in steps)
            if gc.output_scores:
                processors = _hf_processors(gc, mask, min_new, eos)
                scores = tuple(processors(sequences[:, :n_prompt + t], raw[:, t].clone()) for t in steps)
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits)

    def _generator_for(self, batch_size: int, seq_len: int):
        """A generator with room for batch_size sequences of seq_len tokens, kept for the next call."""
        from ..engine.generator import Generator
        gen = getattr(self, "_generator", None)
        pages = -(-seq_len // self.page_size)
        if gen is None or gen.scheduler.max_batch_size < batch_size or gen.cache.pool.n_pages < batch_size * pages:
            gen = self._generator = Generator(self, max_batch_size=batch_size,
                                              cache_tokens=batch_size * pages * self.page_size)
        return gen


def _stopping_criteria(criteria, stop_strings, tokenizer):
    """transformers' StoppingCriteriaList of the caller's criteria and stop strings, or None when there are none
    (importing transformers' generation package pulls in accelerate and the hub's kernels: seconds on a first
    token that needs neither)."""
    if not criteria and not stop_strings:
        return None
    from transformers import StoppingCriteriaList, StopStringCriteria
    out = StoppingCriteriaList(criteria or [])
    if stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: generate(..., stop_strings=[...], tokenizer=tokenizer)")
        out.append(StopStringCriteria(tokenizer, stop_strings))
    return out


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


SUPPORTED_FIELDS = frozenset({
    "max_new_tokens", "max_length", "min_new_tokens", "min_length", "do_sample", "temperature", "top_k", "top_p",
    "min_p", "typical_p", "repetition_penalty", "eos_token_id", "pad_token_id", "bos_token_id", "stop_strings",
    "num_return_sequences", "return_dict_in_generate", "output_scores", "output_logits"})


# transformers' values for the fields generate() implements when nothing sets them (GenerationConfig() with
# GenerationConfig._get_default_generation_params() filled in; tests/test_hf.py checks them against transformers').
DEFAULTS = {"max_new_tokens": None, "max_length": 20, "min_new_tokens": None, "min_length": 0, "do_sample": False,
            "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None, "typical_p": 1.0, "repetition_penalty": 1.0,
            "eos_token_id": None, "pad_token_id": None, "bos_token_id": None, "stop_strings": None,
            "num_return_sequences": 1, "return_dict_in_generate": False, "output_scores": False, "output_logits": None}
# generation_config.json entries that change nothing generate() does (transformers writes them into most files)
INERT = {"transformers_version": None, "_from_model_config": None, "use_cache": None, "output_attentions": False,
         "output_hidden_states": False}


def saved_settings(path: Path) -> dict | None:
    """The entries of the directory's generation_config.json that generate() implements, read without transformers
    (its import was 1.4-1.5 s of an 8B warm load's first token on the H100); None when only transformers can say
    what the file means: an entry generate() does not implement (transformers' GenerationConfig then names it in its
    error), a broken file, or none (transformers derives the settings from config.json)."""
    file = path / "generation_config.json"
    if not file.is_file():
        return None
    try:
        saved = json.loads(file.read_text())
    except (OSError, ValueError):
        return None                     # transformers' loader reports a broken file
    if not isinstance(saved, dict):
        return None
    for name, value in saved.items():
        if name not in SUPPORTED_FIELDS and (name not in INERT or INERT[name] is not None and value != INERT[name]):
            return None
    return {k: v for k, v in saved.items() if k in SUPPORTED_FIELDS}


def _plain_settings(saved: dict | None, kwargs: dict) -> SimpleNamespace | None:
    """generate()'s settings without transformers: the kwargs over the file's saved settings over DEFAULTS; None
    when the file (saved None) or a kwarg that generate() does not implement needs transformers to judge."""
    if saved is None or not set(kwargs) <= SUPPORTED_FIELDS | {"use_cache"}:
        return None
    settings = {**DEFAULTS, **saved, **kwargs}
    if settings["max_new_tokens"] is not None and settings["max_new_tokens"] <= 0:
        raise ValueError(f"`max_new_tokens` must be greater than 0, but is {settings['max_new_tokens']}.")
    for name, value in DEFAULTS.items():            # a None in the file or a kwarg means transformers' default
        if settings[name] is None:
            settings[name] = value
    return SimpleNamespace(**{k: settings[k] for k in DEFAULTS})


def _checked(gc):
    if gc.do_sample and gc.temperature <= 0:
        raise ValueError(f"do_sample=True needs temperature > 0, got {gc.temperature}; use do_sample=False "
                         f"for greedy decoding")
    return gc


def _refuse_unsupported(**arguments) -> None:
    """generate()'s named arguments that would change decoding in ways we do not implement."""
    given = [name for name, value in arguments.items() if value not in (None, False) and not
             (name == "logits_processor" and len(value) == 0)]
    if given:
        raise TypeError(f"generate(): {', '.join(given)} not supported by ExlForCausalLM (it decodes with its own "
                         f"engine); use a transformers model for these")


def _sampling_params(gc, n_rows: int) -> list:
    """One SamplingParams per row: greedy (after repetition penalty) unless do_sample; sampling rows get
    consecutive seeds drawn from torch's global generator."""
    from ..engine.sampling import SamplingParams
    if not gc.do_sample:
        return [SamplingParams(temperature=0.0, repetition_penalty=gc.repetition_penalty)] * n_rows
    seed = int(torch.randint(0, 2**62, ()))
    return [SamplingParams(temperature=gc.temperature, top_k=gc.top_k or 0, top_p=gc.top_p,
                           min_p=gc.min_p or 0.0, typical_p=gc.typical_p, repetition_penalty=gc.repetition_penalty,
                           seed=seed + b) for b in range(n_rows)]


def _hf_processors(gc, mask: Tensor, min_new: int, eos: list[int]):
    """transformers' logits processors for these settings, in generate's order (scores as transformers reports);
    mask: the prompt's attention mask (left padding is no part of the repetition penalty's history)."""
    from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                              RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper, TypicalLogitsWarper)
    out = LogitsProcessorList()
    if gc.repetition_penalty != 1.0:
        padding = (~mask).sum(dim=1)
        out.append(RepetitionPenaltyLogitsProcessor(gc.repetition_penalty, prompt_ignore_length=padding))
    if min_new > 0 and eos:
        out.append(MinNewTokensLengthLogitsProcessor(mask.shape[1], min_new, eos))
    if gc.do_sample:
        if gc.temperature != 1.0:
            out.append(TemperatureLogitsWarper(gc.temperature))
        if gc.top_k:
            out.append(TopKLogitsWarper(gc.top_k))
        if gc.top_p < 1.0:
            out.append(TopPLogitsWarper(gc.top_p))
        if gc.min_p:
            out.append(MinPLogitsWarper(gc.min_p))
        if gc.typical_p < 1.0:
            out.append(TypicalLogitsWarper(gc.typical_p))
    return out


def load_generation_config(path: Path, config):
    """The directory's generation_config.json, else the defaults transformers derives from config.json (config: its
    PretrainedConfig or its dict)."""
    from transformers import GenerationConfig
    if (path / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(str(path))
    return GenerationConfig.from_model_config(dict(config) if isinstance(config, dict) else config)


def hf_config(path: Path, raw: dict):
    """transformers' config class for the directory; a plain PretrainedConfig of the same fields when transformers
    does not know the model type (our own parse of config.json already succeeded)."""
    from transformers import AutoConfig, PretrainedConfig
    try:
        return AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, OSError):
        return PretrainedConfig.from_dict(raw)

"""What ChatExl and ExlLLM share: the fields users set, and their translation into Generator arguments."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from exl_backends import SamplingParams
from exl_backends.adapters.engines import shared_generator

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                   "presence_penalty", "seed")
# per-call keyword arguments a call may carry besides the sampling fields
CALL_FIELDS = SAMPLING_FIELDS + ("max_tokens", "model", "json_schema", "json_object")


class ExlSettings(BaseModel):
    model_config = ConfigDict(populate_by_name=True, protected_namespaces=())

    model_name: str = Field(alias="model")
    """The model directory (EXL2, GPTQ or fp16 safetensors with its tokenizer)."""
    max_tokens: int | None = None
    """New tokens at most; None: up to the model's context."""
    temperature: float | None = None
    """0 is greedy; None: the engine's default (1.0)."""
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    """Default stop strings: output ends before the first of them."""
    device: str | None = None
    """"cuda", "cpu", ...; None: CUDA when available."""
    max_seq_len: int | None = None
    """Context length to allocate; None: the model's (fitted to GPU memory)."""
    cache_mode: str = "fp16"
    """KV cache: "fp16", "q8", "q6" or "q4"."""

    def generator(self, model: str | None = None):
        """The shared Generator of this model directory (loaded on first use)."""
        return shared_generator(model or self.model_name, self.device, self.max_seq_len, self.cache_mode)

    def job_arguments(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Generator.submit keyword arguments from the fields, overridden by one call's kwargs (which may only
        name CALL_FIELDS: anything else is an error, never silently dropped)."""
        unknown = sorted(set(kwargs) - set(CALL_FIELDS))
        if unknown:
            raise ValueError(f"unsupported argument(s) {unknown} for {type(self).__name__}; supported per call: "
                             f"{list(CALL_FIELDS)}")
        values = {name: kwargs.get(name, getattr(self, name)) for name in SAMPLING_FIELDS}
        sampling = SamplingParams(**{k: v for k, v in values.items() if v is not None})
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is None:
            max_tokens = self.generator(kwargs.get("model")).max_seq_len    # the engine cuts it to what fits
        return {"max_new_tokens": max_tokens,
                "sampling": sampling, "stop": stop if stop is not None else (self.stop or []),
                "json_schema": kwargs.get("json_schema"), "json_object": bool(kwargs.get("json_object"))}

    @property
    def _llm_type(self) -> str:
        return "exl"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, **{name: getattr(self, name) for name in SAMPLING_FIELDS},
                "max_tokens": self.max_tokens, "stop": self.stop}

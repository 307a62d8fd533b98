"""Exl: a LlamaIndex LLM over exl-backends' Generator. complete() sends plain text; chat() renders the messages with
the tokenizer's chat template. The async methods wait for the engine in worker threads, so the event loop stays
free while tokens are computed."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, ChatResponseAsyncGen, ChatResponseGen,
                                              CompletionResponse, CompletionResponseAsyncGen,
                                              CompletionResponseGen, LLMMetadata, MessageRole, TextBlock)
from llama_index.core.bridge.pydantic import Field
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from exl_backends import SamplingParams
from exl_backends.engines import shared_generator

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
ROLES = {MessageRole.SYSTEM: "system", MessageRole.DEVELOPER: "system", MessageRole.USER: "user",
         MessageRole.ASSISTANT: "assistant", MessageRole.CHATBOT: "assistant", MessageRole.MODEL: "assistant",
         MessageRole.TOOL: "tool", MessageRole.FUNCTION: "tool"}


class Exl(CustomLLM):
    """`Exl(model="path/to/dir", max_tokens=256, temperature=0.7)`: a local EXL2/GPTQ/fp16 model. Construction is
    cheap; the weights load on first use (metadata included: the context window comes from the model), once per
    process for each directory."""

    model: str = Field(description="The model directory (EXL2, GPTQ or fp16 safetensors with its tokenizer).")
    max_tokens: int = Field(default=256, gt=0, description="New tokens at most per call (LLMMetadata.num_output).")
    temperature: float | None = Field(default=None, ge=0, description="0 is greedy; None: the engine's 1.0.")
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = Field(default=None, description="Stop strings: output ends before the first one.")
    device: str | None = Field(default=None, description='"cuda", "cpu", ...; None: CUDA when available.')
    max_seq_len: int | None = Field(default=None, description="Context to allocate; None: the model's.")
    cache_mode: str = Field(default="fp16", description='KV cache: "fp16", "q8", "q6" or "q4".')

    @classmethod
    def class_name(cls) -> str:
        return "Exl"

    @property
    def metadata(self) -> LLMMetadata:
        gen = self._generator()
        return LLMMetadata(context_window=gen.max_seq_len, num_output=self.max_tokens,
                           is_chat_model=bool(gen.tokenizer.chat_template), model_name=self.model)

    def _generator(self):
        return shared_generator(self.model, self.device, self.max_seq_len, self.cache_mode)

    def _job_arguments(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Generator.submit arguments from the fields, overridden per call by kwargs naming the same fields (any
        other kwarg is an error, never silently dropped)."""
        unknown = sorted(set(kwargs) - set(SAMPLING_FIELDS) - {"max_tokens", "stop"})
        if unknown:
            raise ValueError(f"unsupported argument(s) {unknown} for Exl; supported per call: "
                             f"{list(SAMPLING_FIELDS) + ['max_tokens', 'stop']}")
        values = {name: kwargs.get(name, getattr(self, name)) for name in SAMPLING_FIELDS}
        return {"max_new_tokens": kwargs.get("max_tokens", self.max_tokens),
                "sampling": SamplingParams(**{k: v for k, v in values.items() if v is not None}),
                "stop": kwargs.get("stop", self.stop) or []}

    def _submit(self, prompt, kwargs: dict[str, Any]):
        gen = self._generator()
        return gen, gen.submit(prompt, **self._job_arguments(kwargs))

    # ---- completion -------------------------------------------------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(prompt, formatted, kwargs)

    def _complete(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> CompletionResponse:
        done = self._submit(self._completion_prompt(prompt, formatted), kwargs)[1].result()
        return CompletionResponse(text=done.text, raw=raw_info(done))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        gen, job = self._submit(self._completion_prompt(prompt, formatted), kwargs)

        def responses() -> CompletionResponseGen:
            text = ""
            try:
                for piece in job:
                    text += piece.text
                    yield CompletionResponse(text=text, delta=piece.text, raw=raw_info(piece))
            finally:
                if not job.is_done:
                    gen.cancel(job)
        return responses()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await asyncio.to_thread(self._complete, prompt, formatted, kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        gen, job = await asyncio.to_thread(self._submit, self._completion_prompt(prompt, formatted), kwargs)

        async def responses() -> CompletionResponseAsyncGen:
            text = ""
            async for piece in pieces(gen, job):
                text += piece.text
                yield CompletionResponse(text=text, delta=piece.text, raw=raw_info(piece))
        return responses()

    def _completion_prompt(self, prompt: str, formatted: bool) -> str:
        return prompt if formatted else self.completion_to_prompt(prompt)

    # ---- chat (the tokenizer's chat template) -----------------------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        done = self._submit(chat_messages(messages), kwargs)[1].result()
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=done.text), raw=raw_info(done))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        gen, job = self._submit(chat_messages(messages), kwargs)

        def responses() -> ChatResponseGen:
            text = ""
            try:
                for piece in job:
                    text += piece.text
                    yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
                                       delta=piece.text, raw=raw_info(piece))
            finally:
                if not job.is_done:
                    gen.cancel(job)
        return responses()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await asyncio.to_thread(self._chat, messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        gen, job = await asyncio.to_thread(self._submit, chat_messages(messages), kwargs)

        async def responses() -> ChatResponseAsyncGen:
            text = ""
            async for piece in pieces(gen, job):
                text += piece.text
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
                                   delta=piece.text, raw=raw_info(piece))
        return responses()


async def pieces(gen, job):
    """The job's chunks, each awaited in a worker thread; closing early cancels the job."""
    try:
        while (piece := await asyncio.to_thread(next, job, None)) is not None:
            yield piece
    finally:
        if not job.is_done:
            await asyncio.to_thread(gen.cancel, job)


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    out = []
    for m in messages:
        if any(not isinstance(b, TextBlock) for b in m.blocks):
            raise ValueError(f"Exl takes text only; a {m.role.value} message has a non-text block")
        out.append({"role": ROLES[m.role], "content": "".join(b.text for b in m.blocks)})
    return out


def raw_info(piece) -> dict[str, Any] | None:
    """finish_reason and token usage of a finished job (None for a chunk in the middle of a stream)."""
    if piece.finish_reason is None:
        return None
    usage = piece.usage
    return {"finish_reason": piece.finish_reason, "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens}

"""ExlLLM: a LangChain text-completion LLM over exl-backends' Generator (the prompt is sent as plain text)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.language_models import LLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict

from langchain_exl.settings import ExlSettings


class ExlLLM(ExlSettings, LLM):
    """Text completion with a local EXL2/GPTQ/fp16 model: `ExlLLM(model="path/to/dir", max_tokens=64)`.

    Returns only the completion, cut before the first stop string. `batch` runs its prompts together in the engine's
    batches. Weights load on first use, once per process for each directory."""
    model_config = ConfigDict(populate_by_name=True, protected_namespaces=())

    def _submit(self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]):
        gen = self.generator(kwargs.get("model"))
        return gen, gen.submit(prompt, **self.job_arguments(stop, kwargs))

    def _call(self, prompt: str, stop: list[str] | None = None, run_manager=None, **kwargs: Any) -> str:
        return self._submit(prompt, stop, kwargs)[1].result().text

    def _generate(self, prompts: list[str], stop: list[str] | None = None, run_manager=None,
                  **kwargs: Any) -> LLMResult:
        """All prompts are queued first, so the engine decodes them in one batch."""
        jobs = [self._submit(p, stop, kwargs)[1] for p in prompts]
        done = [job.result() for job in jobs]
        generations = [[Generation(text=d.text, generation_info={"finish_reason": d.finish_reason})] for d in done]
        usage = {"prompt_tokens": sum(d.usage.prompt_tokens for d in done),
                 "completion_tokens": sum(d.usage.completion_tokens for d in done)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return LLMResult(generations=generations,
                         llm_output={"token_usage": usage, "model_name": kwargs.get("model") or self.model_name})

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None, run_manager=None,
                         **kwargs: Any) -> LLMResult:
        return await asyncio.to_thread(self._generate, prompts, stop, None, **kwargs)

    def _stream(self, prompt: str, stop: list[str] | None = None, run_manager=None,
                **kwargs: Any) -> Iterator[GenerationChunk]:
        # BaseLLM.stream() leaves token callbacks to us
        gen, job = self._submit(prompt, stop, kwargs)
        try:
            for piece in job:
                chunk = text_chunk(piece)
                if run_manager is not None:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        finally:
            if not job.is_done:
                gen.cancel(job)

    async def _astream(self, prompt: str, stop: list[str] | None = None, run_manager=None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        gen, job = await asyncio.to_thread(self._submit, prompt, stop, kwargs)
        try:
            while (piece := await asyncio.to_thread(next, job, None)) is not None:
                chunk = text_chunk(piece)
                if run_manager is not None:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        finally:
            if not job.is_done:
                await asyncio.to_thread(gen.cancel, job)


def text_chunk(piece) -> GenerationChunk:
    if piece.finish_reason is None:
        return GenerationChunk(text=piece.text)
    usage = piece.usage
    return GenerationChunk(text=piece.text, generation_info={
        "finish_reason": piece.finish_reason, "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens})

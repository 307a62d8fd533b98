"""ChatExl: a LangChain chat model over exl-backends' Generator, prompting through the tokenizer's chat template."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.chat_models import agenerate_from_stream
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict

from langchain_exl.settings import ExlSettings

ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool"}


class ChatExl(ExlSettings, BaseChatModel):
    """Chat model running a local EXL2/GPTQ/fp16 model in process.

    `ChatExl(model="path/to/dir", max_tokens=256, temperature=0.7)`. Construction is cheap: the weights load on first
    use, once per process for each directory (`exl_backends.engines`). Prompts are rendered with the tokenizer's chat
    template; generation ends at the template's end-of-turn tokens, at EOS, at a stop string (cut before it) or at
    max_tokens. Structured output is grammar-constrained (`with_structured_output`). Tool calling is not supported
    (`bind_tools` raises NotImplementedError). Text only: image, audio or file content blocks are refused.
    """
    model_config = ConfigDict(populate_by_name=True, protected_namespaces=())

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="exl", ls_model_name=kwargs.get("model", self.model_name),
                                 ls_model_type="chat")
        temperature = kwargs.get("temperature", self.temperature)
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if temperature is not None:
            params["ls_temperature"] = temperature
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # ---- generation -------------------------------------------------------------------------------------------------

    def _submit(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]):
        model = kwargs.get("model") or self.model_name
        gen = self.generator(model)
        return model, gen, gen.submit(chat_messages(messages), **self.job_arguments(stop, kwargs))

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                  **kwargs: Any) -> ChatResult:
        model, _, job = self._submit(messages, stop, kwargs)
        done = job.result()
        message = AIMessage(content=done.text, usage_metadata=usage_metadata(done.usage),
                            response_metadata={"model_name": model, "finish_reason": done.finish_reason})
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        # no on_llm_new_token here: BaseChatModel.stream() fires it for every chunk we yield
        model, gen, job = self._submit(messages, stop, kwargs)
        try:
            for piece in job:
                yield message_chunk(piece, model)
        finally:
            if not job.is_done:
                gen.cancel(job)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        # each wait for the engine runs in a worker thread: the event loop stays free while tokens are computed
        model, gen, job = await asyncio.to_thread(self._submit, messages, stop, kwargs)
        try:
            while (piece := await asyncio.to_thread(next, job, None)) is not None:
                yield message_chunk(piece, model)
        finally:
            if not job.is_done:
                await asyncio.to_thread(gen.cancel, job)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                         **kwargs: Any) -> ChatResult:
        return await agenerate_from_stream(self._astream(messages, stop, **kwargs))

    # ---- structured output ------------------------------------------------------------------------------------------

    def with_structured_output(self, schema: dict | type, *,
                               method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
                               include_raw: bool = False, strict: bool | None = None, **kwargs: Any) -> Runnable:
        """Output constrained to a JSON schema (pydantic class, TypedDict, or JSON schema dict) by the engine's
        grammar, parsed into the pydantic class or a dict. "function_calling" is served the same way (there is no
        tool calling; the result is the same object). method="json_mode": any JSON object (the prompt must say
        which). The grammar is always enforced, so `strict` changes nothing. The JSON is compact (no whitespace
        between tokens), so small models cannot spend their tokens on indentation; output cut by max_tokens fails
        to parse, so leave room."""
        if kwargs:
            raise ValueError(f"unsupported argument(s) {sorted(kwargs)} for ChatExl.with_structured_output")
        if method not in ("json_schema", "function_calling", "json_mode"):
            raise ValueError(f"method={method!r}: ChatExl supports 'json_schema', 'function_calling' (the same "
                             f"grammar) and 'json_mode'")
        ls_format = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        if method == "json_mode":
            llm = self.bind(json_object=True, ls_structured_output_format=ls_format)
        else:
            compact = {**convert_to_json_schema(schema), "x-guidance": {"whitespace_flexible": False}}
            llm = self.bind(json_schema=compact, ls_structured_output_format=ls_format)
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([unparsed], exception_key="parsing_error")


def chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages -> [{"role", "content"}] for the chat template (names and ids are dropped)."""
    out = []
    for m in messages:
        role = m.role if isinstance(m, ChatMessage) else ROLES.get(m.type)
        if role is None:
            raise ValueError(f"ChatExl cannot send a {type(m).__name__} (type {m.type!r}) to the chat template")
        out.append({"role": role, "content": text_content(m)})
    return out


def text_content(message: BaseMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text":
            parts.append(block["text"])
        else:
            raise ValueError(f"ChatExl takes text only; the message has a {block.get('type')!r} content block")
    return "".join(parts)


def usage_metadata(usage) -> UsageMetadata:
    return UsageMetadata(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                         total_tokens=usage.prompt_tokens + usage.completion_tokens,
                         input_token_details={"cache_read": usage.cached_tokens})


def message_chunk(piece, model: str) -> ChatGenerationChunk:
    """One engine chunk as a LangChain chunk; the last carries usage, model name and finish reason (once each,
    since chunks are summed)."""
    if piece.finish_reason is None:
        return ChatGenerationChunk(message=AIMessageChunk(content=piece.text))
    return ChatGenerationChunk(
        message=AIMessageChunk(content=piece.text, usage_metadata=usage_metadata(piece.usage),
                               response_metadata={"model_name": model, "finish_reason": piece.finish_reason},
                               chunk_position="last"),
        generation_info={"finish_reason": piece.finish_reason})

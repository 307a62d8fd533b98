"""ChatExl: a LangChain chat model over exl-backends' Generator, prompting through the tokenizer's chat template."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.chat_models import agenerate_from_stream
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage, ToolMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict

from exl_backends.engine.generator import template_stop_ids
from exl_backends.engine.tools import Delta, Reply, ToolRequest, finish_reason, prepare
from langchain_exl.settings import ExlSettings

ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool"}
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")     # what bind_tools binds, read by ChatExl itself


class ChatExl(ExlSettings, BaseChatModel):
    """Chat model running a local EXL2/GPTQ/fp16 model in process.

    `ChatExl(model="path/to/dir", max_tokens=256, temperature=0.7)`. Construction is cheap: the weights load on first
    use, once per process for each directory (`exl_backends.adapters.engines`). Prompts are rendered with the tokenizer's chat
    template; generation ends at the template's end-of-turn tokens, at EOS, at a stop string (cut before it) or at
    max_tokens. Structured output is grammar-constrained (`with_structured_output`). Text only: image, audio or file
    content blocks are refused.

    Tools (`bind_tools`): rendered with the chat template (or exl_backends.engine.tools' generic fallback for a template
    without tools); every call is built by a grammar, so it parses and its arguments fit the tool's schema.
    `tool_choice` "any"/"required"/True or a tool's name forces a call. Calls come back as `AIMessage.tool_calls`
    (`tool_call_chunks` while streaming; finish_reason "tool_calls"). For templates that think in tags (Qwen3,
    R1 distills) the reasoning is in `additional_kwargs["reasoning_content"]`, never in the content;
    `enable_thinking=False` turns it off where the template offers the switch.
    """
    model_config = ConfigDict(populate_by_name=True, protected_namespaces=())

    enable_thinking: bool | None = None
    """False: ask the chat template for no reasoning block (Qwen3's switch); None: the template's default."""

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
        """The job of one call, and the tool request that parses its reply."""
        tool_args = {k: kwargs[k] for k in TOOL_FIELDS if k in kwargs}
        kwargs = {k: v for k, v in kwargs.items() if k not in TOOL_FIELDS}
        model = kwargs.get("model") or self.model_name
        gen = self.generator(model)
        request = prepare(gen.tokenizer, chat_messages(messages), tool_args.get("tools"),
                          tool_args.get("tool_choice"), tool_args.get("parallel_tool_calls") is not False,
                          self.enable_thinking)
        arguments = self.job_arguments(stop, kwargs)
        if request.grammar is not None:
            if arguments["json_schema"] or arguments["json_object"]:
                raise ValueError("ChatExl: tools cannot be combined with json_schema/json_object output; bind one")
            arguments["grammar"], arguments["stop_check"] = request.grammar, request.stop_check()
        job = gen.submit(request.ids(), stop_token_ids=gen.eos_ids | template_stop_ids(gen.tokenizer), **arguments)
        return model, gen, job, request

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                  **kwargs: Any) -> ChatResult:
        model, _, job, request = self._submit(messages, stop, kwargs)
        done = job.result()
        parser = request.parser()
        pieces = parser.feed(done.text) + parser.close()
        reply = Reply.of(pieces).distinct()
        message = AIMessage(
            content=reply.content, additional_kwargs=reasoning_kwargs(reply.reasoning),
            tool_calls=[{"name": c.name, "args": json.loads(c.arguments), "id": c.id, "type": "tool_call"}
                        for c in reply.calls],
            usage_metadata=usage_metadata(done.usage),
            response_metadata={"model_name": model, "finish_reason": finish_reason(pieces, done.finish_reason)})
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        # no on_llm_new_token here: BaseChatModel.stream() fires it for every chunk we yield
        model, gen, job, request = self._submit(messages, stop, kwargs)
        split = ReplyChunks(request, model)
        try:
            for piece in job:
                yield from split(piece)
        finally:
            if not job.is_done:
                gen.cancel(job)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        # each wait for the engine runs in a worker thread: the event loop stays free while tokens are computed
        model, gen, job, request = await asyncio.to_thread(self._submit, messages, stop, kwargs)
        split = ReplyChunks(request, model)
        try:
            while (piece := await asyncio.to_thread(next, job, None)) is not None:
                for chunk in split(piece):
                    yield chunk
        finally:
            if not job.is_done:
                await asyncio.to_thread(gen.cancel, job)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                         **kwargs: Any) -> ChatResult:
        return await agenerate_from_stream(self._astream(messages, stop, **kwargs))

    # ---- tools ------------------------------------------------------------------------------------------------------

    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
                   tool_choice: dict | str | bool | None = None, parallel_tool_calls: bool | None = None,
                   **kwargs: Any) -> Runnable:
        """Tools as pydantic classes, TypedDicts, functions, LangChain tools or OpenAI dicts (converted by
        convert_to_openai_tool). tool_choice: None/"auto" (the model decides), "none", "any"/"required"/True (a
        call is forced), or a tool's name (that tool is called). parallel_tool_calls=False: one call at most.
        The schemas are checked when the model is called (a ToolError, a ValueError, names the fault)."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        return self.bind(tools=formatted, tool_choice=openai_tool_choice(tool_choice, formatted),
                         parallel_tool_calls=parallel_tool_calls, **kwargs)

    # ---- structured output ------------------------------------------------------------------------------------------

    def with_structured_output(self, schema: dict | type, *,
                               method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
                               include_raw: bool = False, strict: bool | None = None, **kwargs: Any) -> Runnable:
        """Output constrained to a JSON schema (pydantic class, TypedDict, or JSON schema dict) by the engine's
        grammar, parsed into the pydantic class or a dict. method="function_calling": the schema becomes a tool whose
        call is forced (the prompt describes it as a tool; the raw message has it in tool_calls), the same object
        comes back. method="json_mode": any JSON object (the prompt must say which). The grammar is always enforced, so `strict` changes nothing. The JSON is compact (no whitespace
        between tokens), so small models cannot spend their tokens on indentation; output cut by max_tokens fails
        to parse, so leave room."""
        if kwargs:
            raise ValueError(f"unsupported argument(s) {sorted(kwargs)} for ChatExl.with_structured_output")
        if method not in ("json_schema", "function_calling", "json_mode"):
            raise ValueError(f"method={method!r}: ChatExl supports 'json_schema', 'function_calling' (the same "
                             f"grammar) and 'json_mode'")
        ls_format = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, parallel_tool_calls=False,
                                  ls_structured_output_format=ls_format)
            parser = PydanticToolsParser(tools=[schema], first_tool_only=True) if is_pydantic else \
                JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            return with_raw(llm, parser) if include_raw else llm | parser
        if method == "json_mode":
            llm = self.bind(json_object=True, ls_structured_output_format=ls_format)
        else:
            compact = {**convert_to_json_schema(schema), "x-guidance": {"whitespace_flexible": False}}
            llm = self.bind(json_schema=compact, ls_structured_output_format=ls_format)
        parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        return with_raw(llm, parser) if include_raw else llm | parser


def with_raw(llm: Runnable, parser: Runnable) -> Runnable:
    """{"raw": message, "parsed": object or None, "parsing_error": exception or None}."""
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parsed.with_fallbacks([unparsed], exception_key="parsing_error")


def openai_tool_choice(choice: dict | str | bool | None, tools: list[dict]) -> dict | str | None:
    """LangChain's tool_choice forms -> OpenAI's (exl_backends.engine.tools checks the result)."""
    if choice is None or isinstance(choice, dict) or choice in ("auto", "none", "required"):
        return choice
    if choice is True or choice == "any":
        return "required"
    if choice is False:
        return "none"
    if isinstance(choice, str):
        return {"type": "function", "function": {"name": choice}}
    raise ValueError(f"tool_choice {choice!r}: use 'auto', 'none', 'any'/'required', a tool's name, or "
                     f"{{'type': 'function', 'function': {{'name': ...}}}} (tools: "
                     f"{[t['function']['name'] for t in tools]})")


def chat_messages(messages: Sequence[BaseMessage]) -> list[dict]:
    """LangChain messages -> OpenAI-style dicts for the chat template: text content, an AI message's tool calls,
    a tool message's tool_call_id (names are dropped)."""
    out = []
    for m in messages:
        role = m.role if isinstance(m, ChatMessage) else ROLES.get(m.type)
        if role is None:
            raise ValueError(f"ChatExl cannot send a {type(m).__name__} (type {m.type!r}) to the chat template")
        message = {"role": role, "content": text_content(m)}
        if isinstance(m, AIMessage) and m.tool_calls:
            message["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": json.dumps(c["args"])}}
                                     for c in m.tool_calls]
        if isinstance(m, AIMessage) and m.additional_kwargs.get("reasoning_content"):
            message["reasoning_content"] = m.additional_kwargs["reasoning_content"]
        if isinstance(m, ToolMessage):
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
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
        elif block.get("type") in ("tool_use", "tool_call") and isinstance(message, AIMessage):
            continue        # a provider's copy of a call that message.tool_calls holds
        else:
            raise ValueError(f"ChatExl takes text only; the message has a {block.get('type')!r} content block")
    return "".join(parts)


def usage_metadata(usage) -> UsageMetadata:
    return UsageMetadata(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                         total_tokens=usage.prompt_tokens + usage.completion_tokens,
                         input_token_details={"cache_read": usage.cached_tokens})


def reasoning_kwargs(reasoning: str) -> dict:
    return {"reasoning_content": reasoning} if reasoning else {}


class ReplyChunks:
    """Engine chunks -> LangChain chunks through the reply's parser: content, reasoning (additional_kwargs) and
    tool_call_chunks (a call's first with its id and name, then argument pieces, all with its index); the last
    carries usage, model name and finish reason (once each, since chunks are summed)."""

    def __init__(self, request: ToolRequest, model: str):
        self.parser, self.model = request.parser(), model
        self.seen: list[Delta] = []

    def __call__(self, piece) -> list[ChatGenerationChunk]:
        pieces = self.parser.feed(piece.text) if piece.text else []
        if piece.finish_reason is not None:
            pieces += self.parser.close()
        self.seen += [d for d in pieces if d.kind in ("call", "incomplete")]     # what finish_reason reads
        out = [ChatGenerationChunk(message=m) for m in map(lc_chunk, pieces) if m is not None]
        if piece.finish_reason is not None:
            reason = finish_reason(self.seen, piece.finish_reason)
            out.append(ChatGenerationChunk(
                message=AIMessageChunk(content="", usage_metadata=usage_metadata(piece.usage),
                                       response_metadata={"model_name": self.model, "finish_reason": reason},
                                       chunk_position="last"),
                generation_info={"finish_reason": reason}))
        return out


def lc_chunk(d: Delta) -> AIMessageChunk | None:
    if d.kind == "content":
        return AIMessageChunk(content=d.text)
    if d.kind == "reasoning":
        return AIMessageChunk(content="", additional_kwargs={"reasoning_content": d.text})
    if d.kind == "call":
        return AIMessageChunk(content="", tool_call_chunks=[
            {"name": d.name, "args": "", "id": d.id, "index": d.index, "type": "tool_call_chunk"}])
    if d.kind == "arguments":
        return AIMessageChunk(content="", tool_call_chunks=[
            {"name": None, "args": d.text, "id": None, "index": d.index, "type": "tool_call_chunk"}])
    return None

"""Exl: a LlamaIndex LLM over exl-backends' Generator. complete() sends plain text; chat() renders the messages with
the tokenizer's chat template. The async methods wait for the engine in worker threads, so the event loop stays
free while tokens are computed.

Exl is a FunctionCallingLLM (FunctionAgent, predict_and_call, structured_predict through tools): chat_with_tools
goes through exl_backends.engine.tools, whose grammar builds every call, so each parses and fits its tool's schema.
Calls come back in message.additional_kwargs["tool_calls"] (OpenAI's form: id, type, function name and arguments
text), which get_tool_calls_from_response reads; tool results go back as role "tool" messages with
additional_kwargs["tool_call_id"], as FunctionAgent writes them. Reasoning of templates that think in tags is in
additional_kwargs["reasoning_content"], never in the content."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, ChatResponseAsyncGen, ChatResponseGen,
                                              CompletionResponse, CompletionResponseAsyncGen,
                                              CompletionResponseGen, LLMMetadata, MessageRole, TextBlock,
                                              ToolCallBlock)
from llama_index.core.bridge.pydantic import Field
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

from exl_backends import SamplingParams
from exl_backends.adapters.engines import shared_generator
from exl_backends.engine.generator import template_stop_ids
from exl_backends.engine.tools import Delta, Reply, ToolRequest, finish_reason, prepare

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
ROLES = {MessageRole.SYSTEM: "system", MessageRole.DEVELOPER: "system", MessageRole.USER: "user",
         MessageRole.ASSISTANT: "assistant", MessageRole.CHATBOT: "assistant", MessageRole.MODEL: "assistant",
         MessageRole.TOOL: "tool", MessageRole.FUNCTION: "tool"}
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")     # what _prepare_chat_with_tools adds to chat()


class Exl(FunctionCallingLLM):
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
    enable_thinking: bool | None = Field(default=None, description="False: ask the chat template for no reasoning "
                                                                   "block (Qwen3's switch); None: its default.")

    @classmethod
    def class_name(cls) -> str:
        return "Exl"

    @property
    def metadata(self) -> LLMMetadata:
        gen = self._generator()
        return LLMMetadata(context_window=gen.max_seq_len, num_output=self.max_tokens,
                           is_chat_model=bool(gen.tokenizer.chat_template),
                           is_function_calling_model=bool(gen.tokenizer.chat_template), model_name=self.model)

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

    def _submit_chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]):
        """The job of a chat call (with the tools chat_with_tools added, if any) and the request that parses it."""
        gen = self._generator()
        tools = {k: kwargs[k] for k in TOOL_FIELDS if k in kwargs}
        request = prepare(gen.tokenizer, chat_messages(messages), tools.get("tools"), tools.get("tool_choice"),
                          tools.get("parallel_tool_calls") is not False, self.enable_thinking)
        arguments = self._job_arguments({k: v for k, v in kwargs.items() if k not in TOOL_FIELDS})
        job = gen.submit(request.ids(), grammar=request.grammar, stop_check=request.stop_check(),
                         stop_token_ids=gen.eos_ids | template_stop_ids(gen.tokenizer), **arguments)
        return gen, job, request

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
        _, job, request = self._submit_chat(messages, kwargs)
        done = job.result()
        parser = request.parser()
        pieces = parser.feed(done.text) + parser.close()
        return ChatResponse(message=assistant_message(pieces), raw=raw_info(done, pieces))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        gen, job, request = self._submit_chat(messages, kwargs)
        split = ReplyResponses(request)

        def responses() -> ChatResponseGen:
            try:
                for piece in job:
                    yield split(piece)
            finally:
                if not job.is_done:
                    gen.cancel(job)
        return responses()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await asyncio.to_thread(self._chat, messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        gen, job, request = await asyncio.to_thread(self._submit_chat, messages, kwargs)
        split = ReplyResponses(request)

        async def responses() -> ChatResponseAsyncGen:
            async for piece in pieces(gen, job):
                yield split(piece)
        return responses()

    # ---- tools ------------------------------------------------------------------------------------------------------

    def _prepare_chat_with_tools(self, tools: Sequence[BaseTool], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                 tool_choice: str | dict | None = None, **kwargs: Any) -> dict[str, Any]:
        """chat() arguments: the history and user message, the tools as OpenAI specs, the tool choice (tool_choice
        wins: "auto", "none", "required" or a tool's name; else tool_required forces a call)."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str)
                            else user_msg)
        if isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "required"):
            tool_choice = {"type": "function", "function": {"name": tool_choice}}
        return {"messages": messages, "tools": [t.metadata.to_openai_tool(skip_length_check=True) for t in tools],
                "tool_choice": tool_choice or ("required" if tool_required else "auto"),
                "parallel_tool_calls": allow_parallel_tool_calls, **kwargs}

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        calls = response.message.additional_kwargs.get("tool_calls") or []
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected at least one tool call, but the reply has none: "
                             f"{(response.message.content or '')[:200]!r}")
        return [ToolSelection(tool_id=c["id"], tool_name=c["function"]["name"],
                              tool_kwargs=json.loads(c["function"]["arguments"])) for c in calls]


async def pieces(gen, job):
    """The job's chunks, each awaited in a worker thread; closing early cancels the job."""
    try:
        while (piece := await asyncio.to_thread(next, job, None)) is not None:
            yield piece
    finally:
        if not job.is_done:
            await asyncio.to_thread(gen.cancel, job)


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict]:
    """LlamaIndex messages -> OpenAI-style dicts for the chat template: text, an assistant's tool calls
    (additional_kwargs["tool_calls"] or ToolCallBlocks), a tool message's additional_kwargs["tool_call_id"]."""
    out = []
    for m in messages:
        if any(not isinstance(b, (TextBlock, ToolCallBlock)) for b in m.blocks):
            raise ValueError(f"Exl takes text only; a {m.role.value} message has a non-text block")
        message = {"role": ROLES[m.role], "content": "".join(b.text for b in m.blocks if isinstance(b, TextBlock))}
        calls = m.additional_kwargs.get("tool_calls") or [
            {"id": b.tool_call_id, "type": "function", "function": {"name": b.tool_name, "arguments": b.tool_kwargs}}
            for b in m.blocks if isinstance(b, ToolCallBlock)]
        if calls:
            message["tool_calls"] = [c if isinstance(c, dict) else c.model_dump() for c in calls]
        if m.role in (MessageRole.TOOL, MessageRole.FUNCTION):
            message["tool_call_id"] = m.additional_kwargs.get("tool_call_id")
        out.append(message)
    return out


def assistant_message(pieces: list[Delta]) -> ChatMessage:
    """A whole reply: its content, its calls, its reasoning."""
    reply = Reply.of(pieces).distinct()
    return message_of(reply.content, reply.reasoning, [c.spec() for c in reply.calls])


def message_of(content: str, reasoning: str, calls: list[dict]) -> ChatMessage:
    extra: dict[str, Any] = {}
    if calls:
        extra["tool_calls"] = calls
    if reasoning:
        extra["reasoning_content"] = reasoning
    return ChatMessage(role=MessageRole.ASSISTANT, content=content, additional_kwargs=extra)


class ReplyResponses:
    """Engine chunks -> ChatResponses through the reply's parser: the message so far (content, reasoning, and the
    calls whose arguments are complete: a call still streaming is not yet in it) and the content delta."""

    def __init__(self, request: ToolRequest):
        self.parser = request.parser()
        self.content = self.reasoning = ""
        self.calls: list[dict] = []             # OpenAI's form; the last one's arguments may be growing
        self.open = False                       # the last call's arguments are not complete yet
        self.seen: list[Delta] = []             # call begins and cuts, for finish_reason

    def __call__(self, piece) -> ChatResponse:
        new = self.parser.feed(piece.text) if piece.text else []
        if piece.finish_reason is not None:
            new += self.parser.close()
        for d in new:
            if d.kind == "content":
                self.content += d.text
            elif d.kind == "reasoning":
                self.reasoning += d.text
            elif d.kind == "call":
                self.calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
            elif d.kind == "arguments":
                self.calls[-1]["function"]["arguments"] += d.text
            else:                               # "incomplete": the budget cut the last call
                self.calls.pop()
            if d.kind in ("call", "arguments"):
                self.open = not complete_json(self.calls[-1]["function"]["arguments"])
            elif d.kind == "incomplete":
                self.open = False
        self.seen += [d for d in new if d.kind in ("call", "incomplete")]
        # (a complete call never changes again: the messages can share it)
        message = message_of(self.content, self.reasoning, self.calls[:-1] if self.open else list(self.calls))
        delta = "".join(d.text for d in new if d.kind == "content")
        return ChatResponse(message=message, delta=delta, raw=raw_info(piece, self.seen))


def complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def raw_info(piece, pieces: list[Delta] | None = None) -> dict[str, Any] | None:
    """finish_reason ("tool_calls" when the reply called tools) and token usage of a finished job (None for a chunk
    in the middle of a stream)."""
    if piece.finish_reason is None:
        return None
    usage = piece.usage
    return {"finish_reason": finish_reason(pieces or [], piece.finish_reason), "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens}

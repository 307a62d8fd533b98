"""POST /v1/chat/completions and /v1/completions: a request becomes one Generator job per choice (n per prompt), and
the jobs' chunks become OpenAI's response, or its stream of SSE chunks ending in `data: [DONE]`.

Prompts are tokenized here, the way Generator.submit would (chat: the tokenizer's own chat template, whose special
tokens then also end the reply), so that a prompt over the context is a 400 with the numbers before anything is
queued. max_tokens is cut to what fits the context (finish_reason "length" there), as the engine does.

Chat goes through the tool-calling core (exl_backends/engine/tools.py), with tools or without: it renders the messages
(tool calls and tool results included), gives the grammar that makes every call parse and fit its tool's schema,
and splits each reply, streamed or whole, into reasoning (`reasoning_content`), content and `tool_calls`."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections import defaultdict

from fastapi import Request
from sse_starlette import EventSourceResponse

from ..engine.generator import Generator, template_stop_ids
from ..engine.job import Chunk
from ..engine.sampling import SamplingParams
from ..engine.tools import Delta, Reply, ToolError, ToolRequest, finish_reason, prepare
from ..errors import SamplingError
from . import errors
from .engine import Engine, JobStream, QueueFull
from .errors import APIError, bad_request
from .metrics import Metrics
from .schemas import ChatRequest, CompletionRequest, Message, ResponseFormat, Samplers

COMPLETIONS_DEFAULT_MAX_TOKENS = 16         # OpenAI's default for the legacy endpoint
DISCONNECT_POLL_S = 0.5                     # how often a non-streaming request checks that its client is there
SSE_PING_S = 15
SAMPLER_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams)
                       if f.name in Samplers.model_fields and f.name not in ("logit_bias", "seed"))


class Completions:
    def __init__(self, generator: Generator, engine: Engine, model_id: str, metrics: Metrics):
        self.generator, self.engine, self.model_id, self.metrics = generator, engine, model_id, metrics
        self.tokenizer = generator.tokenizer
        self.max_seq_len = generator.max_seq_len
        self._token_text: TokenText | None = None

    # ---- prompts ----------------------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise APIError(404, f"The model '{model}' does not exist: this server serves '{self.model_id}' "
                                f"(GET /v1/models)", param="model", code="model_not_found")

    def chat_request(self, messages: list[Message], tools: list | None = None, tool_choice=None,
                     parallel_tool_calls: bool = True, enable_thinking: bool | None = None) -> ToolRequest:
        """The messages rendered with the tokenizer's chat template for the assistant's reply, with the tools' grammar
        and the reply's parser (ToolError: a 400 naming the field)."""
        if not self.tokenizer.chat_template:
            raise bad_request("this model has no chat template (chat_template in tokenizer_config.json, or "
                              "chat_template.jinja): use /v1/completions with a prompt instead", param="messages")
        try:
            return prepare(self.tokenizer, [message_dict(m, i) for i, m in enumerate(messages)], tools, tool_choice,
                           parallel_tool_calls, enable_thinking)
        except ToolError as e:
            raise bad_request(str(e), param=tool_error_param(str(e))) from None

    def chat_text(self, messages: list[Message]) -> str:
        return self.chat_request(messages).prompt

    def chat_ids(self, prompt: str) -> list[int]:
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        self._check_context(ids, "messages")
        return ids

    def text_ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise bad_request("the prompt is empty: give at least one token", param=param)
        vocab = self.generator.config.vocab_size
        if max(ids) >= vocab:
            raise bad_request(f"prompt token id {max(ids)} is outside the vocabulary (0 to {vocab - 1})",
                              param=param)
        self._check_context(ids, param)
        return ids

    def _check_context(self, ids: list[int], param: str) -> None:
        if len(ids) >= self.max_seq_len:
            e = errors.context_length_error(len(ids), self.max_seq_len)
            e.param = param
            raise e

    def token_text(self) -> "TokenText":
        if self._token_text is None:
            self._token_text = TokenText(self.tokenizer)
        return self._token_text

    # ---- jobs -------------------------------------------------------------------------------------------------

    def job_requests(self, req: ChatRequest | CompletionRequest, prompts: list[list[int]], n: int,
                     max_tokens: int, n_top: int | None, stop_ids: frozenset[int],
                     tooled: ToolRequest | None = None) -> list[dict]:
        """Generator.submit keyword arguments for every choice: prompt p's choice j is job p * n + j. n_top: how
        many alternatives to report with each token's logprob (None: no logprobs). tooled: the tools' request,
        whose grammar (a response_format with it is refused before) and stop check the jobs take."""
        constraint = {"grammar": tooled.grammar, "stop_check": tooled.stop_check()} if tooled and tooled.grammar \
            else response_format(req.response_format)
        stop = [s for s in ([req.stop] if isinstance(req.stop, str) else req.stop or []) if s]
        base = dict(max_new_tokens=max_tokens, stop=stop, banned_strings=req.banned_strings or (),
                    stop_token_ids=stop_ids, logprobs=0 if n_top is None else max(n_top, 1),
                    min_new_tokens=min(req.min_tokens or 0, max_tokens), **constraint)
        return [dict(base, prompt=ids, sampling=self.sampling(req, j)) for ids in prompts for j in range(n)]

    def sampling(self, req: Samplers, choice: int) -> SamplingParams:
        fields = {name: getattr(req, name) for name in SAMPLER_FIELDS if getattr(req, name) is not None}
        if "dry_sequence_breakers" in fields:
            fields["dry_sequence_breakers"] = tuple(fields["dry_sequence_breakers"])
        if req.logit_bias:
            vocab = self.generator.config.vocab_size
            bad = [t for t in req.logit_bias if not 0 <= t < vocab]
            if bad:
                raise bad_request(f"logit_bias: token id {bad[0]} is outside the vocabulary (0 to {vocab - 1})",
                                  param="logit_bias")
            fields["logit_bias"] = dict(req.logit_bias)
        if req.seed is not None:
            fields["seed"] = (req.seed + choice) % 2**63
        try:
            return SamplingParams(**fields)
        except SamplingError as e:
            raise bad_request(str(e)) from None

    async def start(self, requests: list[dict], n_prompt_tokens: int) -> JobStream:
        try:
            stream = await self.engine.start(requests)
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except APIError:
            raise
        except Exception as e:
            raise errors.from_submit(e) from None
        self.metrics.prompt(n_prompt_tokens)
        return stream

    # ---- the endpoints ----------------------------------------------------------------------------------------

    async def chat(self, req: ChatRequest, request: Request):
        self.check_model(req.model)
        if req.functions:
            raise bad_request("`functions` (OpenAI's deprecated form) is not supported: send the functions as "
                              "`tools`: [{\"type\": \"function\", \"function\": {...}}]", param="functions",
                              code="functions_not_supported")
        n = req.n or 1
        n_top = (req.top_logprobs or 0) if req.logprobs else None
        if n_top is not None:
            await asyncio.to_thread(self.token_text)        # reads the vocabulary once
        thinking = req.chat_template_kwargs.enable_thinking if req.chat_template_kwargs else None
        tooled = await asyncio.to_thread(self.chat_request, req.messages, req.tools, req.tool_choice,
                                         req.parallel_tool_calls is not False, thinking)
        constrained = tooled
        if req.response_format is not None and req.response_format.type != "text":
            if tooled.choice != "none" and tooled.tools:
                raise bad_request("response_format cannot be combined with tools (the reply is either text or "
                                  "tool calls): drop one, or set tool_choice 'none'", param="response_format")
            constrained = None      # tool_choice "none": the reply is the response_format's text
        ids = await asyncio.to_thread(self.chat_ids, tooled.prompt)
        stop_ids = self.generator.eos_ids | template_stop_ids(self.tokenizer)
        max_tokens = req.max_completion_tokens or req.max_tokens or self.max_seq_len
        stream = await self.start(self.job_requests(req, [ids], n, max_tokens, n_top, stop_ids, constrained),
                                  len(ids))
        out = ChatOutput(self, n, n_top, stop_ids, tooled)
        if req.stream:
            return self.sse(stream, out, req.stream_options and req.stream_options.include_usage)
        return out.response(await collect(stream, request))

    async def complete(self, req: CompletionRequest, request: Request):
        self.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix (insertion) is not supported", param="suffix")
        n = req.n or 1
        if req.best_of is not None and req.best_of != n:
            raise bad_request("best_of other than n is not supported", param="best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo with logprobs (prompt logprobs) is not supported", param="echo")
        prompts = split_prompts(req.prompt)
        if not prompts:
            raise bad_request("the prompt is empty: give at least one prompt", param="prompt")
        if req.logprobs is not None:
            await asyncio.to_thread(self.token_text)
        ids = await asyncio.to_thread(lambda: [self.text_ids(p) for p in prompts])
        echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts] if req.echo else None
        n_top = req.logprobs
        max_tokens = req.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        stream = await self.start(self.job_requests(req, ids, n, max_tokens, n_top, self.generator.eos_ids),
                                  sum(map(len, ids)))
        out = TextOutput(self, n, n_top, self.generator.eos_ids, echo)
        if req.stream:
            return self.sse(stream, out, req.stream_options and req.stream_options.include_usage)
        return out.response(await collect(stream, request))

    def sse(self, stream: JobStream, out: "Output", include_usage: bool) -> EventSourceResponse:
        async def events():
            try:
                if out.opening():
                    yield b"".join(out.event(c, include_usage) for c in out.opening())
                async for chunks in stream:
                    yield b"".join(out.event(c, include_usage) for index, chunk in chunks
                                   for c in out.deltas(index, chunk))
                if include_usage:
                    yield out.event([], include_usage, out.usage())
            except Exception as e:      # mid-stream: an error event, which the openai client raises
                yield sse_event(dumps(errors.from_generation(e).body()))
            finally:
                stream.cancel()         # the client left (CancelledError here) or a job failed: free the rest
            yield sse_event("[DONE]")
        return EventSourceResponse(events(), sep="\n", ping=SSE_PING_S)


dumps = json.JSONEncoder(separators=(",", ":")).encode


def sse_event(data: str) -> bytes:
    """`data: ...` and a blank line: what sse_starlette.ServerSentEvent writes for one line of data (JSON from
    dumps has no newline), at a third of its cost; a stream writes one per token and choice."""
    return f"data: {data}\n\n".encode()


async def collect(stream: JobStream, request: Request) -> dict[int, list[Chunk]]:
    """Every job's chunks; a client that leaves before the end has its jobs cancelled."""
    async def watch():
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        stream.cancel()
    watcher = asyncio.create_task(watch())
    chunks: dict[int, list[Chunk]] = defaultdict(list)
    try:
        async for batch in stream:
            for index, chunk in batch:
                chunks[index].append(chunk)
    except Exception as e:
        stream.cancel()
        raise errors.from_generation(e) from None
    finally:
        watcher.cancel()
    return chunks


def message_dict(m: Message, index: int) -> dict:
    """A request's message as the chat template (through tools.prepare) reads it."""
    out = {"role": "system" if m.role == "developer" else m.role, "content": message_text(m, index)}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    return out


def tool_error_param(message: str) -> str | None:
    """The request field a ToolError's message is about (it starts by naming it)."""
    if message.startswith("tool_choice"):
        return "tool_choice"
    if message.startswith("tools"):
        return "tools"
    return "messages"


def message_text(m: Message, index: int) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    texts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"messages[{index}].content: only text parts are supported, got a part of type "
                              f"{part.type!r}", param=f"messages[{index}].content")
        texts.append(part.text)
    return "\n".join(texts)


def split_prompts(prompt) -> list[str | list[int]]:
    """OpenAI's prompt forms: a string, strings, token ids, lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def response_format(rf: ResponseFormat | None) -> dict:
    """Generator.submit's constraint arguments."""
    if rf is None or rf.type == "text":
        return {}
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.json_schema is None or rf.json_schema.json_schema is None:
        raise bad_request("response_format json_schema needs json_schema.schema", param="response_format")
    return {"json_schema": rf.json_schema.json_schema}


class TokenText:
    """Each token's text and UTF-8 bytes, for logprobs: llguidance reads the raw bytes of byte-level tokens (a
    token may hold part of a character). A tokenizer it cannot read gives the decoded text and bytes null."""

    def __init__(self, tokenizer):
        import llguidance.hf
        self.tokenizer = tokenizer
        try:
            self.ll = llguidance.hf.from_tokenizer(tokenizer)
        except ValueError:
            self.ll = None
        self._known: dict[int, tuple[str, list[int] | None]] = {}

    def __call__(self, token: int) -> tuple[str, list[int] | None]:
        known = self._known.get(token)
        if known is None:
            if self.ll is None:
                known = (self.tokenizer.decode([token]), None)
            else:
                raw = self.ll.decode_bytes([token])
                known = (raw.decode("utf-8", errors="replace"), list(raw))
            self._known[token] = known
        return known


# ---- responses ---------------------------------------------------------------------------------------------------

class Output:
    """The response to one request, built from its jobs' chunks. Choice i is job i (prompt i // n)."""
    kind: str           # "chat.completion" or "text_completion"
    id_prefix: str

    def __init__(self, completions: Completions, n: int, n_top: int | None, stop_ids: frozenset[int]):
        self.model_id = completions.model_id
        self.token_text = completions.token_text() if n_top is not None else None
        self.n, self.n_top, self.stop_ids = n, n_top, stop_ids
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.finals: dict[int, Chunk] = {}
        self._head: str | None = None

    def usage(self) -> dict:
        """Each prompt counts once, each choice's tokens count."""
        prompts = [c.usage for i, c in self.finals.items() if i % self.n == 0]
        prompt = sum(u.prompt_tokens for u in prompts)
        completion = sum(c.usage.completion_tokens for c in self.finals.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in prompts)}}

    def event(self, choices: list[dict], include_usage: bool, usage: dict | None = None) -> bytes:
        """One streamed chunk as an SSE event. The fields every chunk repeats are serialized once per request."""
        if self._head is None:
            self._head = dumps({"id": self.id, "object": f"{self.kind}.chunk" if self.kind == "chat.completion"
                                else self.kind, "created": self.created, "model": self.model_id,
                                "system_fingerprint": None})[:-1] + ',"choices":'
        tail = f',"usage":{dumps(usage)}}}' if include_usage else "}"
        return sse_event(self._head + dumps(choices) + tail)

    def scored(self, chunk: Chunk) -> list:
        """The chunk's logprobs of content tokens (the token that stopped the job is not content)."""
        if self.n_top is None or not chunk.logprobs:
            return []
        return [lp for t, lp in zip(chunk.token_ids, chunk.logprobs) if t not in self.stop_ids]

    def opening(self) -> list[list[dict]]:
        return []

    def deltas(self, index: int, chunk: Chunk) -> list[list[dict]]:
        raise NotImplementedError

    def response(self, chunks: dict[int, list[Chunk]]) -> dict:
        raise NotImplementedError


class ChatOutput(Output):
    """Each choice's text goes through its own parser (the request's): reasoning, content and tool calls come out as
    OpenAI's fields; a reply with calls finishes with "tool_calls", one whose last call the budget cut with
    "length" (the cut call is left out of a whole reply; a stream has sent its pieces)."""
    kind, id_prefix = "chat.completion", "chatcmpl"

    def __init__(self, completions: Completions, n: int, n_top: int | None, stop_ids: frozenset[int],
                 request: ToolRequest):
        super().__init__(completions, n, n_top, stop_ids)
        self.request = request
        self.parsers: dict = {}
        self.calls: dict[int, list[Delta]] = defaultdict(list)     # each choice's call begins and cuts so far

    def logprobs(self, scored: list) -> dict:
        text = self.token_text

        def entry(token: int, logprob: float) -> dict:
            s, raw = text(token)
            return {"token": s, "logprob": logprob, "bytes": raw}
        return {"content": [dict(entry(r.token, r.logprob), top_logprobs=[entry(t, lp) for t, lp in
                                                                            r.top[:self.n_top]])
                            for r in scored], "refusal": None}

    def opening(self) -> list[list[dict]]:
        return [[{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}] for i in range(self.n)]

    def deltas(self, index: int, chunk: Chunk) -> list[list[dict]]:
        parser = self.parsers.get(index)
        if parser is None:
            parser = self.parsers[index] = self.request.parser()
        pieces = parser.feed(chunk.text) if chunk.text else []
        if chunk.finish_reason is not None:
            pieces += parser.close()
        self.calls[index] += [d for d in pieces if d.kind in ("call", "incomplete")]
        choices = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                   for delta in map(openai_delta, pieces) if delta is not None]
        scored = self.scored(chunk)
        if self.n_top is not None and scored:       # the chunk's tokens' logprobs ride on its first delta
            if not choices:
                choices.append({"index": index, "delta": {"content": ""}, "finish_reason": None})
            choices[0]["logprobs"] = self.logprobs(scored)
        out = [[c] for c in choices]
        if chunk.finish_reason is not None:
            self.finals[index] = chunk
            out.append([{"index": index, "delta": {}, "logprobs": None,
                         "finish_reason": finish_reason(self.calls[index], chunk.finish_reason)}])
        return out

    def response(self, chunks: dict[int, list[Chunk]]) -> dict:
        choices = []
        for index in sorted(chunks):
            cs = chunks[index]
            self.finals[index] = cs[-1]
            parser = self.request.parser()
            pieces = parser.feed("".join(c.text for c in cs)) + parser.close()
            reply = Reply.of(pieces).distinct()
            message = {"role": "assistant", "content": reply.content or (None if reply.calls else ""),
                       "tool_calls": [c.spec() for c in reply.calls] or None}
            if reply.reasoning:
                message["reasoning_content"] = reply.reasoning
            choices.append({
                "index": index, "message": message,
                "logprobs": (self.logprobs([lp for c in cs for lp in self.scored(c)])
                             if self.n_top is not None else None),
                "finish_reason": finish_reason(pieces, cs[-1].finish_reason)})
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model_id,
                "system_fingerprint": None, "choices": choices, "usage": self.usage()}


def openai_delta(d: Delta) -> dict | None:
    """A parser's piece as the `delta` of OpenAI's chunk (None: nothing to send)."""
    if d.kind == "content":
        return {"content": d.text}
    if d.kind == "reasoning":
        return {"reasoning_content": d.text}
    if d.kind == "call":
        return {"tool_calls": [{"index": d.index, "id": d.id, "type": "function",
                                "function": {"name": d.name, "arguments": ""}}]}
    if d.kind == "arguments":
        return {"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]}
    return None


class TextOutput(Output):
    kind, id_prefix = "text_completion", "cmpl"

    def __init__(self, completions: Completions, n: int, n_top: int | None, stop_ids: frozenset[int],
                 echo: list[str] | None):
        super().__init__(completions, n, n_top, stop_ids)
        self.echo = echo
        self.offsets: dict[int, int] = defaultdict(int)     # text length so far, per choice

    def prefix(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""

    def logprobs(self, index: int, scored: list) -> dict:
        tokens, offsets = [], []
        for r in scored:
            s, _ = self.token_text(r.token)
            tokens.append(s)
            offsets.append(self.offsets[index])
            self.offsets[index] += len(s)
        return {"tokens": tokens, "token_logprobs": [r.logprob for r in scored],
                "top_logprobs": [{self.token_text(t)[0]: lp for t, lp in r.top[:self.n_top]} for r in scored],
                "text_offset": offsets}

    def opening(self) -> list[list[dict]]:
        if not self.echo:
            return []
        return [[{"index": i, "text": self.prefix(i), "logprobs": None, "finish_reason": None}]
                for i in range(self.n * len(self.echo))]

    def deltas(self, index: int, chunk: Chunk) -> list[list[dict]]:
        out = []
        scored = self.scored(chunk)
        if chunk.text or scored:
            out.append([{"index": index, "text": chunk.text,
                         "logprobs": self.logprobs(index, scored) if self.n_top is not None else None,
                         "finish_reason": None}])
        if chunk.finish_reason is not None:
            self.finals[index] = chunk
            out.append([{"index": index, "text": "", "logprobs": None, "finish_reason": chunk.finish_reason}])
        return out

    def response(self, chunks: dict[int, list[Chunk]]) -> dict:
        choices = []
        for index in sorted(chunks):
            cs = chunks[index]
            self.finals[index] = cs[-1]
            choices.append({
                "index": index, "text": self.prefix(index) + "".join(c.text for c in cs),
                "logprobs": (self.logprobs(index, [lp for c in cs for lp in self.scored(c)])
                             if self.n_top is not None else None),
                "finish_reason": cs[-1].finish_reason})
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model_id,
                "system_fingerprint": None, "choices": choices, "usage": self.usage()}

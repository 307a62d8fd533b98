"""Request and response bodies of the OpenAI-compatible API.

Requests accept and ignore fields they do not know (clients pass extras through `extra_body`, and the official
client sends fields we do not use); every known field may be null, meaning its default. The ranges declared here
are the API's documented limits (out of range: 400). Responses follow OpenAI's shapes exactly."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16                  # choices per request
MAX_STOP = 16               # stop strings per request (OpenAI allows 4; some clients send more)
MAX_TOP_LOGPROBS = 20

TokenId = Annotated[int, Field(ge=0)]


class Request(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class Samplers(Request):
    """OpenAI's sampling fields and our extra samplers (exl_backends.engine.sampling.SamplingParams, same names)."""
    temperature: float | None = Field(None, ge=0, description="0: greedy. Default 1.")
    top_p: float | None = Field(None, ge=0, le=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="token id (as a string key) -> bias added to its logit")
    seed: int | None = Field(None, description="choice i samples with seed + i")
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    # ours
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    typical_p: float | None = Field(None, ge=0, le=1)
    top_a: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    penalty_range: int | None = Field(None, ge=0, description="0: the whole context")
    dry_multiplier: float | None = Field(None, ge=0)
    dry_base: float | None = Field(None, ge=1)
    dry_allowed_length: int | None = Field(None, ge=1)
    dry_sequence_breakers: list[str] | None = None
    dry_range: int | None = Field(None, ge=0)
    xtc_probability: float | None = Field(None, ge=0, le=1)
    xtc_threshold: float | None = Field(None, ge=0, le=0.5)
    mirostat_tau: float | None = Field(None, ge=0, description="> 0: mirostat v2")
    mirostat_eta: float | None = Field(None, gt=0, le=1)
    dynatemp_range: float | None = Field(None, ge=0)
    dynatemp_exponent: float | None = Field(None, gt=0)
    banned_strings: list[str] | None = Field(None, description="text the output must never contain")
    min_tokens: int | None = Field(None, ge=0)


class StreamOptions(Request):
    include_usage: bool | None = None


class JsonSchemaFormat(Request):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ContentPart(Request):
    type: str
    text: str | None = None


class FunctionCall(Request):
    name: str
    arguments: str | dict[str, Any] | None = Field(None, description="JSON text of an object (a dict is taken too)")


class ToolCallIn(Request):
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class Message(Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="assistant: the calls it made")
    tool_call_id: str | None = Field(None, description="tool: the call this message answers")
    reasoning_content: str | None = Field(None, description="assistant: its reasoning (templates that read it)")


class ChatTemplateKwargs(Request):
    enable_thinking: bool | None = Field(None, description="false: no reasoning block, where the template "
                                                           "offers the switch (Qwen3)")


class ChatRequest(Samplers):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
         "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
         "top_logprobs": 2, "n": 2, "seed": 1}]})
    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="wins over max_tokens; default: the "
                                                                      "rest of the context")
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = Field(None, description='[{"type": "function", "function": {"name", "description", '
                                                      '"parameters": <JSON schema>}}]')
    tool_choice: str | dict[str, Any] | None = Field(None, description='"auto" (default with tools), "none", '
                                                     '"required", or {"type": "function", "function": {"name": ...}}')
    parallel_tool_calls: bool | None = Field(None, description="default true: a reply may make several calls")
    chat_template_kwargs: ChatTemplateKwargs | None = None
    functions: list[Any] | None = None


Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(Samplers):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "Once upon a time", "max_tokens": 8, "logprobs": 2},
        {"prompt": ["Once", "Twice"], "max_tokens": 8, "stream": True, "stop": ["."], "n": 2}]})
    model: str | None = None
    prompt: Prompt
    max_tokens: int | None = Field(None, ge=1, description="default 16")
    n: int | None = Field(None, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="only best_of == n is supported")
    echo: bool | None = None
    suffix: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None


class TokenizeRequest(Request):
    model: str | None = None
    prompt: str | None = Field(None, description="text to tokenize (or give messages)")
    messages: Annotated[list[Message], Field(min_length=1)] | None = Field(
        None, description="chat messages, rendered with the chat template")
    add_special_tokens: bool | None = Field(None, description="text only: add BOS as the tokenizer does "
                                                              "(default true)")


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[TokenId]


# ---- responses -----------------------------------------------------------------------------------------------------

class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = Field(None, description="the reasoning block's text (templates that think in "
                                                            "tags); only present when there is some")


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str


class ToolCallDelta(BaseModel):
    """A call's first chunk has its id, type and name (arguments ""); the next ones add argument text."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    """One streamed event's data; with stream_options.include_usage every chunk has usage (null but in the last,
    whose choices are empty)."""
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class Health(BaseModel):
    status: Literal["ok"] = "ok"

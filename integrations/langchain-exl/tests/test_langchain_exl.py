"""ChatExl and ExlLLM beyond the standard suites: the shared engine per path, callbacks as LangChain expects them,
stop strings while streaming, real batching and async that leaves the event loop free, the chat template, the
constrained structured output, and arguments that are refused. Tiny random chat models (fast, CPU)."""
from __future__ import annotations

import asyncio
import json
import time

import jsonschema

import pytest
import pytest_socket
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel

from exl_backends import SamplingParams
from exl_backends.engine.tools import prepare
from langchain_exl import ChatExl, ExlLLM
from tiny_chat_model import tiny_chat_model


@pytest.fixture(autouse=True)
def offline():
    pytest_socket.disable_socket(allow_unix_socket=True)
    yield
    pytest_socket.enable_socket()


class TokenCounter(BaseCallbackHandler):
    def __init__(self):
        self.tokens = []

    def on_llm_new_token(self, token, **kwargs):
        self.tokens.append(token)


def greedy_chat(**kw) -> ChatExl:
    return ChatExl(model=tiny_chat_model(0), temperature=0, **kw)


def test_construction_is_lazy_and_models_are_shared_per_path():
    ChatExl(model="/no/such/dir")          # nothing loads until the first call
    a, b = greedy_chat(max_tokens=4), ExlLLM(model=tiny_chat_model(0), max_tokens=9)
    assert a.generator() is b.generator()
    assert a.generator(tiny_chat_model(1)) is not a.generator()


def test_chat_template_and_usage():
    chat = greedy_chat(max_tokens=6)
    messages = [SystemMessage("be brief"), HumanMessage("hello"), AIMessage("hi"), HumanMessage("how are you")]
    reply = chat.invoke(messages)
    tok = chat.generator().tokenizer
    rendered = tok.apply_chat_template([{"role": r, "content": c} for r, c in [
        ("system", "be brief"), ("user", "hello"), ("assistant", "hi"), ("user", "how are you")]],
        tokenize=False, add_generation_prompt=True)
    usage = reply.usage_metadata
    assert usage["input_tokens"] == len(tok.encode(rendered, add_special_tokens=False))
    assert usage["output_tokens"] <= 6 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert reply.response_metadata["finish_reason"] in ("stop", "length")


def test_chat_stream_stops_before_the_stop_string_and_fires_one_callback_per_chunk():
    chat = greedy_chat(max_tokens=40)
    free = chat.invoke("hello").content
    stop = free[10:13]
    assert len(free) > 13 and stop.strip()
    counter = TokenCounter()
    chunks = list(chat.stream("hello", stop=[stop], config={"callbacks": [counter]}))
    text = "".join(c.content for c in chunks)
    assert text == free[:free.index(stop)]
    assert chunks[-1].chunk_position == "last" and chunks[-1].response_metadata["finish_reason"] == "stop"
    assert len(counter.tokens) == len(chunks)
    assert greedy_chat(max_tokens=40, stop=[stop]).invoke("hello").content == text     # the field is the default


def test_llm_invoke_stream_batch_and_callbacks():
    llm = ExlLLM(model=tiny_chat_model(0), max_tokens=12, temperature=0)
    gen = llm.generator()
    prompts = ["The moon", "Computers process numbers"]
    expected = [gen.generate(p, max_new_tokens=12, sampling=SamplingParams(temperature=0)).text for p in prompts]
    assert llm.invoke(prompts[0]) == expected[0]
    assert llm.batch(prompts) == expected
    counter = TokenCounter()
    pieces = list(llm.stream(prompts[1], config={"callbacks": [counter]}))
    assert "".join(pieces) == expected[1] and counter.tokens == pieces and len(pieces) > 1
    chain = PromptTemplate.from_template("{topic}") | llm | StrOutputParser()
    assert chain.invoke({"topic": "The moon"}) == expected[0]


async def test_async_calls_leave_the_event_loop_free():
    chat, llm = greedy_chat(max_tokens=60), ExlLLM(model=tiny_chat_model(0), max_tokens=60, temperature=0)
    await chat.ainvoke("warm up")
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    start = time.perf_counter()
    reply, pieces = await asyncio.gather(chat.ainvoke("hello"), collect(llm.astream("The moon")))
    elapsed = time.perf_counter() - start
    task.cancel()
    assert reply.content == greedy_chat(max_tokens=60).invoke("hello").content
    assert "".join(pieces) == llm.invoke("The moon")
    assert ticks >= 0.2 * elapsed / 0.001 * 0.1        # the loop kept running (a blocked loop ticks ~once)
    assert ticks > 5


async def collect(stream) -> list:
    return [piece async for piece in stream]


class Pair(BaseModel):
    first: str
    second: str


def test_structured_output_is_constrained_to_the_schema():
    chat = ChatExl(model=tiny_chat_model(0), temperature=1.0, seed=0, max_tokens=400)
    pair = chat.with_structured_output(Pair).invoke("give me a pair")
    assert isinstance(pair, Pair)
    raw = chat.with_structured_output(Pair, include_raw=True).invoke("give me a pair")
    assert raw["parsing_error"] is None and raw["raw"].content.startswith('{"first":"')   # compact JSON
    assert isinstance(chat.with_structured_output(Pair.model_json_schema(), method="json_mode").invoke("{"), dict)


def test_refused_arguments():
    chat = greedy_chat(max_tokens=4)
    with pytest.raises(ValueError, match="unsupported"):
        chat.invoke("hi", logit_bias={1: 2.0})
    with pytest.raises(ValueError, match="text only"):
        chat.invoke([HumanMessage(content=[{"type": "image_url", "image_url": {"url": "x"}}])])


# ---- tools -------------------------------------------------------------------------------------------------------

class Weather(BaseModel):
    """Current weather in a city."""
    city: str
    celsius: bool


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@tool
def lookup(key: str) -> str:
    """Look a key up."""
    return key


SPEAK = {"type": "function", "function": {"name": "speak", "description": "Say a word", "parameters": {
    "type": "object", "properties": {"word": {"type": "string", "enum": ["yes", "no"]}}, "required": ["word"]}}}
TOOLS = [Weather, multiply, lookup, SPEAK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in map(convert_to_openai_tool, TOOLS)}


def tool_chat(**kw) -> ChatExl:
    return ChatExl(model=tiny_chat_model(0), temperature=1.0, seed=kw.pop("seed", 0), max_tokens=120, **kw)


def test_bound_tools_of_every_kind_give_valid_calls_streamed_and_not():
    chat = tool_chat().bind_tools(TOOLS, tool_choice="any")
    reply = chat.invoke("What is the weather in Oslo?")
    assert reply.tool_calls and reply.content == "" and reply.response_metadata["finish_reason"] == "tool_calls"
    for call in reply.tool_calls:
        assert call["id"].startswith("call_") and call["type"] == "tool_call"
        jsonschema.validate(call["args"], SCHEMAS[call["name"]])
    chunks = list(chat.stream("What is the weather in Oslo?"))
    whole = sum(chunks[1:], chunks[0])
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [(c["name"], c["args"]) for c in reply.tool_calls]
    assert whole.response_metadata["finish_reason"] == "tool_calls"
    pieces = [c for c in chunks if c.tool_call_chunks]
    assert len(pieces) > len(reply.tool_calls)          # the arguments came in pieces
    assert all(c.tool_call_chunks[0]["id"] and c.tool_call_chunks[0]["name"] for c in pieces
               if c.tool_call_chunks[0]["args"] == "")


@pytest.mark.parametrize("seed", range(3))
def test_named_choice_and_no_parallel_calls_give_one_call_of_that_tool(seed):
    reply = tool_chat(seed=seed).bind_tools(TOOLS, tool_choice="multiply", parallel_tool_calls=False).invoke("2*3?")
    assert [c["name"] for c in reply.tool_calls] == ["multiply"]
    jsonschema.validate(reply.tool_calls[0]["args"], SCHEMAS["multiply"])


def test_tool_choice_none_answers_with_text():
    reply = tool_chat().bind_tools(TOOLS, tool_choice="none").invoke("hi", max_tokens=12)
    assert reply.tool_calls == [] and reply.content


def test_structured_output_by_function_calling():
    chat = tool_chat()
    weather = chat.with_structured_output(Weather, method="function_calling").invoke("Oslo?")
    assert isinstance(weather, Weather)
    raw = chat.with_structured_output(SPEAK, method="function_calling", include_raw=True).invoke("Say yes")
    assert raw["parsing_error"] is None and raw["parsed"]["word"] in ("yes", "no")
    assert [c["name"] for c in raw["raw"].tool_calls] == ["speak"]


def test_tool_results_go_back_through_the_template():
    chat = tool_chat()
    call = {"name": "multiply", "args": {"a": 2, "b": 3}, "id": "call_1", "type": "tool_call"}
    messages = [HumanMessage("2*3?"), AIMessage("", tool_calls=[call]), ToolMessage("6", tool_call_id="call_1")]
    reply = chat.bind_tools(TOOLS).invoke(messages, max_tokens=4)
    request = prepare(chat.generator().tokenizer, [
        {"role": "user", "content": "2*3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "content": "6", "tool_call_id": "call_1"}], [convert_to_openai_tool(t) for t in TOOLS])
    assert '{"name": "multiply", "arguments": {"a": 2, "b": 3}}' in request.prompt
    assert "<tool_response>\n6\n</tool_response>" in request.prompt
    assert reply.usage_metadata["input_tokens"] == len(request.ids())
    with pytest.raises(ValueError, match="tool_call_id 'call_2'"):
        chat.bind_tools(TOOLS).invoke(messages[:2] + [ToolMessage("6", tool_call_id="call_2")])


def test_bad_tools_are_refused_by_name():
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "strin"}}}}}
    with pytest.raises(ValueError, match="'strin'"):
        tool_chat().bind_tools([bad]).invoke("hi")
    with pytest.raises(ValueError, match="'nope', which is not among the tools"):
        tool_chat().bind_tools(TOOLS, tool_choice="nope").invoke("hi")


# a template that thinks in tags and opens the block in its generation prompt (as R1 distills do)
THINKING = ("{% for m in messages %}<|begin_of_text|>{{ m['role'] }}\n{{ m['content'] }}<|end_of_text|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|begin_of_text|>assistant\n<think>\n{% endif %}")


def test_reasoning_goes_to_additional_kwargs(monkeypatch):
    chat = tool_chat()
    monkeypatch.setattr(chat.generator().tokenizer, "chat_template", THINKING)
    reply = chat.bind_tools([multiply], tool_choice="any").invoke("2*3?")
    reasoning = reply.additional_kwargs["reasoning_content"]
    assert reasoning and "think>" not in reasoning and "think>" not in reply.content and reply.tool_calls
    chunks = list(chat.bind_tools([multiply], tool_choice="any").stream("2*3?"))
    whole = sum(chunks[1:], chunks[0])
    assert whole.additional_kwargs["reasoning_content"] == reasoning
    assert [c["args"] for c in whole.tool_calls] == [c["args"] for c in reply.tool_calls]


@pytest.mark.slow
def test_default_model_calls_the_tool_with_the_prompts_argument():
    """The standard suite's test_tool_calling question, which a random model cannot answer, on the default model."""
    from langchain_tests.integration_tests.chat_models import magic_function

    from exl_backends.commands.quickstart import default_model_dir
    try:
        path = default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    chat = ChatExl(model=str(path), temperature=0, max_tokens=40, device="cpu", max_seq_len=1024)
    reply = chat.bind_tools([magic_function], tool_choice="any", parallel_tool_calls=False).invoke(
        "What is the value of magic_function(3)? Use the tool.")
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("magic_function", {"input": 3})]


@pytest.mark.slow
def test_default_model_forced_call_without_max_tokens_ends_at_a_repeated_call():
    """LangChain's defaults (no max_tokens, parallel calls allowed): the default model copied its calls until the
    context ran out (776 tokens, 66 s on a 2-core CPU at max_seq_len 1024); the reply now ends at the first call
    that repeats one (79 tokens), and the message leaves that repeat out."""
    from exl_backends.commands.quickstart import default_model_dir
    try:
        path = default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression such as 2 * (3 + 4)."""
        return expression

    @tool
    def capital(country: str) -> str:
        """The capital city of a country."""
        return country

    chat = ChatExl(model=str(path), temperature=0, device="cpu", max_seq_len=1024)
    reply = chat.bind_tools([calculator, capital], tool_choice="any").invoke("What is 12 * 7?")
    calls = [(c["name"], c["args"]) for c in reply.tool_calls]
    assert reply.usage_metadata["output_tokens"] < 150 and reply.response_metadata["finish_reason"] == "tool_calls"
    assert calls and all(c not in calls[:i] for i, c in enumerate(calls))     # the repeat it ended at left out

"""ChatExl and ExlLLM beyond the standard suites: the shared engine per path, callbacks as LangChain expects them,
stop strings while streaming, real batching and async that leaves the event loop free, the chat template, the
constrained structured output, and arguments that are refused. Tiny random chat models (fast, CPU)."""
from __future__ import annotations

import asyncio
import time

import pytest
import pytest_socket
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from pydantic import BaseModel

from exl_backends import SamplingParams
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
    with pytest.raises(NotImplementedError):
        chat.bind_tools([Pair])
    with pytest.raises(ValueError, match="text only"):
        chat.invoke([HumanMessage(content=[{"type": "image_url", "image_url": {"url": "x"}}])])

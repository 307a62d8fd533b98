"""Exl (LlamaIndex FunctionCallingLLM): metadata from the model, complete/stream/chat and their async versions, tool
calls (chat_with_tools, FunctionAgent with a FunctionTool), on a tiny random chat model (fast) and on the real default
model (slow); offline."""
from __future__ import annotations

import asyncio
import json

import pytest
import pytest_socket
from llama_index.core.base.llms.base import BaseLLM
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel

from exl_backends import SamplingParams
from llama_index.llms.exl import Exl
from tiny_chat_model import tiny_chat_model


@pytest.fixture(autouse=True)
def offline():
    pytest_socket.disable_socket(allow_unix_socket=True)
    yield
    pytest_socket.enable_socket()


def test_is_a_llama_index_llm():
    assert BaseLLM.__name__ in [b.__name__ for b in Exl.__mro__]
    Exl(model="/no/such/dir")          # construction loads nothing


async def test_complete_stream_chat_and_async_agree():
    llm = Exl(model=tiny_chat_model(0), max_tokens=10, temperature=0)
    meta = llm.metadata
    assert meta.context_window == 2048 and meta.num_output == 10 and meta.is_chat_model and meta.is_function_calling_model
    assert meta.model_name == tiny_chat_model(0)
    gen = llm._generator()
    expected = gen.generate("The moon", max_new_tokens=10, sampling=SamplingParams(temperature=0)).text
    done = llm.complete("The moon")
    assert done.text == expected and done.raw["completion_tokens"] <= 10
    stream = list(llm.stream_complete("The moon"))
    assert stream[-1].text == expected and "".join(r.delta for r in stream) == expected
    assert (await llm.acomplete("The moon")).text == expected
    assert [r.text async for r in await llm.astream_complete("The moon")][-1] == expected

    messages = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hello")]
    reply = gen.generate([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
                         max_new_tokens=10, sampling=SamplingParams(temperature=0)).text
    assert llm.chat(messages).message.content == reply
    assert "".join(r.delta for r in llm.stream_chat(messages)) == reply
    assert (await llm.achat(messages)).message.content == reply
    chunks = [r async for r in await llm.astream_chat(messages)]
    assert chunks[-1].message.content == reply and chunks[-1].raw["finish_reason"] in ("stop", "length")
    with pytest.raises(ValueError, match="unsupported"):
        llm.complete("x", frequency_penalty=1.0)


async def test_async_runs_concurrently_with_the_event_loop():
    llm = Exl(model=tiny_chat_model(0), max_tokens=40, temperature=0)
    await llm.acomplete("warm up")
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    await asyncio.gather(llm.acomplete("The moon"), llm.achat([ChatMessage(role="user", content="hi")]))
    task.cancel()
    assert ticks > 5


@pytest.mark.slow
async def test_default_model_answers_in_every_mode():
    from exl_backends.commands.quickstart import default_model_dir
    llm = Exl(model=str(default_model_dir()), max_tokens=12, temperature=0, max_seq_len=1024)
    question = [ChatMessage(role="user", content="What is the capital of France?")]
    assert llm.metadata.context_window == 1024 and llm.metadata.is_chat_model
    assert "Paris" in llm.chat(question).message.content
    assert "Paris" in "".join(r.delta for r in llm.stream_chat(question))
    assert "Paris" in (await llm.achat(question)).message.content
    assert (await llm.acomplete("The capital of France is")).text.strip()


class Song(BaseModel):
    """A song."""
    title: str
    year: int


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def test_chat_with_tools_gives_valid_calls_streamed_and_not():
    llm = Exl(model=tiny_chat_model(0), max_tokens=80, temperature=1.0, seed=0)
    tool = FunctionTool.from_defaults(fn=multiply)
    response = llm.chat_with_tools([tool], user_msg="What is 6 times 7?", tool_required=True)
    calls = llm.get_tool_calls_from_response(response)
    assert len(calls) == 1 and calls[0].tool_name == "multiply" and calls[0].tool_id.startswith("call_")
    assert set(calls[0].tool_kwargs) == {"a", "b"} and all(type(v) is int for v in calls[0].tool_kwargs.values())
    assert response.raw["finish_reason"] == "tool_calls" and response.message.content == ""
    streamed = list(llm.stream_chat_with_tools([tool], user_msg="What is 6 times 7?", tool_required=True))
    assert [(c.tool_name, c.tool_kwargs) for c in llm.get_tool_calls_from_response(streamed[-1])] == \
           [(c.tool_name, c.tool_kwargs) for c in calls]
    # mid-stream, only calls whose arguments are complete are in the message
    for r in streamed:
        for c in r.message.additional_kwargs.get("tool_calls", []):
            json.loads(c["function"]["arguments"])
    # structured_predict goes through a forced call for a function-calling LLM
    song = llm.structured_predict(Song, PromptTemplate("Name a song about {topic}"), topic="rain")
    assert isinstance(song, Song) and type(song.year) is int
    with pytest.raises(ValueError, match="no tool call|none"):
        llm.get_tool_calls_from_response(llm.chat_with_tools([tool], user_msg="hi", tool_choice="none"))


async def test_function_agent_calls_the_tool_and_finishes():
    from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
    called = []

    def record(a: int, b: int) -> int:
        """Multiply two integers."""
        called.append((a, b))
        return a * b

    # (a call takes ~50 tokens of the tiny byte-level vocabulary: the budget leaves room for it)
    llm = Exl(model=tiny_chat_model(0), max_tokens=96, temperature=1.0, seed=0)
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(fn=record, name="multiply")], llm=llm,
                          initial_tool_choice="multiply")
    handler = agent.run("What is 6 times 7?")
    results = [e async for e in handler.stream_events() if isinstance(e, ToolCallResult)]
    output = await handler
    assert called and results[0].tool_name == "multiply" and results[0].tool_output.raw_output == \
        called[0][0] * called[0][1]
    assert output.response is not None


@pytest.mark.slow
async def test_default_model_function_agent_calls_the_tool():
    """A FunctionAgent on the default model calls the tool with the prompt's argument (the 135M model copies one
    argument reliably; with two it writes zeros) and finishes."""
    from llama_index.core.agent.workflow import FunctionAgent

    from exl_backends.commands.quickstart import default_model_dir
    called = []

    def magic(input: int) -> int:
        """Apply a magic function to an input."""
        called.append(input)
        return input + 2

    llm = Exl(model=str(default_model_dir()), max_tokens=40, temperature=0, max_seq_len=1024)
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(fn=magic)], llm=llm, initial_tool_choice="magic")
    output = await agent.run("What is the value of magic(3)? Use the tool.")
    assert called == [3] and output.tool_calls[0].tool_output.raw_output == 5

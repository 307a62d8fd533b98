"""Exl (LlamaIndex CustomLLM): metadata from the model, complete/stream/chat and their async versions, on a tiny
random chat model (fast) and on the real default model (slow); offline."""
from __future__ import annotations

import asyncio

import pytest
import pytest_socket
from llama_index.core.base.llms.base import BaseLLM
from llama_index.core.llms import ChatMessage

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
    assert meta.context_window == 512 and meta.num_output == 10 and meta.is_chat_model
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
    from exl_backends.quickstart import default_model_dir
    llm = Exl(model=str(default_model_dir()), max_tokens=12, temperature=0, max_seq_len=1024)
    question = [ChatMessage(role="user", content="What is the capital of France?")]
    assert llm.metadata.context_window == 1024 and llm.metadata.is_chat_model
    assert "Paris" in llm.chat(question).message.content
    assert "Paris" in "".join(r.delta for r in llm.stream_chat(question))
    assert "Paris" in (await llm.achat(question)).message.content
    assert (await llm.acomplete("The capital of France is")).text.strip()

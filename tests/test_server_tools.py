"""Tool calling and reasoning through the OpenAI-compatible server, driven by the official openai client: tool_calls
and finish_reason "tool_calls" as OpenAI returns them, streamed delta.tool_calls that reassemble to the whole call,
a tool result sent back through the template, reasoning_content split out, bad tools refused with a 400. Each
reply is checked against the in-process Generator and tools.prepare on the same model and seed."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")

from exl_backends import ExlForCausalLM, Generator, SamplingParams  # noqa: E402
from exl_backends.engine.generator import template_stop_ids  # noqa: E402
from exl_backends.engine.tools import prepare  # noqa: E402
from exl_backends.server.app import create_app  # noqa: E402

from conftest import needs_fixtures  # noqa: E402
from serving import THINKING_TEMPLATE, running, save_chat_model  # noqa: E402

pytestmark = needs_fixtures()

CONTEXT = 1024          # the generic fallback's tool descriptions take ~450 tokens of the tiny vocabulary
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "add": ADD["function"]["parameters"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def serve(directory, template: str | None = None):
    model_dir = save_chat_model(directory, **({"template": template} if template else {}))
    gen = Generator(ExlForCausalLM.from_pretrained(model_dir, device="cpu", max_seq_len=CONTEXT), page_size=16,
                    cache_tokens=16 * 1024)
    return gen, create_app(gen, "tiny-chat", None)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    gen, app = serve(tmp_path_factory.mktemp("tools_server"))
    with running(app) as url:
        yield gen, url


@pytest.fixture(scope="module")
def gen(served):
    return served[0]


@pytest.fixture(scope="module")
def url(served):
    return served[1]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def reference(gen, messages, tools, choice, max_tokens, seed, parallel=True):
    """The reply the server should give: the same prompt, grammar, stops and seed in-process."""
    req = prepare(gen.tokenizer, messages, tools, choice, parallel)
    done = gen.generate(req.ids(), max_new_tokens=max_tokens, grammar=req.grammar,
                        stop_token_ids=gen.eos_ids | template_stop_ids(gen.tokenizer),
                        sampling=SamplingParams(temperature=1.0, seed=seed))
    return req.parse(done.text), done


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def reassemble(chunks) -> tuple[dict[int, dict], str, str | None]:
    """A stream's tool calls by index (checking OpenAI's shape: id, type and name only on a call's first delta),
    its content, and its finish_reason."""
    calls, content, finish = {}, "", None
    for c in chunks:
        choice = c.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                assert d.id.startswith("call_") and d.type == "function" and d.function.name, d
                assert d.function.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.type is None and d.function.name is None, d
                calls[d.index]["arguments"] += d.function.arguments
    return calls, content, finish


# ---- calls -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("choice, parallel", [("required", True), ({"type": "function", "function": {"name": "add"}},
                                                                   True), ("required", False)])
def test_forced_call_streamed_and_not(client, gen, choice, parallel):
    args = dict(model="tiny-chat", messages=ASK, tools=[WEATHER, ADD], tool_choice=choice, max_tokens=80,
                temperature=1.0, seed=4, parallel_tool_calls=parallel)
    reply, done = reference(gen, ASK, [WEATHER, ADD], choice, 80, seed=4, parallel=parallel)
    assert reply.calls, done.text
    r = client.chat.completions.create(**args)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None
    assert calls_of(message) == [(c.name, c.arguments) for c in reply.calls]
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)
    for c in message.tool_calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    if isinstance(choice, dict):
        assert {c.function.name for c in message.tool_calls} == {"add"}
    if not parallel:
        assert len(message.tool_calls) == 1
    # streamed: the same call, its arguments in several pieces
    chunks = list(client.chat.completions.create(**args, stream=True))
    calls, content, finish = reassemble(chunks)
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == calls_of(message)
    assert sorted(calls) == list(range(len(calls))) and content == "" and finish == "tool_calls"
    assert sum(bool(c.choices[0].delta.tool_calls) for c in chunks) > len(calls) + 1


def test_auto_and_none_answer_with_text(client, gen):
    for choice in ("auto", "none"):
        reply, done = reference(gen, ASK, [WEATHER], choice, 12, seed=1)
        r = client.chat.completions.create(model="tiny-chat", messages=ASK, tools=[WEATHER], tool_choice=choice,
                                           max_tokens=12, temperature=1.0, seed=1)
        message = r.choices[0].message
        assert message.tool_calls is None and message.content == reply.content == done.text
        assert r.choices[0].finish_reason == done.finish_reason


def test_a_call_cut_by_max_tokens_is_length_without_calls(client):
    r = client.chat.completions.create(model="tiny-chat", messages=ASK, tools=[WEATHER], tool_choice="required",
                                       max_tokens=5, temperature=1.0, seed=0)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=ASK, tools=[WEATHER], max_tokens=5,
                                                 tool_choice="required", temperature=1.0, seed=0, stream=True))
    assert reassemble(chunks)[2] == "length"


def test_tool_result_round_trip(client, gen):
    """The call the server made goes back with its result: the next reply is the one the template gives for that
    history (tool_calls on the assistant message, tool_call_id on the tool message)."""
    first = client.chat.completions.create(model="tiny-chat", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=60, temperature=1.0, seed=2).choices[0].message
    assert first.tool_calls
    history = ASK + [first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "18 C and sunny"} for c in first.tool_calls]
    reply, done = reference(gen, history, [WEATHER], "auto", 16, seed=3)
    req = prepare(gen.tokenizer, history, [WEATHER])
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in req.prompt
    assert f'"arguments": {first.tool_calls[0].function.arguments}' in req.prompt
    r = client.chat.completions.create(model="tiny-chat", messages=history, tools=[WEATHER], max_tokens=16,
                                       temperature=1.0, seed=3)
    assert r.choices[0].message.content == reply.content and calls_of(r.choices[0].message) == [
        (c.name, c.arguments) for c in reply.calls]
    assert r.usage.prompt_tokens == len(req.ids())


# ---- bad input ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param, match", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}]}, "tools", "'strin'"),
    ({"tools": [{"type": "function"}]}, "tools", r"tools\[0\]"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "'sometimes'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "messages": ASK + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
     "messages", "no earlier assistant message made a call with that id"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
    ({"functions": [WEATHER["function"]]}, "functions", "send the functions as `tools`"),
])
def test_bad_tool_requests_are_400(url, body, param, match):
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={"messages": ASK, "max_tokens": 3, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert re.search(match, error["message"]), error["message"]


# ---- reasoning ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    gen, app = serve(tmp_path_factory.mktemp("thinking_server"), THINKING_TEMPLATE)
    with running(app) as url:
        yield gen, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_reasoning_is_split_out_streamed_and_not(thinking):
    gen, client = thinking
    # without tools: the prompt opens <think> and a random model never closes it, so all is reasoning
    want = gen.generate(ASK, max_new_tokens=10, sampling=SamplingParams(temperature=1.0, seed=0))
    r = client.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=10, temperature=1.0, seed=0)
    message = r.choices[0].message
    assert message.reasoning_content == want.text and message.content == "" and "</think>" not in want.text
    # with a forced call: the grammar closes the reasoning, then calls
    args = dict(model="tiny-chat", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=120,
                temperature=1.0, seed=0)
    message = client.chat.completions.create(**args).choices[0].message
    assert message.reasoning_content and message.tool_calls and message.content is None
    assert "think>" not in message.reasoning_content
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), SCHEMAS["get_weather"])
    chunks = list(client.chat.completions.create(**args, stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    calls, content, finish = reassemble(chunks)
    assert reasoning == message.reasoning_content and content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == calls_of(message)


# ---- the default model -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_default_model_tool_round_trip_through_the_openai_client():
    """Call -> tool result -> answer on the default model, streamed and not (the same greedy reply both ways)."""
    from exl_backends.commands.quickstart import default_model_dir
    try:
        path = default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model = ExlForCausalLM.from_pretrained(path, device="cpu", max_seq_len=1024)
    with running(create_app(Generator(model, max_batch_size=4), path.name, None)) as base:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        args = dict(model=path.name, temperature=0, max_tokens=40, tools=[WEATHER])
        first = c.chat.completions.create(messages=ASK, tool_choice="required", parallel_tool_calls=False, **args)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1
        jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), SCHEMAS["get_weather"])
        streamed = reassemble(c.chat.completions.create(messages=ASK, tool_choice="required",
                                                        parallel_tool_calls=False, stream=True, **args))
        assert [(v["name"], v["arguments"]) for v in streamed[0].values()] == calls_of(message)
        history = ASK + [message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C and sunny"}]
        answer = c.chat.completions.create(messages=history, **args).choices[0]
        assert answer.message.content or answer.message.tool_calls
        chunks = list(c.chat.completions.create(messages=history, stream=True, **args))
        assert reassemble(chunks)[1] == (answer.message.content or "")

"""The OpenAI-compatible server, driven over loopback by the official openai client (and raw HTTP where the client
cannot say it): chat and completions, streaming and not, stop strings, n > 1 with seeds, logprobs, json_schema,
usage, auth in both header styles, OpenAI-shaped errors with their codes, the queue bound, `exl serve` itself.
Outputs are checked against the in-process Generator on the same model."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time

import httpx
import jsonschema
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")

from exl_backends import ExlForCausalLM, Generator, SamplingParams  # noqa: E402
from exl_backends.server import auth  # noqa: E402
from exl_backends.server.app import create_app  # noqa: E402
from exl_backends.server.auth import ApiKey  # noqa: E402
from exl_backends.server.banner import auth_lines  # noqa: E402

from conftest import REPO  # noqa: E402
from serving import KEY, metric, running, save_chat_model, wait_for_metric  # noqa: E402

CONTEXT = 256
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("chat_tiny"))


@pytest.fixture(scope="module")
def model(model_dir):
    return ExlForCausalLM.from_pretrained(model_dir, device="cpu", max_seq_len=CONTEXT)


@pytest.fixture(scope="module")
def gen(model):
    return Generator(model, page_size=16, cache_tokens=64 * 16)


@pytest.fixture(scope="module")
def key_path(tmp_path_factory):
    return tmp_path_factory.mktemp("config") / "api_key"


@pytest.fixture(scope="module")
def url(gen, key_path):
    with running(create_app(gen, "tiny-chat", ApiKey(KEY, key_path), max_body_bytes=64 * 1024)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# ---- the happy paths ---------------------------------------------------------------------------------------------

def test_models(client, url):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-chat"] and models[0].object == "model"
    assert client.models.retrieve("tiny-chat").id == "tiny-chat"
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}


def test_chat_matches_the_generator_and_counts_usage(client, gen, model):
    r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=12, temperature=0)
    want = gen.generate(MESSAGES, max_new_tokens=12, sampling=GREEDY)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny-chat"
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason == "length"
    rendered = model.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    n_prompt = len(model.tokenizer.encode(rendered, add_special_tokens=False))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 12, n_prompt + 12)


def test_chat_stream_has_openai_shape(client):
    plain = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=10,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    first, *middle, finish, usage = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert all(c.choices[0].finish_reason is None and c.usage is None for c in [first] + middle)
    assert "".join(c.choices[0].delta.content for c in middle) == plain.choices[0].message.content
    assert finish.choices[0].finish_reason == "length" and finish.choices[0].delta.content is None
    assert usage.choices == [] and usage.usage.completion_tokens == 10
    assert usage.usage.prompt_tokens == plain.usage.prompt_tokens


def test_raw_stream_ends_with_done(url):
    with httpx.stream("POST", f"{url}/v1/completions", headers={"x-api-key": KEY}, timeout=60,
                      json={"prompt": "Once upon", "max_tokens": 4, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1])
    assert "usage" not in json.loads(events[0][6:])        # only with stream_options.include_usage


def test_completions_stream_and_not(client, gen):
    want = gen.generate("Once upon a time", max_new_tokens=20, sampling=GREEDY)
    r = client.completions.create(model="tiny-chat", prompt="Once upon a time", max_tokens=20, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == want.text
    assert r.usage.prompt_tokens == want.usage.prompt_tokens and r.usage.completion_tokens == 20
    streamed = list(client.completions.create(model="tiny-chat", prompt="Once upon a time", max_tokens=20,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want.text
    assert streamed[-1].choices[0].finish_reason == "length"
    # token ids as the prompt, and several prompts at once
    ids = gen.tokenizer.encode("Once upon a time")
    for prompt in (ids, [ids]):
        assert client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=20,
                                         temperature=0).choices[0].text == want.text
    r = client.completions.create(model="tiny-chat", prompt=["Once upon a time", "Once"], max_tokens=20,
                                  temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices[:2]] == [want.text, want.text]
    once = gen.generate("Once", max_new_tokens=20, sampling=GREEDY)
    assert r.choices[2].text == once.text
    assert r.usage.prompt_tokens == want.usage.prompt_tokens + once.usage.prompt_tokens
    assert r.usage.completion_tokens == 40 + 2 * len(once.token_ids)


def test_default_completion_length_is_16(client):
    r = client.completions.create(model="tiny-chat", prompt="abc", temperature=0)
    assert r.usage.completion_tokens <= 16
    assert r.usage.completion_tokens == 16 or r.choices[0].finish_reason == "stop"


def test_stop_strings_cut_the_text(client):
    full = client.completions.create(model="tiny-chat", prompt="The cat", max_tokens=40, temperature=0)
    text = full.choices[0].text
    stop = text[12:15]
    assert len(stop) == 3
    cut = text[:text.index(stop)]
    for stream in (False, True):
        r = client.completions.create(model="tiny-chat", prompt="The cat", max_tokens=40, temperature=0,
                                      stop=[stop, "never appears \u2603"], stream=stream)
        if stream:
            chunks = list(r)
            got, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            got, reason = r.choices[0].text, r.choices[0].finish_reason
        assert got == cut and reason == "stop"


def test_n_choices_with_seeds_match_the_generator(client, gen):
    r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=10, n=3, seed=11,
                                       temperature=1.0, top_p=0.9)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, choice in enumerate(r.choices):
        want = gen.generate(MESSAGES, max_new_tokens=10, sampling=SamplingParams(temperature=1.0, top_p=0.9,
                                                                                 seed=11 + i))
        assert choice.message.content == want.text
    assert len({c.message.content for c in r.choices}) > 1
    assert r.usage.completion_tokens == sum(
        len(gen.generate(MESSAGES, max_new_tokens=10, sampling=SamplingParams(temperature=1.0, top_p=0.9,
                                                                              seed=11 + i)).token_ids)
        for i in range(3))
    # streamed: chunks of the three choices interleave, each keeps its index
    texts = {}
    for c in client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=10, n=3, seed=11,
                                            temperature=1.0, top_p=0.9, stream=True):
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert [texts[i] for i in range(3)] == [c.message.content for c in r.choices]


def test_extra_samplers_go_through(client, gen):
    extra = {"min_p": 0.05, "top_k": 40, "dry_multiplier": 0.8, "xtc_probability": 0.5, "typical_p": 0.95,
             "banned_strings": ["e"]}
    r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=12, seed=5,
                                       extra_body=extra)
    want = gen.generate(MESSAGES, max_new_tokens=12, banned_strings=["e"], sampling=SamplingParams(
        seed=5, **{k: v for k, v in extra.items() if k != "banned_strings"}))
    assert r.choices[0].message.content == want.text and "e" not in want.text
    r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=6, seed=5,
                                       extra_body={"mirostat_tau": 3.0})
    assert r.choices[0].message.content == gen.generate(
        MESSAGES, max_new_tokens=6, sampling=SamplingParams(seed=5, mirostat_tau=3.0)).text


def test_logit_bias_forces_a_token(client, gen):
    token = gen.tokenizer.encode(" the", add_special_tokens=False)[-1]
    r = client.completions.create(model="tiny-chat", prompt="x", max_tokens=5, temperature=0,
                                  logit_bias={str(token): 100})
    assert r.choices[0].text == gen.tokenizer.decode([token] * 5)


def test_chat_logprobs_match_the_engine(client, gen):
    r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3)
    want = gen.generate(MESSAGES, max_new_tokens=8, sampling=GREEDY, logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(want.logprobs) == 8
    raw = b"".join(bytes(e.bytes) for e in content)         # a random model makes invalid UTF-8 too
    assert raw.decode("utf-8", errors="replace") == r.choices[0].message.content
    for e, ref in zip(content, want.logprobs):
        assert e.logprob == pytest.approx(ref.logprob, abs=1e-5)
        assert [t.logprob for t in e.top_logprobs] == pytest.approx([lp for _, lp in ref.top], abs=1e-5)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].bytes == e.bytes     # greedy
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    # streamed, the same entries arrive with the content deltas
    streamed = [e for c in client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=8,
                                                          temperature=0, logprobs=True, top_logprobs=3, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # (to rounding: the streamed request reuses the first one's cached prompt pages, so its last prompt token's
    # forward has other shapes than a whole prefill)
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    # logprobs without alternatives
    r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=3, temperature=0,
                                       logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


def test_completion_logprobs_shape(client, gen):
    r = client.completions.create(model="tiny-chat", prompt="Hello", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    want = gen.generate("Hello", max_new_tokens=6, sampling=GREEDY, logprobs=2)
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-5)
    assert all(len(top) == 2 and max(top.values()) == pytest.approx(v, abs=1e-5)
               for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_json_schema_output_parses(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["answer", "n"],
              "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                             "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    r = client.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, max_tokens=150, seed=1, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_tokenize_and_detokenize(url, model):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{url}/v1/tokenize", headers=h, json={"prompt": "Hello world"}, timeout=10).json()
    assert r["tokens"] == model.tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == CONTEXT
    chat = httpx.post(f"{url}/v1/tokenize", headers=h, json={"messages": MESSAGES}, timeout=10).json()
    rendered = model.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == model.tokenizer.encode(rendered, add_special_tokens=False)
    back = httpx.post(f"{url}/v1/detokenize", headers=h, json={"tokens": r["tokens"]}, timeout=10).json()
    assert back == {"prompt": "Hello world"}


def test_metrics_are_prometheus_text(url, client):
    client.completions.create(model="tiny-chat", prompt="abc", max_tokens=3, temperature=0)
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.headers["content-type"].startswith("text/plain")
    for name in ("exl_requests_total", "exl_generation_tokens_per_second", "exl_queue_depth",
                 "exl_cache_pages_used", "exl_cache_usage_ratio", "exl_jobs_running"):
        assert f"# TYPE {name} " in r.text
    assert metric(url, 'exl_requests_total{route="/v1/completions",status="200"}') >= 1
    assert metric(url, "exl_generation_tokens_total") >= 3
    assert wait_for_metric(url, "exl_cache_pages_used", 0) == 0


# ---- auth --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-wrong-key-000000"},
                                     {"x-api-key": "sk-wrong-key-000000"}, {"Authorization": "Basic abc"}])
def test_missing_or_wrong_key_is_401(url, key_path, headers):
    r = httpx.post(f"{url}/v1/chat/completions", headers=headers, json={"messages": MESSAGES}, timeout=10)
    assert r.status_code == 401
    e = error_of(r)
    assert e["code"] == "invalid_api_key" and e["type"] == "invalid_request_error"
    assert "Authorization: Bearer <key>" in e["message"] and "x-api-key" in e["message"]
    assert str(key_path) in e["message"]
    assert "sk-wrong-key-000000" not in e["message"]


def test_openai_client_raises_authentication_error(url):
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong-key-000000", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.code == "invalid_api_key" and "sk-wr***" in info.value.message


@pytest.mark.parametrize("headers", [{"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}])
def test_right_key_in_either_header_is_200(url, headers):
    r = httpx.post(f"{url}/v1/completions", headers=headers, json={"prompt": "a", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_open_routes_need_no_key(url):
    for path in ("/health", "/metrics", "/openapi.json"):
        assert httpx.get(f"{url}{path}", timeout=10).status_code == 200


def test_no_auth_server(gen):
    with running(create_app(gen, "tiny-chat", None)) as base:
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        assert "securitySchemes" not in httpx.get(f"{base}/openapi.json", timeout=10).json().get("components", {})


def test_no_auth_warns_beyond_loopback():
    assert not any("WARNING" in line for line in auth_lines(None, "http://127.0.0.1:5000", "127.0.0.1"))
    assert not any("WARNING" in line for line in auth_lines(None, "http://[::1]:5000", "::1"))
    assert any("WARNING" in line and "0.0.0.0" in line for line in auth_lines(None, "http://0.0.0.0:5000",
                                                                                  "0.0.0.0"))


def test_key_is_generated_once_with_mode_0600(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    first = auth.load_or_create()
    assert first.is_new and first.path == tmp_path / "exl-backends" / "api_key"
    assert stat.S_IMODE(first.path.stat().st_mode) == 0o600
    assert first.value.startswith("sk-exl-") and len(first.value) > 40
    again = auth.load_or_create()
    assert again.value == first.value and not again.is_new
    lines = auth_lines(first, "http://127.0.0.1:5000", "127.0.0.1")
    assert any(f'curl http://127.0.0.1:5000/v1/models -H "Authorization: Bearer {first.value}"' in line
               for line in lines)
    assert not any(first.value in line for line in auth_lines(again, "http://127.0.0.1:5000", "127.0.0.1"))


# ---- errors ------------------------------------------------------------------------------------------------------

def test_unknown_model_is_404(client, url):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert info.value.code == "model_not_found" and info.value.param == "model"
    assert "tiny-chat" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    r = httpx.get(f"{url}/v2/nothing", timeout=10)
    assert r.status_code == 404 and "/v1" in error_of(r)["message"]


def test_prompt_over_the_context_is_400_with_the_numbers(client):
    long = "word " * 400
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": long}])
    e = info.value
    assert e.code == "context_length_exceeded" and f"maximum context length is {CONTEXT} tokens" in e.message
    n_prompt = int(e.message.split("your prompt is ")[1].split()[0])
    assert n_prompt > CONTEXT
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-chat", prompt=[1] * CONTEXT, max_tokens=1)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"


def test_max_tokens_is_cut_to_the_context(client):
    r = client.completions.create(model="tiny-chat", prompt=[5] * (CONTEXT - 3), max_tokens=100, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 3


@pytest.mark.parametrize("body, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logit_bias": {"99999": 5}}, "logit_bias"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"mirostat_tau": 3.0, "xtc_probability": 0.5}, None),
    ({"banned_strings": [""]}, None),
])
def test_bad_parameters_are_400(url, body, param):
    r = httpx.post(f"{url}/v1/chat/completions", headers={"x-api-key": KEY}, timeout=30,
                   json={"messages": MESSAGES, "max_tokens": 3, **body})
    assert r.status_code == 400, r.text
    e = error_of(r)
    assert e["type"] == "invalid_request_error" and e["param"] == param


@pytest.mark.parametrize("content, headers", [
    (b"{not json", {"content-type": "application/json"}),
    (b'{"messages": "hello"}', {"content-type": "application/json"}),
    (b'{"messages": [{"content": "no role"}]}', {"content-type": "application/json"}),
    (b'[1, 2]', {"content-type": "application/json"}),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}', {"content-type": "application/json"}),
])
def test_malformed_bodies_are_422(url, content, headers):
    r = httpx.post(f"{url}/v1/chat/completions", headers={"x-api-key": KEY, **headers}, content=content, timeout=10)
    assert r.status_code == 422, r.text
    assert error_of(r)["type"] == "invalid_request_error"


def test_client_sees_422_as_unprocessable(client):
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="tiny-chat", messages="hello", max_tokens=2)


def test_body_too_large_is_413(url):
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}]}).encode()
    r = httpx.post(f"{url}/v1/chat/completions", headers={"x-api-key": KEY, "content-type": "application/json"},
                   content=big, timeout=10)
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"

    def chunked():                          # no Content-Length: counted as it streams in
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]
    r = httpx.post(f"{url}/v1/chat/completions", headers={"x-api-key": KEY, "content-type": "application/json"},
                   content=chunked(), timeout=10)
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_full_queue_is_429_with_retry_after(gen):
    with running(create_app(gen, "tiny-chat", None, max_jobs=2)) as base:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        holder = c.completions.create(model="tiny-chat", prompt="a", max_tokens=200, n=2, stream=True,
                                      stop=None, extra_body={"min_tokens": 200})
        next(iter(holder))                  # its two jobs are running
        with pytest.raises(openai.RateLimitError) as info:
            c.completions.create(model="tiny-chat", prompt="b", max_tokens=2)
        assert info.value.code == "queue_full" and info.value.response.headers["retry-after"] == "1"
        holder.close()                      # disconnect: its jobs are cancelled, the queue empties
        assert wait_for_metric(base, "exl_queue_depth", 0) == 0
        assert wait_for_metric(base, "exl_cache_pages_used", 0) == 0
        deadline = time.monotonic() + 20
        while True:
            try:
                assert c.completions.create(model="tiny-chat", prompt="b", max_tokens=2).choices
                break
            except openai.RateLimitError:
                assert time.monotonic() < deadline
                time.sleep(0.05)


def test_failure_inside_one_request_leaves_the_server_serving(gen, url, client, monkeypatch):
    forward = gen._forward
    calls = {"n": 0}

    def failing_once(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return forward(batch)
    monkeypatch.setattr(gen, "_forward", failing_once)
    r = httpx.post(f"{url}/v1/completions", headers={"x-api-key": KEY}, timeout=30,
                   json={"prompt": "boom", "max_tokens": 5})
    assert r.status_code == 503 and error_of(r)["code"] == "out_of_memory"
    assert r.headers["retry-after"] == "1"
    calls["n"] = 0
    with pytest.raises(openai.APIError) as info:            # streamed: an error event
        list(client.completions.create(model="tiny-chat", prompt="boom", max_tokens=5, stream=True))
    assert "out of memory" in info.value.message
    assert client.completions.create(model="tiny-chat", prompt="fine", max_tokens=5).choices[0].text is not None
    assert wait_for_metric(url, "exl_cache_pages_used", 0) == 0
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}


# ---- exl serve ---------------------------------------------------------------------------------------------------

def test_exl_serve_generates_a_key_and_serves(model_dir, tmp_path):
    """exl serve (with n-gram drafting) at first start: a key made and kept, the banner, a completion."""
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "exl_backends.cli", "serve", "-m", str(model_dir), "--port", "0",
                             "--max-seq-len", "128", "--device", "cpu", "--ngram-draft"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line)
    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while not any(line.startswith("try ") for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        banner = "".join(lines)
        key_file = tmp_path / "exl-backends" / "api_key"
        key = key_file.read_text().strip()
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        assert f'-H "Authorization: Bearer {key}"' in banner and "fp32 (not quantized)" in banner
        assert "128 tokens per request" in banner and "auth       on" in banner
        assert "draft      n-gram lookup in each request's tokens, up to 7 tokens a step" in banner
        base = banner.split("url        ")[1].split("/v1")[0]
        assert base.startswith("http://127.0.0.1:")
        r = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == model_dir.name
        assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 401
        r = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                       json=dict(model=model_dir.name, prompt="a b c a b c a b", max_tokens=6, temperature=0))
        assert r.status_code == 200 and 1 <= r.json()["usage"]["completion_tokens"] <= 6
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_exl_serve_takes_one_way_of_drafting(capsys):
    from exl_backends.cli import parser
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "-m", "m", "--draft-model", "d", "--ngram-draft"])
    assert "not allowed with argument" in capsys.readouterr().err


# ---- the default model -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_answers_through_the_server():
    from exl_backends.commands.quickstart import default_model_dir
    try:
        path = default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model = ExlForCausalLM.from_pretrained(path, device="cpu", max_seq_len=512)
    with running(create_app(Generator(model, max_batch_size=4), path.name, ApiKey(KEY))) as base:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
        r = c.chat.completions.create(model=path.name, temperature=0, max_tokens=24, messages=[
            {"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in r.choices[0].message.content
        assert r.choices[0].finish_reason in ("stop", "length")
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=path.name, temperature=0, max_tokens=24, stream=True,
            messages=[{"role": "user", "content": "What is the capital of France?"}]))
        assert streamed == r.choices[0].message.content

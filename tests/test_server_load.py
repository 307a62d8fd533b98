"""The server under load, on loopback, bounded in time: 32 concurrent streaming clients each get their full, correct
completion; 8 clients that leave mid-stream have their jobs cancelled while the others finish, and the cache goes
back to idle; schemathesis, fuzzing every operation of the server's own OpenAPI schema, finds no 500 and no
response off its documented shape."""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from exl_backends import ExlForCausalLM, Generator, SamplingParams  # noqa: E402
from exl_backends.server.app import create_app  # noqa: E402
from exl_backends.server.auth import ApiKey  # noqa: E402

from serving import KEY, metric, running, save_chat_model, wait_for_metric  # noqa: E402

N_CLIENTS = 32
N_LEAVING = 8
NEW = 16
GREEDY = SamplingParams(temperature=0.0)
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("load_tiny"))


@pytest.fixture(scope="module")
def model(model_dir):
    return ExlForCausalLM.from_pretrained(model_dir, device="cpu", max_seq_len=256)


@pytest.fixture(scope="module")
def gen(model):
    return Generator(model, page_size=16, max_batch_size=64, cache_tokens=256 * 16)


@pytest.fixture(scope="module")
def url(gen):
    with running(create_app(gen, "tiny", ApiKey(KEY))) as base:
        yield base


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 509, (int(k),), generator=g).tolist() for k in torch.randint(5, 40, (n,), generator=g)]


def batch_sizes(gen: Generator, monkeypatch) -> list[int]:
    """Records the number of sequences of every batch the generator runs (until the test ends)."""
    sizes = []
    forward = gen._forward

    def counting(batch):
        sizes.append(batch.n_seqs)
        return forward(batch)
    monkeypatch.setattr(gen, "_forward", counting)
    return sizes


async def stream_text(client, prompt: list[int], max_tokens: int, leave_after: int | None = None) -> str:
    """A streaming completion's text; with leave_after, the client disconnects after that many chunks."""
    stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"min_tokens": max_tokens})
    text, n = "", 0
    async for chunk in stream:
        text += chunk.choices[0].text
        n += 1
        if n == leave_after:
            await stream.close()
            break
    return text


async def run_clients(url: str, jobs: list[tuple[list[int], int, int | None]]) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=64)))
    async with client:
        return await asyncio.wait_for(asyncio.gather(*(stream_text(client, *job) for job in jobs)), RUN_TIMEOUT_S)


def test_32_concurrent_streams_each_get_their_completion(gen, url, monkeypatch):
    ps = prompts(N_CLIENTS, seed=1)
    want = [gen.generate(p, max_new_tokens=NEW, min_new_tokens=NEW, sampling=GREEDY).text for p in ps]
    sizes = batch_sizes(gen, monkeypatch)
    got = asyncio.run(run_clients(url, [(p, NEW, None) for p in ps]))
    assert got == want
    assert max(sizes) >= 8, f"the clients never ran together (largest batch {max(sizes)})"
    assert wait_for_metric(url, "exl_cache_pages_used", 0) == 0


def test_clients_leaving_mid_stream_are_cancelled_and_others_finish(gen, url):
    survivors = prompts(N_CLIENTS, seed=2)
    leavers = prompts(N_LEAVING, seed=3)
    want = [gen.generate(p, max_new_tokens=24, min_new_tokens=24, sampling=GREEDY).text for p in survivors]
    cancelled = metric(url, 'exl_jobs_finished_total{reason="cancelled"}')
    jobs = [(p, 24, None) for p in survivors] + [(p, 200, 2) for p in leavers]
    got = asyncio.run(run_clients(url, jobs))
    assert got[:N_CLIENTS] == want
    assert wait_for_metric(url, 'exl_jobs_finished_total{reason="cancelled"}', cancelled + N_LEAVING) == \
        cancelled + N_LEAVING
    assert wait_for_metric(url, "exl_cache_pages_used", 0) == 0
    assert metric(url, "exl_queue_depth") == 0 and metric(url, "exl_jobs_running") == 0
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
    # and it goes on serving
    one = prompts(1, seed=4)[0]
    assert asyncio.run(run_clients(url, [(one, 8, None)])) == [
        gen.generate(one, max_new_tokens=8, min_new_tokens=8, sampling=GREEDY).text]


@pytest.fixture(scope="module")
def short_url(model_dir):
    """A server whose context is short: fuzzed requests (no max_tokens, n up to 16) generate little (64: room for
    a tool message, which a template without tool support gets wrapped in <tool_response> tags)."""
    model = ExlForCausalLM.from_pretrained(model_dir, device="cpu", max_seq_len=64)
    with running(create_app(Generator(model, page_size=16, cache_tokens=64 * 16), "tiny", ApiKey(KEY))) as base:
        yield base


def test_schemathesis_finds_no_server_error(short_url, tmp_path):
    """Property-based fuzzing of every operation in /openapi.json (valid and invalid bodies, boundary values,
    streaming): no 5xx, every status documented, every response (and every streamed event) of its documented
    shape."""
    pytest.importorskip("schemathesis")
    url = short_url
    cmd = [sys.executable, "-c", "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
           "run", f"{url}/openapi.json", "--checks",
           "not_a_server_error,status_code_conformance,response_schema_conformance,content_type_conformance",
           "--max-examples", "20", "--seed", "1", "--header", f"Authorization: Bearer {KEY}",
           "--request-timeout", "60", "--no-color", "--generation-database", "none",
           "--report-dir", str(tmp_path)]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "No issues found" in r.stdout
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
    assert wait_for_metric(url, "exl_cache_pages_used", 0) == 0


def test_a_client_that_does_not_read_stalls_no_one(gen, url):
    """A client sends a long streaming request and never reads its socket: the others are served as usual, and
    its job runs to its end on its own (nothing waits on that client)."""
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"prompt": prompts(1, seed=5)[0], "max_tokens": 200, "min_tokens": 200, "stream": True,
                       "temperature": 0}).encode()
    slow = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(("127.0.0.1", port))
    try:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"x-api-key: " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        others = prompts(8, seed=6)
        want = [gen.generate(p, max_new_tokens=NEW, min_new_tokens=NEW, sampling=GREEDY).text for p in others]
        assert asyncio.run(run_clients(url, [(p, NEW, None) for p in others])) == want
        assert wait_for_metric(url, "exl_jobs_running", 0) == 0      # the unread job finished all the same
        assert wait_for_metric(url, "exl_cache_pages_used", 0) == 0
    finally:
        slow.close()
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}


def test_a_non_streaming_client_that_leaves_is_cancelled(url, gen, monkeypatch):
    forward = gen._forward

    def slow(batch):        # 220 steps then outlast the server's disconnect poll (DISCONNECT_POLL_S) many times
        time.sleep(0.01)
        return forward(batch)
    monkeypatch.setattr(gen, "_forward", slow)
    cancelled = metric(url, 'exl_jobs_finished_total{reason="cancelled"}')
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"prompt": prompts(1, seed=7)[0], "max_tokens": 220, "min_tokens": 220, "n": 2}).encode()
    with socket.create_connection(("127.0.0.1", port)) as leaving:
        leaving.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                        b"x-api-key: " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
                        b"\r\n\r\n" + body)
        assert wait_for_metric(url, "exl_jobs_running", 2) == 2
    assert wait_for_metric(url, 'exl_jobs_finished_total{reason="cancelled"}', cancelled + 2) == cancelled + 2
    assert wait_for_metric(url, "exl_cache_pages_used", 0) == 0

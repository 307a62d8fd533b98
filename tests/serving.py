"""Helpers of the server tests: a tiny random model with a chat template, and a real uvicorn server on an ephemeral
loopback port, run in a thread and always stopped."""
from __future__ import annotations

import json
import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from conftest import save_tiny, tiny_config

KEY = "sk-test-0123456789abcdef"
# ChatML in the fixtures' vocabulary: <|end_of_text|> (special, id 510) ends each turn, so it also ends a reply
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|end_of_text|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# a template with tool support and reasoning, in the Qwen3 style: tools in the system turn, calls in <tool_call>
# tags, results in <tool_response> tags, and a generation prompt that opens a <think> block
THINKING_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|end_of_text|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}{% elif m.role == 'tool' %}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% else %}{{ m.content }}{% endif %}<|end_of_text|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def save_chat_model(directory: Path, template: str = CHAT_TEMPLATE) -> Path:
    save_tiny(directory, tiny_config("llama"))
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), chat_template=template)))
    return directory


@contextmanager
def running(app, start_timeout: float = 60.0):
    """Serves app on 127.0.0.1 (an ephemeral port) in a thread; yields the base URL; stops it on exit."""
    import uvicorn

    from exl_backends.server.serve import listen
    sock = listen("127.0.0.1", 0)                   # as `exl serve` binds (TCP_NODELAY)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def metric(base_url: str, name: str) -> float:
    """One sample of /metrics (a name with its labels, e.g. 'exl_jobs_finished_total{reason="cancelled"}')."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def wait_for_metric(base_url: str, name: str, value: float, timeout: float = 20.0) -> float:
    """Polls a metric until it equals value (or the time runs out); returns the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        got = metric(base_url, name)
        if got == value or time.monotonic() > deadline:
            return got
        time.sleep(0.05)

"""Every script in examples/ runs (offline, on the default model) and prints what it promises."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow
EXAMPLES = REPO / "examples"


def run_example(name: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_every_example_has_a_test():
    tested = {"agent.py", "engine.py", "hf_generate.py", "langchain_chain.py", "langchain_structured.py",
              "llamaindex_rag.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_engine():
    out = run_example("engine.py").splitlines()
    assert "Paris" in out[0] and "4" in out[2]
    answer = json.loads(next(line for line in out if line.startswith("json: "))[len("json: "):])
    assert set(answer) == {"city", "country"} and all(isinstance(v, str) for v in answer.values())
    assert next(line for line in out if line.startswith("ngram: ")).startswith("ngram: same text True")


def test_hf_generate():
    out = run_example("hf_generate.py")
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert "Paris" in out.splitlines()[0] and "Paris" in lines["stream"] and "Paris" in lines["pipeline"]


def test_langchain_chain():
    streamed, invoked = run_example("langchain_chain.py").strip().splitlines()[:2]
    assert "Paris" in streamed and "Italy" in invoked


def test_langchain_structured():
    assert "Person(name='Alice', age=31)" in run_example("langchain_structured.py")


def test_llamaindex_rag_answers_from_its_documents():
    out = run_example("llamaindex_rag.py")
    answer = next(line for line in out.splitlines() if line.startswith("answer:"))
    assert "ninth of October" in answer or "October 9" in answer
    assert "lantern festival" in next(line for line in out.splitlines() if line.startswith("source:"))


def test_agent_calls_both_tools_then_answers_alike_through_langchain_and_the_server():
    out = run_example("agent.py").splitlines()
    for door in ("langchain", "server"):
        assert [line for line in out if line.startswith(f"{door} call: ")] == [
            f'{door} call: capital({{"country": "France"}}) -> Paris',
            f'{door} call: calculator({{"expression": "12 * 7"}}) -> 84']
    answers = [line.split(": ", 1)[1] for line in out if line.startswith(("langchain answer: ", "server answer: "))]
    assert len(answers) == 2 and answers[0] == answers[1] and ("84" in answers[0] or "Paris" in answers[0])

"""The README's Python snippets run as written. In CI they run on a tiny random chat model (EXL2, converted by our
converter): their model paths ("path/to/...") and the default model's directory point at it, nothing else changes.
On the real default model (slow), the first snippet's JSON-schema call returns JSON valid against its schema within a
few tokens."""
from __future__ import annotations

import json
import re

import pytest

import exl_backends.commands.quickstart
from tiny_chat_model import tiny_chat_model

from conftest import REPO

BLOCKS = re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), flags=re.S | re.M)
NOT_RUN = {"gpu_split=": "several GPUs: tests/test_placement.py and tests/test_tensor_parallel.py run these calls"}
PLACEHOLDER = re.compile(r'"path/to/[\w-]*"')


def not_run(block: str) -> str | None:
    return next((why for marker, why in NOT_RUN.items() if marker in block), None)


def run(block: str, model_dir: str, monkeypatch) -> dict:
    """exec of the block as written, its placeholder paths and the default model's directory set to model_dir."""
    monkeypatch.setattr(exl_backends.commands.quickstart, "default_model_dir", lambda: model_dir)
    namespace: dict = {}
    exec(compile(PLACEHOLDER.sub(repr(model_dir), block), "README.md", "exec"), namespace)
    return namespace


def test_the_readme_has_the_snippets_this_file_expects():
    assert len(BLOCKS) >= 6 and sum(not_run(b) is None for b in BLOCKS) >= 5


@pytest.mark.parametrize("block", BLOCKS, ids=[b.splitlines()[0][:40] for b in BLOCKS])
def test_snippet_runs_on_a_tiny_model(block, monkeypatch, capsys):
    if not_run(block):
        pytest.skip(not_run(block))
    run(block, tiny_chat_model(0), monkeypatch)
    assert capsys.readouterr().out.strip()          # every snippet prints what it made


def test_json_schema_snippet_cut_by_the_budget_reports_length():
    """What the README promises for a schema that does not close in time: cut JSON with finish_reason "length"."""
    from exl_backends import ExlForCausalLM, Generator
    gen = Generator(ExlForCausalLM.from_pretrained(tiny_chat_model(0), device="cpu"))
    out = gen.generate("Give me a user as JSON", max_new_tokens=3,
                       json_schema={"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}})
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


@pytest.mark.slow
def test_first_snippet_on_the_default_model_returns_valid_json_quickly(monkeypatch, capsys):
    import jsonschema
    block = BLOCKS[0]
    assert "default_model_dir()" in block and "json_schema=user" in block
    ns = run(block, str(exl_backends.commands.quickstart.default_model_dir()), monkeypatch)
    out = ns["out"]
    assert out.finish_reason == "stop" and len(out.token_ids) <= 32, (out.finish_reason, out.text)
    jsonschema.validate(json.loads(out.text), ns["user"])
    assert "Paris" in capsys.readouterr().out                # the stream: "The capital of France is Paris"

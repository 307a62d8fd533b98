"""Constrained output: a random "model" (random logits, sampled through the constraint's mask) must always produce
output that parses and validates, with the fixtures' byte-level BPE tokenizer (vocab 512)."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

pytest.importorskip("llguidance", reason="llguidance (a dependency) is not installed: the GPU machine lacks it")

from exl_backends.engine.constraints import Constraint, GrammarTokenizer
from exl_backends.engine.sampling import SamplerState, SamplingParams, sample
from exl_backends.errors import SamplingError

from conftest import TOKENIZER_DIR

VOCAB = 512
EOS = 510


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def grammar_tokenizer(tokenizer):
    return GrammarTokenizer(tokenizer)


def generate(constraint: Constraint, tokenizer, seed: int, max_tokens: int = 3000) -> str:
    """A random model: random logits each step, sampled with the constraint's mask, until EOS."""
    state = SamplerState(SamplingParams(seed=seed), [])
    g = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(max_tokens):
        mask = constraint.allowed(VOCAB)
        token = sample(torch.randn(VOCAB, generator=g) * 2, state, mask).token
        assert mask[token]
        constraint.advance(token)
        state.accept(token)
        if token == EOS:
            assert constraint.is_finished()
            return tokenizer.decode(tokens)
        tokens.append(token)
    raise AssertionError(f"no EOS after {max_tokens} tokens: {tokenizer.decode(tokens)[:200]!r}")


def random_schema(rng: random.Random, depth: int = 0, kind: str | None = None) -> dict:
    kinds = ["integer", "number", "boolean", "null", "string", "enum", "pattern", "const"]
    if depth < 2:
        kinds += ["array", "object", "object", "anyOf"]
    kind = kind or rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        bounded = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 99)}
        return rng.choice([{"type": "integer"}, bounded])
    if kind == "number":
        return rng.choice([{"type": "number"}, {"type": "number", "minimum": -1.5, "maximum": 2.25}])
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "string":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 10)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "a b", "x\"y", 7, None, True], rng.randint(1, 4))}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice([r"^[a-z]{1,6}$", r"^[0-9]{2,4}-[A-Z]$", r"^(ab|cd)+x?$"])}
    if kind == "const":
        return {"const": rng.choice(["fixed", 42, [1, 2], {"k": "v"}])}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low,
                "maxItems": low + rng.randint(0, 3)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1), random_schema(rng, depth + 1)]}
    names = rng.sample(["id", "name", "tags", "score", "ok", "child", "note", "x y"], rng.randint(1, 4))
    required = rng.sample(names, rng.randint((len(names) + 1) // 2, len(names)))
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": required, "additionalProperties": False}


@pytest.mark.parametrize("seed", range(50))
def test_json_schema_output_validates(seed, tokenizer, grammar_tokenizer):
    rng = random.Random(seed)
    schema = random_schema(rng, kind="object" if seed % 5 else None)       # mostly objects, as APIs ask
    constraint = Constraint(grammar_tokenizer, json_schema=schema if seed % 2 else json.dumps(schema))
    text = generate(constraint, tokenizer, seed)
    jsonschema.validate(json.loads(text), schema)


def test_json_object(tokenizer, grammar_tokenizer):
    for seed in range(5):
        assert isinstance(json.loads(generate(Constraint(grammar_tokenizer, json_object=True), tokenizer, seed)),
                          dict)


@pytest.mark.parametrize("pattern", [
    r"[0-9]{3}-[0-9]{4}",     # not \\d: Rust and Python disagree on Unicode digits newer than Python
    r"(yes|no|maybe)",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)",
    r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
    r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,3}",
    r"#[0-9a-fA-F]{6}",
])
def test_regex_output_fullmatches(pattern, tokenizer, grammar_tokenizer):
    for seed in range(5):
        text = generate(Constraint(grammar_tokenizer, regex=pattern), tokenizer, seed)
        assert re.fullmatch(pattern, text), text


def test_grammars(tokenizer, grammar_tokenizer):
    lark = 'start: term (("+" | "-") term)*\nterm: NUMBER | "(" start ")"\nNUMBER: /0|[1-9][0-9]{0,2}/'
    gbnf = 'root ::= answer "."\nanswer ::= "yes" | "no"'
    for seed in range(5):
        text = generate(Constraint(grammar_tokenizer, grammar=lark), tokenizer, seed)
        assert re.fullmatch(r"[0-9()+-]+", text) and eval(text) is not None, text      # balanced arithmetic
        assert generate(Constraint(grammar_tokenizer, grammar=gbnf), tokenizer, seed) in ("yes.", "no.")


def test_mask_padding_and_eos(tokenizer, grammar_tokenizer):
    constraint = Constraint(grammar_tokenizer, regex="ab|abcd")
    padded = constraint.allowed(VOCAB + 37)                 # lm_head wider than the tokenizer
    assert padded.shape == (VOCAB + 37,) and not padded[VOCAB:].any()
    assert torch.equal(constraint.allowed(300), padded[:300])
    for token in tokenizer.encode("ab", add_special_tokens=False):
        assert not constraint.allowed(VOCAB)[EOS]
        constraint.advance(token)
    assert constraint.allowed(VOCAB)[EOS] and constraint.is_accepting() and not constraint.is_finished()
    with pytest.raises(SamplingError, match="not allowed by the constraint"):
        constraint.advance(tokenizer.encode("x", add_special_tokens=False)[0])


def test_rollback_restores_masks(tokenizer, grammar_tokenizer):
    constraint = Constraint(grammar_tokenizer, json_schema={"type": "object", "properties": {
        "name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name", "n"],
        "additionalProperties": False})
    tokens = tokenizer.encode('{"name": "bob", "n": 12}', add_special_tokens=False) + [EOS]
    masks = []
    for token in tokens:
        masks.append(constraint.allowed(VOCAB))
        assert masks[-1][token]
        constraint.advance(token)
    assert constraint.is_finished() and not constraint.allowed(VOCAB).any()     # nothing after EOS
    for n in (1, 4, len(tokens) - 1):
        constraint.rollback(n)
        assert torch.equal(constraint.allowed(VOCAB), masks[len(tokens) - n])
        for token in tokens[len(tokens) - n:]:
            constraint.advance(token)
    constraint.rollback(len(tokens))
    assert torch.equal(constraint.allowed(VOCAB), masks[0])


def test_draft_masks(tokenizer, grammar_tokenizer):
    constraint = Constraint(grammar_tokenizer, regex=r"[0-9]{2,5}")
    digits = tokenizer.encode("12345", add_special_tokens=False)
    constraint.advance(digits[0])
    before = constraint.allowed(VOCAB)
    masks = constraint.draft_masks(digits[1:], VOCAB)
    assert torch.equal(constraint.allowed(VOCAB), before)                # state unchanged
    expected = [before]
    for token in digits[1:]:
        constraint.advance(token)
        expected.append(constraint.allowed(VOCAB))
    constraint.rollback(len(digits) - 1)
    assert torch.equal(masks, torch.stack(expected))
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    masks = constraint.draft_masks([digits[1], letter, digits[2]], VOCAB)
    assert torch.equal(masks[:2], torch.stack(expected[:2])) and masks[2:].all()
    assert torch.equal(constraint.allowed(VOCAB), before)


@pytest.mark.parametrize("kwargs, message", [
    (dict(json_schema={"type": "foo"}), "invalid constraint: Invalid type: foo"),
    (dict(json_schema={"type": "string", "minLength": 5, "maxLength": 2}), "Unsatisfiable schema"),
    (dict(json_schema="{not json"), "invalid json_schema"),
    (dict(json_schema="[1, 2]"), "invalid json_schema: a JSON schema is an object"),
    (dict(regex="a(b"), "unclosed group"),
    (dict(grammar="start: ( "), "invalid constraint"),
    (dict(), "exactly one of .*none"),
    (dict(regex="a", json_object=True), r"exactly one of .*\['json_object', 'regex'\]"),
])
def test_bad_constraints(kwargs, message, grammar_tokenizer):
    with pytest.raises(SamplingError, match=message):
        Constraint(grammar_tokenizer, **kwargs)


@pytest.mark.slow
def test_smollm2_tokenizer_accepts_its_own_tokenization():
    """A 49k byte-level BPE vocabulary: the tokenizer's own encoding of valid JSON passes the masks."""
    from exl_backends.commands.quickstart import default_model_dir
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())      # imported on first use, as the quickstart
    grammar_tokenizer = GrammarTokenizer(tokenizer)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    constraint = Constraint(grammar_tokenizer, json_schema=schema)
    for token in tokenizer.encode('{"city": "Paris — Île-de-France", "population": 2102650}'):
        assert constraint.allowed(grammar_tokenizer.vocab_size)[token]
        constraint.advance(token)
    assert constraint.allowed(grammar_tokenizer.vocab_size)[tokenizer.eos_token_id]

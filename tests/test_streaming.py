"""Streaming text: whole characters only, stop strings across token boundaries (held back while partial), banned
strings taken back and resampled. A scripted forward makes the model say exactly the tokens a test needs."""
from __future__ import annotations

import pytest
import torch

from exl_backends import ExlForCausalLM
from exl_backends.engine.detokenizer import Detokenizer, find_first, partial_start
from exl_backends.engine.generator import Generator

from conftest import save_tiny, tiny_config

EOS = 510
PROMPT = [39, 68, 288, 78]      # "Hello"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny(path, tiny_config("llama"))
    return ExlForCausalLM.from_pretrained(path, device="cpu")


def scripted(model, choices: list[list[int]], **kw) -> Generator:
    """A generator whose model prefers, at generated position i, choices[i][0], then choices[i][1], ...
    and EOS after the script (the real forward still runs, so the cache is filled as usual)."""
    gen = Generator(model, page_size=16, cache_tokens=1024, **kw)
    forward, vocab = gen._forward, model.exl_config.vocab_size

    def prefer(batch):
        forward(batch)
        wanted = (batch.positions[batch.logit_rows] + 1 - len(PROMPT)).tolist()
        logits = torch.zeros(len(wanted), vocab)
        for row, i in enumerate(wanted):
            for rank, token in enumerate(choices[i] if i < len(choices) else [EOS]):
                logits[row, token] = 10.0 - rank
        return logits
    gen._forward = prefer
    return gen


def says(model, text: str, **kw) -> Generator:
    return scripted(model, [[t] for t in model.tokenizer.encode(text, add_special_tokens=False)], **kw)


def stream(gen: Generator, **kw) -> list:
    return list(gen.stream(PROMPT, max_new_tokens=64, **kw))


TEXT = "héllo wörld 日本 😀!"


def test_a_character_can_span_several_tokens(model):
    ids = model.tokenizer.encode("日", add_special_tokens=False)
    assert len(ids) == 3 and all(model.tokenizer.decode([i]) == "\ufffd" for i in ids)


def test_detokenizer_adds_whole_characters_only(model):
    tok = model.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = Detokenizer(tok, PROMPT)
    seen = []
    for t in ids:
        detok.add(t)
        assert "\ufffd" not in detok.text and TEXT.startswith(detok.text)
        seen.append(detok.text)
    assert detok.text == TEXT and len(set(seen)) < len(seen)     # some tokens had to wait for the next
    detok.rollback(3)                                            # the 3 tokens of 😀's last bytes and "!"
    assert detok.text == "héllo wörld 日本 " and detok.tail() == "\ufffd"


def test_stream_never_splits_a_character(model):
    ids = model.tokenizer.encode(TEXT, add_special_tokens=False)
    chunks = stream(says(model, TEXT))
    assert all("\ufffd" not in c.text for c in chunks)
    assert "".join(map(str, chunks)) == TEXT
    assert [t for c in chunks for t in c.token_ids] == ids + [EOS]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].usage.completion_tokens == len(ids) + 1


@pytest.mark.parametrize("stop, expected", [
    (["STOP"], "Hello world. "),            # " S" + "T" + "O" + "P": the stop string starts inside a token
    (["ld. ST"], "Hello wor"),              # spans four tokens
    (["here", "world"], "Hello "),          # the earliest match wins
    ("re", "Hello world. STOP he"),         # a single string, at the very end
])
def test_stop_strings_across_tokens(model, stop, expected):
    chunks = stream(says(model, "Hello world. STOP here"), stop=stop)
    assert "".join(map(str, chunks)) == expected
    assert chunks[-1].finish_reason == "stop"
    kept = says(model, "Hello world. STOP here").generate(PROMPT, stop=stop, include_stop=True)
    hit = find_first("Hello world. STOP here", 0, (stop,) if isinstance(stop, str) else tuple(stop))
    assert kept.text == expected + hit[1]


def test_partial_stop_string_is_held_then_released(model):
    chunks = stream(says(model, "Hello world. STOP here"), stop=["STAR"])
    assert "".join(map(str, chunks)) == "Hello world. STOP here" and chunks[-1].finish_reason == "stop"
    texts = [c.text for c in chunks]
    # " S" and "T" could begin "STAR": nothing after " " shows until "O" rules it out
    assert " STO" in "".join(texts) and any(t.endswith(" ") for t in texts) and "T" not in texts


def test_banned_string_is_taken_back_and_resampled(model):
    tok = model.tokenizer
    ids = tok.encode("the cat sat", add_special_tokens=False)     # t, he, " c", at, " s", at
    b = tok.encode(" b", add_special_tokens=False)[0]
    choices = [[t] for t in ids]
    choices[2] = [ids[2], b]                                       # " c" first, " b" second
    chunks = stream(scripted(model, choices), banned_strings=["cat"])
    assert "".join(map(str, chunks)) == "the bat sat"
    assert all("c" not in c.text for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == ids[:2] + [b] + ids[3:] + [EOS]


def test_string_helpers():
    assert find_first("abcabc", 1, ("ca", "bc")) == (1, "bc")
    assert find_first("abc", 0, ("x",)) is None
    assert partial_start("hello wo", 0, ("world",)) == 6
    assert partial_start("hello w", 7, ("world",)) == 7       # nothing after begin
    assert partial_start("abc", 0, ()) == 3
    assert partial_start("aab", 0, ("aabx", "bz")) == 0       # the longest candidate wins

"""ExlForCausalLM.generate against transformers' generate on the same tiny random Llama (f32, CPU)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import MaxLengthCriteria, StoppingCriteriaList

from exl_backends import ExlForCausalLM, Generator
from exl_backends.errors import ConfigError

from conftest import FIXTURES, save_tiny, tiny_config

PAD = 511


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    hf = save_tiny(path, tiny_config("llama"))
    return ExlForCausalLM.from_pretrained(path, device="cpu"), hf


def left_padded(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n:] = torch.randint(0, 509, (n,), generator=g)
        mask[b, width - n:] = 1
    return ids, mask


def hf_generate(hf, ids, mask, **kw):
    with torch.no_grad():
        return hf.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, **kw)


def test_batched_greedy_equals_transformers(tiny):
    model, hf = tiny
    ids, mask = left_padded([5, 12, 20], seed=1)
    ref = hf_generate(hf, ids, mask, max_new_tokens=32)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=32, pad_token_id=PAD), ref)
    # an EOS that one row reaches early: that row is padded after it, like transformers does
    eos = ref[1, 20 + 3].item()
    ref = hf_generate(hf, ids, mask, max_new_tokens=32, eos_token_id=eos)
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=32, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(ours, ref) and (ours[1, 24:] == PAD).all()


class Recorder:
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended = True


def test_streamer_gets_prompt_then_columns_then_end(tiny):
    model, _ = tiny
    ids, mask = left_padded([7, 9], seed=2)
    streamer = Recorder()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, streamer=streamer, pad_token_id=PAD)
    assert streamer.ended and torch.equal(streamer.puts[0], ids)
    assert all(p.shape == (2,) for p in streamer.puts[1:])
    assert torch.equal(torch.stack(streamer.puts[1:], dim=1), out[:, ids.shape[1]:])


def test_stopping_criteria_end_rows(tiny):
    model, hf = tiny
    ids, mask = left_padded([6, 10], seed=3)
    criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=ids.shape[1] + 5)])
    ref = hf_generate(hf, ids, mask, max_new_tokens=20, stopping_criteria=criteria)
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=20, stopping_criteria=criteria, pad_token_id=PAD)
    assert ours.shape == (2, ids.shape[1] + 5) and torch.equal(ours, ref)


def test_sampling_follows_torch_seed(tiny):
    model, _ = tiny
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    torch.manual_seed(0)
    one = model.generate(ids, max_new_tokens=16, do_sample=True, temperature=1.0, top_p=0.95)
    torch.manual_seed(0)
    two = model.generate(ids, max_new_tokens=16, do_sample=True, temperature=1.0, top_p=0.95)
    greedy = model.generate(ids, max_new_tokens=16)
    assert torch.equal(one, two) and not torch.equal(one, greedy)


def test_unsupported_arguments_are_refused(tiny):
    model, _ = tiny
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(TypeError):
        model.generate(ids, num_beams=2)
    with pytest.raises(ValueError, match="left"):
        model.generate(ids, attention_mask=torch.tensor([[1, 1, 0]]))


# ---- the tokenizer loads when first used ---------------------------------------------------------------------------

TOKENIZER_MODULES = ("transformers.tokenization_utils_base", "transformers.tokenization_utils_tokenizers",
                     "transformers.tokenization_utils_fast", "tokenizers")


def test_generate_from_token_ids_leaves_the_tokenizer_unloaded(tiny):
    path = tiny[0].name_or_path
    lazy = ExlForCausalLM.from_pretrained(path, device="cpu")
    ids, mask = left_padded([6, 11], seed=5)
    kw = dict(attention_mask=mask, max_new_tokens=10, pad_token_id=PAD)
    out = lazy.generate(ids, **kw)
    torch.manual_seed(0)
    sampled = lazy.generate(ids, do_sample=True, temperature=1.0, **kw)
    assert "tokenizer" not in lazy.__dict__ and "tokenizer" not in lazy._generator.__dict__
    eager = ExlForCausalLM.from_pretrained(path, device="cpu")
    assert eager.tokenizer is not None                      # loaded first
    assert torch.equal(eager.generate(ids, **kw), out)
    torch.manual_seed(0)
    assert torch.equal(eager.generate(ids, do_sample=True, temperature=1.0, **kw), sampled)


def test_load_and_first_token_import_no_tokenizer_classes(tmp_path):
    """In a fresh process: from_pretrained and generate() from token ids import none of transformers' tokenizer
    machinery (1-1.7 s of an 8B warm load on the H100); the tokenizer, when read, does."""
    probe = ("import sys, torch\n"
             "from exl_backends import ExlForCausalLM\n"
             f"m = ExlForCausalLM.from_pretrained({str(FIXTURES / 'exl2' / 'llama_tiny_exl2_4.0bpw_h6')!r}, "
             "device='cpu')\n"
             "m.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=1, do_sample=False)\n"
             f"print([name for name in {TOKENIZER_MODULES!r} if name in sys.modules])\n"
             "m.tokenizer\n"
             f"print([name for name in {TOKENIZER_MODULES!r} if name in sys.modules])\n")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    before, after = out.stdout.strip().splitlines()[-2:]
    assert before == "[]"
    assert "'transformers.tokenization_utils_base'" in after


def test_a_directory_without_a_tokenizer_fails_before_its_weights_load(tmp_path, monkeypatch):
    path = tmp_path / "model"
    shutil.copytree(FIXTURES / "exl2" / "llama_tiny_exl2_4.0bpw_h6", path)
    (path / "tokenizer.json").unlink()
    monkeypatch.setattr("exl_backends.adapters.hf.Model.load", lambda *a: pytest.fail("weights loaded"))
    with pytest.raises(ConfigError, match="cannot load the tokenizer .*it has none of tokenizer.json"):
        ExlForCausalLM.from_pretrained(path, device="cpu")


def test_a_broken_tokenizer_fails_when_first_used(tmp_path):
    path = tmp_path / "model"
    shutil.copytree(FIXTURES / "exl2" / "llama_tiny_exl2_4.0bpw_h6", path)
    (path / "tokenizer.json").write_text("{}")
    model = ExlForCausalLM.from_pretrained(path, device="cpu")
    assert model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2).shape == (1, 5)
    with pytest.raises(ConfigError, match="cannot load the tokenizer"):
        Generator(model).generate("The moon", max_new_tokens=2)


def test_text_generation_loads_the_tokenizer_when_first_used(tiny):
    model = ExlForCausalLM.from_pretrained(tiny[0].name_or_path, device="cpu")
    assert "tokenizer" not in model.__dict__
    out = Generator(model).generate("The moon", max_new_tokens=8, stop_token_ids=[])
    assert "tokenizer" in model.__dict__
    tok = model.tokenizer
    assert len(out.token_ids) == 8 and out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert Generator(model).generate(tok.encode("The moon"), max_new_tokens=8, stop_token_ids=[]).token_ids == \
        out.token_ids
    given = ExlForCausalLM(model.model, tok, model.name_or_path, 64, "fp16")     # a tokenizer passed in is kept
    assert given.tokenizer is tok

"""ExlForCausalLM.generate against transformers' generate on the same tiny random Llama (f32, CPU)."""
from __future__ import annotations

import pytest
import torch
from transformers import MaxLengthCriteria, StoppingCriteriaList

from exl_backends import ExlForCausalLM

from conftest import save_tiny, tiny_config

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

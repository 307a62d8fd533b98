"""The real default model, SmolLM2-135M-Instruct (imported from its GGUF once per machine)."""
from __future__ import annotations

import pytest
import torch

from exl_backends import ExlForCausalLM
from exl_backends.commands.quickstart import chat_prompt, default_model_dir

from conftest import WIKITEXT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    path = default_model_dir()
    return path, ExlForCausalLM.from_pretrained(path, device="cpu", max_seq_len=1024)


def test_logits_equal_transformers_on_wikitext(smollm2):
    from transformers import AutoModelForCausalLM
    path, ours = smollm2
    text = (WIKITEXT / "test-excerpt.txt").read_text()
    ids = ours.tokenizer(text, return_tensors="pt").input_ids[:, :256]
    assert ids.shape[1] == 256
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids).logits
    diff = (ours(ids).logits - ref).abs().max().item()
    assert diff <= 1e-4 * ref.abs().max().item()


def test_chat_answer_names_paris(smollm2):
    from exl_backends import Generator, SamplingParams
    _, model = smollm2
    ids = chat_prompt(model.tokenizer, "What is the capital of France?")
    answer = str(Generator(model).generate(ids, max_new_tokens=24, sampling=SamplingParams(temperature=0.0)))
    assert "Paris" in answer


def test_quickstart_runs_the_exl2_conversion_and_answers_paris(capsys):
    from exl_backends.commands import quickstart
    answer = quickstart.run(device="cpu", max_new_tokens=24)
    assert "Paris" in answer
    config = (quickstart.default_exl2_dir("cpu") / "config.json").read_text()
    assert '"quant_method": "exl2"' in config
    assert "tokens/s" in capsys.readouterr().out

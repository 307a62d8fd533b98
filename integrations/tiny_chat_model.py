"""Tiny random chat models for fast CPU tests: a 2-layer Llama with the exl2-ref fixtures' byte-level tokenizer and
a chat template added (the fixtures' tokenizer has none). Random weights: the text is noise, the protocol is real.
A few output tokens (the quote among them) get rows of a larger norm in lm_head, so sampled JSON strings close
within a few tokens and the structured-output tests fit in max_tokens. Both adapters' tests import it (pytest's
pythonpath, pyproject.toml)."""
from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("EXL_FIXTURES", REPO / "tests" / "fixtures" / "exl2-ref"))
TOKENIZER_DIR = FIXTURES / "hf" / "llama_tiny"
CHAT_TEMPLATE = ("{% for m in messages %}<|begin_of_text|>{{ m['role'] }}\n{{ m['content'] }}<|end_of_text|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|begin_of_text|>assistant\n{% endif %}")
BOOSTED = ['"', "a", "e", "t", "\u0120", "s"]        # \u0120: the byte-level space


@functools.cache
def tiny_chat_model(seed: int = 0) -> str:
    """The directory of a tiny random chat model converted to EXL2 6.0 bpw by our converter (made once per
    process, deleted at exit), so the adapters run through the quantized path."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    directory = Path(tempfile.mkdtemp(prefix=f"exl-tiny-chat-{seed}-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=509, eos_token_id=510, pad_token_id=511, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():           # wider than the default init, so the logits are not all alike
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
        from transformers import PreTrainedTokenizerFast
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_DIR / "tokenizer.json"))
        model.lm_head.weight[tokenizer.convert_tokens_to_ids(BOOSTED)] *= 12
    model.save_pretrained(directory)
    shutil.copy(TOKENIZER_DIR / "tokenizer.json", directory / "tokenizer.json")
    tokenizer_config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    from exl_backends.convert.pipeline import ConvertOptions, convert
    exl2 = directory / "exl2"
    convert(ConvertOptions(directory, exl2, 6.0, rows=4, length=64, device="cpu", job_dir=directory / "job"))
    return str(exl2)

"""Perplexity and KL divergence (exl_backends/commands/evaluate.py) against direct computations with transformers."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from exl_backends import ExlForCausalLM
from exl_backends.commands.evaluate import Scores, kl_divergence, perplexity, score, text_tokens, windows
from exl_backends.errors import ExlError

from conftest import save_tiny, tiny_config


@pytest.mark.parametrize("n,ctx,stride", [(100, 16, 16), (100, 16, 5), (17, 16, 16), (16, 16, 8), (2, 8, 8),
                                          (1000, 128, 100)])
def test_windows_score_every_token_once_with_context(n, ctx, stride):
    """Overlapping windows score every token but the first; disjoint ones (stride = ctx) leave each window's
    first token as context only."""
    scored, starts = [], []
    for begin, end, first in windows(n, ctx, stride):
        assert end - begin <= ctx and begin < first < end
        scored += range(first, end)
        starts.append(begin)
    expected = [t for t in range(1, n) if stride < ctx or t % ctx]
    assert scored == expected and starts[0] == 0


def test_windows_reject_bad_arguments():
    with pytest.raises(ExlError):
        windows(10, 8, 9)
    with pytest.raises(ExlError):
        windows(10, 1, 1)


def test_score_matches_torch():
    torch.manual_seed(0)
    logits, ref, targets = torch.randn(300, 50) * 3, torch.randn(300, 50) * 3, torch.randint(0, 50, (300,))
    s = score(logits, targets, ref)
    assert s.nll == pytest.approx(F.cross_entropy(logits, targets, reduction="sum").item(), rel=1e-5)
    assert s.ref_nll == pytest.approx(F.cross_entropy(ref, targets, reduction="sum").item(), rel=1e-5)
    kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(ref, -1), log_target=True, reduction="sum").item()
    assert s.kl == pytest.approx(kl, rel=1e-4)
    assert s.top1 == int((logits.argmax(-1) == ref.argmax(-1)).sum())
    total = Scores()
    total.add(s)
    total.add(score(logits[:10], targets[:10]))
    assert total.tokens == 310 and total.perplexity == pytest.approx(math.exp(total.nll / 310))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    hf = save_tiny(a, tiny_config("llama"), seed=1)
    save_tiny(b, tiny_config("llama"), seed=2)
    return a, b, hf


def test_perplexity_equals_transformers_on_the_same_windows(models):
    a, _, hf = models
    model = ExlForCausalLM.from_pretrained(a, device="cpu")
    tokens = torch.randint(0, 509, (90,), generator=torch.Generator().manual_seed(3))
    nll, count = 0.0, 0
    for begin, end, first in windows(90, 32, 20):
        with torch.no_grad():
            logits = hf(tokens[None, begin:end]).logits[0]
        nll += F.cross_entropy(logits[first - 1 - begin: end - 1 - begin], tokens[first:end], reduction="sum").item()
        count += end - first
    s = perplexity(model, tokens, ctx=32, stride=20)
    assert s.tokens == count == 89
    assert s.perplexity == pytest.approx(math.exp(nll / count), rel=1e-4)


def test_kl_divergence_of_a_model_from_itself_is_zero_and_positive_from_another(models):
    a, b, _ = models
    ma, mb = ExlForCausalLM.from_pretrained(a, device="cpu"), ExlForCausalLM.from_pretrained(b, device="cpu")
    tokens = torch.randint(0, 509, (64,), generator=torch.Generator().manual_seed(4))
    same = kl_divergence(ma, ma, tokens, ctx=32)
    assert abs(same.mean_kl) < 1e-6 and same.top1_agreement == 1.0
    assert same.perplexity == pytest.approx(same.ref_perplexity)
    other = kl_divergence(mb, ma, tokens, ctx=32)
    assert other.mean_kl > 1e-4 and other.top1_agreement < 1.0
    assert other.ref_perplexity == pytest.approx(same.perplexity)


def test_text_tokens(models, tmp_path):
    a, _, _ = models
    tok = ExlForCausalLM.from_pretrained(a, device="cpu").tokenizer
    f = tmp_path / "t.txt"
    f.write_text("The teacher asked the class a simple question about the moon.")
    ids = text_tokens(tok, f)
    assert ids.dtype == torch.int64 and len(ids) > 5 and tok.decode(ids.tolist()).startswith("The teacher")
    assert len(text_tokens(tok, f, max_tokens=4)) == 4
    f.write_text("")
    with pytest.raises(ExlError, match="fewer than 2 tokens"):
        text_tokens(tok, f)


def test_cli_ppl_and_kld(models, tmp_path, capsys):
    from exl_backends.cli import main
    a, b, _ = models
    f = tmp_path / "t.txt"
    f.write_text("The teacher asked the class a simple question about the moon. " * 20)
    assert main(["ppl", "-m", str(a), "-f", str(f), "--ctx", "32", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("perplexity ") and "(ctx 32, stride 32)" in out
    assert main(["kld", "-m", str(b), "--ref", str(a), "-f", str(f), "--ctx", "32", "--max-tokens", "100"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mean KL divergence ") and "top-1 agreement" in out
    assert main(["kld", "-m", str(a), "--ref", str(a), "--ctx", "16", "--max-tokens", "32"]) == 0
    assert "mean KL divergence 0.000000" in capsys.readouterr().out

"""Perplexity and KL divergence: `exl ppl`, `exl kld` and the converter's quality receipt.

Text is scored in windows of `ctx` tokens starting every `stride` tokens; each token is predicted once, by the
first window that holds it with some context (a window's first token is context only). KL divergence is
KL(P_ref || P_model) of the next-token distributions, averaged over scored tokens; top-1 agreement is the
fraction of tokens where both argmaxes agree."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..errors import ExlError

SCORE_ROWS = 256       # logits rows turned into log-probabilities at a time (bounds memory for big vocabularies)


@dataclass
class Scores:
    tokens: int = 0
    nll: float = 0.0            # sum of -log p_model(target)
    ref_nll: float = 0.0        # sum of -log p_ref(target) (with a reference)
    kl: float = 0.0             # sum of KL(P_ref || P_model)
    top1: int = 0               # tokens whose argmax agrees with the reference's

    def add(self, other: "Scores") -> None:
        self.tokens += other.tokens
        self.nll += other.nll
        self.ref_nll += other.ref_nll
        self.kl += other.kl
        self.top1 += other.top1

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def ref_perplexity(self) -> float:
        return math.exp(self.ref_nll / self.tokens)

    @property
    def mean_kl(self) -> float:
        return self.kl / self.tokens

    @property
    def top1_agreement(self) -> float:
        return self.top1 / self.tokens


def score(logits: Tensor, targets: Tensor, ref_logits: Tensor | None = None) -> Scores:
    """logits [T, V] predicting targets [T] (row t predicts targets[t]); ref_logits [T, V] optional."""
    out = Scores(tokens=int(targets.numel()))
    for a in range(0, targets.numel(), SCORE_ROWS):
        rows = slice(a, a + SCORE_ROWS)
        logp = torch.log_softmax(logits[rows].float(), dim=-1)
        t = targets[rows].to(logp.device)[:, None]
        out.nll -= float(logp.gather(1, t).sum())
        if ref_logits is not None:
            ref = torch.log_softmax(ref_logits[rows].float().to(logp.device), dim=-1)
            out.ref_nll -= float(ref.gather(1, t).sum())
            out.kl += float((ref.exp() * (ref - logp)).sum())
            out.top1 += int((ref.argmax(-1) == logp.argmax(-1)).sum())
    return out


def windows(n_tokens: int, ctx: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over n_tokens tokens."""
    if ctx < 2 or stride < 1 or stride > ctx:
        raise ExlError(f"need ctx >= 2 and 1 <= stride <= ctx (got ctx {ctx}, stride {stride})")
    out, scored_to = [], 1
    for begin in range(0, max(n_tokens - 1, 1), stride):
        end = min(begin + ctx, n_tokens)
        first = max(scored_to, begin + 1)
        if first < end:
            out.append((begin, end, first))
        scored_to = end
        if end == n_tokens:
            break
    return out


def text_tokens(tokenizer, file: str | Path, max_tokens: int | None = None) -> Tensor:
    """The token ids of a text file (no special tokens added) [T] int64."""
    path = Path(file)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ExlError(f"cannot read {path}: {e.strerror or e}") from None
    ids = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) < 2:
        raise ExlError(f"{path} holds fewer than 2 tokens of text; nothing to score")
    return torch.tensor(ids[:max_tokens] if max_tokens else ids, dtype=torch.int64)


def _window_logits(model, ids: Tensor) -> Tensor:
    return model(ids[None]).logits[0]                                 # [T, V] f32


@torch.inference_mode()
def perplexity(model, tokens: Tensor, ctx: int = 2048, stride: int | None = None, progress=None) -> Scores:
    """model: an ExlForCausalLM (anything called on ids [1, T] returning .logits [1, T, V])."""
    total = Scores()
    for begin, end, first in windows(len(tokens), ctx, stride or ctx):
        logits = _window_logits(model, tokens[begin:end])
        total.add(score(logits[first - 1 - begin: end - 1 - begin], tokens[first:end]))
        if progress:
            progress(end - first)
    return total


@torch.inference_mode()
def kl_divergence(model, ref, tokens: Tensor, ctx: int = 2048, stride: int | None = None, progress=None) -> Scores:
    """Scores of `model` against the reference model `ref` (typically the fp16 one) on the same windows."""
    total = Scores()
    for begin, end, first in windows(len(tokens), ctx, stride or ctx):
        rows = slice(first - 1 - begin, end - 1 - begin)
        ref_logits = _window_logits(ref, tokens[begin:end])[rows]
        logits = _window_logits(model, tokens[begin:end])[rows]
        total.add(score(logits, tokens[first:end], ref_logits.to(logits.device)))
        if progress:
            progress(end - first)
    return total

"""Speculative decoding: cheap proposals of the next few tokens, checked by the target model in one forward.

Two proposers: `NgramIndex` (prompt lookup: what followed the last time the context's ending occurred) and
`DraftModel` (a smaller model with the same vocabulary). `verify` is the acceptance rule for sampled jobs;
greedy jobs simply keep drafted tokens while they equal the target's own choice."""
from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ConfigError
from ..model.batch import Batch
from ..model.cache import KVCache
from ..model.runner import Runner
from .sampling import draw


def verify(p: Tensor, q: Tensor | None, draft: int, rng: torch.Generator) -> int:
    """Speculative sampling (Leviathan et al. 2023): keeps `draft` with probability min(1, p[draft] / q[draft]),
    else draws from norm(max(0, p - q)); the token returned is distributed exactly as p.
    p, q: f32 [V] target and draft distributions; q None: the draft was proposed deterministically (q one-hot)."""
    q_draft = 1.0 if q is None else q[draft].item()
    u = torch.rand((), generator=rng, dtype=torch.float64).item()
    if u * q_draft < p[draft].item():
        return draft
    residual = p.index_fill(0, torch.tensor([draft], device=p.device), 0.0) if q is None else (p - q).clamp(min=0)
    return draw(residual, rng)     # draw normalises by the residual's sum


class NgramIndex:
    """Prompt lookup for one sequence: where each n-gram (n <= max_n) last ended, for proposing what followed it.
    Positions at or past a rollback are rechecked against the tokens before use."""

    def __init__(self, max_n: int = 3):
        self.max_n = max_n
        self.ends: dict[tuple[int, ...], int] = {}
        self.n_indexed = 1              # n-grams ending before this position are indexed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching ending of tokens."""
        end = len(tokens)
        for e in range(self.n_indexed, end):        # ends before `end`: each has a continuation
            for n in range(1, min(self.max_n, e) + 1):
                self.ends[tuple(tokens[e - n:e])] = e
        self.n_indexed = max(self.n_indexed, end)
        for n in range(min(self.max_n, end), 0, -1):
            key = tuple(tokens[end - n:])
            e = self.ends.get(key)
            if e is not None and e < end and tuple(tokens[e - n:e]) == key:
                return tokens[e:e + k]
        return []

    def truncate(self, length: int) -> None:
        self.n_indexed = max(1, min(self.n_indexed, length))


class DraftModel:
    """A small model with the target's vocabulary. Its cache has the target's page layout, so a job uses the same
    page table in both and prefix reuse covers both."""

    def __init__(self, draft, target, n_pages: int, page_size: int, target_runner: Runner):
        """Its single-token steps replay CUDA graphs when the target's do (its own Runner, padding into the
        target's trash page, which no job's page table holds)."""
        if draft.exl_config.vocab_size != target.exl_config.vocab_size:
            raise ConfigError(f"draft model {draft.name_or_path} has a vocabulary of {draft.exl_config.vocab_size} "
                              f"tokens, the model {target.exl_config.vocab_size}; a draft model must share the "
                              f"tokenizer and vocabulary")
        if draft.device != target.device:
            raise ConfigError(f"draft model is on {draft.device}, the model on {target.device}; load both on one "
                              f"device")
        self.model = draft.model
        self.cache = KVCache(draft.exl_config, n_pages, page_size, draft.cache_mode, draft.device, draft.dtype)
        t = target_runner
        self.runner = Runner(draft.model, self.cache, t.sizes[-1], t.max_pages, eager=not t.use_graphs,
                             trash_page=t.trash_page)

    def forward(self, batch: Batch) -> Tensor:
        """Logits of batch's rows; a graph's view, valid until the next forward."""
        return self.runner.forward(batch)

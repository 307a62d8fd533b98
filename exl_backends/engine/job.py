"""One generation job: its tokens and cache position, sampler and constraint state, text state, and the queue of
chunks its consumer reads. The generator feeds it tokens (`commit`); iterating it yields `Chunk`s."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .detokenizer import Detokenizer, find_first, partial_start
from .sampling import SampleResult, SamplerState


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int          # prompt tokens whose K/V came from the prefix cache instead of the model


@dataclass(frozen=True)
class Chunk:
    """A piece of streamed output: its text, the tokens that made it and, when asked for, their logprobs.
    The last chunk of a job carries finish_reason ("stop", "length", "cancelled") and usage."""
    text: str
    token_ids: list[int]
    logprobs: list[SampleResult] | None
    finish_reason: str | None = None
    usage: Usage | None = None

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[SampleResult] | None

    def __str__(self) -> str:
        return self.text


class Job:
    def __init__(self, prompt_ids: list[int], max_tokens: int, min_tokens: int, state: SamplerState,
                 constraint, stop_ids: frozenset[int], stop_strings: tuple[str, ...],
                 banned_strings: tuple[str, ...], include_stop: bool, n_logprobs: int, tokenizer,
                 ngram, advance: Callable[["Job"], None], stop_check: Callable[[str], bool] | None = None):
        self.n_prompt = len(prompt_ids)
        self.tokens = list(prompt_ids)          # prompt + generated
        self.max_tokens, self.min_tokens = max_tokens, min_tokens   # bounds on len(tokens)
        self.state, self.constraint, self.ngram = state, constraint, ngram
        self.is_plain_greedy = state.params.is_plain_greedy and constraint is None
        self.stop_ids, self.stop_strings, self.banned_strings = stop_ids, stop_strings, banned_strings
        self.include_stop, self.n_logprobs = include_stop, n_logprobs
        self.stop_check = stop_check
        self.bans: dict[int, list[int]] = {}    # position -> tokens taken back there (they formed a banned string)
        self.logprobs: list[SampleResult] = []
        self.finish_reason: str | None = None
        # the cache, kept by the scheduler and the generator
        self.pages: list[int] = []
        self.hashes: list[bytes] = []           # chained hashes of the full pages of tokens, as far as known
        self.n_registered = 0                   # pages registered for prefix reuse
        self.n_cached = 0                       # tokens whose K/V are in the cache (more may be written, unconfirmed)
        self.n_draft_cached: int | None = None  # the same in the draft model's cache, when there is one
        self.n_reused = 0                       # prompt tokens taken from the prefix cache
        # text (tokenizer None: none, the chunks carry token ids only)
        self.detok = None if tokenizer is None else Detokenizer(tokenizer, prompt_ids)
        self.n_emitted_chars = self.n_emitted_tokens = 0
        self.stop_at: int | None = None         # where the text ends, when a stop string ended it
        # the consumer's side
        self._advance = advance
        self._chunks: deque[Chunk] = deque()
        self._closed = False
        self._error: BaseException | None = None

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def is_decoding(self) -> bool:
        """The prompt is in the cache: the job feeds one token (its newest) per step."""
        return len(self.tokens) - self.n_cached == 1

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def n_computed(self) -> int:
        """Tokens whose K/V are confirmed in every cache the job uses."""
        return self.n_cached if self.n_draft_cached is None else min(self.n_cached, self.n_draft_cached)

    # ---- tokens in ------------------------------------------------------------------------------------------------

    def banned_at(self, position: int) -> list[int]:
        """Tokens banned at position: those taken back there (banned strings), and before min_tokens the stops."""
        banned = list(self.bans.get(position, ()))
        if position < self.min_tokens:
            banned += self.stop_ids
        return banned

    def samples_plainly(self, position: int) -> bool:
        """Whether the token at position is plain sampling, which sampling.sample_rows / draw_rows serve for many
        jobs at once: no constraint, no logprobs, nothing banned there."""
        return (self.state.params.is_plain_sampling and self.constraint is None and not self.n_logprobs
                and not self.bans.get(position) and not (position < self.min_tokens and self.stop_ids))

    def is_banned(self, position: int, token: int) -> bool:
        """token in banned_at(position), without building the list (asked for every token of every job)."""
        return token in self.bans.get(position, ()) or (position < self.min_tokens and token in self.stop_ids)

    def mask(self, position: int, vocab: int, device: torch.device) -> Tensor | None:
        """bool [vocab] of the tokens allowed at position (the constraint advanced up to it); None: all of them."""
        banned = self.banned_at(position)
        if self.constraint is None and not banned:
            return None
        if self.constraint is None:
            mask = torch.ones(vocab, dtype=torch.bool)
        else:
            mask = self.constraint.allowed(vocab)
        if banned:
            mask[banned] = False
        return mask.to(device)

    def commit(self, token: int, logprob: SampleResult | None) -> bool:
        """Appends a chosen token and checks what it ends. False when the job cannot go on from it: it finished,
        or the token completed a banned string and was taken back."""
        self.tokens.append(token)
        self.state.accept(token)
        if self.constraint is not None:
            self.constraint.advance(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if token in self.stop_ids:
            return self.finish("stop")
        if self.detok is not None:          # (no text: no stop strings, banned strings or stop_check either)
            self.detok.add(token)
            if self.banned_strings and self._take_back_banned():
                return False
            if self.stop_strings:
                hit = find_first(self.detok.text, self.n_emitted_chars, self.stop_strings)
                if hit is not None:
                    self.stop_at = hit[0] + (len(hit[1]) if self.include_stop else 0)
                    return self.finish("stop")
        if self.constraint is not None and self.constraint.is_finished():
            return self.finish("stop")
        if self.stop_check is not None and self.stop_check(self.detok.text):
            return self.finish("stop")
        if len(self.tokens) >= self.max_tokens:
            return self.finish("length")
        return True

    def _take_back_banned(self) -> bool:
        """If the text now holds a banned string, rolls back to the token where it starts and bans that token
        there, so the next sample at that position goes another way."""
        hit = find_first(self.detok.text, self.n_emitted_chars, self.banned_strings)
        if hit is None:
            return False
        index = self.detok.n_tokens_within(hit[0])
        position = self.n_prompt + index
        self.bans.setdefault(position, []).append(self.tokens[position])
        self.rollback(self.n_generated - index)
        return True

    def rollback(self, n: int) -> None:
        """Takes back the last n generated tokens (never emitted: their text was held back)."""
        del self.tokens[len(self.tokens) - n:]
        self.state.rollback(n)
        if self.constraint is not None:
            self.constraint.rollback(n)
        if self.logprobs:
            del self.logprobs[len(self.logprobs) - n:]
        if self.detok is not None:
            self.detok.rollback(n)
        if self.ngram is not None:
            self.ngram.truncate(len(self.tokens))
        self.n_cached = min(self.n_cached, len(self.tokens) - 1)
        if self.n_draft_cached is not None:
            self.n_draft_cached = min(self.n_draft_cached, len(self.tokens) - 1)

    def finish(self, reason: str) -> bool:
        self.finish_reason = reason
        return False

    # ---- text out -------------------------------------------------------------------------------------------------

    def next_chunk(self) -> Chunk | None:
        """The output that became safe to show since the last chunk; None while nothing did. Held back: text that
        may still turn into a stop string, and whole tokens whose text may still turn into a banned string."""
        if self.detok is None:
            return self._ids_chunk()
        text = self.detok.text
        if self.is_finished:
            if self.stop_at is None:
                text += self.detok.tail()
            end = len(text) if self.stop_at is None else self.stop_at
            n_tokens = self.n_generated
        else:
            end = partial_start(text, self.n_emitted_chars, self.stop_strings)
            if self.banned_strings:
                held = partial_start(text, self.n_emitted_chars, self.banned_strings)
                end = min(end, self.detok.token_start(self.detok.n_tokens_within(held)))
            if end <= self.n_emitted_chars:
                return None
            n_tokens = self.detok.n_tokens_within(end)
        piece = text[self.n_emitted_chars:end]
        first, last = self.n_prompt + self.n_emitted_tokens, self.n_prompt + n_tokens
        logprobs = self.logprobs[self.n_emitted_tokens:n_tokens] if self.n_logprobs else None
        self.n_emitted_chars, self.n_emitted_tokens = end, n_tokens
        if not self.is_finished:
            return Chunk(piece, self.tokens[first:last], logprobs)
        return Chunk(piece, self.tokens[first:last], logprobs, self.finish_reason, self.usage())

    def _ids_chunk(self) -> Chunk | None:
        """next_chunk of a job without text: its new tokens, all safe to show."""
        first, last = self.n_prompt + self.n_emitted_tokens, len(self.tokens)
        if first == last and not self.is_finished:
            return None
        self.n_emitted_tokens = self.n_generated
        logprobs = self.logprobs[first - self.n_prompt:] if self.n_logprobs else None
        if not self.is_finished:
            return Chunk("", self.tokens[first:last], logprobs)
        return Chunk("", self.tokens[first:last], logprobs, self.finish_reason, self.usage())

    def usage(self) -> Usage:
        return Usage(self.n_prompt, self.n_generated, self.n_reused)

    # ---- the consumer ---------------------------------------------------------------------------------------------

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        while True:
            closed = self._closed       # read before the queue: the last chunk is queued before _closed is set
            if self._chunks:
                return self._chunks.popleft()
            if self._error is not None:
                raise self._error
            if closed:
                raise StopIteration
            self._advance(self)

    @property
    def is_done(self) -> bool:
        """Nothing more will be queued (finished, cancelled or failed)."""
        return self._closed

    def result(self) -> Completion:
        """Runs the job to its end and returns its whole output (call it instead of iterating the job)."""
        chunks = list(self)
        if not chunks:
            raise RuntimeError("result() found no output left: this job's chunks were already taken by iterating "
                               "it; call result() instead of iterating, or keep the chunks you iterate")
        last = chunks[-1]
        logprobs = [lp for c in chunks for lp in c.logprobs] if self.n_logprobs else None
        return Completion("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids],
                          last.finish_reason, last.usage, logprobs)

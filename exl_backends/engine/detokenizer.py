"""Streaming text: incremental detokenisation that only ever adds whole characters, and the string searches
behind stop strings and banned strings (what to hold back while it may still become one of them)."""
from __future__ import annotations

from bisect import bisect_right

CONTEXT_TOKENS = 5      # prompt tokens decoded with the first new ones, so a leading space or merge comes out right


class Detokenizer:
    """Text of the generated tokens, grown one token at a time.

    Each step decodes the window ids[prefix:] and ids[prefix:read]; the text past the shorter decode is new text,
    unless it ends in U+FFFD (a character whose bytes are not all here yet): then it waits for more tokens.
    `ends[i]` is the text length once generated token i was added, which maps text positions back to tokens."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.text = ""
        self.ends: list[int] = []
        self.offsets: list[tuple[int, int]] = [(0, len(self.ids))]   # (prefix, read) before each token, and now

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> None:
        prefix, read = self.offsets[-1]
        self.ids.append(token)
        before = self._decode(self.ids[prefix:read])
        after = self._decode(self.ids[prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            prefix, read = read, len(self.ids)
        self.ends.append(len(self.text))
        self.offsets.append((prefix, read))

    def rollback(self, n: int) -> None:
        if n:
            del self.ids[-n:], self.ends[-n:], self.offsets[-n:]
            self.text = self.text[:self.ends[-1] if self.ends else 0]

    def tail(self) -> str:
        """The text of trailing tokens that do not yet form whole characters (U+FFFD for the missing bytes)."""
        prefix, read = self.offsets[-1]
        return self._decode(self.ids[prefix:])[len(self._decode(self.ids[prefix:read])):]

    def n_tokens_within(self, n_chars: int) -> int:
        """How many generated tokens have all their text inside text[:n_chars]; this is also the index of the
        token whose text covers text[n_chars]."""
        return bisect_right(self.ends, n_chars)

    def token_start(self, index: int) -> int:
        return self.ends[index - 1] if index else 0


def find_first(text: str, begin: int, strings: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest (position, string) at which any of strings occurs in text[begin:]."""
    hits = [(i, s) for s in strings if (i := text.find(s, begin)) >= 0]
    return min(hits) if hits else None


def partial_start(text: str, begin: int, strings: tuple[str, ...]) -> int:
    """Where the longest suffix of text[begin:] that could still grow into one of strings starts (a proper prefix
    of one of them); len(text) when there is none. Text from there on must be held back."""
    if not strings:         # the common case, asked for every token of every job
        return len(text)
    longest = max(len(s) for s in strings)
    for i in range(max(begin, len(text) - longest + 1), len(text)):
        rest = text[i:]
        if any(s.startswith(rest) for s in strings):
            return i
    return len(text)

"""Constrained output (JSON schema, any JSON object, regex, Lark/GBNF grammar) through llguidance.

Why llguidance (of llguidance, xgrammar and outlines-core; tried first, it met every need, so the other two were not
measured): one Rust engine covers all four kinds of constraint (outlines-core has no grammars); an Earley parser
over a lazily built lexer needs no per-schema precompilation over the vocabulary (a schema compiles in ~2 ms, and
a mask for SmolLM2's 49k vocabulary costs about 50-400 us of CPU per token on a loaded 2-core machine, unpacking
included). It reads any HF fast tokenizer from its tokenizer.json (byte-level BPE included: the fixtures' tokenizer
and SmolLM2's both work), rolls back natively (needed for banned strings and speculative decoding), reports invalid
schemas and regexes as messages instead of crashing, installs as one abi3 wheel with no torch dependency, and is the
engine behind vLLM's and SGLang's "guidance" backends and llama.cpp's LLGUIDANCE option. JSON whitespace is the
library's default (flexible).

Contract with generator.py
- Build one `GrammarTokenizer(hf_tokenizer, eos_token_ids)` per model (this reads the whole vocabulary, ~1 s for
  large ones) and pass it to every `Constraint(grammar_tokenizer, json_schema=... | json_object=True | regex=... |
  grammar=...)`; exactly one kind per constraint.
- Each step: `mask = constraint.allowed(vocab_size)` (bool [V] on CPU, V the lm_head width; ids the tokenizer does
  not have are False) -> `sampling.sample(logits, state, mask)` -> `constraint.advance(token)`.
  `rollback(n)` takes back the last n advanced tokens; `draft_masks(draft, V)` gives the mask at every position
  of a speculative draft.
- max_tokens (the job's budget of new tokens) makes the output close itself in time: once the tokens left come
  within reach of the shortest completion, the constraint forces that completion (`closing`), so a JSON value or
  a tool call ends valid instead of cut (it ends short: a string closed where it was, optional fields left out).
  A completion of free text (a reasoning block, an unbounded string the search cannot close) is not searched for;
  such an output ends at the budget, incomplete, and the job says "length".
- EOS is allowed exactly when the output so far is complete. `is_finished()`: the output is complete and nothing
  but EOS may follow (the job may end without sampling). Advancing an EOS token ends the constraint: after it
  nothing is allowed, until it is rolled back.
"""
from __future__ import annotations

import json

import llguidance
import llguidance.hf
import numpy as np
import torch
from torch import Tensor

from ..errors import SamplingError
from .tools import REASONING_TAGS

# Characters a closing search tries, most closing first: a quote ends a string (and opens the shortest value), then
# the closers, the shortest values, separators, then any printable character (key names, enum values, literal
# text of a grammar).
CLOSE_CHARS = ('"]}0,:' + "ntf-.e1[{" + "abcdghijklmopqrsuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "23456789"
               + "_</>=|;!?#$%&'()*+@\\^`~" + " \n")     # whitespace last: where it is free it never closes anything
# Whole strings a closing search tries once each where characters alone reach no completion: the closing tags of
# reasoning blocks (a block of free text has no completion within reach character by character).
CLOSE_HINTS = tuple(close for _, close in REASONING_TAGS)
CLOSE_MAX_CHARS = 192       # a completion longer than this is not searched for (free text has none within reach)
# The completion is forced while CLOSE_MARGIN tokens beyond it are still left: the token sampled before it may
# lengthen it (`,` after a value: a whole field more), and one token rarely adds more than a few characters.
CLOSE_MARGIN = 8
CLOSE_SLACK = 24

class GrammarTokenizer:
    """llguidance's view of an HF fast tokenizer, built once per model and shared by its constraints."""

    def __init__(self, hf_tokenizer, eos_token_ids: list[int] | None = None):
        eos = list(eos_token_ids) if eos_token_ids else hf_tokenizer.eos_token_id
        if eos is None:
            raise SamplingError("constrained output needs an EOS token: the tokenizer has none, pass eos_token_ids")
        try:
            self.ll = llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=eos)
        except ValueError as e:
            raise SamplingError(f"constrained output needs a fast (tokenizer.json) HF tokenizer: {e}") from e
        self.vocab_size = self.ll.vocab_size
        self.eos_token_ids = frozenset(self.ll.eos_tokens)
        self._char_tokens: list[int] | None = None

    def hint_tokens(self) -> list[list[int]]:
        """The tokens of each CLOSE_HINTS string."""
        return [self.ll.tokenize_str(h) for h in CLOSE_HINTS]

    def char_tokens(self) -> list[int]:
        """The tokens of single characters that closing searches try, in CLOSE_CHARS' order (made once)."""
        if self._char_tokens is None:
            ids = [self.ll.tokenize_str(c) for c in CLOSE_CHARS]
            self._char_tokens = [t[0] for t in ids if len(t) == 1]
        return self._char_tokens


class Constraint:
    """The state of one constrained output: which tokens may come next."""

    def __init__(self, tokenizer: GrammarTokenizer, *, json_schema: dict | str | None = None,
                 json_object: bool = False, regex: str | None = None, grammar: str | None = None,
                 max_tokens: int | None = None):
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        spec = _grammar_spec(json_schema, json_object, regex, grammar)
        error = llguidance.LLMatcher.validate_grammar(spec, tokenizer.ll)
        if error:
            raise SamplingError(f"invalid constraint: {error.strip()}")
        self._matcher = llguidance.LLMatcher(tokenizer.ll, spec, log_level=0)
        # an EOS was advanced: kept out of the matcher, which records an EOS only in some states (not once the
        # grammar has stopped), so that rollback counts stay exact
        self._ended = False
        self._n_advanced = 0
        self._closing: list[int] = []           # tokens forced to complete the output before the budget ends
        self._closing_from = 0                  # _n_advanced where the forced completion began
        self._close_len: int | None = None      # the last completion's length (None: none found)
        self._searched = False

    def allowed(self, vocab_size: int) -> Tensor:
        """bool [vocab_size] on CPU: the tokens allowed next."""
        out = torch.zeros(vocab_size, dtype=torch.bool)
        if self._ended:
            return out
        forced = self._forced_token()
        if forced is not None:
            out[forced] = True
            return out
        # one bit per token, packed in little-endian int32 words: token t is bit t % 8 of byte t // 8
        packed = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        self._raise_on_error()
        bits = torch.from_numpy(np.unpackbits(packed, bitorder="little").view(np.bool_))
        n = min(vocab_size, self.tokenizer.vocab_size)
        out[:n] = bits[:n]
        return out

    def advance(self, token: int):
        if self._ended:
            raise SamplingError(f"token {token} advanced after EOS ended the constrained output")
        if token in self.tokenizer.eos_token_ids:
            if not self._matcher.is_accepting():
                raise SamplingError(f"EOS token {token} advanced before the constrained output is complete")
            self._ended = True
            return
        if not self._matcher.consume_token(token):
            raise SamplingError(f"token {token} is not allowed by the constraint: {self._matcher.get_error()}")
        self._n_advanced += 1

    def rollback(self, n: int):
        if n and self._ended:
            self._ended = False
            n -= 1
        if n and not self._matcher.rollback(n):
            raise SamplingError(f"cannot roll the constraint back by {n} tokens: {self._matcher.get_error()}")
        self._n_advanced -= n
        if self._closing and self._n_advanced < self._closing_from:
            self._closing = []

    def _forced_token(self) -> int | None:
        """The next token of the forced completion, when the budget has come to need one."""
        if self.max_tokens is None or self._matcher.is_accepting():
            return None
        left = self.max_tokens - self._n_advanced      # tokens left, this one included
        if self._n_advanced - self._closing_from >= len(self._closing):   # (a completed output went on)
            self._closing = []
        if not self._closing:
            # a completion is searched for at the start, then only near the end (each search costs ~0.1-1 ms);
            # one more token may add up to a few closers, hence the slack
            if self._searched and left > (self._close_len or 0) + CLOSE_MARGIN + CLOSE_SLACK:
                return None
            self._searched = True           # the first search, from the start, sizes the window of the next
            closing = shortest_closing(self._matcher, self.tokenizer.char_tokens(), self.tokenizer.hint_tokens())
            if closing is not None:         # the same text in the tokenizer's own (fewer) tokens, where they fit
                canonical = self.tokenizer.ll.tokenize_bytes(self.tokenizer.ll.decode_bytes(closing))
                if len(canonical) < len(closing) and self._matcher.validate_tokens(canonical) == len(canonical):
                    closing = canonical
            if closing is not None:         # (none is found mid-character: a token ended inside a UTF-8 sequence)
                self._close_len = len(closing)
            # one token is kept for the EOS after the completion
            if closing is None or len(closing) + 1 + CLOSE_MARGIN < left:
                return None
            self._closing, self._closing_from = closing, self._n_advanced
        return self._closing[self._n_advanced - self._closing_from]

    def is_accepting(self) -> bool:
        """The output so far is complete: EOS is allowed now."""
        return self._ended or self._matcher.is_accepting()

    def is_finished(self) -> bool:
        """The output is complete and nothing but EOS can follow."""
        return self._ended or self._matcher.is_stopped()

    def draft_masks(self, draft: list[int], vocab_size: int) -> Tensor:
        """bool [len(draft) + 1, vocab_size]: row i is the mask after the first i draft tokens. Rows after a
        disallowed draft token are all True: that token has probability 0 under its mask, so rejection sampling
        rejects it and never reaches them."""
        masks = torch.ones(len(draft) + 1, vocab_size, dtype=torch.bool)
        n_advanced = 0
        for i, token in enumerate(draft):
            masks[i] = self.allowed(vocab_size)
            if not masks[i, token]:
                break
            self.advance(token)
            n_advanced += 1
        else:
            masks[len(draft)] = self.allowed(vocab_size)
        self.rollback(n_advanced)
        return masks

    def _raise_on_error(self):
        if self._matcher.is_error():
            raise SamplingError(f"constraint failed: {self._matcher.get_error()}")


def _grammar_spec(json_schema, json_object: bool, regex: str | None, grammar: str | None) -> str:
    given = [name for name, value in (("json_schema", json_schema), ("json_object", json_object or None),
                                      ("regex", regex), ("grammar", grammar)) if value is not None]
    if len(given) != 1:
        raise SamplingError(f"a Constraint takes exactly one of json_schema, json_object=True, regex, grammar; "
                            f"got {given or 'none'}")
    try:
        if json_schema is not None:
            schema = json.loads(json_schema) if isinstance(json_schema, str) else json_schema
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(schema)
        if json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        if regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(regex)
        return llguidance.grammar_from("grammar", grammar)      # Lark, or GBNF converted to Lark
    except ValueError as e:     # json.JSONDecodeError is a ValueError too
        raise SamplingError(f"invalid {given[0]}: {e}") from e


def shortest_closing(matcher, char_tokens: list[int], hints: list[list[int]] = ()) -> list[int] | None:
    """Tokens that take the matcher to an accepting state: single characters chosen greedily in CLOSE_CHARS' order
    (for JSON this closes the open string, array and object levels, adding required fields with the shortest
    values); where they find none (a block of free text), each hint once where it fits, then characters. None when
    none is found within CLOSE_MAX_CHARS. The matcher is left as it was. Hints come second because a hint fits in
    any free string: tried first, they wrote "</think>" into every JSON string the budget closed."""
    closing = greedy_closing(matcher, char_tokens, [])
    return closing if closing is not None or not hints else greedy_closing(matcher, char_tokens, hints)


def greedy_closing(matcher, char_tokens: list[int], hints: list[list[int]]) -> list[int] | None:
    seq: list[int] = []
    try:
        for hint in hints:
            if not matcher.is_accepting() and matcher.validate_tokens(hint) == len(hint):
                matcher.consume_tokens(hint)
                seq += hint
        while not matcher.is_accepting():
            if len(seq) >= CLOSE_MAX_CHARS:
                return None
            for t in char_tokens:
                if matcher.validate_tokens([t]) == 1:
                    matcher.consume_token(t)
                    seq.append(t)
                    break
            else:
                return None
        return seq
    finally:
        if seq:
            matcher.rollback(len(seq))

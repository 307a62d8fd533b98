"""Logits processors and the sampler: `SamplingParams` (what the user asked for), `SamplerState` (one job's token
history, random generator and mirostat state) and `sample` / `probs` / `greedy` (one decoding step).

Contract with generator.py
- One `SamplerState(params, prompt_ids, tokenizer)` per job. The generator calls `state.accept(token)` for every
  token the job keeps, and `state.rollback(n)` when it takes tokens back (banned strings, rejected draft tokens);
  the prompt itself cannot be rolled back. `sample` and `probs` never change the history.
- `sample(logits, state, mask=None, n_logprobs=0) -> SampleResult` for one row: logits f32 [V] on CPU or CUDA,
  mask a bool [V] of allowed tokens (`constraints.Constraint.allowed`). V is the lm_head's width.
- `probs(logits, state, mask)` is the exact distribution `sample` draws from (f32 [V], sums to 1), for speculative
  rejection sampling. XTC's coin is folded into it as a mixture, so it is deterministic given the state.
- `greedy(logits [B, V]) -> LongTensor [B]` is the fast path for a batch whose jobs all have
  `params.is_plain_greedy` and no constraint.
- `sample_rows(logits [R, V], states) -> list[int | None]` is the fast path for the jobs of a step with
  `params.is_plain_sampling` (temperature with top_k / top_p / min_p only), no mask and no logprobs: all rows in
  one pass and one host read. `sample` takes the same route for such a row, so a job draws the same tokens alone
  or in any batch.
- Mirostat's mu moves in `accept(token)`, from the surprise of the token `sample` last chose; a token accepted
  without `sample` choosing it (a draft token) leaves mu as it was, so the generator must refuse mirostat together
  with speculative decoding.
- Reproducible per job: each state owns a CPU `torch.Generator` (seeded from `params.seed`, else from the OS) and
  draws exactly one uniform number per sampled token (none when greedy), whatever the batch or the device.

Order of processing (each step a pure function below):
  1. mask (constraint) and banned_token_ids -> -inf; logit_bias added
  2. penalties over the last `penalty_range` tokens of prompt + output (0: all of them): repetition
     (transformers' rule), then frequency and presence (OpenAI's rule); then DRY over the last `dry_range` tokens
  3. temperature == 0: argmax of the result (greedy); the steps below are skipped, since the truncations always keep
     the most likely token and the random ones (dynatemp, XTC, mirostat) are refused with temperature 0
  4. temperature, or dynamic temperature when dynatemp_range > 0 (llama.cpp's entropy rule)
  5. top_k, top_p, min_p, typical_p (each as transformers' warper of that name), top_a
  6. softmax, then XTC (llama.cpp's rule) as the mixture of "applied" (xtc_probability) and "not applied"
  7. mirostat v2 (on when mirostat_tau > 0; llama.cpp's rule, mu starts at 2 * tau)
  8. one token drawn by inverse CDF with the job's generator (greedy draws nothing)
Logprobs (`SampleResult.logprob` and `.top`) are log_softmax of the raw logits, before any of the steps above, as
OpenAI and vLLM report them by default.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..errors import SamplingError

NEG_INF = float("-inf")
DRY_MAX_MATCH = 50      # longest repeat DRY measures (text-generation-webui's cap; keeps base**n finite)


@dataclass(frozen=True)
class SamplingParams:
    """Every knob of the sampler; the defaults change nothing (plain sampling at temperature 1).

    temperature=0 means greedy (argmax after mask, bias and penalties; a seed is allowed and unused). `seed` None
    draws a seed from the OS. Ranges are checked on construction; an unsupported combination is a SamplingError,
    never a silent no-op. A sampler's own settings (xtc_threshold, dry_base, dry_allowed_length,
    dry_sequence_breakers, dry_range, mirostat_eta, dynatemp_exponent, penalty_range) act only while the sampler
    is on (xtc_probability, dry_multiplier, mirostat_tau, dynatemp_range > 0; a penalty != neutral), so clients that
    always send every field keep working.
    Field names follow OpenAI and llama.cpp, with one difference: penalty_range and dry_range 0 mean the whole
    context (llama.cpp's 0 disables; here a penalty is off when its strength is neutral).
    """
    temperature: float = 1.0
    dynatemp_range: float = 0.0           # temperature varies in [max(0, t - range), t + range] by entropy
    dynatemp_exponent: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    top_a: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", "\"", "*")
    dry_range: int = 0
    mirostat_tau: float = 0.0
    mirostat_eta: float = 0.1
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_range: int = 0
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    banned_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        _number(self, "temperature", 0.0, math.inf)
        _number(self, "dynatemp_range", 0.0, math.inf)
        _number(self, "dynatemp_exponent", 0.0, math.inf, open_low=True)
        _integer(self, "top_k", 0)
        _number(self, "top_p", 0.0, 1.0)
        _number(self, "min_p", 0.0, 1.0)
        _number(self, "typical_p", 0.0, 1.0)
        _number(self, "top_a", 0.0, 1.0)
        _number(self, "xtc_probability", 0.0, 1.0)
        _number(self, "xtc_threshold", 0.0, 0.5)     # above 0.5 no two tokens qualify: XTC would do nothing
        _number(self, "dry_multiplier", 0.0, math.inf)
        _number(self, "dry_base", 1.0, math.inf)
        _integer(self, "dry_allowed_length", 1)
        _integer(self, "dry_range", 0)
        _number(self, "mirostat_tau", 0.0, math.inf)
        _number(self, "mirostat_eta", 0.0, 1.0, open_low=True)
        _number(self, "repetition_penalty", 0.0, math.inf, open_low=True)
        _number(self, "frequency_penalty", -math.inf, math.inf)
        _number(self, "presence_penalty", -math.inf, math.inf)
        _integer(self, "penalty_range", 0)
        self._check_tokens()
        self._check_combinations()

    def _check_tokens(self):
        breakers = tuple(self.dry_sequence_breakers)
        if not all(isinstance(s, str) and s for s in breakers):
            raise SamplingError(f"SamplingParams.dry_sequence_breakers={breakers!r}: expected non-empty strings")
        object.__setattr__(self, "dry_sequence_breakers", breakers)
        banned = tuple(self.banned_token_ids)
        for token in banned:
            _token_id("banned_token_ids", token)
        object.__setattr__(self, "banned_token_ids", banned)
        if self.logit_bias is not None:
            bias = dict(self.logit_bias)
            for token, value in bias.items():
                _token_id("logit_bias", token)
                if not _is_real(value) or not math.isfinite(value):
                    raise SamplingError(f"SamplingParams.logit_bias[{token}]={value!r}: expected a finite number")
            both = sorted(set(bias) & set(banned))
            if both:
                raise SamplingError(f"SamplingParams: tokens {both} are both banned and given a logit_bias")
            object.__setattr__(self, "logit_bias", bias)
        if self.seed is not None and not (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                          and 0 <= self.seed < 2 ** 63):
            raise SamplingError(f"SamplingParams.seed={self.seed!r}: expected None or an integer in [0, 2**63)")

    def _check_combinations(self):
        if self.temperature == 0:
            for name in ("dynatemp_range", "xtc_probability", "mirostat_tau"):
                if getattr(self, name) > 0:
                    raise SamplingError(f"SamplingParams.{name}={getattr(self, name)} needs temperature > 0 "
                                        "(temperature=0 is greedy decoding, which draws nothing at random)")
        if self.mirostat_tau > 0 and self.xtc_probability > 0:
            raise SamplingError("SamplingParams: mirostat (mirostat_tau > 0) and XTC (xtc_probability > 0) "
                                "cannot be combined; choose one")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0
                or self.dry_multiplier > 0)

    @property
    def is_plain_greedy(self) -> bool:
        """Argmax of the raw logits is the whole job: `greedy` may serve it (when it has no constraint either)."""
        return self.is_greedy and not self.has_penalties and not self.logit_bias and not self.banned_token_ids

    @property
    def is_plain_sampling(self) -> bool:
        """Temperature > 0 with at most top_k, top_p and min_p on the raw logits: `sample_rows` may serve it (when
        it has no mask and wants no logprobs), many jobs in one pass."""
        return (not self.is_greedy and not self.has_penalties and not self.logit_bias and not self.banned_token_ids
                and self.dynatemp_range == 0 and self.typical_p == 1 and self.top_a == 0
                and self.xtc_probability == 0 and self.mirostat_tau == 0)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(params, name: str, low: float, high: float, open_low: bool = False):
    value = getattr(params, name)
    ok = _is_real(value) and math.isfinite(value) and (low < value if open_low else low <= value) and value <= high
    if not ok:
        if math.isinf(low):
            valid = "a finite number"
        elif math.isinf(high):
            valid = f"a number {'>' if open_low else '>='} {low:g}"
        else:
            valid = f"a number in {'(' if open_low else '['}{low:g}, {high:g}]"
        raise SamplingError(f"SamplingParams.{name}={value!r}: expected {valid}")


def _integer(params, name: str, low: int):
    value = getattr(params, name)
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        raise SamplingError(f"SamplingParams.{name}={value!r}: expected an integer >= {low}")


def _token_id(name: str, token):
    if not (isinstance(token, int) and not isinstance(token, bool) and token >= 0):
        raise SamplingError(f"SamplingParams.{name}: token id {token!r} is not an integer >= 0")


# ---- per-job state -------------------------------------------------------------------------------------------------

class SamplerState:
    """One job's sampler state: prompt + accepted tokens, the random generator, mirostat's mu, DRY's breakers."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], tokenizer=None):
        self.params = params
        self.n_prompt = len(prompt_ids)
        # numpy, not torch: accept() runs for every token of every job, and a numpy item write costs ~0.1 us where
        # a tensor's costs ~5; history is a zero-copy tensor view of it
        self._ids = np.zeros(self.n_prompt + max(64, self.n_prompt), dtype=np.int64)
        self._ids[:self.n_prompt] = prompt_ids          # (half the time of building a padded list first)
        self._n = self.n_prompt
        self.mu = 2.0 * params.mirostat_tau
        self._mu_trail: list[float] = []            # mu before each accepted token, for rollback
        self._pending_mu: tuple[int, float] | None = None
        self.dry_breakers = torch.tensor(self._breaker_ids(tokenizer), dtype=torch.long)

    @functools.cached_property
    def rng(self) -> torch.Generator:
        """The job's random generator, made on its first draw (a greedy job makes none): seeded by params.seed, else
        by the OS."""
        rng = torch.Generator()
        if self.params.seed is None:
            rng.seed()
        else:
            rng.manual_seed(self.params.seed)
        return rng

    def _breaker_ids(self, tokenizer) -> list[int]:
        p = self.params
        if p.dry_multiplier == 0 or not p.dry_sequence_breakers:
            return []
        if tokenizer is None:
            raise SamplingError("SamplingParams.dry_sequence_breakers needs the tokenizer: pass "
                                "SamplerState(params, prompt_ids, tokenizer=...)")
        # how a breaker is tokenized after ordinary text: the last token of "a" + breaker (text-generation-webui)
        return sorted({tokenizer.encode("a" + s, add_special_tokens=False)[-1] for s in p.dry_sequence_breakers})

    @property
    def history(self) -> Tensor:
        """Prompt + accepted tokens, int64 [n] on CPU (a view: copy before keeping it)."""
        return torch.from_numpy(self._ids[:self._n])

    @property
    def n_generated(self) -> int:
        return self._n - self.n_prompt

    def accept(self, token: int):
        if self._n == self._ids.size:
            self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
        self._ids[self._n] = token
        self._n += 1
        self._mu_trail.append(self.mu)
        if self._pending_mu is not None and self._pending_mu[0] == token:
            self.mu = self._pending_mu[1]
        self._pending_mu = None

    def rollback(self, n: int):
        if not 0 <= n <= self.n_generated:
            raise SamplingError(f"cannot roll back {n} tokens: the job has generated {self.n_generated}")
        if n:
            self._n -= n
            self.mu = self._mu_trail[-n]
            del self._mu_trail[-n:]
        self._pending_mu = None


# ---- the processors: pure functions on one row of f32 logits [V] ------------------------------------------------

def apply_mask(logits: Tensor, mask: Tensor) -> Tensor:
    return logits.masked_fill(~mask, NEG_INF)


def ban_tokens(logits: Tensor, ids: Tensor) -> Tensor:
    return logits.index_fill(0, ids, NEG_INF)


def add_bias(logits: Tensor, ids: Tensor, bias: Tensor) -> Tensor:
    return logits.index_add(0, ids, bias)


def repetition_penalty(logits: Tensor, ids: Tensor, penalty: float) -> Tensor:
    """transformers' rule for the distinct tokens `ids` seen: a positive logit is divided, a negative multiplied."""
    seen = logits[ids]
    return logits.index_copy(0, ids, torch.where(seen < 0, seen * penalty, seen / penalty))


def frequency_presence_penalty(logits: Tensor, ids: Tensor, counts: Tensor, frequency: float,
                               presence: float) -> Tensor:
    """OpenAI's rule: logit -= count * frequency + presence, for each distinct token seen `count` times."""
    return logits.index_add(0, ids, -(counts.to(logits.dtype) * frequency + presence))


def dry_penalties(history: Tensor, breakers: Tensor, multiplier: float, base: float,
                  allowed_length: int) -> tuple[Tensor, Tensor]:
    """DRY: the tokens that would extend a repeat of the context's ending, and their penalties.

    A token that followed an earlier occurrence of the last L tokens (L >= allowed_length, matches stopping at
    sequence breakers and at DRY_MAX_MATCH) loses multiplier * base ** (L - allowed_length), with L its longest
    such match. Same result as text-generation-webui's reference loop. history: int64 [n] CPU.
    Returns (token ids int64 [U], penalties f32 [U])."""
    empty = (torch.zeros(0, dtype=torch.long), torch.zeros(0))
    n = history.numel()
    is_breaker = torch.isin(history, breakers)
    if n < 2 or is_breaker[-1]:
        return empty
    starts = torch.arange(n - 1)                        # candidate match ends: positions before the last token
    run = (history[:-1] == history[-1]) & ~is_breaker[1:]   # last token matches, follower is no breaker
    length = run.long()
    for m in range(1, DRY_MAX_MATCH):                   # extend every match one token further back
        back = n - 1 - m
        if back < 0 or is_breaker[back] or not run.any():
            break
        earlier = starts - m
        run = run & (earlier >= 0) & (history[earlier.clamp(min=0)] == history[back])
        length += run
    hit = length >= allowed_length
    if not hit.any():
        return empty
    ids, where = torch.unique(history[1:][hit], return_inverse=True)
    longest = torch.zeros(ids.numel(), dtype=torch.long).scatter_reduce(0, where, length[hit], "amax")
    return ids, multiplier * base ** (longest - allowed_length).double()


def temperature(logits: Tensor, t: float) -> Tensor:
    return logits / t


def dynamic_temperature(logits: Tensor, t: float, spread: float, exponent: float) -> Tensor:
    """llama.cpp's dynatemp: the temperature lies in [max(0, t - spread), t + spread], placed by the entropy of the
    candidates (finite logits) over its maximum log(n), raised to `exponent`."""
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).nansum()             # removed tokens give 0 * -inf = nan: skipped
    n = torch.isfinite(logits).sum().clamp(min=2)       # one candidate: entropy 0, any temperature gives it p=1
    low, high = max(0.0, t - spread), t + spread
    dyn = low + (high - low) * (entropy / n.log()).clamp(0, 1) ** exponent
    # shift so the top logit is 0: a temperature near 0 then sends the rest to -inf, never to nan
    return (logits - logits.max()) / dyn.clamp(min=torch.finfo(torch.float32).tiny)


def top_k(logits: Tensor, k: int) -> Tensor:
    """transformers' TopKLogitsWarper: keeps every token at least as likely as the k-th (ties kept)."""
    kth = torch.topk(logits, min(k, logits.numel())).values[-1]
    return logits.masked_fill(logits < kth, NEG_INF)


def top_p(logits: Tensor, p: float) -> Tensor:
    """transformers' TopPLogitsWarper: keeps the most likely tokens until their mass reaches p (at least one). The
    sort is stable, so tied tokens at the cut go in index order (lowest first) on every device."""
    sorted_logits, order = torch.sort(logits, descending=False, stable=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    remove = cumulative <= 1 - p
    remove[-1] = False
    return logits.masked_fill(remove.scatter(0, order, remove), NEG_INF)


def min_p(logits: Tensor, p: float) -> Tensor:
    """transformers' MinPLogitsWarper: removes tokens less likely than p times the top token's probability."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < p * probs.max(), NEG_INF)


def typical_p(logits: Tensor, mass: float) -> Tensor:
    """transformers' TypicalLogitsWarper: keeps the tokens whose surprise is closest to the entropy, up to mass."""
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp * logp.exp()).nansum()
    shifted, order = torch.sort((-logp - entropy).abs(), stable=True)
    cumulative = logits[order].softmax(-1).cumsum(-1)
    last = (cumulative < mass).sum().clamp(max=logits.numel() - 1)
    remove = shifted > shifted[last]
    remove[0] = False
    return logits.masked_fill(remove.scatter(0, order, remove), NEG_INF)


def top_a(logits: Tensor, a: float) -> Tensor:
    """Removes tokens less likely than a * p_max ** 2 (a <= 1 always keeps the top token)."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < a * probs.max() ** 2, NEG_INF)


def xtc(probs: Tensor, threshold: float, probability: float) -> Tensor:
    """XTC (exclude top choices) as a distribution: with `probability`, every candidate with p >= threshold except
    the least likely of them is removed (when at least two reach it); this returns the mixture of both outcomes."""
    above = (probs >= threshold) & (probs > 0)
    survivor = torch.where(above, probs, math.inf).argmin()
    remove = above.index_fill(0, survivor, False) & (above.sum() >= 2)
    excluded = probs.masked_fill(remove, 0)
    return probability * excluded / excluded.sum() + (1 - probability) * probs


def mirostat_v2(probs: Tensor, mu: float) -> Tensor:
    """Keeps the tokens whose surprise -log2(p) is at most mu (always the most likely one), renormalised."""
    keep = (-torch.log2(probs) <= mu).index_fill(0, probs.argmax(), True)
    kept = probs * keep
    return kept / kept.sum()


def greedy(logits: Tensor) -> Tensor:
    """[B, V] -> int64 [B]: argmax per row, for batches of plain-greedy jobs. On CUDA f32 logits by a kernel of
    our own (kernels/argmax.cu: torch's argmax reduces a row in one block, ~30 us for 128,256 logits); the same
    indices as torch.argmax."""
    if logits.is_cuda and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1 \
            and logits.shape[1] > 0:
        from ..kernels.argmax import row_argmax
        return row_argmax(logits)
    return logits.argmax(-1)


# ---- one step --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SampleResult:
    token: int
    logprob: float                      # log_softmax of the raw logits at `token`
    top: list[tuple[int, float]]        # the n_logprobs most likely (token, logprob) of the raw logits


def filtered_logits(logits: Tensor, state: SamplerState, mask: Tensor | None = None) -> Tensor:
    """Steps 1-2: mask, bans, bias and penalties. f32 [V] on the logits' device."""
    p = state.params
    if logits.dim() != 1:
        raise SamplingError(f"sample takes one row of logits [V], got shape {tuple(logits.shape)}")
    vocab = logits.numel()
    x = logits.float()
    if mask is not None:
        if mask.shape != logits.shape or mask.dtype != torch.bool:
            raise SamplingError(f"mask must be bool [{vocab}], got {mask.dtype} {tuple(mask.shape)}")
        x = apply_mask(x, mask.to(x.device))
    if p.banned_token_ids:
        x = ban_tokens(x, _vocab_ids("banned_token_ids", p.banned_token_ids, vocab, x.device))
    if p.logit_bias:
        ids = _vocab_ids("logit_bias", list(p.logit_bias), vocab, x.device)
        x = add_bias(x, ids, torch.tensor(list(p.logit_bias.values()), dtype=x.dtype, device=x.device))
    return _penalised(x, state)


def _vocab_ids(name: str, ids, vocab: int, device) -> Tensor:
    if max(ids) >= vocab:
        raise SamplingError(f"SamplingParams.{name}: token id {max(ids)} is outside the vocabulary (size {vocab})")
    return torch.tensor(ids, dtype=torch.long, device=device)


def _penalised(x: Tensor, state: SamplerState) -> Tensor:
    p = state.params
    history = state.history
    if p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0:
        window = history[-p.penalty_range:] if p.penalty_range else history
        ids, counts = torch.unique(window[window < x.numel()], return_counts=True)
        ids, counts = ids.to(x.device), counts.to(x.device)
        if p.repetition_penalty != 1:
            x = repetition_penalty(x, ids, p.repetition_penalty)
        if p.frequency_penalty != 0 or p.presence_penalty != 0:
            x = frequency_presence_penalty(x, ids, counts, p.frequency_penalty, p.presence_penalty)
    if p.dry_multiplier > 0:
        window = history[-p.dry_range:] if p.dry_range else history
        ids, penalty = dry_penalties(window, state.dry_breakers, p.dry_multiplier, p.dry_base, p.dry_allowed_length)
        keep = ids < x.numel()
        x = x.index_add(0, ids[keep].to(x.device), -penalty[keep].to(x.device, x.dtype))
    return x


def probs(logits: Tensor, state: SamplerState, mask: Tensor | None = None) -> Tensor:
    """The distribution `sample` draws from: f32 [V] on the logits' device, summing to 1 (one-hot when greedy)."""
    p = state.params
    x = filtered_logits(logits, state, mask)
    top = x.argmax()
    if not torch.isfinite(x[top]):
        raise broken_row_error(BROKEN_LOGITS if torch.isnan(logits).any() or torch.isposinf(logits).any()
                               else NOTHING_ALLOWED)
    if p.is_greedy:
        return torch.zeros_like(x).index_fill(0, top, 1.0)
    if p.dynatemp_range > 0:
        x = dynamic_temperature(x, p.temperature, p.dynatemp_range, p.dynatemp_exponent)
    elif p.temperature != 1:
        x = temperature(x, p.temperature)
    if p.top_k > 0:
        x = top_k(x, p.top_k)
    if p.top_p < 1:
        x = top_p(x, p.top_p)
    if p.min_p > 0:
        x = min_p(x, p.min_p)
    if p.typical_p < 1:
        x = typical_p(x, p.typical_p)
    if p.top_a > 0:
        x = top_a(x, p.top_a)
    dist = x.softmax(-1)
    if p.xtc_probability > 0:
        dist = xtc(dist, p.xtc_threshold, p.xtc_probability)
    if p.mirostat_tau > 0:
        dist = mirostat_v2(dist, state.mu)
    return dist


def draw(dist: Tensor, rng: torch.Generator) -> int:
    """Inverse CDF with one uniform from the CPU generator: the same draw on any device, and a zero-probability
    token is never chosen (searchsorted right finds the first cdf strictly above the point; the clamp to the last
    token with p > 0 covers total * u rounding up to total)."""
    cdf = dist.double().cumsum(-1)
    u = torch.rand((), generator=rng, dtype=torch.float64).item()
    last = (cdf < cdf[-1]).sum()
    return int(torch.searchsorted(cdf, cdf[-1:] * u, right=True).clamp(max=last))


BROKEN_LOGITS, NOTHING_ALLOWED = 1, 2        # why a row of logits gives no token (draw_rows' codes)


def broken_row_error(code: int) -> SamplingError:
    """The error of a row that gives no token, by draw_rows' code."""
    if code == BROKEN_LOGITS:
        return SamplingError("the model's logits contain NaN or +inf, so no token can be drawn: its activations left "
                             "fp16's range, or its weights are corrupt")
    return SamplingError("no token is allowed: the mask, banned_token_ids and penalties removed every token")


def sample_rows(logits: Tensor, states: list[SamplerState]) -> list[int | None]:
    """One token per row of logits [R, V] for jobs with params.is_plain_sampling, no mask and no logprobs: what
    `sample` draws for each row alone (the same steps row by row, one uniform from each job's generator), in one
    pass over the rows and one host read. None for a row whose logits have no finite maximum (NaN, +inf or all
    -inf): `sample` on that row alone raises the error that names it."""
    tokens, broken = draw_rows(logits, states)
    values, codes = torch.stack((tokens, broken)).tolist()
    return [None if b else t for t, b in zip(values, codes)]


def draw_rows(logits: Tensor, states: list[SamplerState]) -> tuple[Tensor, Tensor]:
    """sample_rows without the host read: (tokens int64 [R], broken int64 [R]) on the logits' device, broken 0 for
    a row that gave its token, else why not (BROKEN_LOGITS: NaN or +inf; NOTHING_ALLOWED: every logit -inf, as
    `probs` tells them apart). Each job's uniform is drawn now, so a step may be queued on these tokens before they
    are read (generator.Launched)."""
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise SamplingError(f"sample_rows and draw_rows take logits [{len(states)}, V] for {len(states)} states, got "
                            f"{tuple(logits.shape)}")
    ps = [s.params for s in states]
    if not all(p.is_plain_sampling for p in ps):
        raise SamplingError("sample_rows serves plain sampling only (temperature > 0 with top_k, top_p, min_p)")
    x = logits.float()
    top = x.max(-1).values                  # NaN if any is NaN
    broken = (~torch.isfinite(top)).long() * torch.where(top == -math.inf, NOTHING_ALLOWED, BROKEN_LOGITS)

    # the rows' parameters, then their uniforms, in one host-to-device copy each (a copy costs host time per step)
    k = [min(p.top_k, x.shape[1]) or x.shape[1] for p in ps]
    columns = torch.tensor([[p.temperature, i - 1, 1 - p.top_p, p.min_p] for p, i in zip(ps, k)],
                           dtype=torch.float32).to(x.device, non_blocking=True)
    temperature, kth_index, cut, min_p = columns.T[:, :, None]
    u = torch.tensor([torch.rand((), generator=s.rng, dtype=torch.float64).item() for s in states],
                     dtype=torch.float64).to(x.device, non_blocking=True)[:, None]
    if any(p.temperature != 1 for p in ps):
        x = x / temperature
    if any(p.top_k > 0 for p in ps):
        kth = torch.topk(x, max(k), -1).values.gather(1, kth_index.long())
        x = x.masked_fill(x < kth, NEG_INF)
    if any(p.top_p < 1 for p in ps):
        sorted_logits, order = torch.sort(x, descending=False, stable=True)      # as top_p: ties in index order
        remove = sorted_logits.softmax(-1).cumsum(-1) <= cut
        remove[:, -1] = False
        x = x.masked_fill(remove.scatter(1, order, remove), NEG_INF)
    if any(p.min_p > 0 for p in ps):
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, NEG_INF)
    cdf = x.softmax(-1).double().cumsum(-1)
    last = (cdf < cdf[:, -1:]).sum(-1, keepdim=True)
    return torch.minimum(torch.searchsorted(cdf, cdf[:, -1:] * u, right=True), last)[:, 0], broken


def sample(logits: Tensor, state: SamplerState, mask: Tensor | None = None, n_logprobs: int = 0) -> SampleResult:
    """One token for one job (see the module docstring for the order of processing)."""
    if n_logprobs < 0:
        raise SamplingError(f"n_logprobs={n_logprobs}: expected an integer >= 0")
    token = None
    if logits.dim() == 1 and mask is None and state.params.is_plain_sampling:
        # the engine's batched route for such jobs (sample_rows), so a job draws the same tokens either way
        token = sample_rows(logits[None], [state])[0]
    if token is None:       # (for plain sampling, only when the logits are broken: probs names the problem)
        dist = probs(logits, state, mask)
        token = int(dist.argmax()) if state.params.is_greedy else draw(dist, state.rng)
        if state.params.mirostat_tau > 0:
            surprise = -math.log2(dist[token].item())
            state._pending_mu = (token, state.mu - state.params.mirostat_eta * (surprise - state.params.mirostat_tau))
    logp = torch.log_softmax(logits.float(), -1)
    top = torch.topk(logp, min(n_logprobs, logp.numel()))
    return SampleResult(token, logp[token].item(), list(zip(top.indices.tolist(), top.values.tolist())))

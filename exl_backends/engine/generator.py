"""Generator: many generation jobs on one model and one paged KV cache, batched together step by step.

One step (`_step`):
  1. the scheduler picks the step's jobs: every decoding job, then prefill chunks within the token budget,
     admitting queued jobs while their pages can be promised (scheduler.py);
  2. speculative decoding only: drafts are proposed for the decoding jobs (speculative.py);
  3. one Batch with all their new tokens goes through the model (`_forward`, the one place the model is called);
  4. per job: choose the next token (sample it, or verify the drafted ones), commit it, check stops and banned
     strings, queue the text that became safe to show (job.py, detokenizer.py);
  5. finished jobs leave at once; their full pages stay cached for prefix reuse until memory is needed (pages.py).
While every job of a decode step has its token chosen on the device (a plain greedy decoder, or plain sampling
with nothing banned at that position) and nothing waits to be admitted, drafted or taken back, the next decode
step goes to the GPU before this one's tokens reach the host, fed this step's tokens on the device (`Launched`), so
the host's work on a step overlaps the GPU's on the next instead of leaving it idle; a job that ends on a token
wastes the one step launched after it.

Context: a prompt must leave room for one new token (len(prompt) < max_seq_len, else ContextLengthError);
max_new_tokens is then cut to what fits in max_seq_len, and the job ends with finish_reason "length" there.

Threading: a job is consumed by iterating it (`stream`, `generate` and `Job.result` do). A consumer whose job has
nothing queued runs the next step itself, or, while another consumer runs one, waits for that step to end (each
step advances every job). So any number of threads can consume at once (a server can give each request's
iteration to `asyncio.to_thread`) and share the steps, and every consumer sees its chunks as soon as the step that
made them ends: waiting on one plain lock instead, the thread that just stepped took it again before the others
woke, and 16 concurrent consumers saw their first token only near the end of their jobs. `submit` only queues the
job (it never waits on a step); `cancel` waits for a running step to end, then frees the job's pages at once. An
error in the forward pass fails every job; an error in one job's sampling or constraint fails only that job. Both
reach the job's consumer."""
from __future__ import annotations

import functools
import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch
from torch import Tensor

from ..errors import ConfigError, ContextLengthError, SamplingError
from ..model.batch import Batch, SeqChunk
from ..model.cache import KVCache
from ..model.model import Model
from ..model.runner import Runner
from .job import Chunk, Completion, Job
from .pages import PageManager
from .sampling import NEG_INF, SampleResult, SamplerState, SamplingParams, broken_row_error, draw, draw_rows, greedy, probs, sample, sample_rows
from .scheduler import Scheduler
from .speculative import DraftModel, NgramIndex, verify

GREEDY = SamplingParams(temperature=0.0)
# Default drafted tokens per step. An n-gram proposal is only as long as its match, and checking 8 tokens in one
# step costs little more than 5 (8B shape on the H200: 3.50 vs 3.35 ms against 2.36 for a token), so n-gram drafting
# proposes up to 7 (a code-rewriting task on SmolLM2: 1.98x faster, 1.68x at 4; BENCHMARKS.md); a draft model
# pays a forward for each drafted token, so it drafts 4.
NGRAM_DRAFT_TOKENS = 7
DRAFT_MODEL_TOKENS = 4
NO_DRAFT = ((), None)       # (drafted tokens, their draft distributions) of a job with nothing drafted


class Generator:
    def __init__(self, model, draft_model=None, ngram_draft: bool = False, max_batch_size: int = 32,
                 max_seq_len: int | None = None, cache_tokens: int | None = None, page_size: int | None = None,
                 max_step_tokens: int = 2048, n_draft_tokens: int | None = None, cuda_graphs: bool = True):
        """model: an ExlForCausalLM. cache_tokens: KV cache size in tokens, shared by all jobs (default
        max_seq_len: one full-length job). max_step_tokens: tokens per forward pass, the prefill chunk budget.
        draft_model (an ExlForCausalLM with the same vocabulary) or ngram_draft=True: speculative decoding with
        up to n_draft_tokens drafted tokens per step (default NGRAM_DRAFT_TOKENS or DRAFT_MODEL_TOKENS).
        cuda_graphs=False runs decode steps eagerly (debugging)."""
        if n_draft_tokens is None:
            n_draft_tokens = NGRAM_DRAFT_TOKENS if ngram_draft else DRAFT_MODEL_TOKENS
        if draft_model is not None and ngram_draft:
            raise ConfigError("choose one way of drafting: draft_model or ngram_draft=True")
        for name, value in (("max_batch_size", max_batch_size), ("max_step_tokens", max_step_tokens),
                            ("n_draft_tokens", n_draft_tokens)):
            if value < 1:
                raise ConfigError(f"Generator {name} must be at least 1, got {value}")
        self.model = model
        self.config = model.exl_config
        self.max_seq_len = max_seq_len or model.max_seq_len
        self.page_size = page_size or model.page_size
        graphs = cuda_graphs and model.device.type == "cuda"
        n_pages = -(-(cache_tokens or self.max_seq_len) // self.page_size) + graphs   # graphs take a trash page
        self.cache = KVCache(self.config, n_pages, self.page_size, model.cache_mode, model.device, model.dtype,
                             layer_devices=model.model.block_devices)
        self.runner = Runner(model.model, self.cache, max_batch_size, -(-self.max_seq_len // self.page_size),
                             eager=not graphs)       # before anything counts free pages: it takes one
        self.pages = PageManager(self.cache.pool, self.page_size)
        self.draft = None if draft_model is None else DraftModel(draft_model, model, n_pages, self.page_size,
                                                                  self.runner)
        self.ngram = ngram_draft
        n_draft = n_draft_tokens if self.draft is not None or ngram_draft else 0
        self.scheduler = Scheduler(self.pages, max_batch_size, max_step_tokens, n_draft)
        self._grammar_tokenizer = None
        self.capacity_pages = self.cache.pool.n_free     # what jobs may use: all that is free once set up
        # Whose turn it is. A step runs outside `_turn` while `_stepping` is set; a cancel runs inside it between
        # steps, and no new step starts while one waits (else a busy consumer could keep it waiting for good).
        self._turn = threading.Condition()
        self._stepping = False
        self._steps = 0                         # steps ended so far: a waiting consumer wakes when it changes
        self._cancels = 0                       # cancels waiting for their turn
        self._inbox: deque[Job] = deque()
        self._ahead: Launched | None = None     # a decode step on the GPU whose tokens are not read yet
        self._copies = TokenCopies()
        # steps fed tokens on the device: not under tensor parallelism, whose other ranks get each step's tokens
        # from rank 0's host
        self._own_model = isinstance(model.model, Model)

    # The tokenizer and what comes from it are taken when first needed (text and chat prompts, text output, the
    # default stop tokens, stop strings, constraints, DRY): a job from token ids that wants only token ids back and
    # names its stop tokens (ExlForCausalLM.generate) never loads it (ExlForCausalLM.tokenizer says why).
    @functools.cached_property
    def tokenizer(self):
        return self.model.tokenizer

    @functools.cached_property
    def eos_ids(self) -> frozenset[int]:
        """The stop tokens of a job that names none: config.json's and generation_config.json's EOS tokens and
        the tokenizer's."""
        eos = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return frozenset(eos)

    # ---- the public API -------------------------------------------------------------------------------------------

    def submit(self, prompt: str | list[int] | list[dict], max_new_tokens: int = 256,
               sampling: SamplingParams | None = None, stop: str | Iterable[str] | None = (),
               banned_strings: Iterable[str] | None = (), stop_token_ids: Iterable[int] | None = None,
               json_schema: dict | str | None = None, json_object: bool = False, regex: str | None = None,
               grammar: str | None = None, logprobs: int = 0, min_new_tokens: int = 0, include_stop: bool = False,
               add_bos: bool | None = None, stop_check: Callable[[str], bool] | None = None,
               text: bool = True) -> Job:
        """Queues a job and returns it; iterate it for its chunks, or call .result().

        prompt: text, token ids, or chat messages ([{"role": ..., "content": ...}], rendered with the tokenizer's
        chat template; its special tokens then also stop the job). sampling None: greedy. stop_token_ids None:
        the model's EOS tokens. logprobs: how many top alternatives to report with each token's logprob (0: no
        logprobs). add_bos (text prompts): None follows the tokenizer, True ensures a BOS, False adds none.
        json_schema / json_object / regex / grammar (Lark, or GBNF): the output is constrained to it (one kind
        at most), and closes itself before max_new_tokens runs out where it can (constraints.py). stop_check:
        called with the text so far after each token; True ends the job there (finish_reason "stop", the text
        kept whole), as tools.ToolRequest.stop_check ends a reply that repeats a call. text=False: the chunks
        carry token ids only (text ""), so a prompt of token ids needs no tokenizer (ExlForCausalLM.generate)."""
        ids, template_stops = self._encode(prompt, add_bos)
        stop_strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
        banned = tuple(banned_strings or ())
        if any(not s for s in stop_strings + banned):
            raise ValueError("stop strings and banned strings must not be empty")
        if not text and (stop_strings or banned or stop_check is not None):
            raise ValueError("stop strings, banned strings and stop_check read the text: submit with text=True")
        max_tokens = self._check_lengths(ids, max_new_tokens, min_new_tokens)
        params = sampling or GREEDY
        if self.scheduler.n_draft and params.mirostat_tau > 0:
            raise SamplingError("mirostat (mirostat_tau > 0) cannot be used with speculative decoding: drafted "
                                "tokens would not move its state; use a Generator without drafting")
        if logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {logprobs}")
        stop_ids = (self.eos_ids if stop_token_ids is None else frozenset(stop_token_ids)) | template_stops
        state = SamplerState(params, ids, self.tokenizer if params.dry_multiplier > 0 else None)   # DRY's breakers
        job = Job(ids.tolist(), max_tokens, len(ids) + min_new_tokens, state,
                  self._constraint(json_schema, json_object, regex, grammar, max_tokens - len(ids)), stop_ids, stop_strings, banned, include_stop,
                  logprobs, self.tokenizer if text else None, NgramIndex() if self.ngram else None, self._advance,
                  stop_check)
        if self.draft is not None:
            job.n_draft_cached = 0
        self._inbox.append(job)
        return job

    def stream(self, prompt, **kwargs) -> Iterator[Chunk]:
        """The job's chunks as they come (see submit for the arguments; they are checked at once). Closing the
        iterator early cancels the job."""
        return self._stream(self.submit(prompt, **kwargs))

    def _stream(self, job: Job) -> Iterator[Chunk]:
        try:
            yield from job
        finally:
            if not job.is_done:
                self.cancel(job)

    def generate(self, prompt, **kwargs) -> Completion:
        """The whole completion (see submit for the arguments); str() of it is the text."""
        return self.submit(prompt, **kwargs).result()

    def cancel(self, job: Job) -> None:
        """Ends a job now and frees its pages; its consumer gets a last chunk with finish_reason "cancelled"."""
        with self._turn:
            self._cancels += 1
            try:
                self._turn.wait_for(lambda: not self._stepping)
            finally:
                self._cancels -= 1
                self._turn.notify_all()         # consumers held back for this cancel
            if job.is_done:
                return
            if job in self._inbox:
                self._inbox.remove(job)
            self.scheduler.drop(job)
            job.finish("cancelled")
            self._emit(job)

    # ---- prompts --------------------------------------------------------------------------------------------------

    def _encode(self, prompt, add_bos: bool | None) -> tuple[np.ndarray, frozenset[int]]:
        """The prompt's token ids (int64: SamplerState copies them in ~1 us, a list of 2000 in ~60), and the
        stop tokens its chat template adds."""
        if isinstance(prompt, str):
            tok = self.tokenizer
            ids = tok.encode(prompt, add_special_tokens=add_bos is not False)
            if add_bos and tok.bos_token_id is not None and ids[:1] != [tok.bos_token_id]:
                ids = [tok.bos_token_id] + ids
            return np.array(ids, dtype=np.int64), frozenset()
        prompt = list(prompt)
        if prompt and all(isinstance(m, dict) for m in prompt):
            tok = self.tokenizer
            text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            return np.array(tok.encode(text, add_special_tokens=False), dtype=np.int64), template_stop_ids(tok)
        try:        # (C loops: a 2000-token prompt's ids are checked in ~50 us, a third of min/max on a list)
            ids = np.frombuffer(array("q", prompt), dtype=np.int64)
        except (TypeError, OverflowError) as e:
            raise ValueError(f"prompt token ids must be integers (64-bit): {e}") from None
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.config.vocab_size)][0]
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (0 to {self.config.vocab_size - 1})")
        return ids, frozenset()

    def _check_lengths(self, ids: np.ndarray, max_new_tokens: int, min_new_tokens: int) -> int:
        """The job's bound on prompt + generated tokens."""
        if len(ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if max_new_tokens < 1 or not 0 <= min_new_tokens <= max_new_tokens:
            raise ValueError(f"need 1 <= max_new_tokens and 0 <= min_new_tokens <= max_new_tokens, got "
                             f"max_new_tokens={max_new_tokens}, min_new_tokens={min_new_tokens}")
        if len(ids) >= self.max_seq_len:
            raise ContextLengthError(f"the prompt has {len(ids)} tokens and max_seq_len is {self.max_seq_len}: no "
                                     f"room for a new token; shorten the prompt or load the model with a larger "
                                     f"max_seq_len")
        max_tokens = min(len(ids) + max_new_tokens, self.max_seq_len)
        capacity = self.capacity_pages * self.page_size
        if self.scheduler.pages_for(max_tokens) > self.capacity_pages:
            raise ContextLengthError(f"the job needs {max_tokens} tokens of cache (prompt {len(ids)} + up to "
                                     f"{max_tokens - len(ids)} new), the generator's cache holds {capacity}; "
                                     f"lower max_new_tokens or make the Generator with a larger cache_tokens")
        return max_tokens

    def _constraint(self, json_schema, json_object: bool, regex: str | None, grammar: str | None, max_tokens: int):
        if json_schema is None and not json_object and regex is None and grammar is None:
            return None
        from .constraints import Constraint, GrammarTokenizer    # llguidance loads only for constrained jobs
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = GrammarTokenizer(self.tokenizer, sorted(self.eos_ids))
        return Constraint(self._grammar_tokenizer, json_schema=json_schema, json_object=json_object, regex=regex,
                          grammar=grammar, max_tokens=max_tokens)

    # ---- the engine -----------------------------------------------------------------------------------------------

    def _forward(self, batch: Batch) -> Tensor:
        """The model call (swappable: a CUDA-graph runner replays decode steps). f32 logits [R, V]."""
        return self.runner.forward(batch)

    def _advance(self, job: Job) -> None:
        """For a consumer whose job has nothing queued: runs the next step, or waits for the running one to end."""
        with self._turn:
            if job._chunks or job.is_done:
                return
            if self._stepping or self._cancels:
                steps = self._steps             # the running step (or the cancels) may settle this job
                self._turn.wait_for(lambda: self._steps != steps or not (self._stepping or self._cancels))
                return
            self._stepping = True
        try:                # no other thread touches the engine meanwhile: they wait for their turn
            progressed = self._step()
        except Exception as e:
            self._fail_all(e)
            raise
        finally:
            with self._turn:
                self._stepping = False
                self._steps += 1
                self._turn.notify_all()
        if not progressed:
            raise RuntimeError("the generator has nothing to run, yet a job is unfinished")

    def _step(self) -> bool:
        step = self._ahead
        if step is None:
            while self._inbox:
                self.scheduler.add(self._inbox.popleft())
            plan = self.scheduler.schedule()
            if not plan:
                return False
            self._copy_heads()
            drafts = self._propose([(job, width - 1) for job, width in plan if width > 1 and job.is_decoding])
            chunks = [self._chunk(job, width, drafts) for job, width in plan]
            rows = logit_rows(plan, chunks)
            batch = Batch.build(chunks, self.page_size, self.model.device, logit_rows=[r for rs in rows for r in rs])
            logits = self._forward(batch)
            if self.draft is not None:
                prefills = [(job, c) for (job, _), c in zip(plan, chunks) if not job.is_decoding]
                if prefills:
                    self._draft_prefill(prefills)
            if not self._can_look_ahead([job for job, _ in plan], 0):
                self._take_tokens(plan, chunks, rows, logits, drafts)
                return True
            step = Launched(plan, chunks, rows, logits, 0, self._copies)
        # the next step goes to the GPU before this one's tokens are read, so that the host's work on them overlaps
        # the GPU's on the next (it is fed this step's tokens on the device)
        live = [job for job, _ in step.plan if not job.is_finished]
        self._ahead = self._launch_next(step) if live and self._can_look_ahead(live, 1) else None
        self._take_tokens(step.plan, step.chunks, step.rows, step.logits, {}, *step.tokens())
        return True

    def _copy_heads(self) -> None:
        """The cached page heads that newly admitted prompts reuse, copied into their own pages (the draft
        model's cache too: it shares the page table)."""
        if not self.scheduler.copies:       # (most steps)
            return
        ps = self.page_size
        for source, page, n in self.scheduler.copies:
            self.model.model.copy_slots(self.cache, source * ps, page * ps, n)
            if self.draft is not None:
                self.draft.cache.copy(source * ps, page * ps, n)
        self.scheduler.copied()

    def _can_look_ahead(self, jobs: list[Job], ahead: int) -> bool:
        """Whether the step after a launched one can go now, `ahead` tokens past each job's last committed one
        (0: whether a step just run can be treated as launched): nothing waits to be admitted or drafted, and each
        job, below its length limit there, has its token there chosen on the device."""
        if self._inbox or self.scheduler.waiting or self.scheduler.n_draft or not self._own_model:
            return False
        return all(len(job.tokens) + ahead < job.max_tokens and (ahead or job.is_decoding)
                   and chosen_on_device(job, len(job.tokens) + ahead) for job in jobs)

    def _launch_next(self, step: "Launched") -> "Launched":
        """The decode step after `step` (whose tokens are not yet committed) for its unfinished jobs, its input
        tokens taken from step's tokens on the device."""
        keep = [i for i, (job, _) in enumerate(step.plan) if not job.is_finished]
        plan = [step.plan[i] for i in keep]
        chunks = []
        for job, _ in plan:
            self.scheduler.grow(job, len(job.tokens) + 1)
            chunks.append(SeqChunk([0], len(job.tokens), job.pages))
        batch = Batch.build(chunks, self.page_size, self.model.device, logit_rows=list(range(len(plan))))
        batch.feed(step.top if len(keep) == len(step.plan) else step.top[keep])
        return Launched(plan, chunks, [range(i, i + 1) for i in range(len(plan))], self._forward(batch), 1,
                        self._copies)

    def _chunk(self, job: Job, width: int, drafts: dict) -> SeqChunk:
        """The job's tokens for this step: its next prompt chunk, or its newest token and the drafted ones."""
        if job.is_decoding:
            return SeqChunk([job.tokens[-1], *drafts.get(job, NO_DRAFT)[0]], job.n_cached, job.pages)
        return SeqChunk(job.tokens[job.n_cached:job.n_cached + width], job.n_cached, job.pages)

    def _take_tokens(self, plan: list[tuple[Job, int]], chunks: list[SeqChunk], rows: list[range],
                     logits: Tensor | None, drafts: dict, top: list[int] | None = None,
                     drawn: dict[Job, int | SamplingError | None] | None = None) -> None:
        """Commits each job's tokens from its logits rows (for a launched step from its tokens alone: `top` and
        the `drawn` ones of its sampling jobs), then retires finished jobs and queues text. Jobs that finished since
        the step was launched are skipped."""
        if top is None and any(job.is_plain_greedy for job, _ in plan):
            top = greedy(logits).tolist()       # one host sync
        if drawn is None:
            drawn = self._plain_samples(plan, rows, logits) if logits is not None else {}
        first = 0
        for (job, _), chunk, rs in zip(plan, chunks, rows):
            first += len(rs)
            if job.is_finished:
                continue
            job.n_cached += len(chunk.tokens)
            if rs:
                drafted, qs = drafts.get(job, NO_DRAFT)
                self._decide(job, logits, range(first - len(rs), first), top, drafted, qs, drawn.get(job))
            # K/V past the last committed token belong to rejected drafts or taken-back tokens: not cached
            last = len(job.tokens) - 1
            job.n_cached = min(job.n_cached, last)
            if job.n_draft_cached is not None:
                job.n_draft_cached = min(job.n_draft_cached, last)
            self.scheduler.register(job, min(job.n_computed, job.n_prompt))
            if job.is_finished:
                self.scheduler.drop(job)
            self._emit(job)

    def _plain_samples(self, plan: list[tuple[Job, int]], rows: list[range], logits: Tensor) -> dict[Job, int | None]:
        """The tokens of the step's plain-sampling jobs that take one row with no mask and no logprobs, drawn for
        all of them in one pass (sampling.sample_rows: the tokens `sample` draws row by row, with one host read for
        the lot instead of a few reads and ~20 small launches per job)."""
        picked, first = [], 0
        for (job, _), rs in zip(plan, rows):
            first += len(rs)
            if len(rs) == 1 and not job.is_finished and job.samples_plainly(len(job.tokens)):
                picked.append((job, first - 1))
        if not picked:
            return {}
        index = [r for _, r in picked]
        if index != list(range(logits.shape[0])):       # (a step of plain-sampling jobs only takes every row)
            logits = logits.index_select(0, torch.tensor(index).to(logits.device, non_blocking=True))
        tokens = sample_rows(logits, [job.state for job, _ in picked])
        return {job: token for (job, _), token in zip(picked, tokens)}

    def _decide(self, job: Job, logits: Tensor, rows: range, top: list[int] | None, drafted: list[int],
                qs: list[Tensor] | None, drawn: int | SamplingError | None = None) -> None:
        """Commits the job's next tokens from its rows of logits [R, V] (1 + len(drafted) of them): its i-th row
        gives the token after drafted[:i]; drafted tokens are kept while the chosen token equals them. drawn: the
        token already drawn for its one row (_plain_samples, Launched), or why none was."""
        try:
            if isinstance(drawn, SamplingError):
                raise drawn
            for i, row in enumerate(rows):
                draft = drafted[i] if i < len(drafted) else None
                if drawn is not None:
                    token, logprob = drawn, None
                else:
                    token, logprob = self._choose(job, logits, row, top, draft,
                                                  qs[i] if qs and draft is not None else None)
                if not job.commit(token, logprob) or token != draft:
                    return
        except Exception as e:      # a constraint or sampling failure ends this job only
            job._error = e
            job.finish("error")

    def _choose(self, job: Job, logits: Tensor, row: int, top: list[int] | None, draft: int | None,
                q: Tensor | None) -> tuple[int, SampleResult | None]:
        """The token at logits[row], from the batch's argmax `top` when it serves (indexing the logits tensor only
        when it does not: a tensor index costs more host time than the rest of a greedy job's step)."""
        if job.is_plain_greedy and not job.n_logprobs and not job.is_banned(len(job.tokens), top[row]):
            return top[row], None   # a ban removes other tokens only: the batch's argmax is still this job's
        logits = logits[row]
        mask = job.mask(len(job.tokens), logits.shape[-1], logits.device)
        if draft is None or job.state.params.is_greedy:
            result = sample(logits, job.state, mask, job.n_logprobs)
            return result.token, result if job.n_logprobs else None
        token = verify(probs(logits, job.state, mask), q, draft, job.state.rng)
        return token, logprob(logits, token, job.n_logprobs) if job.n_logprobs else None

    def _emit(self, job: Job) -> None:
        chunk = job.next_chunk() if job._error is None else None
        if chunk is not None:
            job._chunks.append(chunk)
        if job.is_finished:
            job._closed = True

    def _fail_all(self, error: Exception) -> None:
        jobs = list(self._inbox) + list(self.scheduler.waiting) + list(self.scheduler.running)
        self._inbox.clear()
        self._ahead = None
        for job in jobs:
            self.scheduler.drop(job)
            job._error = error
            job.finish("error")
            job._closed = True

    # ---- speculative decoding -------------------------------------------------------------------------------------

    def _propose(self, decoders: list[tuple[Job, int]]) -> dict[Job, tuple[list[int], list[Tensor] | None]]:
        """Drafted tokens (and the draft distributions they were drawn from, None when chosen deterministically)
        for each (job, at most k tokens)."""
        if not decoders:
            return {}
        if self.ngram:
            return {job: (self._allowed_prefix(job, job.ngram.propose(job.tokens, k)), None) for job, k in decoders}
        return self._draft_model_proposals(decoders)

    def _allowed_prefix(self, job: Job, tokens: list[int]) -> list[int]:
        """The longest prefix of tokens that the job's masks allow, position by position."""
        n = 0
        for t in tokens:
            mask = job.mask(len(job.tokens) + n, self.config.vocab_size, torch.device("cpu"))
            if mask is not None and not mask[t]:
                break
            if job.constraint is not None:
                job.constraint.advance(t)
            n += 1
        if job.constraint is not None:
            job.constraint.rollback(n)
        return tokens[:n]

    def _draft_model_proposals(self, decoders: list[tuple[Job, int]]) -> dict:
        want = dict(decoders)
        drafted = {job: [] for job in want}
        qs = {job: [] for job in want}
        for i in range(max(want.values())):
            active = [job for job in want if len(drafted[job]) == i < want[job]]
            if not active:
                break
            chunks = []
            for job in active:
                seq = job.tokens + drafted[job]
                chunks.append(SeqChunk(seq[job.n_draft_cached:], job.n_draft_cached, job.pages))
                job.n_draft_cached = len(seq)
            logits = self.draft.forward(Batch.build(chunks, self.page_size, self.model.device))
            for job, row in zip(active, logits):
                token, q = self._draft_token(job, row, len(job.tokens) + i)
                if token is None:
                    continue
                drafted[job].append(token)
                qs[job].append(q)
                job.state.accept(token)
                if job.constraint is not None:
                    job.constraint.advance(token)
        for job, tokens in drafted.items():
            job.state.rollback(len(tokens))
            if job.constraint is not None:
                job.constraint.rollback(len(tokens))
        return {job: (drafted[job], qs[job]) for job in want}

    def _draft_token(self, job: Job, logits: Tensor, position: int) -> tuple[int | None, Tensor | None]:
        """The draft model's proposal at position, drawn as the job would sample (None: nothing to propose)."""
        if job.constraint is not None and job.constraint.is_finished():
            return None, None
        try:
            dist = probs(logits, job.state, job.mask(position, logits.shape[-1], logits.device))
        except SamplingError:       # nothing allowed: the target's own step will report it
            return None, None
        if job.state.params.is_greedy:
            return int(dist.argmax()), None
        return draw(dist, job.state.rng), dist

    def _draft_prefill(self, pairs: list[tuple[Job, SeqChunk]]) -> None:
        """Runs the target's prefill chunks through the draft model too, so its cache holds the prompts."""
        self.draft.forward(Batch.build([c for _, c in pairs], self.page_size, self.model.device, logit_rows=[]))
        for job, c in pairs:
            job.n_draft_cached = c.start + len(c.tokens)


def chosen_on_device(job: Job, position: int) -> bool:
    """Whether Launched can choose the job's token at position on the device, so that a step can be fed it before
    the host sees it: a plain greedy decoder (its stop tokens masked there while min_new_tokens bans them), or plain
    sampling there (sampling.draw_rows); never with banned strings, which may take a token back."""
    return not job.banned_strings and (job.is_plain_greedy or job.samples_plainly(position))


class Launched:
    """A decode step sent to the GPU whose jobs' tokens (chosen_on_device) are chosen there: its jobs, chunks and
    logits rows, and its tokens (int64 [R] on the device: each greedy job's argmax, its stop tokens masked while
    min_new_tokens bans them, and each sampling job's draw, whose uniform is taken now), on their way to pinned host
    memory (TokenCopies), so that reading them waits for this step's kernels only, not for the ones queued after
    them. The logits themselves (a graph's output, which the next step overwrites) are copied only for a job that
    needs more than its token: logprobs. A sampled row that gives no token gives its error instead (draw_rows'
    code). `ahead`: how many tokens past each job's last committed one the step's tokens go."""

    def __init__(self, plan: list[tuple[Job, int]], chunks: list[SeqChunk], rows: list[range], logits: Tensor,
                 ahead: int, copies: "TokenCopies"):
        self.plan, self.chunks, self.rows = plan, chunks, rows
        self.top = greedy(logits)
        for i, (job, _) in enumerate(plan):
            if job.is_plain_greedy and len(job.tokens) + ahead < job.min_tokens and job.stop_ids:
                stops = torch.tensor([t for t in job.stop_ids if t < logits.shape[-1]], dtype=torch.long)
                self.top[i] = logits[i].index_fill(0, stops.to(logits.device, non_blocking=True), NEG_INF).argmax()
        sampled = [i for i, (job, _) in enumerate(plan) if not job.is_plain_greedy]
        self.sampled = [(plan[i][0], i) for i in sampled]
        self.logits = logits.clone() if any(job.n_logprobs for job, _ in plan) else None
        if not sampled:                         # (greedy alone: its tokens, no error codes to stack beside them)
            self.host, self.done = copies.start(self.top)
            return
        index = torch.tensor(sampled).to(logits.device, non_blocking=True)
        tokens, codes = draw_rows(logits.index_select(0, index), [plan[i][0].state for i in sampled])
        self.top.index_copy_(0, index, tokens)
        broken = torch.zeros_like(self.top)
        broken.index_copy_(0, index, codes)
        self.host, self.done = copies.start(torch.stack((self.top, broken)))

    def tokens(self) -> tuple[list[int], dict[Job, int | SamplingError]]:
        """(every row's token, the sampled jobs' tokens, or the error of a row that gave none)."""
        if self.done is not None:
            self.done.synchronize()
        if not self.sampled:
            return self.host.tolist(), {}
        top, broken = self.host.tolist()
        return top, {job: broken_row_error(broken[i]) if broken[i] else top[i] for job, i in self.sampled}


class TokenCopies:
    """Launched steps' tokens on their way to pinned host memory, each copy on a stream of its own (one per
    device): on the step's stream it would sit between this step's kernels and the next step's, which is launched
    before the host reads them; on its own it runs beside the next step."""

    def __init__(self) -> None:
        self.streams: dict[torch.device, torch.cuda.Stream] = {}

    def start(self, t: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
        """t's copy in pinned host memory, started without waiting, and the event that marks its arrival (on the
        CPU: t itself and None). Waiting for the event waits for the kernels queued before the copy only."""
        if not t.is_cuda:
            return t, None
        main = torch.cuda.current_stream(t.device)      # (a layer split: the last GPU's stream)
        side = self.streams.get(t.device)
        if side is None:
            side = self.streams[t.device] = torch.cuda.Stream(t.device)
        side.wait_stream(main)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            host.copy_(t, non_blocking=True)
        t.record_stream(side)                   # (t's memory is not reused before the copy has read it)
        done = torch.cuda.Event()
        done.record(side)
        return host, done


def logit_rows(plan: list[tuple[Job, int]], chunks: list[SeqChunk]) -> list[range]:
    """Per job, the batch rows whose logits it needs: from the row of its newest token on (that row and one per
    drafted token); none for a chunk that ends inside the prompt."""
    rows, end = [], 0
    for (job, _), chunk in zip(plan, chunks):
        end += len(chunk.tokens)
        n = max(0, chunk.start + len(chunk.tokens) - len(job.tokens) + 1)
        rows.append(range(end - n, end))
    return rows


def logprob(logits: Tensor, token: int, n_top: int) -> SampleResult:
    """The token's logprob and the n_top most likely tokens, from the raw logits (as sampling.sample reports)."""
    logp = torch.log_softmax(logits.float(), -1)
    best = torch.topk(logp, min(n_top, logp.numel()))
    return SampleResult(token, logp[token].item(), list(zip(best.indices.tolist(), best.values.tolist())))


def template_stop_ids(tokenizer) -> frozenset[int]:
    """Special tokens the chat template writes (other than BOS): a reply ends at any of them (<|im_end|>,
    <|eot_id|>, <end_of_turn>, ...)."""
    template = str(tokenizer.chat_template or "")
    return frozenset(i for i, t in tokenizer.added_tokens_decoder.items()
                     if t.special and t.content in template and i != tokenizer.bos_token_id)

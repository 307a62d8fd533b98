"""Who runs in the next step, and the cache pages they take.

Every decoding job runs each step (one token, plus its drafted tokens); the rest of the step's token budget goes
to prefill chunks, oldest job first, then to queued jobs, admitted first come first served. A job is admitted only
when the pages it could ever need (prompt + max_new_tokens, less the prefix it reuses) fit in what is free or
evictable after the pages promised to running jobs. It then takes pages as it grows, and growth never fails: a
running job is never evicted or stalled, and a job that does not fit waits in the queue until others finish.
A prompt reuses the cached pages of its prefix that are computed when it is admitted (jobs admitted in the same
step compute a common prefix each), and the head of the next cached page that its tokens match: copied into its own
page before the step runs (`copies`: the generator copies, then calls copied())."""
from __future__ import annotations

from collections import deque

from .job import Job
from .pages import PageManager, page_hashes


class Scheduler:
    def __init__(self, pages: PageManager, max_batch_size: int, max_step_tokens: int, n_draft: int):
        self.pages, self.page_size = pages, pages.page_size
        self.max_batch_size, self.max_step_tokens, self.n_draft = max_batch_size, max_step_tokens, n_draft
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        # a page head is copied when it saves at least this many tokens: fewer cost less to compute again than
        # the copies (a few per layer)
        self.min_head = max(1, self.page_size // 8)
        self.heads: dict[Job, tuple[int, int]] = {}         # admitted this step: (cached source page, tokens)
        self.copies: list[tuple[int, int, int]] = []        # (source page, the job's page, tokens) to copy now

    def add(self, job: Job) -> None:
        self.waiting.append(job)

    def schedule(self) -> list[tuple[Job, int]]:
        """(job, how many tokens it may feed) for each job of the next step, with pages for them allocated.
        A decoding job's width counts its newest token and up to n_draft drafted ones."""
        plan = [(job, 1 + min(self.n_draft, job.max_tokens - len(job.tokens) - 1))
                for job in self.running if job.is_decoding]
        budget = self.max_step_tokens - sum(width for _, width in plan)
        if len(plan) < len(self.running):       # some running jobs still prefill (else no need to look)
            for job in self.running:
                if budget <= 0:
                    break
                if not job.is_decoding:
                    plan.append((job, min(len(job.tokens) - job.n_cached, budget)))
                    budget -= plan[-1][1]
        while budget > 0 and self.waiting and len(self.running) < self.max_batch_size and self._admit(self.waiting[0]):
            job = self.waiting.popleft()
            plan.append((job, min(len(job.tokens) - job.n_cached, budget)))
            budget -= plan[-1][1]
        for job, width in plan:
            self.grow(job, job.n_cached + width)
        for job, (source, n) in self.heads.items():
            self.copies.append((source, job.pages[job.n_cached // self.page_size], n))
        self.heads.clear()
        return plan

    def copied(self) -> None:
        """The caller copied `copies` into every cache: their source pages may go."""
        self.pages.release([source for source, _, _ in self.copies])
        self.copies.clear()

    def drop(self, job: Job) -> None:
        """Takes a finished or cancelled job out; its confirmed full pages stay cached for reuse."""
        if job in self.waiting:
            self.waiting.remove(job)
        elif job in self.running:
            self.running.remove(job)
            self.register(job, job.n_computed)
            n_full, ps = job.n_computed // self.page_size, self.page_size
            if job.n_computed % ps and n_full < len(job.pages):      # its last page, partly filled
                self.pages.register_partial(job.pages[n_full], job.hashes[n_full - 1] if n_full else b"",
                                            tuple(job.tokens[n_full * ps:job.n_computed]))
            self.pages.release(job.pages)
            job.pages = []

    def register(self, job: Job, n_tokens: int) -> None:
        """Registers the job's full pages among its first n_tokens (their K/V final) for prefix reuse."""
        n_full, ps = n_tokens // self.page_size, self.page_size
        if n_full <= job.n_registered:
            return
        job.hashes = page_hashes(job.tokens, ps, n_full, job.hashes)
        for i in range(job.n_registered, n_full):
            self.pages.register(job.pages[i], job.hashes[i], job.hashes[i - 1] if i else b"",
                                tuple(job.tokens[i * ps:(i + 1) * ps]))
        job.n_registered = n_full

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def _admit(self, job: Job) -> bool:
        # reuse at most the pages before the prompt's last token: that token must run to give the first logits
        job.hashes = page_hashes(job.tokens, self.page_size, (job.n_prompt - 1) // self.page_size, job.hashes)
        shared = self.pages.match(job.hashes)
        start = len(shared) * self.page_size
        source, head = self.pages.follower(job.hashes[len(shared) - 1] if shared else b"",
                                           job.tokens[start:min(start + self.page_size, job.n_prompt - 1)])
        promised = sum(self.pages_for(j.max_tokens) - len(j.pages) for j in self.running)
        need = self.pages_for(job.max_tokens) - len(shared)

        def fits(held):
            return need <= self.pages.n_available - self.pages.n_unowned(held) - promised
        held = shared + [source] if head >= self.min_head else shared
        if not fits(held):      # holding the source until its copy may be what does not fit: compute instead
            held = shared
            if not fits(held):
                return False
        self.pages.hold(held)
        job.pages, job.n_registered = shared, len(shared)
        job.n_cached = job.n_reused = start
        if len(held) > len(shared):         # its own next page starts as a copy of the source's head
            self.heads[job] = (source, head)
            job.n_cached = job.n_reused = start + head
        if job.n_draft_cached is not None:
            job.n_draft_cached = job.n_cached
        self.running.append(job)
        return True

    def grow(self, job: Job, n_tokens: int) -> None:
        """Gives the job pages for n_tokens tokens (admission promised them: this never fails)."""
        missing = self.pages_for(n_tokens) - len(job.pages)
        if missing > 0:
            job.pages += self.pages.allocate(missing)

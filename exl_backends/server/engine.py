"""The Generator seen from asyncio.

The Generator is stepped by whoever iterates a job (under its lock), so each job gets a thread of its own that
iterates it and hands every chunk to the event loop (`loop.call_soon_threadsafe` into an asyncio.Queue): the loop
never waits on a step, a slow client only lets its own chunks pile up (the other threads keep stepping), and a job
whose client left is cancelled from a worker thread (cancel waits for the running step, then frees the pages).

Outstanding jobs (queued or running, counted from submit until their thread ends) are bounded: a request that would
go over the bound is refused at once (QueueFull -> 429), so the threads, the queue and the memory held stay bounded.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..engine.generator import Generator
from ..engine.job import Chunk, Job
from .metrics import Metrics


class QueueFull(Exception):
    pass


class Engine:
    def __init__(self, generator: Generator, max_jobs: int, metrics: Metrics):
        self.generator, self.max_jobs, self.metrics = generator, max_jobs, metrics
        self._lock = threading.Lock()
        self._n_outstanding = 0
        self._live: set[Job] = set()
        self._threads = ThreadPoolExecutor(max_workers=max_jobs, thread_name_prefix="exl-job")

    @property
    def n_outstanding(self) -> int:
        return self._n_outstanding

    async def start(self, requests: list[dict]) -> "JobStream":
        """Reserves a place for each job, submits them (Generator.submit keyword arguments, one dict per job; in a
        worker thread: tokenizing and compiling a constraint take time) and starts their consumers. Raises
        QueueFull, or what a submit raised (the jobs already submitted are then cancelled)."""
        with self._lock:
            if self._n_outstanding + len(requests) > self.max_jobs:
                raise QueueFull(f"{self._n_outstanding} jobs are queued or running and the server takes at most "
                                f"{self.max_jobs}; retry shortly")
            self._n_outstanding += len(requests)
        try:
            jobs = await asyncio.to_thread(self._submit_all, requests)
        except BaseException:
            self._release(len(requests))
            raise
        stream = JobStream(self, jobs, asyncio.get_running_loop())
        with self._lock:
            self._live.update(jobs)
        for index, job in enumerate(jobs):
            self._threads.submit(self._consume, index, job, stream.deliver)
        return stream

    def _submit_all(self, requests: list[dict]) -> list[Job]:
        jobs = []
        try:
            for kwargs in requests:
                jobs.append(self.generator.submit(**kwargs))
        except BaseException:
            self._cancel(jobs)
            raise
        return jobs

    def _consume(self, index: int, job: Job, deliver: Callable[[int, object], None]) -> None:
        """A job's thread: iterates it to its end, delivering each chunk, then None (the end) or the error."""
        try:
            for chunk in job:
                self.metrics.generated(len(chunk.token_ids))
                if chunk.finish_reason is not None:
                    self.metrics.finished(chunk.finish_reason)
                deliver(index, chunk)
            deliver(index, None)
        except BaseException as e:      # a Rust panic (llguidance) is one too: it must not leave a stream hanging
            self.metrics.finished("error")
            deliver(index, e if isinstance(e, Exception) else RuntimeError(f"{type(e).__name__}: {e}"))
        finally:
            with self._lock:
                self._live.discard(job)
            self._release(1)

    def _release(self, n: int) -> None:
        with self._lock:
            self._n_outstanding -= n

    def cancel_soon(self, jobs: list[Job]) -> None:
        """Cancels unfinished jobs from a worker thread (cancel waits for the running step)."""
        jobs = [job for job in jobs if not job.is_done]
        if jobs:
            threading.Thread(target=self._cancel, args=(jobs,), name="exl-cancel", daemon=True).start()

    def _cancel(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.generator.cancel(job)

    def close(self) -> None:
        """Cancels every job (server shutdown) and lets the threads end."""
        with self._lock:
            live = list(self._live)
        self._cancel(live)
        self._threads.shutdown(wait=False, cancel_futures=True)


class JobStream:
    """The chunks of one request's jobs, as lists of (job index, chunk) in the order they come. Iterating raises
    the first job failure; `cancel` ends every job still running (a client that left, or a failure)."""

    def __init__(self, engine: Engine, jobs: list[Job], loop: asyncio.AbstractEventLoop):
        self.engine, self.jobs, self.loop = engine, jobs, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.n_open = len(jobs)

    def deliver(self, index: int, item) -> None:
        """From a job's thread: a chunk, None (the job ended) or its error."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, item))
        except RuntimeError:        # the loop is closed: the server is shutting down, nobody reads
            pass

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[tuple[int, Chunk]]:
        """Every chunk queued now (waiting for one when none is), so a stream can send them in one write."""
        while self.n_open:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            chunks = []
            for index, item in items:
                if item is None:
                    self.n_open -= 1
                elif isinstance(item, BaseException):
                    self.n_open = 0
                    raise item
                else:
                    chunks.append((index, item))
            if chunks:
                return chunks
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.engine.cancel_soon(self.jobs)

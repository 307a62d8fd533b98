"""Prometheus metrics (text exposition format 0.0.4) for /metrics: requests by route and status, tokens and
tokens/s, jobs by how they ended, queue depth, cache use. Counters are updated from the event loop and from the
job threads, hence the lock; gauges are read from the Generator when scraped."""
from __future__ import annotations

import threading
import time
from collections import Counter, deque

RATE_WINDOW_S = 10.0        # tokens/s is averaged over this much recent time


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.finish_reasons: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.in_flight = 0
        self._recent: deque[tuple[float, int]] = deque()     # (time, tokens) of recent chunks

    def request_started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def request_done(self, route: str, status: int) -> None:
        with self._lock:
            self.in_flight -= 1
            self.requests[route, status] += 1

    def prompt(self, n_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += n_tokens

    def generated(self, n_tokens: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.generated_tokens += n_tokens
            self._recent.append((now, n_tokens))
            self._drop_old(now)

    def finished(self, reason: str) -> None:
        with self._lock:
            self.finish_reasons[reason] += 1

    def _drop_old(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._drop_old(now)
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def render(self, generator, n_outstanding: int) -> str:
        """The exposition text; generator: the served Generator (queue and cache gauges)."""
        pages = generator.pages
        used = generator.capacity_pages - pages.n_available
        running = len(generator.scheduler.running)
        with self._lock:
            requests = sorted(self.requests.items())
            reasons = sorted(self.finish_reasons.items())
            prompt, generated, in_flight = self.prompt_tokens, self.generated_tokens, self.in_flight
        out = []
        family(out, "exl_requests_total", "counter", "HTTP requests answered, by route and status",
               [(f'route="{route}",status="{status}"', n) for (route, status), n in requests])
        family(out, "exl_requests_in_flight", "gauge", "HTTP requests being answered", [("", in_flight)])
        family(out, "exl_prompt_tokens_total", "counter", "prompt tokens of the jobs submitted", [("", prompt)])
        family(out, "exl_generation_tokens_total", "counter", "tokens generated", [("", generated)])
        family(out, "exl_generation_tokens_per_second", "gauge",
               f"tokens generated per second, over the last {RATE_WINDOW_S:g} s",
               [("", round(self.tokens_per_second(), 3))])
        family(out, "exl_jobs_finished_total", "counter", "jobs ended, by finish reason",
               [(f'reason="{r}"', n) for r, n in reasons])
        family(out, "exl_jobs_running", "gauge", "jobs in the running batch", [("", running)])
        family(out, "exl_queue_depth", "gauge", "jobs accepted and waiting to run",
               [("", max(0, n_outstanding - running))])
        family(out, "exl_cache_pages_total", "gauge", "KV cache pages jobs can use", [("", generator.capacity_pages)])
        family(out, "exl_cache_pages_used", "gauge", "KV cache pages held by jobs", [("", used)])
        family(out, "exl_cache_pages_cached", "gauge", "KV cache pages kept only for prefix reuse (freed on demand)",
               [("", len(pages.unowned))])
        family(out, "exl_cache_usage_ratio", "gauge", "fraction of the KV cache held by jobs",
               [("", round(used / max(generator.capacity_pages, 1), 6))])
        family(out, "exl_cache_page_tokens", "gauge", "tokens per KV cache page", [("", generator.page_size)])
        return "\n".join(out) + "\n"


def family(out: list[str], name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
    out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    out += [f"{name}{{{labels}}} {value}" if labels else f"{name} {value}" for labels, value in samples]

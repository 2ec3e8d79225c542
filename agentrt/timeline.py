"""A short server-side history of TTFT, prefix-cache hit rate and the latency SLO, for the dashboard's charts.

Prometheus histograms and counters say everything since the process started; a chart of the
last minutes needs the values per time slice, kept on the server so that a page reload (or a
second viewer) sees the same history. :class:`Timeline` keeps one bucket per ``interval_s``
seconds for the last ``window_s`` seconds (a bounded ring: older buckets are dropped) and is
fed on requests: every first token adds a TTFT, every finished request its prompt and cached
tokens, every ended generation and session whether it met the latency SLO. Each bucket keeps the
TTFT count, sum and maximum exactly and a uniform sample of at most ``sample_size`` values (reservoir sampling, seeded) for the median and the 95th percentile;
the hit rate of a bucket is its cached tokens over its prompt tokens, as the engine counts them.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class _Bucket:
    start: float  # epoch seconds, a multiple of the interval
    ttft_count: int = 0
    ttft_sum: float = 0.0
    ttft_max: float = 0.0
    sample: list[float] = field(default_factory=list)
    requests: int = 0  # finished requests (those that count prompt and cached tokens)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    slo_met: int = 0  # generations that ended meeting the latency SLO
    slo_missed: int = 0
    sessions_met: int = 0  # sessions that ended with every turn within the SLO
    sessions_missed: int = 0


def quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (nearest rank: the smallest value with at least ``q`` of them at or
    below it); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class Timeline:
    """Bucketed TTFT and hit-rate samples over the last ``window_s`` seconds. Safe to feed from any
    thread. ``clock`` (epoch seconds) is for tests."""

    def __init__(self, interval_s: float = 5.0, window_s: float = 600.0, sample_size: int = 256,
                 clock: Callable[[], float] = time.time, seed: int = 0) -> None:
        if interval_s <= 0 or window_s < interval_s:
            raise ValueError(f"need 0 < interval_s <= window_s, got {interval_s} and {window_s}")
        if sample_size < 1:
            raise ValueError(f"sample_size must be >= 1, got {sample_size}")
        self.interval_s = interval_s
        self.window_s = window_s
        self.sample_size = sample_size
        self._clock = clock
        self._rng = random.Random(seed)
        self._buckets: deque[_Bucket] = deque(maxlen=math.ceil(window_s / interval_s))
        self._lock = threading.Lock()

    def _current(self) -> _Bucket:
        start = math.floor(self._clock() / self.interval_s) * self.interval_s
        if not self._buckets or self._buckets[-1].start < start:
            self._buckets.append(_Bucket(start))
        return self._buckets[-1]

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            b = self._current()
            b.ttft_count += 1
            b.ttft_sum += seconds
            b.ttft_max = max(b.ttft_max, seconds)
            if len(b.sample) < self.sample_size:
                b.sample.append(seconds)
            else:  # reservoir: each of the bucket's values stays in the sample with equal chance
                j = self._rng.randrange(b.ttft_count)
                if j < self.sample_size:
                    b.sample[j] = seconds

    def observe_request(self, prompt_tokens: int, cached_tokens: int) -> None:
        with self._lock:
            b = self._current()
            b.requests += 1
            b.prompt_tokens += prompt_tokens
            b.cached_tokens += cached_tokens

    def observe_slo(self, met: bool) -> None:
        with self._lock:
            b = self._current()
            if met:
                b.slo_met += 1
            else:
                b.slo_missed += 1

    def observe_session_end(self, met: bool) -> None:
        with self._lock:
            b = self._current()
            if met:
                b.sessions_met += 1
            else:
                b.sessions_missed += 1

    def points(self) -> list[dict]:
        """One point per interval of the window up to now, oldest first (intervals without requests
        included, with zero counts and null values, so a chart shows the gap)."""
        with self._lock:
            now = self._clock()
            last = math.floor(now / self.interval_s) * self.interval_s
            n = self._buckets.maxlen or 1
            first = last - (n - 1) * self.interval_s
            held = {round(b.start / self.interval_s): b for b in self._buckets if b.start >= first - 1e-9}
            out = []
            for i in range(n):
                start = first + i * self.interval_s
                b = held.get(round(start / self.interval_s))
                out.append(_point(start, b, self.interval_s))
            return out

    def slo_summary(self, seconds: float = 60.0) -> dict:
        """The latency SLO over the intervals that began in the last ``seconds`` (the current one
        included): generations that met it and ended, sessions that ended within it and ended, and the
        goodput, sessions ended within the SLO per minute over that span (None before any ended)."""
        with self._lock:
            since = math.floor(self._clock() / self.interval_s) * self.interval_s - seconds + self.interval_s
            recent = [b for b in self._buckets if b.start >= since - 1e-9]
            met = sum(b.slo_met for b in recent)
            ended = met + sum(b.slo_missed for b in recent)
            s_met = sum(b.sessions_met for b in recent)
            s_ended = s_met + sum(b.sessions_missed for b in recent)
            return {"seconds": seconds, "requests": ended, "requests_in_slo": met,
                    "requests_in_slo_ratio": met / ended if ended else None,
                    "sessions_ended": s_ended, "sessions_in_slo": s_met,
                    "goodput_sessions_per_min": s_met * 60.0 / seconds if s_ended else None}

    def as_json(self) -> dict:
        return {"interval_s": self.interval_s, "window_s": self.window_s, "points": self.points()}


def _point(start: float, b: _Bucket | None, interval_s: float) -> dict:
    if b is None:
        return {"t": start, "ttft_count": 0, "ttft_mean_s": None, "ttft_p50_s": None, "ttft_p95_s": None,
                "ttft_max_s": None, "requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "hit_rate": None,
                "slo_met": 0, "slo_missed": 0, "slo_ratio": None, "sessions_met": 0, "sessions_missed": 0,
                "goodput_sessions_per_min": None}
    slo_ended, sessions_ended = b.slo_met + b.slo_missed, b.sessions_met + b.sessions_missed
    return {"t": start, "ttft_count": b.ttft_count,
            "ttft_mean_s": b.ttft_sum / b.ttft_count if b.ttft_count else None,
            "ttft_p50_s": quantile(b.sample, 0.5), "ttft_p95_s": quantile(b.sample, 0.95),
            "ttft_max_s": b.ttft_max if b.ttft_count else None,
            "requests": b.requests, "prompt_tokens": b.prompt_tokens, "cached_tokens": b.cached_tokens,
            "hit_rate": b.cached_tokens / b.prompt_tokens if b.prompt_tokens else None,
            "slo_met": b.slo_met, "slo_missed": b.slo_missed,
            "slo_ratio": b.slo_met / slo_ended if slo_ended else None,
            "sessions_met": b.sessions_met, "sessions_missed": b.sessions_missed,
            "goodput_sessions_per_min": b.sessions_met * 60.0 / interval_s if sessions_ended else None}

"""Figures of one run: latency percentiles, job completion time, throughput, hit rate, goodput, cost.

Definitions (all from client-side records of successful calls unless noted):

* TTFT, TPOT (per request, ``(e2e - ttft) / (completion_tokens - 1)``), end-to-end: p50/p90/p99.
* Job completion time: per session, first call sent to last reply received (tool/think time included).
* Throughput: output tokens/s and total (prompt + output) tokens/s over the run's wall time,
  and the same divided by the number of workers.
* Hit rate: sum of ``usage.prompt_tokens_details.cached_tokens`` / sum of prompt tokens
  (``None`` when the server reported no usage).
* Goodput: requests/s that met the SLO (TTFT <= ``ttft_s`` and TPOT <= ``tpot_s``; a
  one-token reply has no TPOT and is judged on TTFT); ``attainment`` = their share of all calls
  (failed calls count as misses).
* Cost: ``workers * wall hours`` per million output / total tokens (worker-hours, priced by
  nobody), and with ``price_per_worker_hour`` the dollars: ``price * workers * wall hours``.

A run bounded by ``--duration`` records only the calls that completed (turns cut at the hard
limit are not calls), so every figure here is of those.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 2.0
    tpot_s: float = 0.25
    attainment: float = 0.9   # a rate "meets the SLO" when this share of calls does

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0 or not 0 < self.attainment <= 1:
            raise ValueError(f"SLO needs ttft_s > 0, tpot_s > 0 and 0 < attainment <= 1, got {self}")

    def met(self, call: dict) -> bool:
        if not call["ok"] or call["ttft_s"] > self.ttft_s:
            return False
        return call["tpot_s"] is None or call["tpot_s"] <= self.tpot_s


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` in [0, 100]; ``None`` for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _pcts(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


def _per_million(dollars: float, tokens: int) -> float | None:
    return dollars / tokens * 1e6 if tokens else None


def hit_rate_over_time(calls: list[dict], bins: int = 10) -> list[dict]:
    """Cached / prompt tokens of the calls finishing in each of ``bins`` equal time slices."""
    ok = [c for c in calls if c["ok"] and c.get("prompt_tokens") is not None]
    if not ok:
        return []
    end = max(c["end_s"] for c in ok)
    width = end / bins if end > 0 else 1.0
    out = []
    for b in range(bins):
        sel = [c for c in ok if b * width <= c["end_s"] < (b + 1) * width or (b == bins - 1 and c["end_s"] == end)]
        prompt = sum(c["prompt_tokens"] for c in sel)
        out.append({"t_s": (b + 1) * width, "calls": len(sel),
                    "hit_rate": sum(c["cached_tokens"] or 0 for c in sel) / prompt if prompt else None})
    return out


def summarize(calls: list[dict], sessions: list[dict], wall_s: float, slo: SLO, workers: int = 1,
              price_per_worker_hour: float | None = None) -> dict:
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    ok = [c for c in calls if c["ok"]]
    out_tok = sum(c["completion_tokens"] for c in ok)
    usage_known = bool(ok) and all(c.get("prompt_tokens") is not None for c in ok)
    prompt_tok = sum(c["prompt_tokens"] for c in ok) if usage_known else None
    cached_known = usage_known and all(c.get("cached_tokens") is not None for c in ok)
    cached_tok = sum(c["cached_tokens"] for c in ok) if cached_known else None
    total_tok = out_tok + prompt_tok if prompt_tok is not None else None
    good = sum(1 for c in calls if slo.met(c))
    wall = max(wall_s, 1e-9)
    figures = {
        "calls": len(calls), "calls_ok": len(ok), "calls_failed": len(calls) - len(ok),
        "sessions": len(sessions), "sessions_completed": sum(1 for s in sessions if s["ok"]),
        "wall_s": wall_s, "workers": workers,
        "prompt_tokens": prompt_tok, "completion_tokens": out_tok, "cached_tokens": cached_tok,
        "ttft_s": _pcts([c["ttft_s"] for c in ok]),
        "tpot_s": _pcts([c["tpot_s"] for c in ok if c["tpot_s"] is not None]),
        "e2e_s": _pcts([c["e2e_s"] for c in ok]),
        "jct_s": _pcts([s["jct_s"] for s in sessions if s["ok"]]),
        "output_tok_s": out_tok / wall, "total_tok_s": total_tok / wall if total_tok is not None else None,
        "output_tok_s_per_worker": out_tok / wall / workers,
        "total_tok_s_per_worker": total_tok / wall / workers if total_tok is not None else None,
        "requests_per_s": len(ok) / wall,
        "hit_rate": cached_tok / prompt_tok if cached_tok is not None and prompt_tok else None,
        "slo": asdict(slo), "goodput_rps": good / wall, "slo_met_calls": good,
        "attainment": good / len(calls) if calls else 0.0,
        "hit_rate_over_time": hit_rate_over_time(calls),
    }
    figures["meets_slo"] = figures["attainment"] >= slo.attainment
    worker_hours = workers * wall_s / 3600.0
    figures["cost"] = {"worker_hours": worker_hours,
                       "worker_hours_per_million_output_tokens": _per_million(worker_hours, out_tok),
                       "worker_hours_per_million_total_tokens": _per_million(worker_hours, total_tok or 0)}
    if price_per_worker_hour is not None:
        dollars = price_per_worker_hour * worker_hours
        figures["cost"] |= {"price_per_worker_hour": price_per_worker_hour, "dollars": dollars,
                            "per_million_output_tokens": _per_million(dollars, out_tok),
                            "per_million_total_tokens": _per_million(dollars, total_tok or 0)}
    return figures


def best_rate(sweep: list[dict]) -> float | None:
    """The highest arrival rate whose run met the SLO (``None`` if none did)."""
    met = [r["rate"] for r in sweep if r["summary"]["meets_slo"]]
    return max(met) if met else None

"""One benchmark: build the workload, run it (at one or several arrival rates), summarise.

    from agentrt.bench import BenchOptions, run_bench
    result = run_bench(BenchOptions(target="http://127.0.0.1:8000", preset="tiny", sessions=2))

``result`` is a JSON-ready dict: the options, the workload, one entry per arrival rate
(its calls, sessions, summary, what a ``duration_s`` bound let run, the planned volume with
the probe's rates and the estimate, and the server's ``/metrics`` deltas when it has them)
and the highest rate that met the SLO. Before the runs one small request probes the target's
prefill and decode rates (``agentrt.bench.estimate``), so the start of a run says how much it
will send and about how long it will take.
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass, field, replace

import httpx

from agentrt.bench import prom
from agentrt.bench.driver import CallFailed
from agentrt.bench.estimate import ProbeResult, describe, estimate_s, plan_record, plan_volume, probe
from agentrt.bench.progress import note
from agentrt.bench.runner import RunOptions, run_plans
from engine.cpu_info import cpu_model
from agentrt.bench.summary import SLO, best_rate, summarize
from agentrt.bench.trace import load_records, plan_trace
from agentrt.bench.workload import preset as load_preset
from agentrt.bench.workload import plan_sessions


@dataclass(frozen=True)
class BenchOptions:
    target: str
    preset: str = "swe"
    sessions: int | None = None            # None: the preset's default (a trace: its first 8 records)
    seed: int = 0
    rates: tuple[float, ...] = ()          # session arrivals/s to sweep; () = the preset's rate
    max_turns: int | None = None
    max_reply_tokens: int | None = None
    think_scale: float | None = None
    trace: str | None = None               # a Mooncake-format file replaces the preset
    trace_block_tokens: int = 512
    trace_time_scale: float = 1.0
    api: str = "chat"
    model: str | None = None
    api_key: str | None = None
    tokenizer: str | None = None           # GGUF whose tokenizer sizes the text (default: the default model)
    slo: SLO = field(default_factory=SLO)
    workers: int = 1
    price_per_worker_hour: float | None = None
    metrics_urls: tuple[str, ...] | None = None  # None: the target itself; () = scrape nothing
    flush_urls: tuple[str, ...] = ()       # POST /flush_cache here before each run (cold start)
    session_pin_ttl_s: float | None = None
    progress: bool = True
    duration_s: float | None = None        # no session or turn starts after this; None = run the whole plan
    grace_s: float = 15.0                  # turns still running at duration_s + grace_s are cut
    estimate: bool = True                  # probe the target and print the planned volume and an estimate

    def __post_init__(self) -> None:
        if self.sessions is None:
            object.__setattr__(self, "sessions", 8 if self.trace else load_preset(self.preset).default_sessions)
        if self.sessions < 1:
            raise ValueError(f"--sessions must be >= 1, got {self.sessions}")
        if any(r <= 0 for r in self.rates):
            raise ValueError(f"--rates must be positive session arrivals per second, got {self.rates}")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.price_per_worker_hour is not None and self.price_per_worker_hour < 0:
            raise ValueError(f"--price-per-worker-hour must be >= 0, got {self.price_per_worker_hour}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"--duration must be > 0 seconds, got {self.duration_s}")
        if not self.grace_s >= 0:
            raise ValueError(f"--grace must be >= 0 seconds, got {self.grace_s}")


def load_tokenizer(path: str | None):
    """The model's tokenizer (no weights), to size the workload's text."""
    from engine.loader import load_tokenizer as load

    return load(path)[0]


def build_workload(opts: BenchOptions, tokenizer, rate: float | None):
    """(spec, plans) for one arrival rate (``None``: the preset's own rate / the trace's timestamps)."""
    spec = load_preset("tiny" if opts.trace else opts.preset).with_overrides(
        max_turns=opts.max_turns, max_reply_tokens=opts.max_reply_tokens, think_scale=opts.think_scale,
        session_rate=rate)
    if opts.trace:
        records = load_records(opts.trace, limit=opts.sessions)
        scale = opts.trace_time_scale
        if rate is not None:  # stretch the trace to this mean arrival rate
            span = (records[-1]["timestamp"] - records[0]["timestamp"]) / 1000.0
            scale = (len(records) - 1) / rate / span if span > 0 else 0.0
        plans = plan_trace(records, tokenizer, opts.trace_block_tokens, scale, opts.max_reply_tokens, opts.seed)
        return replace(spec, name="trace", compact_at_tokens=None), plans
    return spec, plan_sessions(spec, opts.sessions, tokenizer, opts.seed)


def flush(urls: tuple[str, ...]) -> None:
    for url in urls:
        resp = httpx.post(url.rstrip("/") + "/flush_cache", timeout=30.0)
        if resp.status_code >= 300:
            raise RuntimeError(f"{url}/flush_cache answered {resp.status_code}: cannot start the run cold")
    if urls:
        time.sleep(0.5)  # let the KV 'cleared' events reach the routers


def run_once(opts: BenchOptions, tokenizer, rate: float | None, label: str = "bench",
             rates: ProbeResult | None = None, probe_error: str | None = None) -> dict:
    """One run; with ``rates`` (from :func:`probe`) it first prints the planned volume and the estimate."""
    spec, plans = build_workload(opts, tokenizer, rate)
    volume = plan_volume(plans, spec, tokenizer)
    est = estimate_s(volume, rates) if rates is not None else None
    if opts.estimate:
        for line in describe(volume, rates, est, probe_error, opts.duration_s, opts.grace_s):
            note(f"[{label}] {line}")
    metrics_urls = (opts.target,) if opts.metrics_urls is None else opts.metrics_urls
    route = "/v1/chat/completions" if opts.api == "chat" else "/v1/sessions/{session_id}/turns"
    flush(opts.flush_urls)
    before = {u: prom.scrape(u, route) for u in metrics_urls}
    run = run_plans(plans, spec, RunOptions(opts.target, opts.api, opts.model, opts.api_key,
                                            session_pin_ttl_s=opts.session_pin_ttl_s, progress=opts.progress,
                                            duration_s=opts.duration_s, grace_s=opts.grace_s),
                    tokenizer, label)
    time.sleep(0.2)  # engine counters are read at scrape time; the last stream may close just before
    after = {u: prom.scrape(u, route) for u in metrics_urls}
    server = {u: prom.delta(before[u], after[u]) for u in metrics_urls}
    summary = summarize(run.calls, run.sessions, run.wall_s, opts.slo, opts.workers, opts.price_per_worker_hour)
    return {"rate": rate if rate is not None else spec.session_rate, "model": run.model, "summary": summary,
            "bounded": run.bounded, "plan": plan_record(volume, rates, est, probe_error),
            "server_metrics": server, "calls": run.calls, "sessions": run.sessions,
            "workload": {"preset": None if opts.trace else spec.name, "trace": opts.trace, "sessions": len(plans),
                         "calls": sum(p.n_calls for p in plans), "spec": asdict(spec)}}


def run_bench(opts: BenchOptions, tokenizer=None) -> dict:
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(opts.tokenizer)
    rates, probe_error = None, None
    if opts.estimate:
        try:
            rates = probe(opts.target, opts.model, opts.api_key, tokenizer)
        except CallFailed as exc:
            probe_error = str(exc)
    runs = ([run_once(opts, tokenizer, r, f"rate {r:g}/s", rates, probe_error) for r in opts.rates]
            or [run_once(opts, tokenizer, None, "bench", rates, probe_error)])
    return {"options": _jsonable(asdict(opts)), "machine": machine(), "runs": runs,
            "best_rate": best_rate(runs) if opts.rates else None,
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def machine() -> dict:
    import os

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "processor": cpu_model()}
    try:
        import torch

        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["cuda"] = None
    return info


def _jsonable(d: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items() if k != "api_key"}

"""``agentrt bench --ablate``: one workload through a ladder that switches one component at a time.

Every step runs the same seeded workload on a local deployment (``deploy.Deployment``: N
workers behind ``agentrt router``), each from cold caches (``/flush_cache`` on every worker
first). The ladder, in order:

1. ``rr-nocache``   round-robin routing, radix prefix cache off (chat API, full history re-sent)
2. ``rr-cache``     + radix prefix cache                          -> factor of the cache
3. ``prefix-route`` + prefix-aware routing (the ``agentrt`` policy) -> factor of routing
4. ``sess-nopin``   same deployment through agentrt's session API, every session asking for a
                    1 ms pin TTL (pins expire at once: pinning effectively off). Not a component:
                    the change of API is shown, not credited.
5. ``sess-pin``     session API with the server's pin TTLs (30 s, 120 s after a tool call)
                                                                 -> factor of session pinning
6. MoE placement (``--ep N`` with an MoE model): ``ep-contiguous``, ``ep-balanced``,
   ``ep-locality`` on top of step 5, each factor against ``ep-contiguous``.

A component this machine cannot run (flashinfer without CUDA, placement with a dense
model) is listed as not measured, with the reason; nothing is estimated.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, replace

from agentrt.bench.bench import BenchOptions, load_tokenizer, machine, run_once
from agentrt.bench.deploy import Deployment

NO_PIN_TTL_S = 0.001


@dataclass(frozen=True)
class Step:
    name: str
    component: str | None       # what this step switches relative to ``base`` (None: not credited)
    base: str | None            # the step it is compared with
    policy: str
    prefix_cache: bool
    api: str = "chat"
    pins: bool = False
    ep_placement: str | None = None

    def worker_flags(self, ep: int) -> tuple[str, ...]:
        flags = ("--enable-prefix-cache", "true" if self.prefix_cache else "false")
        if self.ep_placement is not None:
            flags += ("--ep-size", str(ep), "--ep-placement", self.ep_placement)
        return flags


LADDER = (
    Step("rr-nocache", None, None, "round_robin", False),
    Step("rr-cache", "radix prefix cache", "rr-nocache", "round_robin", True),
    Step("prefix-route", "prefix-aware routing", "rr-cache", "agentrt", True),
    Step("sess-nopin", None, "prefix-route", "agentrt", True, api="sessions"),
    Step("sess-pin", "session KV pinning", "sess-nopin", "agentrt", True, api="sessions", pins=True),
)
MOE_STEPS = tuple(
    Step(f"ep-{p}", None if p == "contiguous" else f"MoE placement {p}", None if p == "contiguous" else "ep-contiguous",
         "agentrt", True, api="sessions", pins=True, ep_placement=p) for p in ("contiguous", "balanced", "locality"))


@dataclass(frozen=True)
class AblationOptions:
    workers: int = 2
    kv_cache_tokens: int | None = None
    model: str | None = None
    ep: int = 1
    steps: tuple[str, ...] | None = None

    def ladder(self) -> tuple[Step, ...]:
        steps = LADDER + (MOE_STEPS if self.ep > 1 else ())
        if self.steps is None:
            return steps
        known = {s.name for s in LADDER + MOE_STEPS}
        unknown = [n for n in self.steps if n not in known]
        if unknown:
            raise ValueError(f"unknown ladder steps {unknown}; known: {', '.join(sorted(known))}")
        return tuple(s for s in steps if s.name in self.steps)


def not_measured(aopts: AblationOptions) -> list[dict]:
    out = []
    cuda = machine().get("cuda")
    out.append({"component": "attention backend torch vs flashinfer",
                "reason": "no CUDA device on this machine (flashinfer needs one)" if not cuda else
                "agentrt serve/worker expose no attention-backend flag (the engine picks flashinfer on CUDA)"})
    if aopts.ep <= 1:
        out.append({"component": "MoE placement contiguous vs balanced vs locality",
                    "reason": "the served model is dense (no MoE layers); run with --model-path <MoE checkpoint> --ep N"})
    return out


def run_ablation(opts: BenchOptions, aopts: AblationOptions) -> dict:
    ladder = aopts.ladder()
    tokenizer = load_tokenizer(opts.tokenizer)
    deployment = Deployment(aopts.workers, aopts.kv_cache_tokens, aopts.model)
    steps: list[dict] = []
    rate = opts.rates[0] if opts.rates else None
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so `finally` stops the deployment
    try:
        for step in ladder:
            deployment.ensure(step.worker_flags(aopts.ep), step.policy)
            run_opts = replace(opts, target=deployment.router_url, api=step.api, workers=aopts.workers,
                               metrics_urls=tuple(deployment.worker_urls), flush_urls=tuple(deployment.worker_urls),
                               session_pin_ttl_s=None if step.pins else NO_PIN_TTL_S)
            run = run_once(run_opts, tokenizer, rate, label=step.name)
            run["label"] = step.name
            steps.append({"step": step.__dict__, "run": run})
    finally:
        deployment.stop()
        signal.signal(signal.SIGTERM, previous)
    return {"options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in opts.__dict__.items()
                        if k not in ("api_key", "slo")} | {"slo": opts.slo.__dict__},
            "ablation": aopts.__dict__ | {"steps": [s.name for s in ladder]}, "machine": machine(),
            "steps": steps, "factors": factors(steps), "not_measured": not_measured(aopts)}


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return a / b if b > 0 else (float("inf") if a > 0 else None)


def factors(steps: list[dict]) -> list[dict]:
    """Each credited step against its base, and prefix routing + cache against the bare baseline."""
    by_name = {s["step"]["name"]: s["run"]["summary"] for s in steps}
    out = []
    pairs = [(s["step"]["name"], s["step"]["base"], s["step"]["component"]) for s in steps if s["step"]["base"]]
    if "prefix-route" in by_name and "rr-nocache" in by_name:
        pairs.append(("prefix-route", "rr-nocache", "prefix-aware routing + radix cache (together)"))
    for name, base, component in pairs:
        if base not in by_name:
            continue
        a, b = by_name[name], by_name[base]
        out.append({"step": name, "base": base, "component": component or "(API change, not credited)",
                    "goodput": _ratio(a["goodput_rps"], b["goodput_rps"]),
                    "throughput": _ratio(a["output_tok_s"], b["output_tok_s"]),
                    "ttft_p99": _ratio(b["ttft_s"]["p99"], a["ttft_s"]["p99"])})
    return out


def write_ablation(result: dict, md_path: str | None, command: str | None) -> None:
    from agentrt.bench.ablation_report import ablation_markdown, print_ablation

    print_ablation(result)
    if md_path:
        ablation_markdown(result, md_path, command)

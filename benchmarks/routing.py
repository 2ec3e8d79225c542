"""Routing benchmark, part (a): replay a Mooncake-format trace against simulated workers.

    python benchmarks/routing.py --trace benchmarks/traces/conversation_trace.jsonl \
        --workers 8 --json out/routing.json

Part (b), ``--live``: real workers behind our router and ``sglang-router``
(``benchmarks/routing_live.py``).

Each trace record is a request: ``timestamp`` (ms), ``input_length``, ``output_length``
and ``hash_ids``, one id per 512-token block naming the block together with its prefix
(exactly what a contract-1 chain hash names). The simulator works at that 512-token
granularity: a trace id *is* a block hash, block_size is 512. Expanding to 16-token
blocks would multiply the bookkeeping by 32 and change no routing decision, since trace
blocks are shared or not as a whole.

Simulated worker (constants are options; defaults model one ~8B model on one
H100-class GPU):

* cache: a bounded LRU set of blocks (``--cache-tokens`` per worker). A request touches
  its blocks root-last, so a parent is always more recent than its children and
  eviction drops leaves first, like a radix cache. Every block of a record is cached,
  the partial last one included, so one infinite cache reproduces the trace's ideal.
* time: one FIFO queue per worker. A request costs ``uncached / prefill_tok_s`` seconds
  of prefill then ``output * decode_s_per_tok`` seconds of batched decode (amortised
  per-token cost in a full batch). TTFT = queue wait + own prefill.
* the worker's cache learns a request's blocks when its prefill ends, and publishes
  ``stored``/``removed`` events to the router's ``PrefixIndex`` (the real one) at that
  moment, as a live worker would. A request queued behind others also hits the blocks
  they will have inserted by the time it starts.
* the router also counts blocks of requests it dispatched whose prefill has not ended
  as held by their worker (the live router's tentative entries, ``router/tentative.py``);
  ``--no-tentative`` routes on the event-fed index alone.

The router side is the real code: ``router.policy`` policies, ``PrefixIndex``,
``InFlightTracker``. A "session" is approximated by the record's second block id (the
first is one system prompt shared by every conversation request), used by
``session_hash`` and as the session record's last worker for ``agentrt``;
``--no-sessions`` replays without it (``session_hash`` then keys on the first block,
which every conversation request shares).

Figures: token hit rate (a block is hit only if every earlier block hit), ideal hit rate
(one infinite cache, requests in timestamp order), max/mean of the workers' busy seconds
(``load_max_mean``) and of their request counts, and p50/p99 modelled TTFT.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402
from router.index import PrefixIndex  # noqa: E402
from router.inflight import InFlightTracker  # noqa: E402
from router.policy import RouteRequest, WorkerState, make_policy, policy_names  # noqa: E402

TRACE_BLOCK = 512
DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "conversation_trace.jsonl"


@dataclass(frozen=True)
class LatencyModel:
    prefill_tok_s: float = 10_000.0
    decode_s_per_tok: float = 0.001

    @property
    def decode_token_weight(self) -> float:
        """Prefill tokens one output token costs (for the router's in-flight estimate)."""
        return self.prefill_tok_s * self.decode_s_per_tok


def load_trace(path: Path, limit: int | None = None) -> list[dict]:
    records = []
    with open(path) as f:
        for line in f:
            if line.strip():
                records.append(json.loads(line))
                if limit is not None and len(records) >= limit:
                    break
    records.sort(key=lambda r: r["timestamp"])
    return records


def hit_tokens(record: dict, n_blocks: int) -> int:
    return min(n_blocks * TRACE_BLOCK, record["input_length"])


def ideal_hit_rate(records: list[dict]) -> float:
    """Token hit rate of one infinite cache."""
    seen: set[int] = set()
    hit = total = 0
    for r in records:
        n = 0
        for h in r["hash_ids"]:
            if h not in seen:
                break
            n += 1
        hit += hit_tokens(r, n)
        total += r["input_length"]
        seen.update(r["hash_ids"])
    return hit / max(total, 1)


class SimWorker:
    """Bounded LRU block cache + FIFO queue; reports cache changes to ``on_event``."""

    def __init__(self, worker_id: str, capacity_blocks: int, on_event) -> None:
        self.worker_id = worker_id
        self.capacity = capacity_blocks
        self.on_event = on_event
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.pending: dict[int, int] = {}  # blocks queued requests will insert -> refcount
        self.free_at = 0.0
        self.busy_s = 0.0
        self.requests = 0
        self.queued = 0

    def match(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks and h not in self.pending:
                break
            n += 1
        return n

    def touch(self, hashes: list[int]) -> None:
        for h in reversed(hashes):
            if h in self.blocks:
                self.blocks.move_to_end(h)

    def enqueue(self, hashes: list[int]) -> None:
        for h in hashes:
            self.pending[h] = self.pending.get(h, 0) + 1

    def insert(self, hashes: list[int]) -> None:
        """Prefill ended: the request's blocks enter the cache (root most recent)."""
        new = [h for h in hashes if h not in self.blocks]
        for h in reversed(hashes):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
            self.pending[h] -= 1
            if not self.pending[h]:
                del self.pending[h]
        if new:
            self.on_event("stored", new, None)
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        if evicted:
            self.on_event("removed", evicted, None)


def simulate(records: list[dict], policy_name: str, n_workers: int, cache_blocks: int,
             model: LatencyModel, sessions: bool = True, tentative: bool = True) -> dict:
    """Replay ``records`` under one policy; returns its figures."""
    policy = make_policy(policy_name)
    index = PrefixIndex()
    tracker = InFlightTracker(model.decode_token_weight)
    workers = []
    for i in range(n_workers):
        wid = f"w{i}"
        workers.append(SimWorker(wid, cache_blocks, _publisher(index, wid)))
    by_id = {w.worker_id: w for w in workers}
    last_worker: dict[int, str] = {}
    timeline: list[tuple[float, int, str, object]] = []  # (time, seq, kind, payload)
    ttfts: list[float] = []
    reasons: dict[str, int] = {}
    hit = total = 0
    seq = 0
    for i, r in enumerate(records):
        now = r["timestamp"] / 1000.0
        while timeline and timeline[0][0] <= now:
            _, _, kind, payload = heapq.heappop(timeline)
            if kind == "prefilled":
                payload[0].insert(payload[1])
            else:
                req, w = payload
                w.queued -= 1
                tracker.completed(req.request_id)
                policy.on_complete(req, w.worker_id)
        hashes = r["hash_ids"]
        session = hashes[1] if sessions and len(hashes) > 1 else None
        extra = None
        if tentative:  # dispatched, prefill not ended: the live router's tentative entries
            extra = {h: holders for h in hashes
                     if (holders := {w.worker_id for w in workers if h in w.pending})}
        matches = index.match(hashes, extra=extra or None)
        # as the live router tells the policy: how much of the match is known, not only tentative
        known = max(index.match(hashes).values(), default=0) if extra else None
        req = RouteRequest(str(i), tuple(hashes), r["input_length"], TRACE_BLOCK,
                           session_id=None if session is None else str(session),
                           last_worker=last_worker.get(session),
                           est_output_tokens=r["output_length"], known_blocks=known)
        states = [WorkerState(w.worker_id, cached_blocks=matches.get(w.worker_id, 0),
                              running=min(w.queued, 1), waiting=max(w.queued - 1, 0),
                              in_flight=tracker.count(w.worker_id),
                              in_flight_tokens=tracker.tokens(w.worker_id)) for w in workers]
        decision = policy.select(req, states)
        policy.on_dispatch(req, decision)
        reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
        w = by_id[decision.worker_id]
        n_hit = w.match(hashes)
        w.touch(hashes[:n_hit])
        w.enqueue(hashes)
        cached = hit_tokens(r, n_hit)
        hit += cached
        total += r["input_length"]
        uncached = r["input_length"] - cached
        tracker.dispatched(req.request_id, w.worker_id, uncached, r["output_length"])
        start = max(now, w.free_at)
        first_token = start + uncached / model.prefill_tok_s
        service = first_token - start + r["output_length"] * model.decode_s_per_tok
        w.free_at = start + service
        w.busy_s += service
        w.requests += 1
        w.queued += 1
        ttfts.append(first_token - now)
        if session is not None:
            last_worker[session] = w.worker_id
        heapq.heappush(timeline, (first_token, seq, "prefilled", (w, hashes)))
        heapq.heappush(timeline, (w.free_at, seq + 1, "done", (req, w)))
        seq += 2
    return {**_figures(hit, total, workers, ttfts), "reasons": reasons}


def _publisher(index: PrefixIndex, worker_id: str):
    def on_event(kind: str, hashes: list[int], parent: int | None) -> None:
        if kind == "stored":
            index.stored(worker_id, hashes)
        elif kind == "removed":
            index.removed(worker_id, hashes)
        else:
            index.clear_worker(worker_id)
    return on_event


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def _figures(hit: int, total: int, workers: list[SimWorker], ttfts: list[float]) -> dict:
    busy = [w.busy_s for w in workers]
    reqs = [w.requests for w in workers]
    return {
        "hit_rate": hit / max(total, 1),
        "load_max_mean": max(busy) / max(sum(busy) / len(busy), 1e-9),
        "requests_max_mean": max(reqs) / max(sum(reqs) / len(reqs), 1e-9),
        "ttft_p50_s": _percentile(ttfts, 0.50),
        "ttft_p99_s": _percentile(ttfts, 0.99),
        "ttft_mean_s": sum(ttfts) / max(len(ttfts), 1),
    }


def run(records: list[dict], n_workers: int, cache_tokens: int, policies: list[str],
        model: LatencyModel, sessions: bool = True, tentative: bool = True) -> dict:
    cache_blocks = max(1, cache_tokens // TRACE_BLOCK)
    out = {"ideal_hit_rate": ideal_hit_rate(records), "records": len(records),
           "workers": n_workers, "cache_tokens_per_worker": cache_blocks * TRACE_BLOCK,
           "latency_model": {"prefill_tok_s": model.prefill_tok_s,
                             "decode_s_per_tok": model.decode_s_per_tok},
           "sessions": sessions, "tentative": tentative, "policies": {}}
    for name in policies:
        out["policies"][name] = simulate(records, name, n_workers, cache_blocks, model, sessions, tentative)
    return out


def default_cache_tokens(records: list[dict], n_workers: int) -> int:
    """The target configuration: a quarter of the trace's distinct blocks, split over workers."""
    distinct = len({h for r in records for h in r["hash_ids"]})
    return max(1, distinct // 4 // n_workers) * TRACE_BLOCK


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="the request trace replayed (part a)")
    p.add_argument("--workers", type=int, default=None, help="default 8 simulated, 3 live")
    p.add_argument("--cache-tokens", type=int, default=None,
                   help="per-worker cache in tokens (default: distinct blocks / 4 / workers)")
    p.add_argument("--policies", default=",".join(policy_names()), help="comma-separated routing policies to replay")
    p.add_argument("--prefill-tok-s", type=float, default=LatencyModel.prefill_tok_s,
                   help="simulated worker prefill speed (tokens/s) of the replay's latency model")
    p.add_argument("--decode-s-per-tok", type=float, default=LatencyModel.decode_s_per_tok,
                   help="simulated seconds per decoded token of the replay's latency model")
    p.add_argument("--quick", type=int, nargs="?", const=2000, default=None, metavar="N",
                   help="replay only the first N records (default 2000)")
    p.add_argument("--no-sessions", action="store_true",
                   help="replay without session ids (no last worker, no session_hash key)")
    p.add_argument("--no-tentative", action="store_true",
                   help="route on KV events alone (no entries for dispatched, not yet prefilled requests)")
    harness.add_common_args(p, repeats=1)
    live = p.add_argument_group("part (b), --live: real workers behind agentrt router and sglang-router")
    live.add_argument("--live", action="store_true", help="run part (b) instead of the trace replay")
    live.add_argument("--sessions", type=int, default=8, help="agent sessions, run concurrently")
    live.add_argument("--turns", type=int, default=4, help="turns per session")
    live.add_argument("--system-tokens", type=int, default=1000, help="tokens of each agent type's system prompt")
    live.add_argument("--tool-result-tokens", type=int, default=150, help="tokens of each turn's tool result")
    live.add_argument("--reply-tokens", type=int, default=16, help="max_tokens of each reply")
    live.add_argument("--kv-cache-tokens", type=int, default=8192, help="KV pool per live worker")
    live.add_argument("--live-fronts", default="agentrt,sglang", help="fronts to drive, in order")
    live.add_argument("--live-tuning", choices=("defaults", "tuned"), default="defaults",
                      help="defaults: both routers as started plainly; tuned: both fitted to the workload "
                           "(agentrt tokens_per_queued_request, sglang-router --balance-abs-threshold)")
    live.add_argument("--live-policy-option", action="append", default=[], metavar="KEY=VALUE",
                      help="extra option for agentrt router's policy (repeatable; only with --live-tuning tuned)")
    args = p.parse_args(argv)
    run_info = harness.Run(args, __file__, argv)
    if args.live:
        return main_live(p, args, run_info)
    if args.repeats != 1:
        p.error("--repeats applies to --live (passes per front); the trace replay is deterministic")
    args.workers = 8 if args.workers is None else args.workers
    if args.workers < 1:
        p.error("--workers must be >= 1")
    if not args.trace.is_file():
        p.error(f"trace not found: {args.trace}")
    policies = [s for s in args.policies.split(",") if s]
    unknown = set(policies) - set(policy_names())
    if unknown:
        p.error(f"unknown policies: {', '.join(sorted(unknown))}")
    records = load_trace(args.trace, args.quick)
    cache_tokens = args.cache_tokens or default_cache_tokens(records, args.workers)
    model = LatencyModel(args.prefill_tok_s, args.decode_s_per_tok)
    t0 = time.perf_counter()
    out = run(records, args.workers, cache_tokens, policies, model, not args.no_sessions, not args.no_tentative)
    out["elapsed_s"] = round(time.perf_counter() - t0, 2)
    print(f"{len(records)} records, {args.workers} workers, {out['cache_tokens_per_worker']} "
          f"cache tokens/worker; ideal hit rate {out['ideal_hit_rate']:.4f}")
    print(f"{'policy':14s} {'hit':>7s} {'/ideal':>7s} {'load max/mean':>14s} {'reqs max/mean':>14s}"
          f" {'TTFT p50':>9s} {'TTFT p99':>9s}")
    for name, f in out["policies"].items():
        print(f"{name:14s} {f['hit_rate']:7.4f} {f['hit_rate'] / max(out['ideal_hit_rate'], 1e-9):7.3f}"
              f" {f['load_max_mean']:14.3f} {f['requests_max_mean']:14.3f}"
              f" {f['ttft_p50_s']:9.3f} {f['ttft_p99_s']:9.3f}")
    run_info.write(out, kernels={})
    return 0


def main_live(p: argparse.ArgumentParser, args: argparse.Namespace, run: harness.Run) -> int:
    from benchmarks.routing_live import LiveOptions, print_live, run_live

    fronts = tuple(f for f in args.live_fronts.split(",") if f)
    if not fronts or set(fronts) - {"agentrt", "sglang"}:
        p.error("--live-fronts takes agentrt and/or sglang")
    try:
        opts = LiveOptions(workers=args.workers or 3, sessions=args.sessions, turns=args.turns,
                           system_tokens=args.system_tokens, tool_result_tokens=args.tool_result_tokens,
                           reply_tokens=args.reply_tokens, kv_cache_tokens=args.kv_cache_tokens, fronts=fronts,
                           repeats=args.repeats, policy_options=tuple(args.live_policy_option),
                           tuning=args.live_tuning, order=args.order)
        if min(opts.workers, opts.sessions, opts.turns, opts.reply_tokens, opts.repeats) < 1:
            p.error("--workers, --sessions, --turns, --reply-tokens and --repeats must be >= 1")
        out = run_live(opts)
    except ValueError as exc:
        p.error(str(exc))
    except RuntimeError as exc:
        print(f"routing --live: {exc}", file=sys.stderr)
        return 1
    print_live(out)
    for name, cmd in out["front_cmds"].items():
        run.add_server(name, cmd, harness.non_default_flags(out["router_tuning"]["non_default_flags"][name]))
    run.write(out, settings=harness.serve_settings(["--kv-cache-tokens", str(args.kv_cache_tokens)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

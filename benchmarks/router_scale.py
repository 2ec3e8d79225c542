"""The router at fleet scale: a simulated fleet driving the real index, event consumer and policy.

    python benchmarks/router_scale.py --workers 8,32,128 --blocks-per-worker 100000 --json out/router_scale.json

One process, no HTTP and no Redis. Per run (one ``--workers`` value):

* **Fleet.** Every worker caches ``--blocks-per-worker`` 16-token blocks named by real
  contract-1 chain hashes (``engine.hashing``). About half (``--shared-fraction``) come from
  the trace's common prefixes: the leading 512-token blocks of
  ``benchmarks/traces/conversation_trace.jsonl`` requests that recur in other requests (its
  system prompt, conversation histories), picked per worker with the trace's own popularity,
  so popular ones are cached by many workers. The rest are the worker's own continuations,
  chained onto those prefixes. Each trace block id stands for 512 tokens derived from the id.
* **Events.** The worker's radix cache would report each insertion as one ``stored`` event
  of its new blocks: one per common prefix (its blocks not yet cached there), and own
  continuations in events sized like the trace's requests' new blocks (x32 at 16-token
  blocks). Events are encoded with the real msgpack codec (``router.events.encode_event``),
  interleaved across workers, and go through the path production uses: stream entries shaped
  as ``XREAD`` returns them (``(id, {b"e": payload})``, batches of ``--batch``, ``poll``'s
  count) into ``KVEventConsumer.apply_entries`` (bounded, validated decode by
  ``EventReader``, seq check, index update, and the tentative index's ``confirmed`` as
  ``on_blocks``, as ``RouterCore`` wires it). Redis is not involved: the entries are built in
  memory (redis-py's reply parsing is not timed), and snapshots come from memory.
* **Figures.** ``bytes_per_block``: memory the index holds after the build (tracemalloc of
  everything allocated while the events were applied and still alive) per cached
  (worker, block) pair. ``events_per_s``: a churn stream on the full index (a worker evicts
  one of its own insertions, then stores it again), events of trace size, with
  ``blocks_per_s``; ``events_per_s_1block`` is the same with one-block events (the per-event
  overhead). Each stream is timed in alternating rounds through ``apply_entries`` and through
  the per-event path it replaced (``apply_entries_reference``: ``decode_event``, a ``KVEvent``
  and an awaited ``apply`` per entry), on the same index in the same process:
  ``*_reference`` and ``*_speedup`` (rate ratio). Decisions: an 8k-token prompt (512 blocks; a worker's cached path,
  extended with uncached blocks where shorter) through ``PrefixIndex.match_levels`` (``match``),
  then the ``agentrt`` policy's ``select_fleet`` on the fleet view the router keeps (workers with
  varied loads) and ``on_dispatch`` (``policy``): what ``RouterCore.choose`` does after its
  tentative-entry lookup. Half the requests name a last worker (a session), half do not. Each
  decision is checked against the reference path, a ``WorkerState`` per worker and ``select``
  (``policy_full``, timed apart: what the router did before); ``match_alone`` and ``match_walk``
  time ``match`` and the block-by-block walk it replaced in alternating passes over the same
  prompts; ``fleet_update`` is one worker's load change in the view. Tokenizing (the default
  model's tokenizer) and hashing the 8k prompt are timed separately. Resync:
  ``KVEventConsumer.resync`` of one worker from a snapshot of its blocks, warm (the index already
  agrees) and cold (after ``clear_worker``).

``--index reference`` runs the same on ``ReferencePrefixIndex`` (the dict of sets this index
replaced), for comparison at small sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402
from engine.hashing import block_hashes, make_seed  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.event_consumer import KVEventConsumer, Snapshot  # noqa: E402
from router.events import KVEvent, encode_event  # noqa: E402
from router.index import PrefixIndex, ReferencePrefixIndex, lengths  # noqa: E402
from router.policy import RouteRequest, WorkerState, make_policy  # noqa: E402
from router.tentative import TentativeIndex  # noqa: E402

BLOCK = 16
TRACE_BLOCK = 512
PER_TRACE_BLOCK = TRACE_BLOCK // BLOCK
PROMPT_TOKENS = 8192
VOCAB = 49152
DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "conversation_trace.jsonl"
SEED = make_seed("router-scale-bench")


def load_records(path: Path) -> list[list[int]]:
    with open(path) as f:
        return [json.loads(line)["hash_ids"] for line in f if line.strip()]


def common_prefixes(records: list[list[int]]) -> tuple[list[tuple[int, ...]], list[int], list[int]]:
    """The trace's recurring prefixes (leading ids seen in >= 2 requests, maximal), their
    popularity (requests using them), and the new blocks of each request (for event sizes)."""
    seen_in = Counter(h for r in records for h in r)
    heads: Counter[tuple[int, ...]] = Counter()
    seen: set[int] = set()
    new_blocks = []
    for r in records:
        k = 0
        while k < len(r) and seen_in[r[k]] >= 2:
            k += 1
        if k:
            heads[tuple(r[:k])] += 1
        new_blocks.append(sum(1 for h in r if h not in seen))
        seen.update(r)
    paths = sorted(heads)
    return paths, [heads[p] for p in paths], [n for n in new_blocks if n > 0]


def trace_tokens(tid: int) -> np.ndarray:
    """512 tokens standing for trace block ``tid`` (distinct ids give distinct tokens)."""
    return ((np.arange(TRACE_BLOCK, dtype=np.int64) * 7919 + tid * 104_729) % VOCAB).astype(np.uint32)


class SharedChains:
    """16-token chain hashes of trace prefixes, computed once per trace id (an id names its prefix)."""

    def __init__(self) -> None:
        self._by_id: dict[int, list[int]] = {}

    def path(self, ids: tuple[int, ...]) -> list[int]:
        out: list[int] = []
        parent = None
        for tid in ids:
            hs = self._by_id.get(tid)
            if hs is None:
                hs = self._by_id[tid] = block_hashes(trace_tokens(tid), BLOCK, SEED, parent)
            out.extend(hs)
            parent = hs[-1]
        return out


@dataclass
class SimWorker:
    worker_id: str
    events: list[tuple[str, list[int], int | None]] = field(default_factory=list)  # kind, hashes, parent
    blocks: set[int] = field(default_factory=set)
    paths: list[list[int]] = field(default_factory=list)  # cached chains: shared prefix + own continuation
    own_events: list[list[int]] = field(default_factory=list)
    n_events: int = 0


def common_pool(heads: list[tuple[int, ...]], weights: list[int],
                blocks: int) -> tuple[list[tuple[int, ...]], list[int]]:
    """The most popular common prefixes, until they name ``blocks`` distinct 16-token blocks
    (twice what a worker takes from them, so each block is cached by about half the fleet)."""
    ids: set[int] = set()
    chosen = []
    for weight, head in sorted(zip(weights, heads), reverse=True):
        chosen.append((head, weight))
        ids.update(head)
        if len(ids) * PER_TRACE_BLOCK >= blocks:
            break
    return [h for h, _ in chosen], [w for _, w in chosen]


def build_fleet(n_workers: int, blocks_per_worker: int, shared_fraction: float, rng: random.Random,
                heads: list[tuple[int, ...]], weights: list[int], new_blocks: list[int],
                chains: SharedChains) -> list[SimWorker]:
    np_rng = np.random.default_rng(rng.randrange(1 << 32))
    shared_target = int(blocks_per_worker * shared_fraction)
    heads, weights = common_pool(heads, weights, 2 * shared_target)
    fleet = []
    for i in range(n_workers):
        w = SimWorker(f"worker-{i:04d}")
        tips: list[list[int]] = []
        while len(w.blocks) < shared_target:
            path = chains.path(rng.choices(heads, weights)[0])
            new = [h for h in path if h not in w.blocks][: shared_target - len(w.blocks)]  # a suffix of path
            if not new:
                continue
            first = path.index(new[0])
            w.events.append(("stored", new, path[first - 1] if first else None))
            w.blocks.update(new)
            tips.append(path[: first + len(new)])
        while len(w.blocks) < blocks_per_worker:
            base = rng.choice(tips)
            n = min(rng.choice(new_blocks) * PER_TRACE_BLOCK, blocks_per_worker - len(w.blocks))
            toks = np_rng.integers(0, VOCAB, size=n * BLOCK, dtype=np.uint32)
            own = block_hashes(toks, BLOCK, SEED, parent=base[-1])
            w.events.append(("stored", own, base[-1]))
            w.own_events.append(own)
            w.blocks.update(own)
            w.paths.append(base + own)
        fleet.append(w)
    return fleet


def interleave(fleet: list[SimWorker]) -> list[bytes]:
    """Every worker's events, encoded, round-robin across workers (seq per worker from 0)."""
    out = []
    cursors = [0] * len(fleet)
    live = list(range(len(fleet)))
    while live:
        nxt = []
        for i in live:
            w = fleet[i]
            kind, hashes, parent = w.events[cursors[i]]
            out.append(encode_event(KVEvent(w.worker_id, cursors[i], kind, tuple(hashes), parent, 0)))
            cursors[i] += 1
            if cursors[i] < len(w.events):
                nxt.append(i)
        live = nxt
    return out


Entries = list[list[tuple[bytes, dict[bytes, bytes]]]]


def stream_batches(payloads: list[bytes], batch: int, first: int = 0) -> Entries:
    """``payloads`` as ``XREAD`` hands them to the consumer: ``(id, {b"e": payload})`` entries, in
    batches of ``batch`` (``poll``'s ``count``)."""
    entries = [(b"%d-0" % (first + i), {b"e": p}) for i, p in enumerate(payloads)]
    return [entries[i: i + batch] for i in range(0, len(entries), batch)]


async def feed(consumer: KVEventConsumer, batches: Entries) -> None:
    """What ``KVEventConsumer.poll`` does with each batch it reads: ``apply_entries``."""
    for entries in batches:
        await consumer.apply_entries(entries)


async def feed_reference(consumer: KVEventConsumer, batches: Entries) -> None:
    """The per-event path ``apply_entries`` replaced: per entry ``decode_event``, a ``KVEvent``, ``apply``."""
    for entries in batches:
        await consumer.apply_entries_reference(entries)


def timed_churn(consumer: KVEventConsumer, fleet: list[SimWorker], seqs: dict[str, int], n_events: int,
                n_blocks: int, rng: random.Random, one_block: bool, rounds: int, batch: int) -> dict:
    """Churn streams of ``n_events`` / ``n_blocks`` in all through each path, in ``rounds`` alternating
    rounds (the order swapped every round), on the same index: rates and CPU rates per path, and the
    garbage collections that ran while they were timed.

    The collector runs before each stream's entries are built, not after: a full collection walks every
    block of the index (~0.8 s at 128 x 100k) and leaves the caches cold, whereas ``poll`` hands
    ``apply_entries`` a reply redis-py has just parsed."""
    took = {"entries": [0.0, 0.0, 0, 0, 0], "reference": [0.0, 0.0, 0, 0, 0]}  # wall s, CPU s, events, blocks, GCs
    for r in range(rounds):
        order = ("entries", "reference") if r % 2 == 0 else ("reference", "entries")
        for path in order:
            stream, blocks = churn(fleet, seqs, max(2, n_events // rounds), n_blocks // rounds, rng, one_block)
            gc.collect()
            batches = stream_batches(stream, batch)
            collections = sum(g["collections"] for g in gc.get_stats())
            c0, t0 = time.process_time(), time.perf_counter()
            asyncio.run((feed if path == "entries" else feed_reference)(consumer, batches))
            t = took[path]
            t[0] += time.perf_counter() - t0
            t[1] += time.process_time() - c0
            t[2] += len(stream)
            t[3] += blocks
            t[4] += sum(g["collections"] for g in gc.get_stats()) - collections
    return {path: {"events_per_s": ev / wall, "blocks_per_s": bl / wall, "hashes_per_event": bl / ev,
                   "events_per_cpu_s": ev / cpu, "gc_collections": gcs}
            for path, (wall, cpu, ev, bl, gcs) in took.items()}


def churn(fleet: list[SimWorker], seqs: dict[str, int], n_events: int, n_blocks: int, rng: random.Random,
          one_block: bool) -> tuple[list[bytes], int]:
    """At least ``n_events`` events and ``n_blocks`` blocks: a worker evicts one of its own
    insertions (or, ``one_block``, its last block), then stores it again."""
    out, blocks = [], 0
    while len(out) < n_events or blocks < n_blocks:
        w = rng.choice(fleet)
        hashes = tuple(rng.choice(w.own_events))
        if one_block:
            hashes = hashes[-1:]
        for kind in ("removed", "stored"):
            out.append(encode_event(KVEvent(w.worker_id, seqs[w.worker_id], kind, hashes, None, 0)))
            seqs[w.worker_id] += 1
            blocks += len(hashes)
    return out, blocks


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def prompt_hashes(w: SimWorker, rng: random.Random, np_rng: np.random.Generator) -> list[int]:
    """512 block hashes: one of ``w``'s cached paths, cut or extended with uncached blocks."""
    path = rng.choice(w.paths)[: PROMPT_TOKENS // BLOCK]
    missing = PROMPT_TOKENS // BLOCK - len(path)
    if missing:
        toks = np_rng.integers(0, VOCAB, size=missing * BLOCK, dtype=np.uint32)
        path = path + block_hashes(toks, BLOCK, SEED, parent=path[-1])
    return path


def decisions(index, fleet: list[SimWorker], n: int, rng: random.Random) -> dict:
    """Route ``n`` 8k-token prompts the way ``RouterCore.choose`` does after its Redis lookup: the
    index's match, then the policy's ``select_fleet`` on the fleet the router keeps (one state per
    worker, updated on load reports and dispatches, not rebuilt per decision), then ``on_dispatch``.
    Each decision is checked against the reference path (a ``WorkerState`` per worker and ``select``),
    replayed apart and timed as ``policy_full``; ``match`` and the block-by-block walk it replaced
    (``match_walk``) are timed alone in alternating passes over the same prompts."""
    np_rng = np.random.default_rng(rng.randrange(1 << 32))
    policy = make_policy("agentrt")
    ids = [w.worker_id for w in fleet]
    loads = {wid: (rng.randrange(0, 8), rng.randrange(0, 4), rng.randrange(0, 6), rng.uniform(0, 60_000))
             for wid in ids}
    view = policy.new_fleet()
    levelled = hasattr(index, "match_levels")
    for wid, (r, q, f, t) in loads.items():
        view.update(WorkerState(wid, 0, r, q, 0, 0, f, t))
    prompts = [prompt_hashes(rng.choice(fleet), rng, np_rng) for _ in range(min(n, 256))]
    total, cpu, match_t, policy_t, full_t, reasons = [], [], [], [], [], Counter()
    requests, answers = [], []
    for k in range(n):
        hashes = prompts[k % len(prompts)]
        last = rng.choice(ids) if k % 2 else None
        c0 = time.thread_time()
        t0 = time.perf_counter()
        req = RouteRequest(str(k), tuple(hashes), PROMPT_TOKENS, BLOCK, session_id=last and "s",
                           last_worker=last, est_output_tokens=256)
        if levelled:
            levels = index.match_levels(req.hashes)
            matched = lengths(levels)
        else:
            levels, matched = None, index.match(req.hashes)
        t1 = time.perf_counter()
        decision, _ = policy.select_fleet(req, view, matched, None, levels)
        policy.on_dispatch(req, decision)
        t2 = time.perf_counter()
        cpu.append(time.thread_time() - c0)
        total.append(t2 - t0)
        match_t.append(t1 - t0)
        policy_t.append(t2 - t1)
        reasons[decision.reason] += 1
        requests.append(req)
        answers.append((matched, decision))
    # The reference, replayed apart (so it does not cool the caches between the decisions above): what
    # the router did before, a ``WorkerState`` per worker, ``select``, ``on_dispatch``, on a policy that
    # sees the same requests in the same order; every decision must be the same.
    reference = make_policy("agentrt")
    for req, (matched, decision) in zip(requests, answers):
        t0 = time.perf_counter()
        states = [WorkerState(wid, matched.get(wid, 0), r, q, 0, 0, f, t) for wid, (r, q, f, t) in loads.items()]
        full = reference.select(req, states)
        reference.on_dispatch(req, full)
        full_t.append(time.perf_counter() - t0)
        if full != decision:
            raise RuntimeError(f"decision {req.request_id}: select_fleet chose {decision}, select {full}")
    # ``match`` against the walk alone, in alternating passes over the same requests (same cache state)
    alone_t: list[float] = []
    walk_t: list[float] = []
    for times, f in [(alone_t, index_match), (walk_t, index_walk)] * 2:
        for req in requests:
            t0 = time.perf_counter()
            f(index, req.hashes)
            times.append(time.perf_counter() - t0)
    update_t = []
    for k in range(n):  # a dispatch or a load report: one worker's state changes
        wid = ids[k % len(ids)]
        s = view.state(wid)
        t0 = time.perf_counter()
        view.update(s._replace(in_flight=s.in_flight + 1, in_flight_tokens=s.in_flight_tokens + 4096.0))
        update_t.append(time.perf_counter() - t0)
        view.update(s)
    ms = 1000.0
    return {"decision_p50_ms": percentile(total, 0.5) * ms, "decision_p99_ms": percentile(total, 0.99) * ms,
            "decision_cpu_p50_ms": percentile(cpu, 0.5) * ms, "decision_cpu_p99_ms": percentile(cpu, 0.99) * ms,
            "match_p50_ms": percentile(match_t, 0.5) * ms, "match_p99_ms": percentile(match_t, 0.99) * ms,
            "policy_p50_ms": percentile(policy_t, 0.5) * ms, "policy_p99_ms": percentile(policy_t, 0.99) * ms,
            "policy_full_p50_ms": percentile(full_t, 0.5) * ms, "policy_full_p99_ms": percentile(full_t, 0.99) * ms,
            "match_alone_p50_ms": percentile(alone_t, 0.5) * ms, "match_alone_p99_ms": percentile(alone_t, 0.99) * ms,
            "match_walk_p50_ms": percentile(walk_t, 0.5) * ms, "match_walk_p99_ms": percentile(walk_t, 0.99) * ms,
            "fleet_update_p50_ms": percentile(update_t, 0.5) * ms,
            "fleet_update_p99_ms": percentile(update_t, 0.99) * ms,
            "decisions": n, "reasons": dict(reasons)}


def index_match(index, hashes) -> dict:
    """What a decision asks of the index (its groups by length, and ``{worker: k}``)."""
    if hasattr(index, "match_levels"):
        return lengths(index.match_levels(hashes))
    return index.match(hashes)


def index_walk(index, hashes) -> dict:
    """``match`` as it was: block by block through the fleet-wide map alone (``PrefixIndex._match_walk``),
    then ``{worker: k}``."""
    walk = getattr(index, "_match_walk", None)
    if walk is None:
        return index.match(hashes)
    levels, tmp = walk(hashes)
    return lengths((k, index._names(mask, tmp)) for k, mask in levels)


def tokenize_and_hash(n: int) -> dict:
    """Time the default model's tokenizer and the contract-1 hashing on an ~8k-token prompt."""
    from router.model_info import load_router_model

    model = load_router_model(None)
    tok = model.tokenizer
    paragraph = ("The agent called the search tool with the query about the quarterly report, read the "
                 "three results, and summarised the revenue figures for the user in a short table. ")
    text = paragraph * (PROMPT_TOKENS // max(1, len(tok.encode(paragraph))) + 1)
    ids = tok.encode(text)[:PROMPT_TOKENS]
    text = tok.decode(ids)
    seed = make_seed(model.model_id)
    t_tok, t_hash = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        got = tok.encode(text)
        t1 = time.perf_counter()
        block_hashes(got, BLOCK, seed)
        t2 = time.perf_counter()
        t_tok.append(t1 - t0)
        t_hash.append(t2 - t1)
    return {"prompt_tokens": len(got), "tokenize_p50_ms": percentile(t_tok, 0.5) * 1000,
            "tokenize_p99_ms": percentile(t_tok, 0.99) * 1000, "hash_p50_ms": percentile(t_hash, 0.5) * 1000,
            "hash_p99_ms": percentile(t_hash, 0.99) * 1000}


def full_collection(repeats: int = 3) -> tuple[float, float]:
    """A full ``gc.collect()``: median wall and CPU ms of ``repeats``."""
    wall, cpu = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        gc.collect()
        wall.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.process_time() - c0) * 1000)
    return round(sorted(wall)[repeats // 2], 2), round(sorted(cpu)[repeats // 2], 2)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_one(n_workers: int, blocks_per_worker: int, args: argparse.Namespace, trace) -> dict:
    rng = random.Random(args.seed * 1_000_003 + n_workers)
    heads, weights, new_blocks = trace
    t0 = time.perf_counter()
    fleet = build_fleet(n_workers, blocks_per_worker, args.shared_fraction, rng, heads, weights, new_blocks,
                        SharedChains())
    payloads = interleave(fleet)
    expected = sum(len(w.blocks) for w in fleet)
    for w in fleet[1:]:  # only worker 0's block set is needed again (resync check)
        w.blocks = set()
    for w in fleet:
        w.n_events, w.events = len(w.events), []
    gen_s = time.perf_counter() - t0
    # The fleet's own lists are the benchmark's, not the router's: keep them out of the
    # collector's scans (the index adds few containers: a dict and one set per worker).
    gc.collect()
    gc.freeze()
    cfg = RouterConfig()
    index = PrefixIndex() if args.index == "bitset" else ReferencePrefixIndex()
    snapshots: dict[str, Snapshot] = {}

    async def snapshot_source(wid: str) -> Snapshot:
        return snapshots.get(wid, Snapshot(-1, ()))
    # As ``RouterCore`` wires it: the tentative index hears of every block the events report (its
    # Redis client is never reached: ``confirmed`` only touches this replica's own entries).
    tentative = TentativeIndex(aioredis.Redis(), cfg)
    consumer = KVEventConsumer(None, cfg, index, snapshot_source=snapshot_source,  # type: ignore[arg-type]
                               on_blocks=tentative.confirmed)
    batches = stream_batches(payloads, args.batch)

    gc.collect()
    rss0 = rss_bytes()
    tracemalloc.start()
    t0 = time.perf_counter()
    asyncio.run(feed(consumer, batches))
    build_s = time.perf_counter() - t0
    index_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    gc.collect()
    rss_delta = rss_bytes() - rss0
    pairs = sum(index.blocks_of(w.worker_id) for w in fleet)
    if pairs != expected or consumer.stats.malformed:
        raise RuntimeError(f"index holds {pairs} pairs, the fleet {expected}; {consumer.stats}")
    build_events = len(payloads)
    del payloads, batches
    # A full collection walks every entry of the index's per-worker sets; the router freezes them out of
    # the collector once made (RouterCore.freeze_index): the stall before and after, as the router does.
    gc_full = full_collection()
    gc.freeze()
    gc_frozen = full_collection()

    seqs = {w.worker_id: w.n_events for w in fleet}
    phase = time.perf_counter()
    rates = {label: timed_churn(consumer, fleet, seqs, 2 if not one else args.churn_events,
                                args.churn_blocks if not one else 0, rng, one, rounds, args.batch)
             for label, one, rounds in (("trace", False, 6), ("1block", True, 10))}
    if sum(index.blocks_of(w.worker_id) for w in fleet) != expected:
        raise RuntimeError("churn changed the number of cached pairs")
    if consumer.stats.malformed or consumer.stats.gaps != n_workers:  # one gap per worker: its first event
        raise RuntimeError(f"churn was not applied in order: {consumer.stats}")

    churn_s = time.perf_counter() - phase
    phase = time.perf_counter()
    dec = decisions(index, fleet, args.decisions, rng)
    decisions_s = time.perf_counter() - phase

    w = fleet[0]
    snapshots[w.worker_id] = Snapshot(seqs[w.worker_id] - 1, tuple(sorted(w.blocks)))
    t0 = time.perf_counter()
    asyncio.run(consumer.resync(w.worker_id))
    warm = time.perf_counter() - t0
    index.clear_worker(w.worker_id)
    c0, t0 = time.process_time(), time.perf_counter()
    asyncio.run(consumer.resync(w.worker_id))
    cold, cold_cpu = time.perf_counter() - t0, time.process_time() - c0
    if index.hashes_of(w.worker_id) != w.blocks:
        raise RuntimeError("resync did not restore the worker's blocks")

    return {"workers": n_workers, "blocks_per_worker": blocks_per_worker, "index": args.index,
            "pairs": pairs, "distinct_blocks": len(index),
            "shared_pair_fraction": round(shared_pairs(index) / pairs, 4),
            "decision_p50_ms": round(dec["decision_p50_ms"], 4), "decision_p99_ms": round(dec["decision_p99_ms"], 4),
            "decision_cpu_p50_ms": round(dec["decision_cpu_p50_ms"], 4),
            "decision_cpu_p99_ms": round(dec["decision_cpu_p99_ms"], 4),
            "match_p50_ms": round(dec["match_p50_ms"], 4), "match_p99_ms": round(dec["match_p99_ms"], 4),
            "policy_p50_ms": round(dec["policy_p50_ms"], 4), "policy_p99_ms": round(dec["policy_p99_ms"], 4),
            "policy_full_p50_ms": round(dec["policy_full_p50_ms"], 4),  # the reference path, replayed apart
            "policy_full_p99_ms": round(dec["policy_full_p99_ms"], 4),
            "match_alone_p50_ms": round(dec["match_alone_p50_ms"], 4),
            "match_alone_p99_ms": round(dec["match_alone_p99_ms"], 4),
            "match_walk_p50_ms": round(dec["match_walk_p50_ms"], 4),
            "match_walk_p99_ms": round(dec["match_walk_p99_ms"], 4),
            "fleet_update_p50_ms": round(dec["fleet_update_p50_ms"], 4),
            "fleet_update_p99_ms": round(dec["fleet_update_p99_ms"], 4),
            "decision_reasons": dec["reasons"],
            "bytes_per_block": round(index_bytes / pairs, 1), "index_bytes": index_bytes,
            "rss_delta_bytes_per_block": round(rss_delta / pairs, 1),
            **churn_figures(rates),
            "build_events": build_events, "build_s": round(build_s, 2), "build_blocks_per_s": round(pairs / build_s),
            "resync_warm_ms": round(warm * 1000, 2), "resync_cold_ms": round(cold * 1000, 2),
            "resync_cold_cpu_ms": round(cold_cpu * 1000, 2),
            "resync_blocks": len(w.blocks), "generate_s": round(gen_s, 2),
            "gc_full_ms": gc_full[0], "gc_full_cpu_ms": gc_full[1],
            "gc_full_frozen_ms": gc_frozen[0], "gc_full_frozen_cpu_ms": gc_frozen[1],
            "churn_s": round(churn_s, 1), "decisions_s": round(decisions_s, 1)}


def churn_figures(rates: dict) -> dict:
    """``timed_churn``'s rates as the JSON names them (the production path unsuffixed)."""
    out = {}
    for label, suffix in (("trace", ""), ("1block", "_1block")):
        new, ref = rates[label]["entries"], rates[label]["reference"]
        out[f"events_per_s{suffix}"] = round(new["events_per_s"])
        if not suffix:
            out["blocks_per_s"] = round(new["blocks_per_s"])
            out["hashes_per_event"] = round(new["hashes_per_event"], 1)
        out[f"events_per_cpu_s{suffix}"] = round(new["events_per_cpu_s"])
        out[f"events_per_s{suffix}_reference"] = round(ref["events_per_s"])
        out[f"events_per_cpu_s{suffix}_reference"] = round(ref["events_per_cpu_s"])
        out[f"events_per_s{suffix}_speedup"] = round(new["events_per_s"] / ref["events_per_s"], 2)
        out[f"churn{suffix}_gc_collections"] = new["gc_collections"] + ref["gc_collections"]
    return out


def shared_pairs(index) -> int:
    """(worker, block) pairs whose block another worker caches too."""
    count = int.bit_count if isinstance(index, PrefixIndex) else len
    return sum(c for c in map(count, index._holders.values()) if c > 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="8,32,128", help="comma-separated fleet sizes, one run each")
    p.add_argument("--blocks-per-worker", type=int, default=100_000, help="KV blocks each worker holds")
    p.add_argument("--shared-fraction", type=float, default=0.5,
                   help="share of each worker's blocks taken from the trace's common prefixes")
    p.add_argument("--decisions", type=int, default=2000, help="routing decisions timed per fleet size")
    p.add_argument("--churn-events", type=int, default=100_000, help="events in the one-block churn stream")
    p.add_argument("--churn-blocks", type=int, default=2_000_000,
                   help="blocks in the trace-size churn stream (its events carry ~500 blocks each)")
    p.add_argument("--batch", type=int, default=1000, help="stream entries per apply_entries call (poll's count)")
    p.add_argument("--tokenize", type=int, default=50, help="8k-prompt tokenize+hash repetitions (0: skip)")
    p.add_argument("--index", choices=("bitset", "reference"), default="bitset",
                   help="prefix index: the bitset one the router runs, or the plain reference")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace whose common prefixes shape the fleet")
    p.add_argument("--seed", type=int, default=0, help="seed of the fleet and the churn")
    harness.add_common_args(p, repeats=None)
    args = p.parse_args(argv)
    run_info = harness.Run(args, __file__, argv)
    try:
        sizes = [int(s) for s in args.workers.split(",") if s.strip()]
    except ValueError:
        p.error(f"--workers takes comma-separated integers, got {args.workers!r}")
    if not sizes or min(sizes) < 1:
        p.error("--workers: every fleet size must be >= 1")
    if args.blocks_per_worker < PROMPT_TOKENS // BLOCK:
        p.error(f"--blocks-per-worker must be >= {PROMPT_TOKENS // BLOCK}")
    if not 0.0 <= args.shared_fraction < 1.0:
        p.error("--shared-fraction must be in [0, 1)")
    if min(args.decisions, args.churn_events, args.churn_blocks) < 2:
        p.error("--decisions, --churn-events and --churn-blocks must be >= 2")
    if args.batch < 1:
        p.error("--batch must be >= 1")
    if not args.trace.is_file():
        p.error(f"trace not found: {args.trace}")
    started = time.perf_counter()
    load0 = os.getloadavg()
    trace = common_prefixes(load_records(args.trace))
    out: dict = {"block_size": BLOCK, "prompt_tokens": PROMPT_TOKENS, "shared_fraction": args.shared_fraction,
                 "loadavg_start": [round(x, 2) for x in load0], "runs": []}
    if args.tokenize:
        out["prompt"] = tokenize_and_hash(args.tokenize)
        print(f"8k prompt: tokenize p50 {out['prompt']['tokenize_p50_ms']:.2f} ms, "
              f"hash p50 {out['prompt']['hash_p50_ms']:.2f} ms ({out['prompt']['prompt_tokens']} tokens)", flush=True)
    print(f"{'workers':>7s} {'blocks/w':>9s} {'dec p50':>8s} {'dec p99':>8s} {'cpu p99':>8s} {'match p50':>9s}"
          f" {'policy p50':>10s} {'B/pair':>7s}"
          f" {'events/s':>9s} {'blocks/s':>10s} {'ev/s 1blk':>10s} {'(per-event)':>11s}"
          f" {'resync warm/cold ms':>20s}", flush=True)
    for n in sizes:
        r = run_one(n, args.blocks_per_worker, args, trace)
        out["runs"].append(r)
        print(f"{n:7d} {args.blocks_per_worker:9d} {r['decision_p50_ms']:8.3f} {r['decision_p99_ms']:8.3f}"
              f" {r['decision_cpu_p99_ms']:8.3f} {r['match_p50_ms']:9.3f} {r['policy_p50_ms']:10.3f}"
              f" {r['bytes_per_block']:7.1f} {r['events_per_s']:9d}"
              f" {r['blocks_per_s']:10d} {r['events_per_s_1block']:10d} {r['events_per_s_1block_reference']:11d}"
              f" {r['resync_warm_ms']:9.1f}/{r['resync_cold_ms']:.1f}", flush=True)
        print(f"        full gc collection {r['gc_full_ms']:.1f} ms, {r['gc_full_frozen_ms']:.1f} ms with the index "
              f"frozen (CPU {r['gc_full_cpu_ms']:.1f} / {r['gc_full_frozen_cpu_ms']:.1f} ms)", flush=True)
        gc.unfreeze()
        gc.collect()
        run_info.write(out, kernels={})   # after every run: a long run interrupted keeps what it measured
    out["elapsed_s"] = round(time.perf_counter() - started, 1)
    out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"elapsed {out['elapsed_s']} s; load average {out['loadavg_start']} -> {out['loadavg_end']}")
    run_info.write(out, kernels={})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

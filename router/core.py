"""One router replica's view of the cluster, and the routing decision.

``RouterCore`` keeps, all rebuilt from Redis (contract 3): the live workers and their load
reports (refreshed every ``refresh_interval_s``), and the global ``PrefixIndex`` fed by the
``KVEventConsumer``. Its own in-flight counts are transient and per replica (the workers'
load reports cover the other replicas' traffic). ``choose`` hashes the prompt (contract 1,
``engine.hashing``), matches it against the index plus the tentative entries of prompts any
replica dispatched and no worker has reported yet (``TentativeIndex``, short-TTL Redis keys),
and asks the routing policy. ``dispatched`` records the new tentative entries; ``completed``
shortens them (the worker's ``stored`` events are due) or, for a failed request, drops them.
For a policy with a fleet view (``agentrt``) the replica keeps ``fleet``, every live worker's load state,
in step with the live set, the load reports and its own in-flight counts, and a decision reads it
(``select_fleet``) instead of building a ``WorkerState`` per worker; a retry that excludes workers takes
the full path.
``affinity`` (``AffinityMap``) keeps, in Redis, the worker of each conversation its client names
by an affinity key; ``RemoteEngine`` reads and writes it. ``decision_log`` (``router/decisions.py``)
keeps the last decisions with their kind (prefix, load, affinity, failover) for the dashboard.

Workers of kind vllm (``--vllm-worker``: vLLM, SGLang, or an agentrt worker publishing vLLM-format
events) are not in Redis: ``vllm`` (``VllmWorkers``, ``router/openai_worker.py``) follows their KV
events into the same index and probes their health; the live ones join ``workers`` at each refresh,
and one that comes back has its entries refilled from what its follower knows.

A dead worker (heartbeat expired, or a failed connection reported through ``mark_dead``)
leaves the live set at once; its index entries are dropped. When it comes back it
registers again and its publisher's opening ``cleared`` event resets its entries. If Redis
is unreachable the replica keeps routing on the last worker list it read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from agentrt.core.tasks import cancel_and_wait, in_background
from engine.hashing import block_hashes, make_seed
from router.affinity import AffinityMap
from router.config import RouterConfig
from router.decisions import DecisionLog
from router.event_consumer import KVEventConsumer
from router.index import PrefixIndex, lengths
from router.inflight import InFlightTracker
from router.move_cost import MoveEstimate, plan_move
from router.policy import NoWorkerAvailable, RouteDecision, RouteRequest, WorkerState, make_policy
from router.registry import LoadReport, WorkerInfo, WorkerRegistry
from router.tentative import TentativeIndex

log = logging.getLogger("router.core")
LAST_URLS_KEPT = 4096   # workers whose last URL a replica keeps for KV lease calls (RouterCore.last_urls)
_NO_LOAD = LoadReport()


def redis_client(url: str) -> aioredis.Redis:
    """A client that survives a Redis restart: a command on a connection that broke is retried on a
    fresh one (with a short backoff) instead of failing the request."""
    # A blocking pool: past max_connections a command waits up to 10 s for a free connection instead of
    # failing with "Too many connections" (redis-py's default pool holds 100, which 200 concurrent
    # sessions exhaust: 503s and turn locks left to expire).
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=1024, timeout=10, socket_timeout=5.0, socket_connect_timeout=2.0,
        health_check_interval=5, retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 4),
        retry_on_error=[RedisConnectionError, RedisTimeoutError])
    client = aioredis.Redis(connection_pool=pool)
    client.auto_close_connection_pool = True  # aclose() closes the pool too, as with from_url
    return client


def retry_for(seconds: float) -> Retry:
    """Retries of a Redis call for about ``seconds`` (backoff 0.05 s doubling to 1 s), on any Redis or
    socket error: for clean-ups that must not be lost to a transient failure (a withdrawn admission,
    a turn lock), bounded by how long what they clean up would last anyway."""
    return Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=max(1, int(seconds) + 5),
                 supported_errors=(aioredis.RedisError, OSError))


@dataclass(frozen=True)
class Route:
    """A routing decision with everything needed to dispatch and account for it."""

    worker: WorkerInfo
    request: RouteRequest
    decision: RouteDecision
    known_blocks: int = 0  # prompt blocks the real index (not tentative entries) says the worker holds
    excluded: frozenset[str] = frozenset()  # workers an earlier attempt of this request failed on
    cache_salt: str = ""
    # the workers the policy weighed, as it saw them: every candidate on the full path; on the fleet view
    # each group's best, the session's last worker and the chosen one
    candidates: tuple[WorkerState, ...] = ()

    @property
    def tentative_hashes(self) -> tuple[int, ...]:
        """The prompt blocks this dispatch makes the worker hold that no KV event reported yet."""
        return self.request.hashes[self.known_blocks:]

    @property
    def uncached_tokens(self) -> int:
        return max(0, self.request.num_tokens - self.decision.cached_blocks * self.request.block_size)


class RouterCore:
    def __init__(self, config: RouterConfig, model_id: str, refresh_interval_s: float = 0.5,
                 decode_token_weight: float = 10.0) -> None:
        self.config = config
        self.model_id = model_id
        self.refresh_interval_s = refresh_interval_s
        self.redis = redis_client(config.redis_url)
        self.registry = WorkerRegistry(self.redis, config)
        self.index = PrefixIndex()
        self.tentative = TentativeIndex(self.redis, config)
        self.affinity = AffinityMap(self.redis, config)
        self.consumer = KVEventConsumer(self.redis, config, self.index, on_blocks=self.tentative.confirmed)
        self.vllm = None
        if config.vllm_workers:
            from router.openai_worker import VllmWorkers

            self.vllm = VllmWorkers(config, model_id, self.index, on_blocks=self.tentative.confirmed)
        self.policy = make_policy(config.policy, **config.policy_options)
        # The live workers' load states, kept as loads, dispatches and completions change them, for a
        # policy that decides without a ``WorkerState`` per worker per decision (None: it needs them).
        self.fleet = self.policy.new_fleet()
        self.inflight = InFlightTracker(decode_token_weight)
        self.workers: dict[str, WorkerInfo] = {}
        # The URL of the workers this replica has seen live, the LAST_URLS_KEPT latest: a KV lease call to one
        # it has since marked dead (a failed connection under load, or a restart it has not seen yet) still
        # goes out there.
        self.last_urls: OrderedDict[str, str] = OrderedDict()
        self.loads: dict[str, LoadReport] = {}
        self.decisions: dict[str, int] = {}  # reason -> count, for /router/state
        self.decision_log = DecisionLog()  # the last decisions and their kinds, for the dashboard
        self.tentative_routes = 0  # decisions where tentative entries lengthened the chosen worker's match
        # KV moves (kv_move): decisions by choice, and the sums of their estimates
        self.moves = {"pull": 0, "recompute": 0, "est_pull_s": 0.0, "est_recompute_s": 0.0, "pulled_tokens": 0}
        self._seeds: dict[str, bytes] = {}
        self._task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        # worker id -> when this replica's last mark_dead reached Redis (inf: still on its way; later than now:
        # it could not reach Redis, and refreshes keep the worker out until its heartbeat key has expired)
        self._marked_dead: dict[str, float] = {}
        self._frozen_sets = 0  # the index's per-worker sets made when the collector last froze

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Read the live workers and their snapshots, then follow events and registrations."""
        if self.vllm is not None:
            await self.vllm.start()
        try:
            await self.refresh(resync_joined=False)  # bootstrap loads every snapshot
            await self.consumer.bootstrap([w for w in self.workers if self.vllm is None or w not in self.vllm])
        except (aioredis.RedisError, OSError) as exc:
            log.warning("Redis unreachable at start (%s); the router retries in the background", exc)
        self.consumer.start()
        self.freeze_index()
        self._task = asyncio.create_task(self._refresh_forever(), name="router-refresh")

    def freeze_index(self) -> None:
        """Keep the index's per-worker sets out of the garbage collector's full collections, once made.

        Those sets hold every (worker, block) pair as plain ints, which can form no cycle; but a full
        collection still walks every entry (12.8M at 128 workers x 100k blocks: 0.5-0.8 s, a stall of every
        request in flight). ``gc.freeze()`` moves what is alive into the permanent generation, which
        collections skip; the sets keep changing there as usual. It runs after start and whenever the
        index made a set (a new worker's slot), after a collection, so no garbage is frozen; objects
        alive then that later become cyclic garbage are never collected (a few per worker joining)."""
        if self.index.sets_made == self._frozen_sets:
            return
        gc.collect()  # cheap: what an earlier freeze moved out is not walked
        gc.freeze()
        self._frozen_sets = self.index.sets_made

    async def stop(self) -> None:
        await cancel_and_wait(self._task)   # the refresh loop: a cancel redis-py swallowed would leave it polling on
        await self.consumer.stop()
        if self.vllm is not None:
            await self.vllm.stop()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.redis.aclose()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            try:
                await self.refresh()
            except (aioredis.RedisError, OSError) as exc:
                log.warning("cannot read workers from Redis (%s); routing on the last known list", exc)

    async def refresh(self, resync_joined: bool = True) -> None:
        """Re-read the live workers and their loads. A worker that (re)joined and whose events this
        router does not follow is loaded from its snapshot at once: one that was only unreachable
        for a while (hung, partitioned) comes back with its cache, and may publish no event for a
        long time (its sessions' prefixes are already cached), so waiting for one would leave its
        index empty and steer its sessions elsewhere."""
        started = time.monotonic()
        live = {w.worker_id: w for w in await self.registry.live_workers()}
        # A worker marked dead while this read was on its way may still be in it: keep it out, or this
        # refresh would route to it again until the next one (and each failed request marks it again).
        for wid in [wid for wid in live if self._marked_dead.get(wid, -1.0) >= started]:
            del live[wid]
        if self.vllm is not None:
            for wid, info in self.vllm.live().items():
                if wid in live:
                    log.warning("worker id %s is both in Redis and a --vllm-worker; routing to the latter", wid)
                live[wid] = info
                if wid not in self.workers:  # (re)joined: its entries from what its events told us
                    self.index.replace_worker(wid, self.vllm.held(wid))
        for wid in set(self.workers) - set(live):
            log.info("worker %s left (heartbeat expired or unregistered)", wid)
            self._forget(wid)
        wrong = {wid for wid, info in live.items() if info.model != self.model_id}
        for wid in wrong:
            log.warning("worker %s serves %r, this router %r: not routing to it", wid, live.pop(wid).model,
                        self.model_id)
        joined = [wid for wid in live if not self.consumer.has_baseline(wid)  # retried until a resync lands
                  and (self.vllm is None or wid not in self.vllm)]
        self.workers = live
        for wid, info in live.items():
            self.last_urls[wid] = info.url
            self.last_urls.move_to_end(wid)
        while len(self.last_urls) > LAST_URLS_KEPT:   # workers that left long ago (a fleet whose ids churn)
            self.last_urls.popitem(last=False)
        self._sync_fleet()
        self.loads = await self.registry.loads([wid for wid in live if self.vllm is None or wid not in self.vllm])
        self._sync_fleet()
        if resync_joined:
            for wid in joined:
                await self.consumer.resync(wid)
        self.freeze_index()

    def _forget(self, worker_id: str) -> None:
        self.consumer.forget_worker(worker_id)
        self.inflight.forget(worker_id)
        self.tentative.forget_worker(worker_id)
        self.policy.on_worker_removed(worker_id)
        self.workers.pop(worker_id, None)
        self.loads.pop(worker_id, None)
        self._sync_worker(worker_id)

    def _queue(self, worker_id: str, load: LoadReport) -> tuple[int, int]:
        """The report's (running, waiting) less this replica's requests it counts that have ended since it
        was taken (``InFlightTracker.ended_since``), taken off the waiting ones first: a report trails its
        worker by up to a heartbeat and a refresh, and would otherwise price the worker for a turn it has
        finished (seen: the holder of a 67-token prompt charged 410 tokens of queue, and passed over)."""
        ended = self.inflight.ended_since(worker_id, load.ts_ms / 1000) if load.ts_ms else 0
        off_waiting = min(ended, load.waiting)
        return max(0, load.running - (ended - off_waiting)), load.waiting - off_waiting

    def _state(self, worker_id: str) -> WorkerState:
        """The worker's load state as the policy sees it (no request-specific part)."""
        load = self.loads.get(worker_id, _NO_LOAD)
        running, waiting = self._queue(worker_id, load)
        return WorkerState(worker_id, 0, running, waiting, load.pages_used, load.pages_free,
                           self.inflight.count(worker_id), self.inflight.tokens(worker_id))

    def _sync_worker(self, worker_id: str | None) -> None:
        """The fleet view of one worker after its load, in-flight work or liveness changed."""
        if self.fleet is None or worker_id is None:
            return
        if worker_id in self.workers:
            self.fleet.update(self._state(worker_id))
        else:
            self.fleet.remove(worker_id)

    def _sync_fleet(self) -> None:
        """The fleet view of every worker (after a refresh: the live set and their load reports)."""
        if self.fleet is None:
            return
        for wid in [wid for wid in self.fleet if wid not in self.workers]:
            self.fleet.remove(wid)
        for wid in self.workers:
            self.fleet.update(self._state(wid))

    async def mark_dead(self, worker_id: str, wait: bool = True) -> None:
        """A connection to the worker failed: route around it now, and tell the other replicas.

        ``wait=False`` (a request failing over) returns once this replica routes around it; the mark
        reaches Redis in the background (with Redis down, redis-py's retries would otherwise hold
        the failing-over request up), and ``stop`` waits for it."""
        log.warning("worker %s unreachable: marked dead", worker_id)
        self._marked_dead[worker_id] = math.inf  # a refresh reading Redis meanwhile may still find it live
        self._forget(worker_id)
        if self.vllm is not None and worker_id in self.vllm:  # not in Redis: live again once a probe succeeds
            self.vllm.mark_dead(worker_id)
            self._marked_dead[worker_id] = time.monotonic()
            return
        task = in_background(self._background, self._mark_dead_in_redis(worker_id))
        if wait:
            await asyncio.shield(task)

    async def _mark_dead_in_redis(self, worker_id: str) -> None:
        kept_out_s = 0.0
        try:
            await self.registry.mark_dead(worker_id)
        except (aioredis.RedisError, OSError) as exc:
            # Its heartbeat key is still there: refreshes would read it live again until it expires. Keep it
            # out for one TTL; by then the key is gone (it died) or newer than this mark (it heartbeats again).
            log.warning("could not mark %s dead in Redis: %s", worker_id, exc)
            kept_out_s = self.config.heartbeat_ttl_s
        finally:  # refreshes that start reading from now on (plus kept_out_s) do not find it live
            self._marked_dead[worker_id] = time.monotonic() + kept_out_s

    # ------------------------------------------------------------ routing

    def hashes(self, prompt_ids: list[int], cache_salt: str = "") -> list[int]:
        seed = self._seeds.get(cache_salt)
        if seed is None:
            seed = self._seeds[cache_salt] = make_seed(self.model_id, cache_salt)
        return block_hashes(prompt_ids, self.config.block_size, seed)

    async def choose(self, request_id: str, prompt_ids: list[int], est_output_tokens: int, *,
                     session_id: str | None = None, last_worker: str | None = None,
                     exclude: frozenset[str] = frozenset(), cache_salt: str = "") -> Route:
        """The policy's pick among live workers not in ``exclude``; ``NoWorkerAvailable`` if none.

        A worker's cached prefix counts the blocks its KV events reported and the blocks
        tentatively sent to it (dispatched by any replica, not yet reported)."""
        candidates = [w for wid, w in self.workers.items() if wid not in exclude]
        if not candidates:
            raise NoWorkerAvailable("no live worker to route to" + (
                f" ({len(exclude)} failed for this request)" if exclude else ""))
        req = RouteRequest(request_id, tuple(self.hashes(prompt_ids, cache_salt)), len(prompt_ids),
                           self.config.block_size, session_id, last_worker, est_output_tokens)
        shared = await self.tentative.lookup_shared(req.hashes)
        # From here to the end of ``dispatched`` nothing awaits: concurrent requests see each other's
        # decisions (in-flight work, tentative entries, the policy's own state) in order.
        candidates = [w for w in candidates if w.worker_id in self.workers]  # one may have died meanwhile
        if not candidates:
            raise NoWorkerAvailable("no live worker to route to")
        tentative = self.tentative.holders(req.hashes, shared)
        if self.fleet is not None and not exclude and len(self.fleet) == len(self.workers):
            return self._choose_fleet(req, tentative, exclude, cache_salt)
        return self._choose_all(req, candidates, tentative, exclude, cache_salt)

    def _choose_all(self, req: RouteRequest, candidates: list[WorkerInfo], tentative: dict[int, set[str]],
                    exclude: frozenset[str], cache_salt: str) -> Route:
        """``choose`` with a ``WorkerState`` per candidate and the policy's ``select``: for a policy with
        no fleet view, and for a retry (``exclude``: the fleet view holds every live worker)."""
        known = self.index.match(req.hashes)
        matched = self.index.match(req.hashes, extra=tentative) if tentative else known
        if tentative:  # the policy prices load by whether the best match is known or only tentative
            req = dataclasses.replace(req, known_blocks=max(known.values(), default=0))
        states = []
        for w in candidates:
            load = self.loads.get(w.worker_id, _NO_LOAD)
            running, waiting = self._queue(w.worker_id, load)
            tiers = self.index.tier_blocks(w.worker_id, req.hashes[:known.get(w.worker_id, 0)])
            states.append(WorkerState(w.worker_id, matched.get(w.worker_id, 0), running, waiting,
                                      load.pages_used, load.pages_free, self.inflight.count(w.worker_id),
                                      self.inflight.tokens(w.worker_id), tiers.get("host", 0),
                                      tiers.get("disk", 0)))
        decision = self.policy.select(req, states)
        wid = decision.worker_id
        if matched.get(wid, 0) > known.get(wid, 0):
            self.tentative_routes += 1
        return Route(self.workers[wid], req, decision, known.get(wid, 0), exclude, cache_salt, tuple(states))

    def _choose_fleet(self, req: RouteRequest, tentative: dict[int, set[str]], exclude: frozenset[str],
                      cache_salt: str) -> Route:
        """``choose`` on the kept fleet view: the same decision as a ``WorkerState`` per live worker and
        ``select`` (``RoutingPolicy.select_fleet``), without reading every worker. The index answers by
        groups of equal prefix length; what the index alone (no tentative entries) says a worker holds is
        asked per worker, only where needed: the chosen one, and the workers holding blocks in a KV tier
        (their tier blocks are counted over that prefix, as before)."""
        assert self.fleet is not None
        index, hashes = self.index, req.hashes
        levels = index.match_levels(hashes, extra=tentative or None)
        matched = lengths(levels)
        if tentative:  # the policy prices load by whether the best match is known or only tentative
            known_levels = index.match_levels(hashes)
            req = dataclasses.replace(req, known_blocks=known_levels[-1][0] if known_levels else 0)
        tiers: dict[str, tuple[int, int]] = {}
        for w in index.tiered_workers():
            if matched.get(w, 0) > 0 and w in self.fleet:
                t = index.tier_blocks(w, hashes[:index.prefix_len(w, hashes) if tentative else matched[w]])
                if t:
                    tiers[w] = (t.get("host", 0), t.get("disk", 0))
        decision, weighed = self.policy.select_fleet(req, self.fleet, matched, tiers, levels)
        wid = decision.worker_id
        known = index.prefix_len(wid, hashes) if tentative else matched.get(wid, 0)
        if matched.get(wid, 0) > known:
            self.tentative_routes += 1
        return Route(self.workers[wid], req, decision, known, exclude, cache_salt, tuple(weighed))

    def kv_move(self, route: Route) -> dict | None:
        """When ``route`` sends a turn to a worker that lacks prompt blocks another live agentrt worker holds
        (the index: KV events, any medium), pull or recompute (router/move_cost.py); for a pull, the
        ``kv_source`` the target is told (the holder's URL and how many blocks it holds). None: recompute
        as without moves (off, nothing held elsewhere, too little to gain, or cheaper to recompute)."""
        target, hashes = route.worker.worker_id, route.request.hashes
        if not self.config.kv_moves or not hashes or self._is_vllm(target):
            return None
        held = self.index.match(hashes)
        here = best = held.get(target, 0)
        holder = None
        for wid, n in held.items():
            if n > best and wid in self.workers and not self._is_vllm(wid):
                holder, best = wid, n
        tokens = (best - here) * self.config.block_size
        if holder is None or tokens < max(1, self.config.kv_move_min_tokens):
            return None
        estimate = self._move_estimate(target, holder, tokens)
        if estimate is None:
            return None
        self.moves[estimate.choice] += 1
        self.moves["est_pull_s"] += estimate.pull_s
        self.moves["est_recompute_s"] += estimate.recompute_s
        log.info("turn %s to %s: %s %d tokens held by %s (estimates: pull %.3f s, recompute %.3f s)",
                 route.request.request_id, target, estimate.choice, tokens, holder, estimate.pull_s,
                 estimate.recompute_s)
        if not estimate.pull:
            return None
        self.moves["pulled_tokens"] += tokens
        return {"url": self.workers[holder].url, "worker": holder, "blocks": best}

    def _move_estimate(self, target: str, holder: str, tokens: int) -> MoveEstimate | None:
        """The cost model on the figures the workers measured (the settings' where they have none yet);
        None while neither worker reported its KV bytes per token (an older worker)."""
        cfg = self.config
        load, source = self.loads.get(target, _NO_LOAD), self.loads.get(holder, _NO_LOAD)
        bytes_per_token = load.kv_bytes_per_token or source.kv_bytes_per_token
        if not bytes_per_token:
            return None
        return plan_move(tokens, bytes_per_token, load.kv_pull_bytes_per_s or cfg.kv_move_bandwidth_bytes_s,
                         load.prefill_tokens_per_s or cfg.kv_move_prefill_tokens_s, cfg.kv_move_overhead_s)

    def _is_vllm(self, worker_id: str) -> bool:
        return self.vllm is not None and worker_id in self.vllm

    async def dispatched(self, route: Route) -> None:
        """The request goes to ``route.worker`` now: count it in flight and record its prompt as tentative
        (here at once, before any await, so the next decision sees it; then in Redis for other replicas).
        Call it right after ``choose``, with no await in between."""
        self.tentative.record_local(route.worker.worker_id, route.tentative_hashes)
        self.policy.on_dispatch(route.request, route.decision)
        before = self.inflight.worker_of(route.request.request_id)  # a repeated id leaves that worker
        self.inflight.dispatched(route.request.request_id, route.worker.worker_id, route.uncached_tokens,
                                 route.request.est_output_tokens)
        if before != route.worker.worker_id:
            self._sync_worker(before)
        self._sync_worker(route.worker.worker_id)
        self.decisions[route.decision.reason] = self.decisions.get(route.decision.reason, 0) + 1
        req = route.request
        self.decision_log.record(req.request_id, req.session_id, len(req.hashes), route.worker.worker_id,
                                 route.decision.cached_blocks, route.decision.reason, route.excluded,
                                 route.cache_salt)
        await self.tentative.publish(route.worker.worker_id, route.tentative_hashes)

    def completed(self, route: Route, ok: bool = True) -> None:
        """The request ended: finished (``ok``: its KV events are due) or failed (drop its tentative entries)."""
        on = self.inflight.worker_of(route.request.request_id)
        self.inflight.completed(route.request.request_id)
        self._sync_worker(on)
        self.policy.on_complete(route.request, route.worker.worker_id)
        end = self.tentative.completed if ok else self.tentative.failed
        in_background(self._background, end(route.worker.worker_id, route.tentative_hashes))

    def state(self) -> dict:
        """This replica's view, for ``GET /router/state`` and ``agentrt status``."""
        now_ms = int(time.time() * 1000)
        stats = self.consumer.stats
        return {
            "model": self.model_id, "policy": self.policy.name, "decisions": dict(self.decisions),
            "index_blocks": len(self.index),
            "kv_moves": dict(self.moves),
            "tentative": {"local_blocks": len(self.tentative), "routes": self.tentative_routes,
                          "recorded": self.tentative.stats.recorded, "confirmed": self.tentative.stats.confirmed,
                          "failed": self.tentative.stats.failed, "redis_errors": self.tentative.stats.redis_errors},
            "affinity": {"hits": self.affinity.stats.hits, "misses": self.affinity.stats.misses,
                         "moved": self.affinity.stats.moved, "redis_errors": self.affinity.stats.redis_errors},
            "events": {"applied": stats.applied, "malformed": stats.malformed, "skipped": stats.skipped,
                       "gaps": stats.gaps, "resyncs": stats.resyncs, "per_kind": dict(stats.per_kind),
                       "last_id": stats.last_id},
            "workers": [{"id": wid, "url": w.url, "indexed_blocks": self.index.blocks_of(wid),
                         "indexed_blocks_by_medium": self.index.blocks_by_medium(wid),
                         "in_flight": self.inflight.count(wid),
                         "load": None if (l := self.loads.get(wid)) is None else
                         {"running": l.running, "waiting": l.waiting, "waiting_tokens": l.waiting_tokens,
                          "waiting_new": l.waiting_new, "waiting_high": l.waiting_high, "pages_used": l.pages_used,
                          "pages_free": l.pages_free, "age_ms": max(0, now_ms - l.ts_ms) if l.ts_ms else None,
                          # of its running + waiting, how many ended since (and are not priced: _queue)
                          "ended_since_report": l.running + l.waiting - sum(self._queue(wid, l))}}
                        for wid, w in sorted(self.workers.items())],
            "vllm_workers": [] if self.vllm is None else self.vllm.state(),
        }

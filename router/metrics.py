"""The router's own Prometheus metrics, read from ``RouterCore`` and ``RemoteEngine`` at scrape time.

A router is not a model server: its ``/metrics`` carries agentrt's HTTP metrics (request counts,
TTFT and TPOT as the router sees them, sessions; ``agentrt/metrics.py``) and this replica's view of
the fleet and its decisions, under ``agentrt_router_*``: live workers, each worker's last
heartbeat load and this replica's requests in flight on it, routing decisions by the policy rule
that made them, failovers, KV events by outcome, prefix-affinity lookups. It does not repeat the
workers' engine metrics (``agentrt_engine_*``, ``agentrt_kv_*``) or the model server protocol's
gauges: Prometheus scrapes those from each worker, and a router repeating them would make every
sum over the deployment count them twice.
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from router.core import RouterCore


class RouterCollector:
    """``agentrt_router_*`` from one replica's ``RouterCore`` (and its engine's failover count)."""

    def __init__(self, core: RouterCore, remote: Any) -> None:
        self.core = core
        self.remote = remote

    def collect(self) -> Iterable[Any]:
        yield from self._fleet()
        yield from self._routing()
        yield from self._kv()

    def _fleet(self) -> Iterable[Any]:
        """The workers this replica sees and what its index and their heartbeats say of each."""
        core = self.core
        workers = sorted(core.workers)
        yield GaugeMetricFamily("agentrt_router_workers_live",
                                "Workers alive in this router's view (registered, heartbeat not expired), now",
                                value=len(workers))
        yield GaugeMetricFamily("agentrt_router_index_blocks",
                                "Prefix blocks (block hashes) in this router's global prefix index, over all "
                                "workers, now", value=len(core.index))
        per_worker = (
            ("agentrt_router_worker_indexed_blocks",
             "Prefix blocks this router's index holds for each live worker (from its KV events), now",
             lambda wid, load: core.index.blocks_of(wid)),
            ("agentrt_router_worker_in_flight", "Requests this router replica has in flight on each worker, now",
             lambda wid, load: core.inflight.count(wid)),
            ("agentrt_router_worker_running",
             "Requests in each worker's running batch, as of its last heartbeat", lambda wid, load: load.running),
            ("agentrt_router_worker_waiting",
             "Requests queued for admission on each worker, as of its last heartbeat", lambda wid, load: load.waiting),
            ("agentrt_router_worker_kv_pages_used",
             "KV cache pages allocated on each worker (running requests and cached prefixes), as of its last "
             "heartbeat", lambda wid, load: load.pages_used),
            ("agentrt_router_worker_kv_pages_free",
             "KV cache pages free on each worker, as of its last heartbeat", lambda wid, load: load.pages_free))
        for name, doc, read in per_worker:
            family = GaugeMetricFamily(name, doc, labels=["worker"])
            for wid in workers:
                load = core.loads.get(wid)
                if load is not None or name in ("agentrt_router_worker_in_flight", "agentrt_router_worker_indexed_blocks"):
                    family.add_metric([wid], read(wid, load))
            yield family

    def _routing(self) -> Iterable[Any]:
        """This replica's routing decisions, failovers, tentative routes and affinity lookups."""
        core = self.core
        decisions = CounterMetricFamily("agentrt_router_decisions",
                                        "Routing decisions this replica made, by the policy rule that chose the "
                                        "worker (reason)", labels=["reason"])
        for reason, n in sorted(core.decisions.items()):
            decisions.add_metric([reason], n)
        yield decisions
        yield CounterMetricFamily("agentrt_router_failovers",
                                  "Requests re-sent to another worker after their worker failed, hung or was "
                                  "draining before producing output", value=self.remote.failovers)
        yield CounterMetricFamily("agentrt_router_tentative_routes",
                                  "Routing decisions where prefixes dispatched but not yet reported by KV events "
                                  "lengthened the chosen worker's match", value=core.tentative_routes)
        affinity = core.affinity.stats
        lookups = CounterMetricFamily("agentrt_router_affinity_lookups",
                                      "Affinity-key lookups of a conversation's last worker, by outcome (hit: found, "
                                      "miss: new or expired)", labels=["outcome"])
        lookups.add_metric(["hit"], affinity.hits)
        lookups.add_metric(["miss"], affinity.misses)
        yield lookups
        yield CounterMetricFamily("agentrt_router_affinity_moves",
                                  "Requests of an affinity-keyed conversation sent to another worker than its "
                                  "recorded one", value=affinity.moved)

    def _kv(self) -> Iterable[Any]:
        """KV events read into the index, and the KV-move decisions."""
        core = self.core
        stats = core.consumer.stats
        events = CounterMetricFamily("agentrt_router_kv_events",
                                     "KV events read from the workers' stream, by outcome: applied to the index, "
                                     "malformed (undecodable, dropped) or skipped (stale or already in a snapshot)",
                                     labels=["outcome"])
        for outcome, n in (("applied", stats.applied), ("malformed", stats.malformed), ("skipped", stats.skipped)):
            events.add_metric([outcome], n)
        yield events
        yield CounterMetricFamily("agentrt_router_kv_event_gaps",
                                  "Gaps in a worker's KV event sequence numbers this replica saw (each triggers a "
                                  "resync)", value=stats.gaps)
        yield CounterMetricFamily("agentrt_router_kv_resyncs",
                                  "Resyncs of a worker's index entries from its snapshot in Redis", value=stats.resyncs)
        moves = CounterMetricFamily("agentrt_router_kv_move_decisions",
                                    "Turns routed away from a worker holding more of their prefix, by what the cost "
                                    "model chose: pull the KV from that worker, or recompute it", labels=["choice"])
        for choice in ("pull", "recompute"):
            moves.add_metric([choice], core.moves[choice])
        yield moves
        estimates = CounterMetricFamily("agentrt_router_kv_move_estimate_seconds",
                                        "Sums of the cost model's estimates over those decisions, by side (pull: the "
                                        "transfer, recompute: the prefill)", labels=["side"])
        estimates.add_metric(["pull"], core.moves["est_pull_s"])
        estimates.add_metric(["recompute"], core.moves["est_recompute_s"])
        yield estimates
        yield CounterMetricFamily("agentrt_router_kv_move_pulled_tokens",
                                  "Prompt tokens whose KV targets were told to pull instead of recomputing",
                                  value=core.moves["pulled_tokens"])

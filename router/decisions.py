"""The last routing decisions of one router replica, each with why its worker was chosen.

Every policy names its rule in ``RouteDecision.reason`` (agentrt's ``prefix``, ``cost``,
``spill``, ``fallback``, ``affinity``; SGLang-like ``cache``, ``balance``, ``smallest_tree``;
...). For a person reading the dashboard these fold into four kinds, :func:`classify`:

* ``failover``: the request's earlier attempt failed on another worker (connection refused or
  reset, hung, draining) and this one went elsewhere, whatever the policy's rule then was;
* ``affinity``: the session's (or affinity key's) last worker was kept (agentrt ``affinity``,
  ``session_hash``);
* ``prefix``: the worker was chosen because it holds the longest cached prefix of the prompt
  (agentrt ``prefix``, SGLang-like ``cache``);
* ``load``: anything chosen for load or spread rather than cache: agentrt ``cost`` (a worker with
  less of the prefix but enough less load), ``spill`` (the prefix's holder was overloaded) and
  ``fallback`` (no worker held a useful prefix: least loaded), ``least_load``, ``round_robin``,
  ``balance``, ``smallest_tree``, ``no_key``. A rule this module does not know is ``load`` too.

The policy's own rule travels with the kind (``rule``), so nothing is lost. :class:`DecisionLog`
is a bounded ring (``maxlen`` decisions, oldest dropped) that ``RouterCore.dispatched`` appends to;
it is per replica and transient, like the in-flight counts (contract 3: nothing another replica
needs to rebuild).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

KINDS = ("prefix", "load", "affinity", "failover")

_RULE_KIND = {
    "prefix": "prefix", "cache": "prefix",
    "affinity": "affinity", "session_hash": "affinity",
    "cost": "load", "spill": "load", "fallback": "load", "least_load": "load", "round_robin": "load",
    "balance": "load", "smallest_tree": "load", "no_key": "load",
}


def classify(rule: str, failed_over: bool) -> str:
    """The kind (one of :data:`KINDS`) of a decision by policy rule ``rule``; ``failed_over``: an
    earlier attempt of the same request failed on another worker."""
    if failed_over:
        return "failover"
    return _RULE_KIND.get(rule, "load")


@dataclass(frozen=True)
class DecisionRecord:
    """One routing decision. ``ts``: epoch seconds; ``session``: the session id or affinity-key digest
    (None for a one-off request); ``prompt_blocks``: the prompt's full blocks; ``matched_blocks``: those
    the chosen worker was believed to hold (its prefix-index match, tentative entries included);
    ``failed``: workers an earlier attempt of this request failed on; ``cache_salt``: whose cache the
    prompt was hashed in (a tenant's, or ``""`` shared), for scoping what each tenant may see."""

    ts: float
    request_id: str
    session: str | None
    prompt_blocks: int
    worker: str
    matched_blocks: int
    kind: str
    rule: str
    failed: tuple[str, ...]
    cache_salt: str = ""

    def as_json(self) -> dict:
        d = asdict(self)
        d["failed"] = list(self.failed)
        del d["cache_salt"]
        return d


class DecisionLog:
    """The last ``maxlen`` decisions, and how many of each kind since the replica started."""

    def __init__(self, maxlen: int = 200) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        self._ring: deque[DecisionRecord] = deque(maxlen=maxlen)
        self.counts: dict[str, int] = {k: 0 for k in KINDS}
        self._lock = threading.Lock()

    def record(self, request_id: str, session: str | None, prompt_blocks: int, worker: str, matched_blocks: int,
               rule: str, failed: frozenset[str] | set[str] = frozenset(), cache_salt: str = "",
               ts: float | None = None) -> DecisionRecord:
        kind = classify(rule, bool(failed))
        rec = DecisionRecord(time.time() if ts is None else ts, request_id, session, prompt_blocks, worker,
                             matched_blocks, kind, rule, tuple(sorted(failed)), cache_salt)
        with self._lock:
            self._ring.append(rec)
            self.counts[kind] += 1
        return rec

    def recent(self, limit: int | None = None, cache_salts: frozenset[str] | None = None) -> list[DecisionRecord]:
        """Newest first, at most ``limit``; only those hashed in one of ``cache_salts`` when given."""
        with self._lock:
            records = list(self._ring)
        records.reverse()
        if cache_salts is not None:
            records = [r for r in records if r.cache_salt in cache_salts]
        return records[:limit]

    def __len__(self) -> int:
        return len(self._ring)

"""Session-level priority: the order in which the scheduler admits waiting requests and preempts running ones.

An agent is done when its last turn is done, so under overload the engine should finish sessions rather
than serve requests in arrival order (Autellix: least attained service per program). With
``scheduling_policy="session"`` (``EngineConfig``) requests are ordered by the key

    (priority, tenant share, started, effective attained service, arrival)        least first

- ``priority``: the request's explicit ``SamplingParams.priority`` (vLLM's name and meaning: lower is
  earlier, default 0). It is strict, as vLLM's priority scheduling is: aging works within one value.
- tenant share: the tokens the engine computed for the request's tenant recently (an exponentially
  decayed sum, half-life ``TENANT_HALF_LIFE_S``) divided by the tenant's weight (``SchedulingKey.weight``).
  The tenant furthest below its weighted share goes first, so tenants share the engine by weight however
  many sessions each runs (hierarchical fair queueing). With one tenant it is the same for every request.
- started: within a tenant's share, a later turn of a session the engine already served
  (``Request.started``, or its session's tokens in the ledger) goes before a new session's first turn,
  whatever their service. An agent is worth something only when its last turn is done: under overload,
  admitting newcomers ahead of running sessions' later turns delays every session that began, so fewer
  finish in time (agent_overload.py measured least attained service alone, which put new sessions
  first, finishing fewer sessions within their SLO than FCFS). New sessions do not starve: the started
  sessions' queued turns are finite (each session ends, and in a tool pause it queues nothing), and a
  new session is started once admitted.
- effective attained service: the tokens computed so far for the request's session (every turn's prompt
  chunks and output; a request without a session is a session of its own) minus ``aging_tokens_per_s``
  for every second the request has waited since it (re)entered the queue. Least first: among started
  sessions short and young ones overtake long ones, and a long one overtakes them after waiting long
  enough, so nothing starves.
- arrival: ties go to the older request.

Preemption (the pool ran dry) takes victims in the reverse order: the running request with the greatest
key, waiting time not counted. ``fcfs`` is arrival order, a preempted request back at the front: the
engine's behaviour before this module, and the default.

Memory is bounded: the ledger keeps the ``MAX_SESSIONS`` sessions most recently charged and the
``MAX_TENANTS`` tenants most recently charged; a session it forgot counts as new.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable

from engine.types import SchedulingKey

if TYPE_CHECKING:
    from engine.request import Request

FCFS, SESSION = "fcfs", "session"   # engine.config.SCHEDULING_POLICIES
MAX_SESSIONS = 65536
MAX_TENANTS = 4096
TENANT_HALF_LIFE_S = 60.0


class ServiceLedger:
    """Tokens the engine computed per session (LRU-bounded) and, decayed, per tenant.

    Charged by the engine thread after each step; ``started`` is also read by threads that add requests,
    hence the lock (every operation is a dict lookup or two)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS, max_tenants: int = MAX_TENANTS,
                 half_life_s: float = TENANT_HALF_LIFE_S) -> None:
        if max_sessions < 1 or max_tenants < 1 or half_life_s <= 0:
            raise ValueError("a service ledger needs max_sessions >= 1, max_tenants >= 1 and half_life_s > 0")
        self.max_sessions, self.max_tenants, self.half_life_s = max_sessions, max_tenants, half_life_s
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._tenants: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tenant -> (decayed tokens, as of)
        self._lock = threading.Lock()

    def charge(self, key: SchedulingKey, tokens: int, now: float) -> None:
        """``tokens`` were computed for ``key``'s session and tenant at time ``now``."""
        with self._lock:
            if key.session:
                self._sessions[key.session] = self._sessions.pop(key.session, 0) + tokens
                if len(self._sessions) > self.max_sessions:
                    self._sessions.popitem(last=False)
            value = self._decayed(key.tenant, now) + tokens
            self._tenants.pop(key.tenant, None)
            self._tenants[key.tenant] = (value, now)
            if len(self._tenants) > self.max_tenants:
                self._tenants.popitem(last=False)

    def session(self, session: str) -> int:
        """Tokens computed for ``session`` so far (0 for one never charged, or forgotten)."""
        with self._lock:
            return self._sessions.get(session, 0)

    def started(self, session: str) -> bool:
        """Whether the engine has computed tokens for ``session`` (and still remembers it)."""
        with self._lock:
            return bool(session) and session in self._sessions

    def tenant(self, tenant: str, now: float) -> float:
        """The tenant's recent tokens: each charge weighs 2^(-age / half_life_s)."""
        with self._lock:
            return self._decayed(tenant, now)

    def _decayed(self, tenant: str, now: float) -> float:
        value, at = self._tenants.get(tenant, (0.0, now))
        return value * 0.5 ** (max(0.0, now - at) / self.half_life_s)

    def __len__(self) -> int:
        return len(self._sessions)


class SessionOrder:
    """The ``session`` policy's key over requests (see the module docstring); the scheduler sorts by it."""

    def __init__(self, ledger: ServiceLedger, aging_tokens_per_s: float) -> None:
        if aging_tokens_per_s < 0:
            raise ValueError(f"aging_tokens_per_s must be >= 0, got {aging_tokens_per_s}")
        self.ledger = ledger
        self.aging = aging_tokens_per_s

    def attained(self, req: Request) -> int:
        """Tokens computed for the request's session so far (its own, without a session)."""
        return self.ledger.session(req.key.session) if req.key.session else req.service

    def started(self, req: Request) -> bool:
        """Whether the request continues a session the engine already served: so marked when it arrived,
        or its session (its own tokens, without a session) charged since."""
        if req.started:
            return True
        return self.ledger.started(req.key.session) if req.key.session else req.service > 0

    def key(self, req: Request, now: float, waiting: bool = True) -> tuple:
        """Admission order, least first; ``waiting=False`` leaves aging out (running requests, victims)."""
        return self.key_fn(now, waiting)(req)

    def key_fn(self, now: float, waiting: bool = True) -> Callable[[Request], tuple]:
        """``key`` at ``now`` for many requests (a sort): each tenant's share is read once."""
        shares: dict[str, float] = {}

        def key(req: Request) -> tuple:
            tenant = req.key.tenant
            if tenant not in shares:
                shares[tenant] = self.ledger.tenant(tenant, now)
            waited = max(0.0, now - req.queued_at) if waiting else 0.0
            return (req.params.priority, shares[tenant] / req.key.weight, not self.started(req),
                    self.attained(req) - self.aging * waited, req.arrival)

        return key


def charge(ledger: ServiceLedger, req: Request, tokens: int, now: float | None = None) -> None:
    """Credit ``tokens`` computed this step to the request and, through the ledger, its session and tenant."""
    req.service += tokens
    ledger.charge(req.key, tokens, time.monotonic() if now is None else now)


def priority_class(priority: int) -> str:
    """``high`` (< 0), ``normal`` (0) or ``low`` (> 0): the label of the queue-depth metric."""
    return "high" if priority < 0 else "low" if priority > 0 else "normal"

"""Affinity keys: the conversation a sessionless request belongs to, as its client names it.

Agent clients that keep their history themselves still say which conversation a call is part
of: OpenAI's ``prompt_cache_key`` body field, or a header. :func:`affinity_key` reads it, in
this order (the first non-blank value wins; values are stripped of surrounding whitespace):

1. the body's ``prompt_cache_key`` (chat completions, completions, and any API that has it);
2. the headers of :data:`AFFINITY_HEADERS`, in that order: ``x-session-affinity`` (a client or
   proxy asking for affinity by name), ``x-claude-code-session-id``, ``session-id``, ``session_id``.

:func:`affinity_hint` turns a key into the routing hint (``engine.client.SessionHint``) that
``Generator.start_chat``/``start`` pass to the engine client, scoped by tenant: the hint's
session id is a hash of the tenant's name and the key, so two tenants that use the same key
never share a worker through it, and the key itself never reaches Redis or a log. A router
remembers where each such conversation ran (``router/affinity.py``); in one process the hint
is moot.

Such a request is also its conversation's latest turn (``Generator.start``, unless the server
runs with ``--affinity-turns false``): it acquires a KV lease like a session turn
(``agentrt/core/leases.py``), so the engine holds its next step for the agent's return, and the
conversation's next request releases it. That next request finds the lease in ``KVLeases``, this
process's record of each conversation's last leased request; a lease made through another router
replica is not known here and simply expires.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Mapping

from engine.client import SessionHint

from agentrt.core.tenants import Tenant

AFFINITY_HEADERS = ("x-session-affinity", "x-claude-code-session-id", "session-id", "session_id")
"""Request headers that name a conversation, in order of precedence (after the body's key)."""


def affinity_key(headers: Mapping[str, str] | Iterable[tuple[str, str]], body_key: str | None = None) -> str | None:
    """The request's affinity key: ``body_key`` (the body's ``prompt_cache_key``) unless blank, else
    the first non-blank header of :data:`AFFINITY_HEADERS`; ``None`` when there is none. Header
    names match case-insensitively (``headers``: a mapping such as Starlette's ``Headers``, or
    name-value pairs); of a header sent twice, the first value counts."""
    if body_key is not None and body_key.strip():
        return body_key.strip()
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    found: dict[str, str] = {}
    for name, value in pairs:
        found.setdefault(name.lower(), value)
    for name in AFFINITY_HEADERS:
        value = found.get(name, "").strip()
        if value:
            return value
    return None


def affinity_hint(tenant: Tenant | None, key: str | None) -> SessionHint | None:
    """The routing hint for conversation ``key`` of ``tenant`` (None: no key, no hint). Its session id
    is ``aff_`` and 32 hex digits of a SHA-256 over the tenant's name and the key; ``remember`` asks a
    router to keep track of the conversation's worker."""
    if key is None:
        return None
    name = tenant.name if tenant is not None else ""
    digest = hashlib.sha256(f"{len(name)}:{name}:{key}".encode()).hexdigest()
    return SessionHint("aff_" + digest[:32], remember=True)

"""Tenants: who an API key belongs to, what that tenant may use, and whose cache it shares.

A tenants file (JSON, or TOML when its name ends in ``.toml``) maps tenant names to the
SHA-256 hex digests of their API keys and their limits; plaintext keys are never stored::

    {"tenants": {"acme": {"key_sha256": ["<hex of sha256(key)>"], "share_cache": false,
                          "max_sessions": 100, "max_concurrent_requests": 8,
                          "tokens_per_minute": 200000, "weight": 2}}}

``weight`` (default 1) is the tenant's fair share of the engine under ``--scheduling-policy session``
(engine/session_priority.py): a tenant of weight 2 is due twice the service of one of weight 1.

Every session belongs to the tenant that created it; another tenant sees 404 for it.
Prefix caches are isolated per tenant through the engine's cache salt (DESIGN.md
contract 1): a tenant's salt is ``tenant:<name>`` unless it sets ``share_cache``, in
which case it uses the shared salt ``""`` and shares cached prefixes with every other
tenant that opted in (and with no one else).

Concurrency and tokens per minute are admitted through a :class:`TenantLimiter`: this
process's :class:`TenantLimits` for ``agentrt serve``, ``router.tenant_limits.RedisTenantLimits``
(shared by every replica) for ``agentrt router``. The session limit is checked by the session
store when it creates a session.

Keys given with ``--api-key`` (no tenants file) all belong to the tenant ``default``,
which shares the cache; with neither, the server is open and every request is
``default``'s.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import math
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_TENANT = "default"
WINDOW_S = 60.0  # the tokens-per-minute window
_HEX = set("0123456789abcdef")


def hash_key(key: str) -> str:
    """The SHA-256 hex digest a tenants file stores for an API key."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Tenant:
    """One tenant. Limits of ``None`` mean "only the server-wide limits apply"."""

    name: str
    key_sha256: tuple[str, ...] = ()
    share_cache: bool = False
    max_sessions: int | None = None
    max_concurrent_requests: int | None = None
    tokens_per_minute: int | None = None
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not 0 < len(self.name) <= 128:
            raise ValueError(f"tenant name must be a string of 1..128 characters, got {self.name!r}")
        for digest in self.key_sha256:
            if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _HEX:
                raise ValueError(f"tenant {self.name!r}: key_sha256 entries must be 64 lower-case hex "
                                 f"characters (sha256 of the key), got {digest!r}")
        for limit in ("max_sessions", "max_concurrent_requests", "tokens_per_minute"):
            value = getattr(self, limit)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"tenant {self.name!r}: {limit} must be an integer >= 1, got {value!r}")
        if not isinstance(self.share_cache, bool):
            raise ValueError(f"tenant {self.name!r}: share_cache must be true or false")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or \
                not 0 < self.weight < float("inf"):
            raise ValueError(f"tenant {self.name!r}: weight must be a number > 0, got {self.weight!r}")

    @property
    def cache_salt(self) -> str:
        """The engine cache salt: shared (``""``) only for tenants that opted in."""
        return "" if self.share_cache else "tenant:" + self.name


_TENANT_FIELDS = {"key_sha256", "share_cache", "max_sessions", "max_concurrent_requests", "tokens_per_minute",
                  "weight"}


def load_tenants(path: str | Path) -> list[Tenant]:
    """Tenants from a JSON or TOML file; ``ValueError`` naming the problem for anything malformed."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read tenants file {path}: {exc}") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"tenants file {path} is not valid {'TOML' if path.suffix == '.toml' else 'JSON'}: "
                         f"{exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("tenants"), dict) or not data["tenants"]:
        raise ValueError(f"tenants file {path} must hold a non-empty 'tenants' table of name -> settings")
    tenants = []
    for name, spec in data["tenants"].items():
        if not isinstance(spec, dict):
            raise ValueError(f"tenants file {path}: tenant {name!r} must be a table of settings")
        unknown = set(spec) - _TENANT_FIELDS
        if unknown:
            raise ValueError(f"tenants file {path}: tenant {name!r} has unknown settings {sorted(unknown)}")
        keys = spec.get("key_sha256", [])
        if not isinstance(keys, list) or not keys:
            raise ValueError(f"tenants file {path}: tenant {name!r} needs a non-empty key_sha256 list")
        tenants.append(Tenant(name=name, key_sha256=tuple(k.lower() if isinstance(k, str) else k for k in keys),
                              **{k: v for k, v in spec.items() if k != "key_sha256"}))
    return tenants


class TenantRegistry:
    """API key -> tenant. ``open`` registries (no keys at all) answer every request as ``default``."""

    def __init__(self, tenants: list[Tenant]) -> None:
        self.tenants = {t.name: t for t in tenants}
        if len(self.tenants) != len(tenants):
            raise ValueError("tenant names must be unique")
        self._by_digest: dict[str, Tenant] = {}
        for t in tenants:
            for digest in t.key_sha256:
                if digest in self._by_digest:
                    raise ValueError(f"an API key is listed for both {self._by_digest[digest].name!r} "
                                     f"and {t.name!r}")
                self._by_digest[digest] = t
        self.open = not self._by_digest

    @classmethod
    def from_config(cls, tenants_file: str | None, api_keys: tuple[str, ...]) -> "TenantRegistry":
        if tenants_file and api_keys:
            raise ValueError("give either a tenants file or --api-key keys, not both")
        if tenants_file:
            return cls(load_tenants(tenants_file))
        keys = tuple(hash_key(k) for k in api_keys)
        return cls([Tenant(DEFAULT_TENANT, key_sha256=keys, share_cache=True)])

    def authenticate(self, token: str | None) -> Tenant | None:
        """The tenant of this bearer token (``default`` when open); None for a missing or unknown key."""
        if self.open:
            return self.tenants[DEFAULT_TENANT]
        if not token:
            return None
        digest = hash_key(token)
        tenant = self._by_digest.get(digest)
        # The dict lookup is on a digest, so its timing reveals nothing about the key; compare anyway.
        if tenant is None or not any(hmac.compare_digest(digest, d) for d in tenant.key_sha256):
            return None
        return tenant

    def get(self, name: str) -> Tenant:
        """The tenant named on a session record (an unknown name: isolated, no limits)."""
        return self.tenants.get(name) or Tenant(name)


class TenantLimiter:
    """Per-tenant concurrent requests and tokens per minute: the interface ``Generator`` admits through.

    Implementations: :class:`TenantLimits` (this process: ``agentrt serve``) and
    ``router.tenant_limits.RedisTenantLimits`` (shared by every router replica on one Redis,
    so a tenant's limits hold cluster-wide).

    ``admit(tenant, tokens)`` reserves one concurrent request and ``tokens`` (prompt +
    ``max_tokens``) in the tenant's sliding 60 s window, both or neither, and returns
    ``(reservation, 0.0)``; over a limit it reserves nothing and returns ``(None, seconds
    until a retry can succeed)``. ``release(tenant, reservation, used_tokens)`` frees the
    concurrent slot and sets the reservation's tokens to ``used_tokens`` (``None``: keep
    what was reserved); call it once per reservation. ``in_flight(name)`` counts the
    tenant's admitted, unreleased requests.
    """

    async def admit(self, tenant: Tenant, tokens: int) -> tuple[Any | None, float]:
        raise NotImplementedError

    async def release(self, tenant: Tenant, reservation: Any, used_tokens: int | None) -> None:
        raise NotImplementedError

    async def in_flight(self, tenant_name: str) -> int:
        raise NotImplementedError


@dataclass
class _Usage:
    in_flight: int = 0
    window: collections.deque = field(default_factory=collections.deque)  # [monotonic time, tokens]


class TenantLimits(TenantLimiter):
    """The in-process limiter: per-tenant counts in this process (one event loop, so no awaits, no races).

    ``admit`` reserves ``prompt + max_tokens`` tokens; ``release`` sets the reservation to
    the tokens really used. Refusals carry the seconds until a retry can succeed. ``now``
    (seconds, monotonic) is for tests.
    """

    def __init__(self) -> None:
        self._usage: dict[str, _Usage] = {}

    async def admit(self, tenant: Tenant, tokens: int, now: float | None = None) -> tuple[list | None, float]:
        """``(reservation, 0)`` when admitted, ``(None, retry_after_s)`` when over a limit."""
        now = time.monotonic() if now is None else now
        usage = self._usage.setdefault(tenant.name, _Usage())
        if tenant.max_concurrent_requests is not None and usage.in_flight >= tenant.max_concurrent_requests:
            return None, 1.0
        if tenant.tokens_per_minute is not None:
            while usage.window and usage.window[0][0] <= now - WINDOW_S:
                usage.window.popleft()
            used = sum(n for _, n in usage.window)
            if used and used + tokens > tenant.tokens_per_minute:
                return None, self._wait(usage, used + tokens - tenant.tokens_per_minute, now)
        entry = [now, tokens]
        usage.window.append(entry)
        usage.in_flight += 1
        return entry, 0.0

    @staticmethod
    def _wait(usage: _Usage, excess: int, now: float) -> float:
        """Seconds until entries totalling ``excess`` tokens leave the window."""
        freed = 0
        for at, n in usage.window:
            freed += n
            if freed >= excess:
                return max(1.0, at + WINDOW_S - now)
        return WINDOW_S

    async def release(self, tenant: Tenant, entry: list, used_tokens: int | None) -> None:
        usage = self._usage[tenant.name]
        usage.in_flight -= 1
        if used_tokens is not None:
            entry[1] = used_tokens

    async def in_flight(self, tenant_name: str) -> int:
        usage = self._usage.get(tenant_name)
        return usage.in_flight if usage else 0


def retry_after(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))

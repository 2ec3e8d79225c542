"""Router configuration: one frozen dataclass, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.hashing import DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class RouterConfig:
    """Everything a router replica (and the worker side of the router's Redis contracts) needs.

    ``key_prefix`` namespaces every Redis key (contract 3). ``block_size`` must equal the
    workers' (contract 1). A worker whose heartbeat key is older than ``heartbeat_ttl_s``
    is dead for routing; workers refresh it every ``heartbeat_interval_s``.
    ``policy`` names a registered routing policy; ``policy_options`` are its keyword
    arguments (validated by the policy itself). ``tentative_ttl_s``: how long a dispatched
    prompt's blocks count as held by the chosen worker before its KV events confirm them
    (``router/tentative.py``; 0 disables), ``tentative_grace_s``: how long after the request
    completed. ``turn_lock_ttl_s``: the session turn lock's TTL, renewed every third of it
    while the turn runs (so it only bounds how long a crashed router blocks a session).
    """

    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "agentrt:"
    deployment: str = "default"
    block_size: int = DEFAULT_BLOCK_SIZE
    heartbeat_ttl_s: float = 10.0
    heartbeat_interval_s: float = 3.0
    events_maxlen: int = 100_000
    event_max_bytes: int = 1 << 20
    event_max_hashes: int = 65_536
    session_max_bytes: int = 16 << 20
    tentative_ttl_s: float = 60.0
    tentative_grace_s: float = 2.0
    turn_lock_ttl_s: float = 60.0
    policy: str = "agentrt"
    policy_options: dict = field(default_factory=dict, hash=False, compare=True)

    def __post_init__(self) -> None:
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        if not self.key_prefix or not self.key_prefix.endswith(":"):
            raise ValueError(f"key_prefix must be non-empty and end with ':', got {self.key_prefix!r}")
        if not self.deployment or any(c in self.deployment for c in ": \t\n"):
            raise ValueError(f"deployment must be non-empty without ':' or spaces, got {self.deployment!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.heartbeat_ttl_s <= 0 or self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_ttl_s and heartbeat_interval_s must be positive")
        if self.heartbeat_interval_s >= self.heartbeat_ttl_s:
            raise ValueError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be shorter than "
                f"heartbeat_ttl_s ({self.heartbeat_ttl_s}) or live workers would expire")
        for name in ("events_maxlen", "event_max_bytes", "event_max_hashes", "session_max_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.tentative_ttl_s < 0 or self.tentative_grace_s < 0:
            raise ValueError("tentative_ttl_s and tentative_grace_s must be >= 0 (0 disables tentative entries)")
        if self.turn_lock_ttl_s <= 0:
            raise ValueError(f"turn_lock_ttl_s must be positive, got {self.turn_lock_ttl_s}")
        if not isinstance(self.policy_options, dict):
            raise ValueError("policy_options must be a dict of keyword arguments")

    # Derived key names (contract 3). One place so workers and routers agree.
    def worker_key(self, worker_id: str) -> str:
        return f"{self.key_prefix}worker:{worker_id}"

    def heartbeat_key(self, worker_id: str) -> str:
        return f"{self.key_prefix}worker:{worker_id}:hb"

    def load_key(self, worker_id: str) -> str:
        return f"{self.key_prefix}worker:{worker_id}:load"

    def snapshot_key(self, worker_id: str) -> str:
        return f"{self.key_prefix}worker:{worker_id}:blocks"

    def snapshot_seq_key(self, worker_id: str) -> str:
        return f"{self.key_prefix}worker:{worker_id}:blocks_seq"

    @property
    def workers_set_key(self) -> str:
        return f"{self.key_prefix}workers:{self.deployment}"

    @property
    def events_stream_key(self) -> str:
        return f"{self.key_prefix}kv_events:{self.deployment}"

    def session_key(self, session_id: str) -> str:
        return f"{self.key_prefix}session:{session_id}"

    def turn_lock_key(self, session_id: str) -> str:
        return f"{self.key_prefix}session:{session_id}:turn"

    def turn_lock_withdrawn_key(self, token: str) -> str:
        return f"{self.key_prefix}turn-withdrawn:{token}"

    def tentative_key(self, block_hash: int) -> str:
        return f"{self.key_prefix}tentative:{self.deployment}:{block_hash:016x}"

    @property
    def sessions_set_key(self) -> str:
        return f"{self.key_prefix}sessions"

    # Per tenant (the name as given: distinct fixed suffixes keep two tenants' keys apart).
    def tenant_sessions_key(self, tenant: str) -> str:
        return f"{self.key_prefix}tenant:{tenant}:sessions"

    def tenant_leases_key(self, tenant: str) -> str:
        return f"{self.key_prefix}tenant:{tenant}:leases"

    def tenant_tokens_key(self, tenant: str) -> str:
        return f"{self.key_prefix}tenant:{tenant}:tokens"

    def tenant_reserved_key(self, tenant: str) -> str:
        return f"{self.key_prefix}tenant:{tenant}:reserved"

    def tenant_withdrawn_key(self, tenant: str) -> str:
        return f"{self.key_prefix}tenant:{tenant}:withdrawn"

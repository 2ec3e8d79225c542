"""Router and worker settings, declared like ``agentrt serve``'s (agentrt/config.py): each a field
with its default and description, its ``AGENTRT_<FIELD>`` environment variable and its flag."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from agentrt.config import Flag, ServerConfig, Settings
from engine.hashing import DEFAULT_BLOCK_SIZE
from router.vllm_wire import zmq_endpoint


@dataclass(frozen=True)
class VllmWorkerSpec:
    """A vLLM/SGLang-style worker a router follows by its KV events (``router/vllm_consumer.py``) and
    reaches by its OpenAI endpoint (``router/openai_worker.py``): ``[ID=]URL,EVENTS[,REPLAY]``."""

    worker_id: str
    url: str                    # OpenAI base URL, without /v1
    events: str                 # ZMQ endpoint of its PUB socket (tcp://...)
    replay: str | None = None   # ZMQ endpoint of its replay ROUTER socket

    @classmethod
    def parse(cls, text: str) -> "VllmWorkerSpec":
        form = "[ID=]URL,EVENTS[,REPLAY], e.g. gpu0=http://10.0.0.5:8000,zmq://10.0.0.5:5557,zmq://10.0.0.5:5558"
        wid, sep, rest = text.strip().partition("=")
        if not sep or "://" in wid:
            wid, rest = "", text.strip()
        parts = [p.strip() for p in rest.split(",")]
        if not 2 <= len(parts) <= 3 or not all(parts):
            raise ValueError(f"a vLLM worker is {form}; got {text!r}")
        url = parts[0].rstrip("/").removesuffix("/v1")
        split = urlsplit(url)
        if split.scheme not in ("http", "https") or not split.hostname:
            raise ValueError(f"a vLLM worker's URL must be http(s)://HOST[:PORT] (its OpenAI server); got {parts[0]!r}")
        events, replay = zmq_endpoint(parts[1]), zmq_endpoint(parts[2]) if len(parts) == 3 else None
        wid = wid or f"vllm-{split.hostname}-{split.port or (443 if split.scheme == 'https' else 80)}"
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", wid):
            raise ValueError(f"a vLLM worker's id must be 1..128 letters, digits, '.', '_' or '-'; got {wid!r}")
        return cls(wid, url, events, replay)


class RouterConfig(Settings):
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
    ``affinity_ttl_s``: how long a conversation named by its client's affinity key stays mapped
    to its worker after its last request (``router/affinity.py``; 0 disables).
    """

    redis_url: Annotated[str, Flag("--redis", "URL")] = Field(
        "redis://127.0.0.1:6379/0", description="Redis URL: redis://, rediss:// (TLS) or unix://")
    key_prefix: str = Field("agentrt:", description="prefix of every Redis key, ending in ':'")
    deployment: str = Field("default", description="deployment name: its workers set and KV event stream in Redis")
    block_size: int = Field(DEFAULT_BLOCK_SIZE, gt=0, description="tokens per hashed KV block; must equal the "
                            "workers' KV page size (contract 1)")
    heartbeat_ttl_s: float = Field(10.0, gt=0, description="a worker silent this many seconds is dead")
    heartbeat_interval_s: float = Field(3.0, gt=0, description="seconds between a worker's heartbeats (shorter "
                                        "than the heartbeat TTL)")
    events_maxlen: int = Field(100_000, gt=0, description="KV events the Redis stream keeps (approximately)")
    event_max_bytes: int = Field(1 << 20, gt=0, description="largest KV event a router decodes, in bytes")
    event_max_hashes: int = Field(65_536, gt=0, description="most block hashes in one KV event a router accepts")
    session_max_bytes: int = Field(16 << 20, gt=0, description="largest session record in Redis, in bytes")
    tentative_ttl_s: float = Field(60.0, ge=0, description="how long a dispatched prompt counts as held by its "
                                   "worker before the worker's KV events confirm it (0: off)")
    tentative_grace_s: float = Field(2.0, ge=0, description="how long a dispatched prompt still counts as held "
                                     "after its request completed, in seconds")
    turn_lock_ttl_s: float = Field(60.0, gt=0, description="TTL of a session's turn lock in Redis (renewed while "
                                   "the turn runs)")
    affinity_ttl_s: float = Field(3600.0, ge=0, description="how long a conversation named by an affinity key "
                                  "(prompt_cache_key, a session header) stays on its worker after its last "
                                  "request, in seconds (0: off, such requests route by prefix alone)")
    policy: str = Field("agentrt", description="routing policy (router/policy.py registry)")
    policy_options: Annotated[dict[str, int | float], NoDecode, Flag("--policy-option", "NAME=NUMBER")] = Field(
        {}, description="a keyword argument of the policy, e.g. tokens_per_queued_request=1024 (repeatable; "
        "default: the policy's own)")
    vllm_workers: Annotated[tuple[VllmWorkerSpec, ...], NoDecode, Flag("--vllm-worker", "[ID=]URL,EVENTS[,REPLAY]")] = \
        Field((), description="a worker of kind vllm (vLLM, SGLang, or agentrt worker --kv-events): its OpenAI "
              "base URL, the ZMQ endpoint of its KV events and optionally of its replay socket; followed by its "
              "events and reached by /v1/completions (repeatable; the variable separates workers with ';')")
    vllm_events_topic: str = Field("", description="ZMQ topic of the vLLM-format KV events to follow ('': all)")
    vllm_health_interval_s: float = Field(2.0, gt=0, description="seconds between health probes (GET /v1/models) "
                                          "of each vLLM worker")
    kv_moves: bool = Field(True, description="KV moves between workers: a router sending a turn away from the "
                           "worker holding its prefix has the target pull the KV from it when the cost model finds "
                           "that faster than recomputing; a worker serves its pages and pulls when told (false: "
                           "neither, such turns are recomputed)")
    kv_move_min_tokens: int = Field(256, ge=0, description="fewest prompt tokens a KV move must save")
    kv_move_bandwidth_bytes_s: float = Field(2e8, gt=0, description="KV transfer bandwidth assumed between "
                                             "workers, in bytes a second, until the target measured its own pulls")
    kv_move_prefill_tokens_s: float = Field(500.0, gt=0, description="prefill throughput assumed for a worker, in "
                                            "tokens a second, until it reported a measured one")
    kv_move_overhead_s: float = Field(0.05, ge=0, description="fixed cost of a KV move (connection, first "
                                      "chunk, insertion), in seconds")
    worker_header_timeout_s: float = Field(10.0, gt=0, description="seconds a worker has to answer a request with "
                                           "its response headers (it streams at once) before the router counts it "
                                           "hung, marks it unhealthy and sends the request elsewhere; a KV move "
                                           "told to a target gets half of it")

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, got {value!r}")
        return value

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value or not value.endswith(":"):
            raise ValueError(f"key_prefix must be non-empty and end with ':', got {value!r}")
        return value

    @field_validator("deployment")
    @classmethod
    def _deployment(cls, value: str) -> str:
        if not value or any(c in value for c in ": \t\n"):
            raise ValueError(f"deployment must be non-empty without ':' or spaces, got {value!r}")
        return value

    @field_validator("policy_options", mode="before")
    @classmethod
    def _name_equals_number(cls, value: Any) -> Any:
        """``NAME=NUMBER`` items (repeated flags, or comma-separated in the environment) as a dict."""
        if isinstance(value, str):
            value = [item.strip() for item in value.split(",") if item.strip()]
        if not isinstance(value, (list, tuple)):
            return value
        options: dict[str, int | float] = {}
        for item in value:
            name, sep, text = str(item).partition("=")
            try:
                number = float(text)
            except ValueError:
                number = None
            if not sep or not name.isidentifier() or number is None:
                raise ValueError(f"policy options are NAME=NUMBER, got {item!r}")
            options[name] = int(number) if number.is_integer() and "." not in text else number
        return options

    @field_validator("vllm_workers", mode="before")
    @classmethod
    def _vllm_workers(cls, value: Any) -> Any:
        """``[ID=]URL,EVENTS[,REPLAY]`` items (repeated flags, or ';'-separated in the environment)."""
        if isinstance(value, str):
            value = [item for item in value.split(";") if item.strip()]
        if not isinstance(value, (list, tuple)):
            return value
        specs = [item if isinstance(item, VllmWorkerSpec) else VllmWorkerSpec.parse(str(item)) for item in value]
        ids = [s.worker_id for s in specs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"vLLM worker ids must be unique, got {ids}")
        return tuple(specs)

    @model_validator(mode="after")
    def _heartbeat(self) -> Self:
        if self.heartbeat_interval_s >= self.heartbeat_ttl_s:
            raise ValueError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be shorter than "
                f"heartbeat_ttl_s ({self.heartbeat_ttl_s}) or live workers would expire")
        return self

    # Derived key names (contract 3). One place so workers and routers agree.
    def worker_key(self, worker_id: str) -> str:
        return f"{self.key_prefix}worker:{worker_id}"

    def heartbeat_key(self, worker_id: str) -> str:
        return f"{self.key_prefix}worker:{worker_id}:hb"

    def load_key(self, worker_id: str) -> str:
        return f"{self.key_prefix}worker:{worker_id}:load"

    def snapshot_key(self, worker_id: str) -> str:
        return f"{self.key_prefix}worker:{worker_id}:blocks"

    def snapshot_tier_key(self, worker_id: str, medium: str) -> str:
        """The worker's blocks held in a KV tier below its device pool (``medium`` host or disk)."""
        return f"{self.key_prefix}worker:{worker_id}:blocks:{medium}"

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

    def affinity_key(self, session_id: str) -> str:
        return f"{self.key_prefix}affinity:{self.deployment}:{session_id}"

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


class WorkerSettings(Settings):
    """How routers see a worker: its id in Redis and the URL they reach it at. Unset, they come from
    the listen address (:meth:`resolve`)."""

    worker_id: str | None = Field(None, min_length=1, description="id in Redis (default: <hostname>-<port>)")
    advertise_url: str | None = Field(None, min_length=1, description="URL routers use to reach this worker "
                                      "(default: http://<host>:<port>)")
    kv_events: Annotated[str | None, Flag("--kv-events", "zmq://HOST:PORT")] = Field(
        None, description="also publish KV events in vLLM's format on this ZMQ endpoint (bound; zmq://*:PORT for "
        "every interface), for Dynamo, llm-d or an agentrt router's --vllm-worker")
    kv_events_replay: Annotated[str | None, Flag("--kv-events-replay", "zmq://HOST:PORT")] = Field(
        None, description="ZMQ endpoint of the replay socket for those events (needs --kv-events)")
    kv_events_topic: str = Field("", description="ZMQ topic of those events")
    kv_events_encoding: Literal["array", "map"] = Field(
        "array", description="msgpack layout of those events: array (older vLLM, SGLang, llm-d) or map (events "
        "as maps with 'type', newer vLLM)")
    kv_events_buffer: int = Field(10_000, gt=0, description="event batches kept for replay")
    kv_pull_timeout_s: float = Field(30.0, gt=0, description="longest a KV pull may take, in seconds; blocks "
                                     "not received by then are recomputed")

    @field_validator("kv_events", "kv_events_replay")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        return None if value is None else zmq_endpoint(value)

    @model_validator(mode="after")
    def _replay_needs_events(self) -> Self:
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ValueError("kv_events_replay needs kv_events (the replay socket serves those events)")
        return self

    def resolve(self, config: ServerConfig) -> "WorkerSettings":
        """Both set: the defaults from ``config``'s listen address where unset."""
        host = config.host if config.host not in ("0.0.0.0", "::", "") else socket.gethostname()
        return self.model_copy(update={
            "worker_id": self.worker_id or f"{socket.gethostname()}-{config.port}".replace(":", "-"),
            "advertise_url": self.advertise_url or f"http://{host}:{config.port}"})

"""Server configuration: one frozen dataclass, from command-line flags and environment variables.

Every field has an environment variable ``AGENTRT_<FIELD>`` (upper case); a flag given on the
command line wins over the environment, which wins over the default.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

ENV_PREFIX = "AGENTRT_"
# Fields whose default is None but whose values are integers (flags and env parse them as int).
# How long an idle HTTP connection stays open. Longer than clients keep idle connections (httpx,
# so the official openai client: 5 s), so a client never sends a request on a connection the
# server is closing at that moment (uvicorn's own default is also 5 s: under load those requests
# failed with a reset connection).
KEEP_ALIVE_S = 75

OPTIONAL_INTS = ("kv_cache_tokens", "max_num_seqs", "max_model_len", "max_waiting", "max_waiting_tokens")


def _setting(default: Any, help: str) -> Any:
    """A ``ServerConfig`` field with the one-line description its flag shows in ``--help``."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ServerConfig:
    """How ``agentrt serve`` runs: the model, the listener, and the limits it enforces.

    Engine settings (``model`` ... ``max_waiting_tokens``) go to ``engine.EngineConfig``; ``None``
    keeps the engine's default (the KV pool is smaller than the engine's default: a laptop
    runs ``agentrt serve`` with its defaults). ``max_waiting`` (requests) and
    ``max_waiting_tokens`` (their tokens; default twice the KV pool) bound the engine's
    waiting queue: past either, a request gets 429 with ``Retry-After``. ``api_keys`` empty
    means no authentication.
    ``max_concurrent_requests`` is the HTTP admission limit (generations in flight); past it
    a request gets 429 with ``Retry-After``.
    ``tenants_file`` (JSON or TOML, ``agentrt/tenants.py``) maps hashed API keys to tenants with
    their own limits and cache isolation; it replaces ``api_keys``. ``default_max_tokens`` is used when a request
    gives no token limit (capped by what is left of the context window).
    Expert parallelism (MoE checkpoints): ``ep`` ranks (this process is rank 0) as ``ep_nodes``
    nodes, ``ep_placement`` of ``num_experts + ep_redundant`` expert slots (docs/moe.md).
    ``enable_prefix_cache`` false turns the engine's radix prefix cache off (every prompt is
    computed in full; for ablations). ``turn_coalesce_max_s`` caps how long the engine holds
    its next step after a session turn ends, for the agent's next turn to join it (a tenth of
    the recent prefill step time at most; 0 turns it off; engine/coalesce.py).
    Sessions: ``session_idle_ttl_s`` deletes a session nobody used for that long;
    ``pin_ttl_s`` keeps a session's KV prefix pinned between turns, ``pin_ttl_tool_s`` when
    the last reply ended in a tool call (the agent comes straight back); ``max_pin_ttl_s``
    caps what a session may ask for.
    """

    host: str = _setting("127.0.0.1", "address to listen on")
    port: int = _setting(8000, "port to listen on")
    model: str | None = _setting(None,
                      "a .gguf file or a Hugging Face model directory (default: the embedded "
                      "SmolLM2-135M-Instruct)")
    served_model_name: str | None = _setting(None,
                      "the model name clients send and /v1/models lists (default: from the model files)")
    device: str = _setting("cpu", "where the engine runs: cpu, cuda, or auto (cuda when available)")
    dtype: str = _setting("auto", "weights and KV cache precision: float32, bfloat16, float16, or auto (bfloat16 "
                                  "on CUDA and on CPUs with AVX512-BF16/AMX, else float32)")
    kv_cache_tokens: int | None = _setting(32768,  # 1.5 GB of fp32 KV for the default model, 0.75 GB bf16
                      "tokens the paged KV cache holds (sizes its memory)")
    max_num_seqs: int | None = _setting(None, "most sequences in one engine step (the batch)")
    max_model_len: int | None = _setting(None, "context window in tokens (default: the model's)")
    max_waiting: int | None = _setting(None, "requests queued for the engine before new ones get 429")
    max_waiting_tokens: int | None = _setting(None,
                      "prompt tokens queued for the engine before new requests get 429 (default: twice the KV "
                      "cache)")
    enable_prefix_cache: bool = _setting(True,
                      "reuse cached KV of earlier prompts' prefixes (false computes every prompt in full)")
    turn_coalesce_max_s: float = _setting(0.2,
                      "how long the engine may hold its next step after a session turn ends, for the agent's next "
                      "turn to join (0: off)")
    ep: int = _setting(1, "expert-parallel ranks for MoE models (this process is rank 0)")
    ep_nodes: int = _setting(1, "nodes the expert-parallel ranks are laid out over")
    ep_placement: str = _setting("contiguous", "how experts are placed on ranks: contiguous, balanced or locality")
    ep_redundant: int = _setting(0, "extra expert slots for replicas of hot experts")
    api_keys: tuple[str, ...] = _setting((), "accept this API key (repeatable; default: no authentication)")
    tenants_file: str | None = _setting(None,
                      "JSON or TOML file of tenants: hashed API keys, limits, cache isolation (replaces "
                      "--api-key)")
    max_body_bytes: int = _setting(4 << 20, "largest request body accepted, in bytes")
    max_concurrent_requests: int = _setting(64, "generations in flight before new requests get 429")
    retry_after_s: int = _setting(1, "the Retry-After seconds sent with 429 and 503 answers")
    default_max_tokens: int = _setting(1024, "reply token limit when a request gives none")
    max_sessions: int = _setting(10_000, "most sessions held at once")
    session_idle_ttl_s: float = _setting(3600.0, "delete a session nobody used for this many seconds")
    pin_ttl_s: float = _setting(30.0, "seconds a session's cached prefix stays pinned after a turn")
    pin_ttl_tool_s: float = _setting(120.0, "seconds the prefix stays pinned when the reply ended in a tool call")
    max_pin_ttl_s: float = _setting(600.0, "the longest pin a session may ask for, in seconds")
    sweep_interval_s: float = _setting(1.0, "seconds between sweeps for idle sessions and expired pins")
    shutdown_timeout_s: float = _setting(10.0, "seconds a graceful shutdown waits for requests in flight")
    log_level: str = _setting("info", "critical, error, warning, info, debug or trace")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not isinstance(self.api_keys, tuple) or any(not k for k in self.api_keys):
            raise ValueError("api_keys must be a tuple of non-empty strings")
        if self.tenants_file is not None and self.api_keys:
            raise ValueError("give either tenants_file or api_keys, not both")
        for name in ("max_body_bytes", "max_concurrent_requests", "default_max_tokens", "max_sessions",
                     "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("session_idle_ttl_s", "pin_ttl_s", "pin_ttl_tool_s", "max_pin_ttl_s",
                     "sweep_interval_s", "shutdown_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.turn_coalesce_max_s < 0:
            raise ValueError(f"turn_coalesce_max_s must be >= 0 (0 turns coalescing off), "
                             f"got {self.turn_coalesce_max_s}")
        if max(self.pin_ttl_s, self.pin_ttl_tool_s) > self.max_pin_ttl_s:
            raise ValueError(f"pin_ttl_s ({self.pin_ttl_s}) and pin_ttl_tool_s ({self.pin_ttl_tool_s}) "
                             f"must not exceed max_pin_ttl_s ({self.max_pin_ttl_s})")
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ValueError(f"log_level must be one of critical/error/warning/info/debug/trace, "
                             f"got {self.log_level!r}")

    def engine_config(self):
        """The ``engine.EngineConfig`` these settings describe (imports the engine lazily)."""
        from engine import EngineConfig

        kwargs: dict[str, Any] = {"model": self.model, "device": self.device, "dtype": self.dtype,
                                  "ep_size": self.ep, "ep_nodes": self.ep_nodes,
                                  "ep_placement": self.ep_placement, "ep_redundant": self.ep_redundant,
                                  "enable_prefix_cache": self.enable_prefix_cache,
                                  "turn_coalesce_max_s": self.turn_coalesce_max_s}
        for name in ("served_model_name", "kv_cache_tokens", "max_num_seqs", "max_model_len", "max_waiting",
                     "max_waiting_tokens"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        return EngineConfig(**kwargs)

    @classmethod
    def from_sources(cls, overrides: Mapping[str, Any] | None = None,
                     environ: Mapping[str, str] | None = None) -> "ServerConfig":
        """Defaults, then ``AGENTRT_*`` environment variables, then ``overrides`` (flags; None = unset)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None and raw != "":
                values[f.name] = _parse(f.name, raw)
        for name, value in (overrides or {}).items():
            if value is not None:
                values[name] = tuple(value) if name == "api_keys" else value
        return cls(**values)


def parse_bool(raw: str, what: str = "value") -> bool:
    """``true/false``, ``1/0``, ``yes/no``, ``on/off`` (any case); anything else is a ValueError."""
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{what}={raw!r} is not a boolean (true/false)")


def _parse(name: str, raw: str) -> Any:
    """One environment variable's text as the field's type."""
    default = getattr(ServerConfig, name, None)
    if name == "api_keys":
        return tuple(k.strip() for k in raw.split(",") if k.strip())
    kind = int if name in OPTIONAL_INTS else type(default)
    if kind is str or kind is type(None):
        return raw
    if kind is bool:
        return parse_bool(raw, f"{ENV_PREFIX}{name.upper()}")
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {kind.__name__}") from None


# ------------------------------------------------------------ flags (agentrt serve, worker, router)


def configure_serve(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerConfig field (``--pin-ttl-s`` for ``pin_ttl_s``); unset flags fall back to env."""
    for f in fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        env = ENV_PREFIX + f.name.upper()
        if f.name == "api_keys":
            parser.add_argument("--api-key", dest="api_keys", action="append", default=None,
                                help=f"{f.metadata['help']}; env {env}, comma-separated")
            continue
        kind = int if f.name in OPTIONAL_INTS else (
            type(f.default) if f.default is not None else str)
        if kind is bool:  # argparse's type=bool would read "false" as True
            kind = _bool_flag
        parser.add_argument(flag, dest=f.name, type=kind, default=None,
                            help=f"{f.metadata['help']} (default {f.default!r}; env {env})")


def _bool_flag(raw: str) -> bool:
    try:
        return parse_bool(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None

"""Control messages to the engine thread, one type each, and the dispatcher that routes them by type.

Every change to the engine's state comes from its own thread: other threads (the server's event loop,
a worker's KV-move endpoint, the KV-event publisher) put a message in the engine's inbox, and the engine
thread handles the messages between steps (``EngineCore._drain_inbox``, engine/core.py). A message is a
frozen dataclass naming what it carries; ``Dispatcher`` maps each type to one handler (SGLang's
``TypeBasedDispatcher``): the request table's (engine/request_table.py) and the KV control operations'
(engine/kv_control.py). It refuses a type it has no handler for, so a new message cannot be dropped
silently.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from engine.request import Request


@dataclass(frozen=True)
class AddRequest:
    """Queue a request ``add_request`` built and admitted."""
    req: Request


@dataclass(frozen=True)
class Abort:
    """Finish a request early (finish reason ``abort``); unknown or finished ids are ignored."""
    request_id: str


@dataclass(frozen=True)
class StopRequest:
    """Finish a request as stopped by stop string ``stop``, which the output processor found in its text
    (engine/tokenizer.py); unknown or finished ids are ignored."""
    request_id: str
    stop: str


@dataclass(frozen=True)
class Pin:
    """Hold the cached prefix of ``token_ids`` under ``pin_id`` for ``ttl_s``."""
    pin_id: str
    token_ids: list[int]
    ttl_s: float
    cache_salt: str = ""


@dataclass(frozen=True)
class ExtendPin:
    """Make an existing pin expire ``ttl_s`` from now (no-op if it is gone)."""
    pin_id: str
    ttl_s: float


@dataclass(frozen=True)
class Unpin:
    pin_id: str


@dataclass(frozen=True)
class Demote:
    """Copy a pin's pages into the KV tiers now and release the pin (a long pause ahead)."""
    pin_id: str


@dataclass(frozen=True)
class Prefetch:
    """Start reading a demoted pin's tier pages back (its session's next turn is near)."""
    pin_id: str


@dataclass(frozen=True)
class FlushCache:
    """Drop every cached block (and the KV tiers' copies)."""


@dataclass(frozen=True)
class CacheSnapshot:
    """Resolve ``future`` to every cached block hash (with ``extra()``, run at the same moment, when set)."""
    future: concurrent.futures.Future
    extra: Callable[[], Any] | None = None


@dataclass(frozen=True)
class TierSnapshot:
    """Resolve ``future`` to the block hashes each KV tier holds."""
    future: concurrent.futures.Future


KV_OPS = ("held", "export", "import", "pinned")


@dataclass(frozen=True)
class KVTransfer:
    """Run page-transfer operation ``op`` (one of ``KV_OPS``, engine/kv_move.py) and resolve ``future``."""
    future: concurrent.futures.Future
    op: str
    args: tuple = ()


class Dispatcher:
    """Calls the handler of a message's type; a type without one is a ``TypeError``."""

    def __init__(self, handlers: dict[type, Callable[[Any], Any]]) -> None:
        self._handlers = dict(handlers)

    def __call__(self, message: Any) -> Any:
        handler = self._handlers.get(type(message))
        if handler is None:
            raise TypeError(f"no handler for engine message {type(message).__name__}")
        return handler(message)

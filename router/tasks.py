"""Stopping the router's background loops (registry refresh, KV event readers, vLLM health probes, heartbeats,
lease renewers).

Each of those loops runs until it is cancelled, and most await Redis. On Python 3.11 a cancellation that
lands while redis-py sets up a connection, or as a command completes inside ``asyncio.wait_for``, can be
swallowed there: the loop goes round again, and whoever did ``task.cancel(); await task`` waits for it
forever (seen: a router's stop hung with its refresh loop still polling a live Redis). ``cancel_and_wait``
cancels again until the task has ended.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("router.tasks")


async def cancel_and_wait(task: asyncio.Task | None, poll_s: float = 0.1) -> None:
    """Cancel ``task`` and return once it has ended, cancelling it again every ``poll_s`` while it runs on
    (a cancellation it swallowed). What it ended with is not raised, since the caller is stopping it; an
    exception is logged (a loop that died before its stop). The caller's own cancellation still propagates."""
    while task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=poll_s)
    if task is not None and not task.cancelled() and task.exception() is not None:
        log.warning("background task %s had ended with %r before it was stopped", task.get_name(), task.exception())

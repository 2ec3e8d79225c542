"""Stopping a task that runs until it is cancelled: the router's and the workers' background loops (registry
refresh, KV event readers, vLLM health probes, heartbeats, lease renewers) and a request's work when its client
has gone (``agentrt/api/http.py``'s ``unless_disconnected``).

On Python 3.11 a cancellation can be lost on its way in: one that lands while redis-py sets up a connection, or
in the turn of the event loop in which an ``asyncio.wait_for`` inside the task gets its result. The task then
goes on (a loop goes round again; a request runs to its end for nobody), and whoever did ``task.cancel();
await task`` waits for all of it, forever for a loop (seen: a router's stop hung with its refresh loop still
polling a live Redis). ``cancel_and_wait`` cancels again until the task has ended.

``in_background`` starts work nobody awaits now (a mark, a withdrawal, a lease call) and holds its task until it
ends: the event loop keeps only weak references to tasks, and its owner waits for what is left when it stops.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("agentrt.tasks")


def in_background(tasks: set[asyncio.Task], coro) -> asyncio.Task:
    """``coro`` as a task held in ``tasks`` until it ends (then dropped from it)."""
    task = asyncio.get_running_loop().create_task(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task


async def cancel_and_wait(task: asyncio.Task | asyncio.Future | None, poll_s: float = 0.1, *,
                          log_exception: bool = True) -> None:
    """Cancel ``task`` and return once it has ended, cancelling it again every ``poll_s`` while it runs on
    (a cancellation it lost). What it ended with is not raised, since the caller is stopping it; an exception
    is logged unless ``log_exception`` is false. The caller's own cancellation still propagates."""
    while task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=poll_s)
    if task is None or task.cancelled():
        return
    exc = task.exception()   # retrieved either way, or asyncio logs it as never retrieved
    if exc is not None and log_exception:
        name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
        log.warning("task %s had ended with %r before it was stopped", name, exc)

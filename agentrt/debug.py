"""Where is a stuck request waiting? ``kill -USR1 PID`` logs every asyncio task's stack and
every thread's (``agentrt serve``, ``worker`` and ``router`` install this at startup)."""

from __future__ import annotations

import asyncio
import faulthandler
import io
import logging
import signal
import sys

log = logging.getLogger("agentrt.debug")


def dump_tasks() -> None:
    tasks = asyncio.all_tasks()
    log.warning("SIGUSR1: %d asyncio tasks", len(tasks))
    for task in tasks:
        buf = io.StringIO()
        task.print_stack(limit=40, file=buf)
        log.warning("task %s:\n%s", task.get_name(), buf.getvalue())
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def install_task_dump() -> None:
    """On SIGUSR1, dump the running loop's tasks (no-op where signals cannot be handled)."""
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)
    except (NotImplementedError, RuntimeError, ValueError, AttributeError):
        pass

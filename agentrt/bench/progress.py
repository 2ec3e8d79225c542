"""Progress bars for ``agentrt bench`` and the scripts under ``benchmarks/``: tqdm on stderr.

One constructor so every long loop looks and behaves the same: the bar goes to stderr (never
into stdout, where reports and JSON go), it is drawn only when stderr is a terminal (tqdm's
``disable=None``), so CI logs and piped runs stay quiet, and ``enabled=False`` (``--no-progress``)
turns it off everywhere.
"""

from __future__ import annotations

import sys

from tqdm import tqdm


def bar(total: int | float | None, desc: str, unit: str = "it", enabled: bool = True, **kwargs) -> tqdm:
    """A tqdm bar on stderr; drawn only when ``enabled`` and stderr is a TTY."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None if enabled else True,
                dynamic_ncols=True, leave=True, **kwargs)


def note(text: str) -> None:
    """A line for the user on stderr (plans, estimates) that does not break a bar being drawn."""
    tqdm.write(text, file=sys.stderr)

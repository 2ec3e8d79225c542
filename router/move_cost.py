"""Pull or recompute: the cost model a router applies when a turn goes to a worker that lacks part of
the prefix another worker holds (router/core.py ``kv_move``).

For the ``tokens`` the target lacks and the holder has::

    pull_s      = overhead_s + tokens * bytes_per_token / bandwidth_bytes_s
    recompute_s = tokens / prefill_tokens_s

and the target pulls when ``pull_s < recompute_s``. The figures are measured where they can be:
``bytes_per_token`` is the pool's (a worker's load report), ``bandwidth_bytes_s`` what the target's
own pulls took (``LoadReport.kv_pull_bytes_per_s``), ``prefill_tokens_s`` the target's recent prefill
steps (``LoadReport.prefill_tokens_per_s``); the router's settings stand in until a worker measured
them. Prefill is priced linearly: at long contexts attention makes a recompute dearer than that, so
the estimate errs toward recomputing. A transfer that turns out slower than its estimate is cut by
the target's ``kv_pull_timeout_s`` and the rest recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoveEstimate:
    """One decision and the estimates it was made on (seconds)."""

    pull: bool
    tokens: int
    pull_s: float
    recompute_s: float

    @property
    def choice(self) -> str:
        return "pull" if self.pull else "recompute"


def plan_move(tokens: int, bytes_per_token: int, bandwidth_bytes_s: float, prefill_tokens_s: float,
              overhead_s: float = 0.05) -> MoveEstimate:
    """Pull or recompute ``tokens`` prompt tokens (see the module docstring); ``ValueError`` for figures
    that cannot be rates or sizes."""
    if tokens < 0 or bytes_per_token <= 0:
        raise ValueError(f"tokens must be >= 0 and bytes_per_token > 0, got {tokens} and {bytes_per_token}")
    if bandwidth_bytes_s <= 0 or prefill_tokens_s <= 0 or overhead_s < 0:
        raise ValueError(f"bandwidth ({bandwidth_bytes_s}) and prefill throughput ({prefill_tokens_s}) must be > 0 "
                         f"and the overhead ({overhead_s}) >= 0")
    pull_s = overhead_s + tokens * bytes_per_token / bandwidth_bytes_s
    recompute_s = tokens / prefill_tokens_s
    return MoveEstimate(tokens > 0 and pull_s < recompute_s, tokens, pull_s, recompute_s)


__all__ = ["MoveEstimate", "plan_move"]

"""The engine's ``EngineStats``, read from its parts at the end of a step by the engine thread and
published for other threads (they must not walk the scheduler's live state)."""

from __future__ import annotations

from engine.builder import EngineParts
from engine.session_priority import priority_class
from engine.types import EngineStats
from engine.window_pool import WindowedPagePool


def engine_stats(parts: EngineParts, page_size: int, prefill_tokens_per_s: float) -> EngineStats:
    s, pool, cache, spec = parts.scheduler, parts.pool, parts.cache, parts.spec
    return EngineStats(
        running=len(s.running), waiting=len(s.waiting),
        pages_total=pool.capacity, pages_used=pool.capacity - pool.num_free,
        pages_free=pool.num_free, pages_cached=cache.cached_pages, pages_evictable=cache.evictable_pages,
        pages_pinned=len({p for pin in s.pins.values() for p in _path_pages(pin.node)}),
        num_pins=len(s.pins), prompt_tokens_total=s.prompt_tokens_total, cached_tokens_total=s.cached_tokens_total,
        generation_tokens_total=s.generation_tokens_total, num_preemptions=s.num_preemptions, page_size=page_size,
        waiting_tokens=s.waiting_tokens, waiting_tokens_limit=parts.waiting_tokens_limit,
        spec_draft_tokens_total=spec.draft_tokens_total, spec_accepted_tokens_total=spec.accepted_tokens_total,
        spec_verifications_total=spec.verifications_total,
        kv_tiers=parts.tiers.stats() if parts.tiers is not None else {}, cpu_kernels=parts.active_kernels,
        kv_cache_bytes_per_token=parts.kv.bytes_per_token, waiting_by_priority=_by_priority(s.waiting),
        prefill_tokens_per_s=prefill_tokens_per_s, **_window_stats(pool))


def _window_stats(pool) -> dict:
    """The sliding layers' pool for EngineStats (empty where no layer slides in the cache)."""
    if not isinstance(pool, WindowedPagePool):
        return {}
    return {"window_pages_total": pool.window_pool.capacity, "window_pages_used": pool.window_pages_used}


def _by_priority(waiting) -> dict[str, int]:
    """Waiting requests by "<priority class>/<new|started>" (engine/session_priority.py, ``priority_class``)."""
    counts: dict[str, int] = {}
    for req in waiting:
        label = f"{priority_class(req.params.priority)}/{'started' if req.started else 'new'}"
        counts[label] = counts.get(label, 0) + 1
    return counts


def _path_pages(node) -> list[int]:
    pages = []
    while node is not None:
        pages.extend(node.pages)
        node = node.parent
    return pages

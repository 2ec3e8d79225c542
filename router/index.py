"""Global prefix index: which workers hold which prefix blocks (fed by KV events, contract 2).

Hashes are contract-1 chain hashes, so a block hash already names its whole prefix:
a worker "holds" a prefix of ``k`` blocks when it holds ``hashes[0..k-1]``. The index is
plain in-process state that any router replica rebuilds from the event stream and the
workers' snapshots (contract 3); it is not thread-safe, callers serialise access (the
consumer applies events from one task and ``match`` runs on the same event loop).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence


class PrefixIndex:
    """hash -> set of worker ids, plus the reverse map so a worker can be dropped in O(its blocks)."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._by_worker: dict[str, set[int]] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def workers(self) -> list[str]:
        """Workers with at least one indexed block."""
        return [w for w, blocks in self._by_worker.items() if blocks]

    def blocks_of(self, worker: str) -> int:
        """How many blocks ``worker`` is known to hold."""
        return len(self._by_worker.get(worker, ()))

    def hashes_of(self, worker: str) -> frozenset[int]:
        """The blocks ``worker`` is known to hold."""
        return frozenset(self._by_worker.get(worker, ()))

    def holders(self, block_hash: int) -> frozenset[str]:
        return frozenset(self._holders.get(block_hash, ()))

    def stored(self, worker: str, hashes: Iterable[int]) -> None:
        """``worker`` now holds every block in ``hashes``."""
        mine = self._by_worker.setdefault(worker, set())
        for h in hashes:
            self._holders.setdefault(h, set()).add(worker)
            mine.add(h)

    def removed(self, worker: str, hashes: Iterable[int]) -> None:
        """``worker`` evicted ``hashes``; unknown hashes are ignored."""
        mine = self._by_worker.get(worker)
        if mine is None:
            return
        hashes = list(hashes)
        mine.difference_update(hashes)
        self._unlink(worker, hashes)

    def clear_worker(self, worker: str) -> None:
        """Drop every entry of ``worker`` (a ``cleared`` event, death, or before a resync)."""
        self._unlink(worker, self._by_worker.pop(worker, set()))

    def _unlink(self, worker: str, hashes: Iterable[int]) -> None:
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._holders[h]

    def replace_worker(self, worker: str, hashes: Iterable[int]) -> None:
        """Resynchronise ``worker`` from a snapshot: its entries become exactly ``hashes``."""
        self.clear_worker(worker)
        self.stored(worker, hashes)

    def match(self, hashes: Sequence[int], extra: Mapping[int, set[str]] | None = None) -> dict[str, int]:
        """Longest cached prefix per worker: ``{worker: k}`` where the worker holds
        ``hashes[0..k-1]`` (contiguous from block 0). Workers with ``k == 0`` are absent.
        ``extra`` adds holders per block (tentative entries, ``router/tentative.py``)."""
        result: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if extra is not None and h in extra:
                holders = extra[h] | holders if holders else extra[h]
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for w in alive:
                result[w] = i + 1
        return result

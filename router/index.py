"""Global prefix index: which workers hold which prefix blocks (fed by KV events, contract 2).

Hashes are contract-1 chain hashes, so a block hash already names its whole prefix:
a worker "holds" a prefix of ``k`` blocks when it holds ``hashes[0..k-1]``. The index is
plain in-process state that any router replica rebuilds from the event stream and the
workers' snapshots (contract 3); it is not thread-safe, callers serialise access (the
consumer applies events from one task and ``match`` runs on the same event loop).

KV tiers (contract 2's optional ``medium``): a worker may hold a block on its device, in host
memory or on disk below it (engine/kv_tier.py). Every medium counts as holding the block for
``match``; a small separate map, ``_media``, keeps the media of the blocks a worker holds in a
tier (a block absent from it is on the device only), so ``removed`` from one medium keeps the
block while another still has it, and ``tier_blocks`` tells the cost model how much of a match
must be loaded rather than being a device hit.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

_BIT = {"device": 1, "host": 2, "disk": 4}
_ORDER = ("device", "host", "disk")   # best first


class PrefixIndex:
    """hash -> set of worker ids, plus the reverse map so a worker can be dropped in O(its blocks)."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._by_worker: dict[str, set[int]] = {}
        self._media: dict[str, dict[int, int]] = {}  # worker -> hash -> bits of _BIT, for tier-held blocks

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

    def stored(self, worker: str, hashes: Iterable[int], medium: str = "device") -> None:
        """``worker`` now holds every block in ``hashes`` (in ``medium``: device, host or disk)."""
        mine = self._by_worker.setdefault(worker, set())
        media = self._media.get(worker)
        if medium != "device" or media:
            media = self._media.setdefault(worker, {})
            bit = _BIT[medium]
            for h in hashes:
                old = media.get(h)
                if old is None:   # not tier-held: on the device if indexed at all
                    old = _BIT["device"] if h in mine else 0
                if old | bit != _BIT["device"]:
                    media[h] = old | bit
                else:
                    media.pop(h, None)
        for h in hashes:
            self._holders.setdefault(h, set()).add(worker)
            mine.add(h)

    def removed(self, worker: str, hashes: Iterable[int], medium: str = "device") -> None:
        """``worker`` no longer holds ``hashes`` in ``medium``; a block it still holds in another
        medium stays. Unknown hashes are ignored."""
        mine = self._by_worker.get(worker)
        if mine is None:
            return
        hashes = list(hashes)
        media = self._media.get(worker)
        if media:
            bit, gone = _BIT[medium], []
            for h in hashes:
                old = media.get(h)
                if old is None:
                    if medium == "device":
                        gone.append(h)
                    continue
                left = old & ~bit
                if left == _BIT["device"]:
                    del media[h]
                elif left:
                    media[h] = left
                else:
                    del media[h]
                    gone.append(h)
            hashes = gone
        elif medium != "device":
            return
        mine.difference_update(hashes)
        self._unlink(worker, hashes)

    def clear_worker(self, worker: str) -> None:
        """Drop every entry of ``worker`` (a ``cleared`` event, death, or before a resync)."""
        self._media.pop(worker, None)
        self._unlink(worker, self._by_worker.pop(worker, set()))

    def medium_of(self, worker: str, block_hash: int) -> str | None:
        """The best medium ``worker`` holds the block in (device, then host, then disk), or None."""
        if block_hash not in self._by_worker.get(worker, ()):
            return None
        bits = self._media.get(worker, {}).get(block_hash, _BIT["device"])
        return next(m for m in _ORDER if bits & _BIT[m])

    def tier_blocks(self, worker: str, hashes: Sequence[int]) -> dict[str, int]:
        """Of ``hashes`` (a matched prefix), how many ``worker`` holds only below its device, by
        medium: ``{"host": n, "disk": m}`` (media with none are absent)."""
        media = self._media.get(worker)
        out: dict[str, int] = {}
        if media:
            for h in hashes:
                bits = media.get(h)
                if bits is not None and not bits & _BIT["device"]:
                    m = "host" if bits & _BIT["host"] else "disk"
                    out[m] = out.get(m, 0) + 1
        return out

    def blocks_by_medium(self, worker: str) -> dict[str, int]:
        """How many blocks ``worker`` holds, each counted once in its best medium."""
        total = self.blocks_of(worker)
        below = {"host": 0, "disk": 0}
        for bits in self._media.get(worker, {}).values():
            if not bits & _BIT["device"]:
                below["host" if bits & _BIT["host"] else "disk"] += 1
        return {"device": total - below["host"] - below["disk"], **below}

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

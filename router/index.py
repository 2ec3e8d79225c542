"""Global prefix index: which workers hold which prefix blocks (fed by KV events, contract 2).

Hashes are contract-1 chain hashes, so a block hash already names its whole prefix:
a worker "holds" a prefix of ``k`` blocks when it holds ``hashes[0..k-1]``. The index is
plain in-process state that any router replica rebuilds from the event stream and the
workers' snapshots (contract 3); it is not thread-safe, callers serialise access (the
consumer applies events from one task and ``match`` runs on the same event loop).

Layout, sized for a fleet (hundreds of workers, 10^5-10^6 cached blocks each; figures in
docs/routing.md, "Scale"): worker ids are interned to small slots, and each block maps to
one Python int used as a bitset of its holders' slots. A block held by one worker points
at that worker's shared ``1 << slot`` object, so it costs one dict entry and its hash; a
shared block costs one extra int for all its holders. ``match`` walks the prompt's block
hashes ANDing masks: O(blocks in the prompt + workers that match), and a dict lookup and an
int AND per block whatever the fleet size. Per worker a set of its hashes (the reverse map)
makes ``removed``/``clear_worker``/``replace_worker`` cost O(that worker's blocks).
A per-pair attribute (say the KV tier holding it) belongs in a side mapping beside
``_by_worker``, so the common device-only case stays this compact.

KV tiers (contract 2's optional ``medium``): a worker may hold a block on its device, in host
memory or on disk below it (engine/kv_tier.py). Every medium counts as holding the block for
``match``; the side map ``_media`` keeps the media of the blocks a worker holds in a tier (a
block absent from it is on the device only), so ``removed`` from one medium keeps the block
while another still has it, and ``tier_blocks`` tells the cost model how much of a match must
be loaded rather than being a device hit. A device-only fleet never creates an entry in it.

``ReferencePrefixIndex`` is the plain dict-of-sets version this one replaced; the tests
drive both with the same random event sequences and compare every query.
"""

from __future__ import annotations

import heapq
from itertools import compress, count
from operator import not_
from typing import Iterable, Iterator, Mapping, Sequence

_BIT = {"device": 1, "host": 2, "disk": 4}
_ORDER = ("device", "host", "disk")   # best first
_DIGITS = bytes.maketrans(b"01", b"\x00\x01")
_FEW = 1  # ``match``: alive workers at most this many test the rest of the prompt in their own sets (see there)


def lengths(levels: Iterable[tuple[int, Iterable[str]]]) -> dict[str, int]:
    """``match_levels``'s groups as ``match``'s ``{worker: k}`` (a dict per group, built in C)."""
    result: dict[str, int] = {}
    for k, workers in levels:
        result.update(dict.fromkeys(workers, k))
    return result


class PrefixIndex:
    """hash -> bitset of worker slots, plus each worker's set of hashes (the reverse map)."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}        # block hash -> bitset of holder slots
        self._slot: dict[str, int] = {}           # worker id -> slot
        self._ids: list[str | None] = []          # slot -> worker id (None: free)
        self._bits: list[int] = []                # slot -> 1 << slot, one shared object per slot
        self._by_worker: list[set[int] | None] = []  # slot -> hashes the worker holds
        self._free: list[int] = []                # free slots (heap: lowest reused first, masks stay narrow)
        self._media: dict[str, dict[int, int]] = {}  # worker -> hash -> bits of _BIT, for tier-held blocks
        self.sets_made = 0  # per-worker sets created so far (RouterCore freezes them out of the collector)

    def __len__(self) -> int:
        return len(self._holders)

    # ------------------------------------------------------------ slots

    def _slot_for(self, worker: str) -> int:
        slot = self._slot.get(worker)
        if slot is not None:
            return slot
        if self._free:
            slot = heapq.heappop(self._free)
            self._ids[slot], self._by_worker[slot] = worker, set()
            self.sets_made += 1
        else:
            slot = len(self._ids)
            self._ids.append(worker)
            self._bits.append(1 << slot)
            self._by_worker.append(set())
            self.sets_made += 1
        self._slot[worker] = slot
        return slot

    def _names(self, mask: int, tmp: Sequence[str] = ()) -> Iterator[str]:
        """Worker ids of the set bits of ``mask``; bits past the last slot name ``tmp[j]``. In C: the
        mask's binary digits, lowest first, as 0/1 bytes select from the slot table (a Python loop
        per bit cost ~0.4 us a worker: 53 us for a prompt all 128 workers match)."""
        ids = self._ids + list(tmp) if tmp else self._ids
        return compress(ids, bin(mask)[:1:-1].encode().translate(_DIGITS))  # type: ignore[arg-type]

    # ------------------------------------------------------------ queries

    def workers(self) -> list[str]:
        """Workers with at least one indexed block."""
        return [w for w, s in self._slot.items() if self._by_worker[s]]

    def blocks_of(self, worker: str) -> int:
        """How many blocks ``worker`` is known to hold."""
        slot = self._slot.get(worker)
        return 0 if slot is None else len(self._by_worker[slot])  # type: ignore[arg-type]

    def hashes_of(self, worker: str) -> frozenset[int]:
        """The blocks ``worker`` is known to hold."""
        slot = self._slot.get(worker)
        return frozenset() if slot is None else frozenset(self._by_worker[slot])  # type: ignore[arg-type]

    def holders(self, block_hash: int) -> frozenset[str]:
        return frozenset(self._names(self._holders.get(block_hash, 0)))

    # ------------------------------------------------------------ updates

    def stored(self, worker: str, hashes: Iterable[int], medium: str = "device") -> None:
        """``worker`` now holds every block in ``hashes`` (in ``medium``: device, host or disk)."""
        slot = self._slot.get(worker)
        if slot is None:
            slot = self._slot_for(worker)
        mine = self._by_worker[slot]
        if medium != "device" or self._media.get(worker):
            hashes = list(hashes)
            self._media_stored(worker, mine, hashes, medium)  # type: ignore[arg-type]
        elif type(hashes) is tuple and len(hashes) == 1:  # one block (an event's usual size at the tip)
            h = hashes[0]
            if h not in mine:  # type: ignore[operator]
                mine.add(h)  # type: ignore[union-attr]
                holders, bit = self._holders, self._bits[slot]
                m = holders.get(h)
                holders[h] = bit if m is None else m | bit
            return
        new = set(hashes)
        new -= mine  # type: ignore[operator]
        if not new:
            return
        mine |= new  # type: ignore[operator]
        bit, holders = self._bits[slot], self._holders
        shared = holders.keys() & new  # iterates ``new``, probes the dict (C speed)
        if shared:
            for h in shared:
                holders[h] |= bit
            new -= shared
        holders.update(dict.fromkeys(new, bit))

    def removed(self, worker: str, hashes: Iterable[int], medium: str = "device") -> None:
        """``worker`` no longer holds ``hashes`` in ``medium``; a block it still holds in another
        medium stays. Unknown hashes are ignored."""
        slot = self._slot.get(worker)
        if slot is None:
            return
        media = self._media.get(worker)
        if media:
            hashes = self._media_removed(media, hashes, medium)
        elif medium != "device":
            return
        mine = self._by_worker[slot]
        if type(hashes) is tuple and len(hashes) == 1:  # one block: no set built, ``_unlink`` inline
            h = hashes[0]
            if h in mine:  # type: ignore[operator]
                mine.remove(h)  # type: ignore[union-attr]
                holders, bits = self._holders, self._bits
                m, bit = holders[h], bits[slot]
                if m is bit:
                    del holders[h]
                else:
                    m ^= bit
                    holders[h] = bits[m.bit_length() - 1] if not m & (m - 1) else m
            return
        gone = mine.intersection(hashes)  # type: ignore[union-attr]
        if gone:
            mine -= gone  # type: ignore[operator]
            self._unlink(slot, gone)

    def clear_worker(self, worker: str) -> None:
        """Drop every entry of ``worker`` (a ``cleared`` event, death, or before a resync)."""
        self._media.pop(worker, None)
        slot = self._slot.pop(worker, None)
        if slot is None:
            return
        self._unlink(slot, self._by_worker[slot])  # type: ignore[arg-type]
        self._ids[slot] = self._by_worker[slot] = None
        heapq.heappush(self._free, slot)

    def _unlink(self, slot: int, hashes: Iterable[int]) -> None:
        holders, bits = self._holders, self._bits
        bit = bits[slot]
        for h in hashes:
            m = holders[h]
            if m is bit:
                del holders[h]
            else:
                m ^= bit
                if not m & (m - 1):  # one holder left: point at its shared bit object
                    m = bits[m.bit_length() - 1]
                holders[h] = m

    def replace_worker(self, worker: str, hashes: Iterable[int]) -> None:
        """Resynchronise ``worker`` from a snapshot: its entries become exactly ``hashes``.

        Applied as a difference (blocks gone, blocks new), so a resync of a worker whose
        snapshot mostly agrees with the index costs set operations, not a rebuild. The snapshot's
        blocks are device blocks: tier media are forgotten (the caller stores a snapshot's tier sets
        after it, ``router/event_consumer.py``)."""
        self._media.pop(worker, None)
        new = set(hashes)
        slot = self._slot.get(worker)
        if slot is not None:
            mine = self._by_worker[slot]
            gone = mine - new  # type: ignore[operator]
            if gone:
                mine -= gone  # type: ignore[operator]
                self._unlink(slot, gone)
        self.stored(worker, new)

    # ------------------------------------------------------------ KV tiers (media)

    def _media_stored(self, worker: str, mine: set[int], hashes: list[int], medium: str) -> None:
        media = self._media.setdefault(worker, {})
        bit = _BIT[medium]
        for h in hashes:
            old = media.get(h)
            if old is None:  # not tier-held: on the device if indexed at all
                old = _BIT["device"] if h in mine else 0
            if old | bit != _BIT["device"]:
                media[h] = old | bit
            else:
                media.pop(h, None)

    @staticmethod
    def _media_removed(media: dict[int, int], hashes: Iterable[int], medium: str) -> list[int]:
        """Clears ``medium`` from ``hashes``' media; returns the blocks the worker now holds nowhere."""
        bit, gone = _BIT[medium], []
        for h in hashes:
            old = media.get(h)
            if old is None:  # device only
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
        return gone

    def medium_of(self, worker: str, block_hash: int) -> str | None:
        """The best medium ``worker`` holds the block in (device, then host, then disk), or None."""
        slot = self._slot.get(worker)
        if slot is None or block_hash not in self._by_worker[slot]:  # type: ignore[operator]
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

    # ------------------------------------------------------------ matching

    def match(self, hashes: Sequence[int], extra: Mapping[int, set[str]] | None = None) -> dict[str, int]:
        """Longest cached prefix per worker: ``{worker: k}`` where the worker holds
        ``hashes[0..k-1]`` (contiguous from block 0). Workers with ``k == 0`` are absent.
        ``extra`` adds holders per block (tentative entries, ``router/tentative.py``)."""
        levels, tmp = self._match_masks(hashes, extra)
        return lengths((k, self._names(mask, tmp)) for k, mask in levels)

    def match_levels(self, hashes: Sequence[int],
                     extra: Mapping[int, set[str]] | None = None) -> list[tuple[int, list[str]]]:
        """``match`` grouped by prefix length: ``[(k, workers holding exactly k), ...]``, ``k``
        ascending, each worker once. A fleet that shares a system prompt matches as one big group
        (the policy's ``select_fleet`` walks a group instead of every member)."""
        levels, tmp = self._match_masks(hashes, extra)
        return [(k, list(self._names(mask, tmp))) for k, mask in levels]

    def prefix_len(self, worker: str, hashes: Sequence[int]) -> int:
        """``match(hashes).get(worker, 0)`` for one worker, from its own set (no fleet-wide lookup)."""
        slot = self._slot.get(worker)
        if slot is None:
            return 0
        mine = self._by_worker[slot]
        if mine.issuperset(hashes):  # type: ignore[union-attr]
            return len(hashes)
        return next(compress(count(), map(not_, map(mine.__contains__, hashes))))  # type: ignore[union-attr]

    def tiered_workers(self) -> list[str]:
        """Workers that hold some block in a KV tier (the only ones ``tier_blocks`` can count for)."""
        return [w for w, media in self._media.items() if media]

    def _match_masks(self, hashes: Sequence[int],
                     extra: Mapping[int, set[str]] | None) -> tuple[list[tuple[int, int]], list[str]]:
        """``match`` as ``[(k, bitset of the workers holding exactly k blocks)]``, ``k`` ascending, and
        the names of the bits past the last slot (``extra``'s workers the index has no slot for).

        Two ways to test a block, each where it is cheaper: while several workers are still alive
        (hold every block so far), one lookup in the fleet-wide map tells them all (a dict of millions
        of blocks: a few cache misses per lookup); once ``_FEW`` (one) is left, its own set of hashes
        (100x smaller, mostly in cache) answers for the rest of the prompt, in C (``issuperset``,
        then the first block it lacks). A prompt whose tail only its owner holds paid a fleet-wide
        lookup per block before. With two or more left, a set scan each costs more than one lookup
        where the map is small (8 workers x 100k blocks: p99 +22% at two), so one it is
        (docs/routing.md, "Scale")."""
        if not hashes:
            return [], []
        if extra:
            return self._match_walk(hashes, extra)
        get = self._holders.get
        levels: list[tuple[int, int]] = []
        alive = -1  # every slot
        few = _FEW
        n = len(hashes)
        i = 0
        while i < n:
            kept = alive & get(hashes[i], 0)
            if kept != alive:
                if i:  # the workers whose bit just dropped hold exactly hashes[0..i-1]
                    levels.append((i, alive ^ kept))
                alive = kept
                if not alive:
                    return levels, []
                i += 1
                if alive.bit_count() <= few:
                    break
            else:
                i += 1
        else:
            levels.append((n, alive))
            return levels, []
        rest = hashes[i:] if i else hashes
        by_worker = self._by_worker
        tail: dict[int, int] = {}
        while alive:
            low = alive & -alive
            alive ^= low
            mine = by_worker[low.bit_length() - 1]
            if mine.issuperset(rest):  # type: ignore[union-attr]
                k = n
            else:  # the first block it lacks (lazy, in C)
                k = next(compress(count(i), map(not_, map(mine.__contains__, rest))))  # type: ignore[union-attr]
            tail[k] = tail.get(k, 0) | low
        levels.extend(sorted(tail.items()))
        return levels, []

    def _match_walk(self, hashes: Sequence[int],
                    extra: Mapping[int, set[str]] | None = None) -> tuple[list[tuple[int, int]], list[str]]:
        """``_match_masks`` by the fleet-wide map alone, block by block (with ``extra``: tentative holders)."""
        get = self._holders.get
        extra_masks, tmp = self._extra_masks(hashes, extra) if extra else (None, [])
        levels: list[tuple[int, int]] = []
        alive = -1  # every slot
        i = 0
        for i, h in enumerate(hashes):
            m = get(h, 0)
            if extra_masks is not None:
                m |= extra_masks.get(h, 0)
            kept = alive & m
            if kept != alive:
                if i:  # the workers whose bit just dropped hold exactly hashes[0..i-1]
                    levels.append((i, alive ^ kept))
                alive = kept
                if not alive:
                    return levels, tmp
        if hashes:
            levels.append((i + 1, alive))
        return levels, tmp

    def _extra_masks(self, hashes: Sequence[int],
                     extra: Mapping[int, set[str]]) -> tuple[dict[int, int], list[str]]:
        """``extra`` as bitsets over the prompt's blocks; workers the index has no slot for get
        bits past the last slot, for this call only (returned in bit order)."""
        tmp: dict[str, int] = {}
        out: dict[int, int] = {}
        slot_of, bits, n = self._slot, self._bits, len(self._ids)
        for h in hashes:
            names = extra.get(h)
            if not names:
                continue
            m = 0
            for w in names:
                s = slot_of.get(w)
                if s is not None:
                    m |= bits[s]
                else:
                    b = tmp.get(w)
                    if b is None:
                        b = tmp[w] = 1 << (n + len(tmp))
                    m |= b
            out[h] = m
        return out, list(tmp)


class ReferencePrefixIndex:
    """The plain reference: hash -> set of worker ids, plus the reverse map. Same methods and
    semantics as ``PrefixIndex`` for device events (it keeps no media); kept as the oracle its
    tests compare against."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._by_worker: dict[str, set[int]] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def workers(self) -> list[str]:
        return [w for w, blocks in self._by_worker.items() if blocks]

    def blocks_of(self, worker: str) -> int:
        return len(self._by_worker.get(worker, ()))

    def hashes_of(self, worker: str) -> frozenset[int]:
        return frozenset(self._by_worker.get(worker, ()))

    def holders(self, block_hash: int) -> frozenset[str]:
        return frozenset(self._holders.get(block_hash, ()))

    def stored(self, worker: str, hashes: Iterable[int], medium: str = "device") -> None:
        # (no media here: a block in any medium counts as held, as in ``PrefixIndex.match``)
        mine = self._by_worker.setdefault(worker, set())
        for h in hashes:
            self._holders.setdefault(h, set()).add(worker)
            mine.add(h)

    def removed(self, worker: str, hashes: Iterable[int], medium: str = "device") -> None:
        if medium != "device":  # device-only reference: a tier copy leaving changes nothing it tracks
            return
        mine = self._by_worker.get(worker)
        if mine is None:
            return
        hashes = list(hashes)
        mine.difference_update(hashes)
        self._unlink(worker, hashes)

    def clear_worker(self, worker: str) -> None:
        self._unlink(worker, self._by_worker.pop(worker, set()))

    def _unlink(self, worker: str, hashes: Iterable[int]) -> None:
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._holders[h]

    def replace_worker(self, worker: str, hashes: Iterable[int]) -> None:
        self.clear_worker(worker)
        self.stored(worker, hashes)

    def match(self, hashes: Sequence[int], extra: Mapping[int, set[str]] | None = None) -> dict[str, int]:
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

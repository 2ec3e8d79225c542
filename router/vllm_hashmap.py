"""From a vLLM-style worker's block hashes to our contract-1 chain hashes, per worker.

A vLLM worker names its blocks by its own hashes (ints or bytes depending on its version, over
its own block size, possibly salted), while our router routes by contract-1 chain hashes over
token ids (``engine/hashing.py``). A ``BlockStored`` event carries what is needed to compute ours:
the stored blocks' ``token_ids`` and the external hash of the block before them. So a
``ChainMapper`` keeps, for every external block of one worker it has seen stored, the state of our
chain at the end of that block: our hash of the last full block of ours that ended inside it or
before it, and the tokens after that boundary (fewer than our block size). A stored block's state
is its parent's state plus its tokens; every full block of ours completed inside it gets its hash
and is *owned* by that external block.

Block sizes may differ: nothing above assumes the worker's block size equals ours. Equal sizes own
one block each; a worker with 32-token blocks owns two of our 16-token blocks per block; SGLang's
1-token pages complete one of ours every 16th page. A block of ours leaves the index when the
external block that completed it is removed (caches evict leaves first; a worker that evicts a
middle block stops matching past it anyway, and so does our contiguous ``PrefixIndex.match``).

Not indexed (kept as "opaque" so their descendants are not indexed either): blocks whose parent
the mapper never saw stored (we joined late and the replay did not reach back far enough), blocks
in another hash namespace (a LoRA adapter, or ``extra_keys`` such as a multimodal hash or a cache
salt: our hashes over token ids alone would claim a prefix the worker cannot reuse for a plain
request), blocks of a KV-cache group other than the first (hybrid models publish one event per
group), and blocks on another medium than the GPU (``medium`` "CPU", ...: this index says what a
worker can reuse without a transfer). The router's seed is the model's with no cache salt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.hashing import hash_block
from router.vllm_wire import BlockRemoved, BlockStored, ExternalHash, is_device_medium


@dataclass(frozen=True)
class _Block:
    owned: tuple[int, ...]      # our hashes completed inside this external block
    chain: int | None           # our hash of the last full block of ours ending at or before its end
    tail: tuple[int, ...]       # tokens after that boundary (< our block size)
    indexable: bool


_ROOT = _Block((), None, (), True)


@dataclass
class MapperStats:
    orphans: int = 0         # stored blocks whose parent was never seen (not indexed)
    foreign: int = 0         # stored blocks in another namespace / group (not indexed)
    other_medium: int = 0    # events about another medium than the GPU (ignored)
    unknown_removed: int = 0  # removed hashes never seen stored


@dataclass
class ChainMapper:
    """One worker's external hash -> our chain state; ``stored``/``removed`` return our hashes that
    entered / left the worker's cache (for ``PrefixIndex.stored``/``removed``)."""

    seed: bytes
    block_size: int
    stats: MapperStats = field(default_factory=MapperStats)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        self._blocks: dict[ExternalHash, _Block] = {}
        self._refs: dict[int, int] = {}  # our hash -> external blocks owning it

    def __len__(self) -> int:
        return len(self._blocks)

    def held(self) -> frozenset[int]:
        """Our hashes of every block this worker holds (to reload the index after a rejoin)."""
        return frozenset(self._refs)

    def clear(self) -> None:
        self._blocks.clear()
        self._refs.clear()

    def stored(self, event: BlockStored) -> list[int]:
        if not is_device_medium(event.medium):
            self.stats.other_medium += 1
            return []
        if event.parent is None:
            state = _ROOT
        else:
            state = self._blocks.get(event.parent)
            if state is None:
                self.stats.orphans += len(event.block_hashes)
                state = _Block((), None, (), False)
        foreign = bool(event.lora_id or event.lora_name or (event.group_idx or 0) != 0
                       or (event.extra_keys and any(k is not None for k in event.extra_keys)))
        if foreign and state.indexable:
            self.stats.foreign += len(event.block_hashes)
        indexable = state.indexable and not foreign
        new: list[int] = []
        size, B = event.block_size, self.block_size
        for i, ext in enumerate(event.block_hashes):
            chain, buf = state.chain, state.tail + event.token_ids[i * size:(i + 1) * size]
            owned: list[int] = []
            if indexable:
                full = len(buf) - len(buf) % B
                for start in range(0, full, B):
                    chain = hash_block(chain, self.seed, buf[start:start + B])
                    owned.append(chain)
                buf = buf[full:]
            else:
                buf = ()
            old = self._blocks.get(ext)
            if old is not None:  # stored again (a replay overlapping what we applied): replace it
                self._release(old)
            state = _Block(tuple(owned), chain, tuple(buf), indexable)
            self._blocks[ext] = state
            for h in owned:
                if self._refs.get(h, 0) == 0 and (old is None or h not in old.owned):
                    new.append(h)
                self._refs[h] = self._refs.get(h, 0) + 1
        return new

    def removed(self, event: BlockRemoved) -> list[int]:
        if not is_device_medium(event.medium):
            self.stats.other_medium += 1
            return []
        gone: list[int] = []
        for ext in event.block_hashes:
            block = self._blocks.pop(ext, None)
            if block is None:
                self.stats.unknown_removed += 1
                continue
            gone.extend(self._release(block))
        return gone

    def _release(self, block: _Block) -> list[int]:
        gone = []
        for h in block.owned:
            n = self._refs.get(h, 0) - 1
            if n <= 0:
                self._refs.pop(h, None)
                gone.append(h)
            else:
                self._refs[h] = n
        return gone

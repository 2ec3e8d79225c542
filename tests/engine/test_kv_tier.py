"""KV tiers below the pool (engine/kv_tier.py), without a model: pages round-trip bit for bit, a
damaged page (flipped bytes, truncated, deleted, another block's) is never served, a full disk
turns the disk tier off without an exception reaching the engine, tiers stay within their bounds
and the disk tier's directory is emptied at shutdown unless kept."""

from __future__ import annotations

import os
import resource
import signal
import time

import pytest
import torch

from engine.kv_tier import PENDING, DiskTier, HostTier, KVTiers

SHAPE = (2, 2, 2, 4, 8)   # KVCache.page_shape of an HSD pool: [K/V, layers, Hkv, page_size, D]


def page(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


def settle(tier: DiskTier, timeout_s: float = 10.0) -> None:
    """Wait until the writer thread has written every page put so far."""
    deadline = time.monotonic() + timeout_s
    while tier._staged:
        assert time.monotonic() < deadline, "the disk tier's writer did not catch up"
        time.sleep(0.01)


def take(tiers: KVTiers, h: int, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while (got := tiers.take(h)) is PENDING:
        assert time.monotonic() < deadline, "the loader did not finish"
        tiers.wait_for_load(0.05)
    return got


@pytest.fixture
def events():
    return []


@pytest.fixture
def disk(tmp_path, events):
    tier = DiskTier(str(tmp_path / "tier"), 8, SHAPE, torch.float32, on_event=lambda *e: events.append(e))
    yield tier
    tier.close()


def test_pages_round_trip_bit_for_bit_through_both_tiers(tmp_path, events):
    disk = DiskTier(str(tmp_path / "t"), 8, SHAPE, torch.bfloat16, on_event=lambda *e: events.append(e))
    tiers = KVTiers(HostTier(2, SHAPE, torch.bfloat16, pin=False), disk, on_event=lambda *e: events.append(e))
    pages = {h: page(h, torch.bfloat16) for h in (11, 12, 13)}
    for h, p in pages.items():
        tiers.offload(h, p)
    # the host tier holds two pages: the oldest went one tier down
    assert [tiers.holds(h) for h in (11, 12, 13)] == ["disk", "host", "host"]
    assert ("removed", [11], "host") in events and ("stored", [11], "disk") in events
    settle(disk)
    assert os.path.getsize(disk._file(11)) > pages[11].numel() * 2
    assert tiers.match([12, 13, 11, 99, 12]) == ["host", "host", "disk"]
    for h, p in pages.items():
        got = take(tiers, h)
        assert got.dtype == torch.bfloat16 and torch.equal(got, p)
    stats = tiers.stats()
    assert stats["disk"]["bytes_read"] > 0 and stats["disk"]["pages"] == 1 and stats["host"]["pages"] == 2
    tiers.close()
    assert not os.path.exists(tmp_path / "t")   # emptied and removed: the tier created it


def damage_flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        b = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def damage_truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def damage_delete(path: str) -> None:
    os.unlink(path)


@pytest.mark.parametrize("damage", [damage_flip, damage_truncate, damage_delete])
def test_a_damaged_page_is_detected_and_forgotten(disk, events, damage):
    tiers = KVTiers(None, disk)
    tiers.offload(5, page(5))
    tiers.offload(6, page(6))
    settle(disk)
    damage(disk._file(5))
    assert take(tiers, 5) is None
    assert disk.stats.corrupt == 1 and 5 not in disk and tiers.holds(5) is None
    assert ("removed", [5], "disk") in events
    assert torch.equal(take(tiers, 6), page(6))   # the other page is untouched


def test_a_file_holding_another_block_is_stale(disk):
    tiers = KVTiers(None, disk)
    tiers.offload(7, page(7))
    tiers.offload(8, page(8))
    settle(disk)
    os.replace(disk._file(8), disk._file(7))   # 7's file now holds block 8's page
    assert take(tiers, 7) is None and disk.stats.corrupt == 1
    assert take(tiers, 8) is None and disk.stats.corrupt == 2   # and 8's file is gone


def test_lru_bound_and_pages_served_before_they_are_written(disk, events):
    for h in range(1, 12):
        disk.put(h, page(h))
        assert torch.equal(disk.read(h), page(h))   # from memory or from its file, the same bytes
    assert len(disk.hashes()) == 8 and disk.hashes() == list(range(4, 12))
    assert ("removed", [1], "disk") in events
    settle(disk)
    time.sleep(0.1)   # the writer deletes evicted files after writing the newer ones
    files = sorted(f for f in os.listdir(disk.path) if f.endswith(".kvpage"))
    assert files == sorted(f"{h:016x}.kvpage" for h in range(4, 12))


def test_a_full_disk_turns_the_tier_off_and_nothing_raises(disk, events):
    """RLIMIT_FSIZE stands in for a full filesystem: writes past it fail (EFBIG) as they would with ENOSPC."""
    one = os.path.getsize(_written(disk, 1))
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (one // 2, old_limit[1]))
    try:
        assert disk.put(2, page(2))   # accepted: the write fails later, on the writer thread
        deadline = time.monotonic() + 10
        while disk.enabled:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert disk.stats.errors == 1 and not disk.stats.enabled and disk.stats.pages == 0
    assert disk.hashes() == [] and ("removed", [1, 2], "disk") in events
    assert not disk.put(3, page(3)) and disk.stats.dropped == 1   # off: pages are dropped, not queued
    assert not [f for f in os.listdir(disk.path) if f.endswith(".kvpage")]   # its files freed the space


def _written(disk: DiskTier, h: int) -> str:
    disk.put(h, page(h))
    settle(disk)
    return disk._file(h)


def test_kept_pages_are_found_again_and_checked_on_load(tmp_path):
    path = str(tmp_path / "kept")
    first = DiskTier(path, 8, SHAPE, torch.float32, keep=True)
    first.put(21, page(21))
    first.put(22, page(22))
    settle(first)
    first.close()
    assert sorted(os.listdir(path)) == ["0000000000000015.kvpage", "0000000000000016.kvpage"]
    damage_flip(os.path.join(path, "0000000000000016.kvpage"))
    kept = DiskTier(path, 8, SHAPE, torch.float32, keep=True)
    assert sorted(kept.hashes()) == [21, 22]
    assert torch.equal(kept.read(21), page(21)) and kept.read(22) is None
    kept.close()
    again = DiskTier(path, 8, SHAPE, torch.float32)   # not kept this time: it starts empty and cleans up
    assert again.hashes() == []
    again.close()
    assert not [f for f in os.listdir(path) if f.endswith(".kvpage")]


def test_a_page_of_another_shape_or_dtype_is_refused(tmp_path):
    path = str(tmp_path / "kept")
    first = DiskTier(path, 4, SHAPE, torch.float32, keep=True)
    first.put(31, page(31))
    settle(first)
    first.close()
    other = DiskTier(path, 4, SHAPE, torch.bfloat16, keep=True)
    assert 31 in other and other.read(31) is None and other.stats.corrupt == 1
    other.close()


def test_host_tier_checksum_catches_a_changed_slot():
    host = HostTier(2, SHAPE, torch.float32, pin=False)
    host.put(1, page(1))
    slot, _ = host._slots[1]
    host.slab[slot].view(-1)[3] += 1.0
    assert host.get(1) is None and host.stats.corrupt == 1 and 1 not in host


def test_bounds_are_validated(tmp_path):
    with pytest.raises(ValueError, match="at least 1 page"):
        HostTier(0, SHAPE, torch.float32, pin=False)
    with pytest.raises(ValueError, match="at least 1 page"):
        DiskTier(str(tmp_path), 0, SHAPE, torch.float32)


def test_tier_settings_are_validated_and_reach_the_engine(tmp_path):
    from agentrt.config import ConfigError, ServerConfig
    from engine import EngineConfig

    with pytest.raises(ValueError, match="kv_disk_tokens must be 0 or at least one page"):
        EngineConfig(kv_disk_tokens=8)
    with pytest.raises(ValueError, match="kv_host_tokens must be an integer >= 0"):
        EngineConfig(kv_host_tokens=-16)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="kv_disk_path must be a directory"):
        EngineConfig(kv_disk_tokens=64, kv_disk_path=str(tmp_path / "file"))
    with pytest.raises(ConfigError, match="--kv-disk-tokens -1"):
        ServerConfig.from_sources({"kv_disk_tokens": -1}, environ={})
    assert ServerConfig.from_sources({}, environ={}).engine_config().kv_disk_tokens == 0
    cfg = ServerConfig.from_sources({"kv_disk_path": str(tmp_path), "kv_disk_tokens": 4096},
                                    environ={"AGENTRT_KV_HOST_TOKENS": "256", "AGENTRT_KV_DISK_KEEP": "true"})
    engine = cfg.engine_config()
    assert (engine.kv_disk_tokens, engine.kv_host_tokens, engine.kv_disk_path, engine.kv_disk_keep) == \
        (4096, 256, str(tmp_path), True)


def test_a_turns_tier_breakdown_survives_the_session_store():
    from agentrt.core.turns import SessionManager
    from agentrt.core.store import SessionRecord, TurnRecord
    from router.redis_store import decode_record, encode_record

    by_tier = {"device": 16, "host": 0, "disk": 32}
    turn = TurnRecord("t1", 1, {"role": "assistant", "content": "ok"}, "stop", 60, 2, 48, 0.0,
                      cached_tokens_by_tier=by_tier)
    record = SessionRecord(id="s", model="m", turns=[turn])
    again = decode_record(encode_record(record), 1 << 20)
    assert again.turns[0].cached_tokens_by_tier == by_tier
    assert SessionManager.turn_view("s", again.turns[0])["usage"]["cached_tokens_by_tier"] == by_tier
    old = TurnRecord("t0", 0, {"role": "assistant", "content": "ok"}, "stop", 10, 2, 0, 0.0)
    assert "cached_tokens_by_tier" not in SessionManager.turn_view("s", old)["usage"]


def resident_pages(path: str) -> int:
    """Pages of ``path`` in the OS page cache (mincore(2) over a read-only map of it)."""
    import ctypes
    import mmap

    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, dtype=np.uint8)       # the map's address, without touching its pages
        rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), size, vec)
        del view
    if rc != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec)


@pytest.mark.parametrize("drop", [False, True])
def test_dropping_the_page_cache_leaves_written_pages_on_the_device_only(tmp_path, drop):
    """With ``drop_page_cache`` the written files are not in the page cache (a read goes to the
    device); without it they are (what a warm read-back measures). The bytes read back are the same."""
    tier = DiskTier(str(tmp_path / "t"), 8, SHAPE, torch.float32, drop_page_cache=drop)
    try:
        for h in (1, 2, 3):
            tier.put(h, page(h))
        settle(tier)
        files = [os.path.join(tier.path, f"{h:016x}.kvpage") for h in (1, 2, 3)]
        resident = [resident_pages(f) for f in files]
        assert all(r == 0 for r in resident) if drop else all(r > 0 for r in resident), resident
        assert all(torch.equal(tier.read(h), page(h)) for h in (1, 2, 3))
    finally:
        tier.close()


PARTIAL = (2, 1, 2, 4, 8)   # the same pool's block without its sliding layer (one of the two layers slides)


def partial_page(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(PARTIAL, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_partial_blocks_round_trip_and_say_they_are_partial(tmp_path):
    """A pool whose sliding layers keep only a window stores whole and partial blocks: each round-trips
    bit for bit through the host slab (in its slot's first bytes) and the disk, keeps its kind when the
    host tier evicts it to disk, and a kept directory knows each file's kind again from its header."""
    path = str(tmp_path / "kept")
    disk = DiskTier(path, 8, SHAPE, torch.float32, keep=True, partial_shape=PARTIAL)
    tiers = KVTiers(HostTier(1, SHAPE, torch.float32, pin=False, partial_shape=PARTIAL), disk)
    blocks = {41: partial_page(41), 42: page(42), 43: partial_page(43)}
    for h, b in blocks.items():
        tiers.offload(h, b)
    assert [tiers.holds(h) for h in blocks] == ["disk", "disk", "host"]
    assert [tiers.is_partial(h) for h in blocks] == [True, False, True]
    for h, b in blocks.items():
        got = take(tiers, h)
        assert torch.equal(got, b) and tiers.is_partial_block(got) == (b.shape == PARTIAL)
    with pytest.raises(ValueError, match="blocks shaped"):
        tiers.offload(44, torch.zeros(2, 3, 2, 4, 8))
    settle(disk)
    tiers.close()
    kept = DiskTier(path, 8, SHAPE, torch.float32, keep=True, partial_shape=PARTIAL)
    assert {h: kept.is_partial(h) for h in kept.hashes()} == {41: True, 42: False}
    assert torch.equal(kept.read(41), blocks[41]) and torch.equal(kept.read(42), blocks[42])
    kept.close()


def test_a_whole_block_replaces_a_partial_copy_never_the_reverse(tmp_path, events):
    """An evicted page that still has its sliding page is worth more than the tier's partial copy of the
    same block: it replaces it (``needs`` says so); a partial page never replaces a whole copy."""
    disk = DiskTier(str(tmp_path / "t"), 8, SHAPE, torch.float32, partial_shape=PARTIAL,
                    on_event=lambda *e: events.append(e))
    tiers = KVTiers(None, disk, on_event=lambda *e: events.append(e))
    tiers.offload(51, partial_page(51))
    assert tiers.needs(51, partial=False) and not tiers.needs(51, partial=True)
    tiers.offload(51, page(51))
    assert not tiers.is_partial(51) and torch.equal(take(tiers, 51), page(51))
    assert ("removed", [51], "disk") in events
    assert not tiers.needs(51, partial=True)
    tiers.offload(51, None)            # the engine passes no copy when the tiers need none
    assert not tiers.is_partial(51)
    settle(disk)
    assert torch.equal(disk.read(51), page(51))
    tiers.close()

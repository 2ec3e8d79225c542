"""``freeze_startup_heap`` (agentrt/server.py): what start-up left alive leaves the collector's walks, what
it left as garbage is freed first."""

import gc
import weakref

from agentrt.server import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self   # a reference cycle: only the cyclic collector frees it


def test_freeze_collects_startup_garbage_then_freezes_what_is_alive():
    gc.collect()
    alive = [_Node() for _ in range(3)]
    garbage = _Node()
    dead = weakref.ref(garbage)
    del garbage
    frozen_before = gc.get_freeze_count()
    try:
        freeze_startup_heap()
        assert dead() is None, "start-up's cyclic garbage was frozen instead of freed"
        assert gc.get_freeze_count() >= frozen_before + len(alive)
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(node) in tracked for node in alive), "live start-up objects are still walked"
    finally:
        gc.unfreeze()
    assert any(o is alive[0] for o in gc.get_objects())

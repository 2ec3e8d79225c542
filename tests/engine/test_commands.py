"""Control messages (engine/commands.py): routed by type, every type handled by the engine, an unknown
one refused rather than dropped, and the public methods that send them still do what they say."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from engine import SamplingParams, commands
from engine.commands import Abort, Dispatcher, Pin, Unpin

MESSAGES = {cls for _, cls in inspect.getmembers(commands, inspect.isclass)
            if dataclasses.is_dataclass(cls) and cls.__module__ == commands.__name__}


def test_the_dispatcher_routes_by_type_and_refuses_an_unknown_one():
    seen = []
    dispatch = Dispatcher({Pin: lambda m: seen.append(("pin", m.pin_id)),
                           Unpin: lambda m: seen.append(("unpin", m.pin_id))})
    dispatch(Pin("p", [1, 2], 3.0))
    dispatch(Unpin("p"))
    assert seen == [("pin", "p"), ("unpin", "p")]
    with pytest.raises(TypeError, match="no handler for engine message Abort"):
        dispatch(Abort("r"))


def test_the_engine_handles_every_message_type(default_engine):
    assert len(MESSAGES) == 12
    assert set(default_engine.core.dispatch._handlers) == MESSAGES


def test_abort_pin_and_snapshot_through_the_inbox(default_engine):
    eng = default_engine
    rid = eng.add_request(list(range(100, 140)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    eng.abort_request(rid)
    outs = eng.step()   # the add, then the abort: nothing runs
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [(rid, True, "abort")]
    assert not eng.has_unfinished()
    eng.generate([list(range(200, 240))], SamplingParams(max_tokens=1, temperature=0))
    eng.pin("pin-a", list(range(200, 240)), 60.0)
    eng.extend_pin("pin-a", 90.0)
    snap = eng.request_cache_snapshot(extra=lambda: "mark")
    assert eng.step() == []   # messages that end no request emit nothing (AsyncEngine reads each output)
    hashes, extra = snap.result(timeout=5)
    assert extra == "mark" and len(hashes) >= 40 // eng.config.page_size
    assert eng.pin_active("pin-a")
    eng.unpin("pin-a")
    assert eng.step() == []
    assert not eng.pin_active("pin-a")
    eng.pin("pin-b", list(range(200, 240)), 60.0)
    assert eng.step() == [] and eng.pin_active("pin-b")
    eng.demote("pin-b")   # no tiers here: a demotion is a release
    eng.prefetch("pin-b")
    assert eng.step() == []
    assert not eng.pin_active("pin-b") and eng.kv_control.prefetches == 0

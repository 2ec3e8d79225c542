"""Turn coalescing: the serving loop holds its next step briefly for an agent's next turn."""

import asyncio

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.engine import AsyncEngine
from engine.coalesce import TurnCoalescer


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_no_hold_before_a_prefill_step_was_measured():
    c = TurnCoalescer(0.2, 0.1, clock=FakeClock())
    c.on_finish(3)
    assert c.window_s == 0.0
    assert c.delay() == 0.0


def test_hold_until_every_finished_turn_came_back():
    clock = FakeClock()
    c = TurnCoalescer(0.2, 0.1, clock=clock)
    c.on_step(1.0, prefill_tokens=0)          # decode-only steps do not size the window
    assert c.window_s == 0.0
    c.on_step(3.0, prefill_tokens=400)
    assert c.window_s == pytest.approx(0.2)   # 10% of 3 s, capped at 0.2 s
    c.on_finish(2)
    assert c.delay() == pytest.approx(0.2)
    clock.t += 0.05
    assert c.delay() == pytest.approx(0.15)
    c.on_arrival()
    assert c.delay() == pytest.approx(0.15)   # one of the two is still owed
    c.on_arrival()
    assert c.delay() == 0.0
    c.on_arrival()                             # an unrelated arrival owes nothing
    assert c.delay() == 0.0


def test_a_turn_that_does_not_come_back_holds_only_for_the_window():
    clock = FakeClock()
    c = TurnCoalescer(0.2, 0.1, clock=clock)
    c.on_step(3.0, prefill_tokens=400)
    c.on_finish(1)
    clock.t += 0.25
    assert c.delay() == 0.0
    c.on_finish(1)                              # a later finish starts its own window
    assert c.delay() == pytest.approx(0.2)


def test_fast_steps_make_a_short_window_and_zero_turns_it_off():
    clock = FakeClock()
    fast = TurnCoalescer(0.2, 0.1, clock=clock)
    fast.on_step(0.02, prefill_tokens=300)      # a GPU-speed prefill step
    assert fast.window_s == pytest.approx(0.002)
    off = TurnCoalescer(0.0, 0.1, clock=clock)
    off.on_step(3.0, prefill_tokens=300)
    off.on_finish(1)
    assert off.delay() == 0.0


def test_config_rejects_bad_coalescing_settings():
    with pytest.raises(ValueError, match="turn_coalesce"):
        EngineConfig(turn_coalesce_max_s=-1)
    with pytest.raises(ValueError, match="turn_coalesce"):
        EngineConfig(turn_coalesce_fraction=2)


@pytest.mark.slow
def test_a_session_turn_coming_back_joins_the_very_next_step(tokenizer):
    """A's reply ends (a session turn: it carries a pin TTL) while B is still decoding. C, the
    agent's next turn, comes 50 ms after A's end reached the client (a quick tool call): the
    loop holds B's next decode step for it, so C is in the step right after A's last one.
    The window is the prefill step's own length here (fraction 1), far over 50 ms on a CPU."""
    engine = LLMEngine(EngineConfig(kv_cache_tokens=8192, max_batched_tokens=512,
                                    turn_coalesce_max_s=5.0, turn_coalesce_fraction=1.0))
    steps: list[set[str]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        if batch:
            steps.append({r.request_id for r in batch.requests})
        return batch

    engine.scheduler.schedule = recording_schedule
    prompt_a = tokenizer.encode("You are a careful agent. " * 40)
    prompt_b = tokenizer.encode("Count slowly from one to one hundred.")

    async def run() -> None:
        ae = AsyncEngine(engine)
        try:
            a = ae.submit(prompt_a, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), "A",
                          lease_ttl_s=30.0)
            b = ae.submit(prompt_b, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), "B")
            async for out in a:
                assert out.finish_reason in (None, "length")
            await asyncio.sleep(0.05)
            c = ae.submit(prompt_a + tokenizer.encode(" Next turn."),
                          SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), "C")
            async for _ in c:
                pass
            async for _ in b:
                pass
        finally:
            await ae.shutdown()

    asyncio.run(run())
    last_a = max(i for i, ids in enumerate(steps) if "A" in ids)
    assert "B" in steps[last_a + 1], steps        # B was still decoding
    assert "C" in steps[last_a + 1], steps        # and C did not miss that step
    assert engine.coalescer.waits >= 1            # C came after the loop had begun to hold


@pytest.mark.slow
def test_a_release_applied_during_a_hold_is_published_at_once(tokenizer):
    """A session turn ends and the loop holds its next step for the agent; the session is deleted meanwhile
    and the release of its lease is applied by the hold. The published state (what ``pin_active`` and the
    stats read from other threads) says so at once: with no pin left the serving loop then sleeps until the
    next request, so a state published only by the next step stayed "held" (a router's delete, seen in
    tests/router/test_cluster.py)."""
    engine = LLMEngine(EngineConfig(kv_cache_tokens=8192, max_batched_tokens=512,
                                    turn_coalesce_max_s=5.0, turn_coalesce_fraction=1.0))
    engine.add_request(tokenizer.encode("You are a careful agent. " * 40),
                       SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), "A", pin_ttl_s=30.0)
    while engine.has_unfinished():
        engine.step()
    assert engine.pin_active("A")
    engine.unpin("A")
    assert engine.step_hold() > 0          # the turn is owed a hold, and the hold applied the release
    assert not engine.has_pins() and not engine.pin_active("A")
    assert engine.stats().num_pins == 0


def test_owed_finishes_stay_bounded_without_a_serving_loop():
    """LLMEngine.step() users never call delay(): expired finishes are dropped on the next finish."""
    clock = FakeClock()
    c = TurnCoalescer(0.2, 0.1, clock=clock)
    c.on_step(3.0, prefill_tokens=400)
    for _ in range(1000):
        c.on_finish(1)
        clock.t += 1.0
    assert len(c._finished) == 1

"""The pin-TTL cost model (agentrt/core/leases.py) against a from-scratch reference: the expected net saving
of a pin of every TTL on a fine grid, computed by brute force from its definition (a returning session
saves its recompute; a pin holds its share of a pressed pool while the session is away, however it ends).
"""

from __future__ import annotations

import random
import types

import pytest

from agentrt.core.leases import MIN_PAUSES, ToolPinTTL, best_pause, pin_net, pool_pressure


def reference_net(tau: float, pauses: list[float], c: float, p: float, pool: int) -> float:
    """Net seconds saved per prefix token by a pin of ``tau``, by cases over the pause samples: a pause
    within the TTL saves the recompute and held the pin for the pause; a longer one saved nothing and
    held it for the whole TTL."""
    total = 0.0
    for pause in pauses:
        if pause <= tau:
            total += c - p * pause / pool
        else:
            total += -p * tau / pool
    return total / len(pauses)


def reference_best(pauses: list[float], c: float, p: float, pool: int) -> tuple[float, float]:
    """(the best TTL on a 1 ms grid up to past the longest pause, its net) by brute force."""
    best_tau, best = 0.0, reference_net(0.0, pauses, c, p, pool)
    for i in range(1, int((max(pauses) + 1) * 1000) + 1):
        tau = i / 1000
        net = reference_net(tau, pauses, c, p, pool)
        if net > best + 1e-15:
            best_tau, best = tau, net
    return best_tau, best


CASES = [
    # pauses, recompute s per token, pressure, pool tokens
    ([1.0, 2.0, 10.0], 2e-3, 0.0, 32768),
    ([1.0, 2.0, 10.0], 2e-3, 1.0, 2048),
    ([0.5, 0.5, 3.0, 7.25, 30.0], 1e-3, 0.6, 4096),
    ([4.0], 1e-4, 1.0, 1024),
]


@pytest.mark.parametrize("pauses, c, p, pool", CASES)
def test_the_model_picks_the_reference_best_ttl(pauses, c, p, pool):
    tau = best_pause(pauses, c, p, pool)
    ref_tau, ref_net = reference_best(pauses, c, p, pool)
    if ref_net <= 0:
        assert tau is None
        return
    assert tau == pytest.approx(ref_tau, abs=1e-9)
    assert pin_net(tau, pauses, c, p, pool) == pytest.approx(ref_net, rel=1e-12)
    assert reference_net(tau, pauses, c, p, pool) == pytest.approx(ref_net, rel=1e-12)


def test_the_choice_by_hand():
    # no pressure: holding is free, the longest pause is worth waiting for
    assert best_pause([1.0, 2.0, 10.0], 2e-3, 0.0, 32768) == 10.0
    # a pressed small pool: per token, 2 ms of recompute against 1/2048 s of the engine per second held.
    # tau=1: 1/3*2e-3 - (1+1+1)/3/2048 = 0.000179; tau=2: 2/3*2e-3 - (1+2+2)/3/2048 = 0.000520;
    # tau=10: 2e-3 - 13/3/2048 = -0.000116. So 2 s.
    assert best_pause([1.0, 2.0, 10.0], 2e-3, 1.0, 2048) == 2.0
    # recompute so cheap that no pin pays for itself
    assert best_pause([4.0], 1e-4, 1.0, 1024) is None


def test_random_histories_agree_with_the_reference():
    rng = random.Random(7)
    for _ in range(12):
        pauses = [round(rng.expovariate(1 / 5.0), 3) for _ in range(rng.randint(1, 12))]
        c, p, pool = rng.choice([5e-4, 2e-3, 1e-2]), rng.random(), rng.choice([1024, 8192, 65536])
        tau = best_pause(pauses, c, p, pool)
        ref_tau, ref_net = reference_best(pauses, c, p, pool)
        if ref_net <= 1e-15:
            assert tau is None, (pauses, c, p, pool)
        else:
            assert pin_net(tau, pauses, c, p, pool) == pytest.approx(ref_net, rel=1e-9, abs=1e-15)


def stats(used: int, evictable: int = 0, waiting_tokens: int = 0, total: int = 100, page: int = 16):
    return types.SimpleNamespace(pages_total=total, pages_used=used, pages_evictable=evictable,
                                 waiting_tokens=waiting_tokens, page_size=page)


def test_pool_pressure_counts_what_eviction_cannot_reclaim_and_the_queue():
    assert pool_pressure(stats(used=50, evictable=30)) == (pytest.approx(0.2), 1600)
    assert pool_pressure(stats(used=50, evictable=30, waiting_tokens=16 * 40)) == (pytest.approx(0.6), 1600)
    assert pool_pressure(stats(used=100, waiting_tokens=16 * 100))[0] == 1.0


def test_the_ttl_uses_the_sessions_own_pauses_then_everyones_then_the_fallback():
    model = ToolPinTTL(fallback_ttl_s=120.0, max_ttl_s=600.0, min_ttl_s=1.0, slack=0.25)
    idle = lambda: stats(used=0)   # noqa: E731  (no pressure: the longest pause wins)
    assert model.plan("s", idle).ttl_s == 120.0                 # nothing measured
    model.observe_prefill(1000, 2.0)
    for i, pause in enumerate((4.0, 6.0, 8.0)):
        assert model.plan("s", idle).ttl_s == 120.0             # fewer than MIN_PAUSES pauses measured
        model.tool_call_ended(f"other-{i}", 100.0)
        model.turn_started(f"other-{i}", 100.0 + pause)
    assert MIN_PAUSES == 3
    assert model.plan("s", idle).ttl_s == pytest.approx(8.0 * 1.25)   # everyone's pauses while s has few
    for start in (10.0, 20.0, 30.0):
        model.tool_call_ended("s", start)
        model.turn_started("s", start + 2.0)
    assert model.plan("s", idle).ttl_s == pytest.approx(2.0 * 1.25)   # its own, from MIN_PAUSES on
    model.turn_started("s", 99.0)                        # a turn that followed no tool call: no pause
    assert model.pauses("s") == [2.0, 2.0, 2.0]
    model.recompute_s_per_token = 1e-9                   # recompute almost free: never worth a pin
    assert model.plan("s", lambda: stats(used=100)).demote


def test_before_a_prefill_is_measured_the_fallback_holds():
    model = ToolPinTTL(fallback_ttl_s=120.0, max_ttl_s=600.0)
    for i in range(3):
        model.tool_call_ended("s", 10.0 * i)
        model.turn_started("s", 10.0 * i + 2.0)
    assert model.plan("s", lambda: stats(used=0)).ttl_s == 120.0
    model.observe_prefill(0, 1.0)    # nothing computed (all cached): no measurement
    model.observe_prefill(10, 0.0)
    assert model.recompute_s_per_token == 0.0
    model.observe_prefill(100, 1.0)
    model.observe_prefill(100, 2.0)
    assert model.recompute_s_per_token == pytest.approx(0.9 * 0.01 + 0.1 * 0.02)


def test_the_ttl_is_capped_and_the_history_bounded():
    model = ToolPinTTL(fallback_ttl_s=120.0, max_ttl_s=30.0, max_sessions=2)
    model.observe_prefill(100, 1.0)
    for i, session in enumerate(("a", "b", "c")):
        model.tool_call_ended(session, 0.0)
        model.turn_started(session, 100.0 + i)
    assert model.plan("a", lambda: stats(used=0)).ttl_s == 30.0
    assert len(model._pauses) == 2 and "a" not in model._pauses
    with pytest.raises(ValueError, match="min_ttl_s <= max_ttl_s"):
        ToolPinTTL(fallback_ttl_s=1.0, max_ttl_s=0.5)


def test_a_hinted_pause_is_pinned_through_when_it_fits_and_pays_else_demoted_and_read_back_before_it_ends():
    from agentrt.core.leases import PREFETCH_LEAD_S, PausePlan, prefetch_after

    model = ToolPinTTL(fallback_ttl_s=120.0, max_ttl_s=600.0, min_ttl_s=1.0, slack=0.25)
    idle, full = (lambda: stats(used=0)), (lambda: stats(used=100))   # noqa: E731
    # no prefill measured: a pause that fits is taken to pay; one past max_ttl_s cannot be pinned through
    assert model.plan("s", full, expected_pause_s=40.0) == PausePlan(50.0)
    assert model.plan("s", idle, expected_pause_s=0.2) == PausePlan(1.0)            # min_ttl_s at least
    assert model.plan("s", idle, expected_pause_s=3600.0) == PausePlan(0.0, True, 3600.0 - PREFETCH_LEAD_S)
    # measured: 10 ms a token to recompute, a 1600-token pool. Idle, any pause that fits pays (net = c);
    # full (p = 1), holding a token for 40 s costs 40/1600 = 25 ms > 10 ms: demote, back 2 s before the end
    model.observe_prefill(1000, 10.0)
    assert pin_net(40.0, [40.0], 0.01, 1.0, 1600) == pytest.approx(0.01 - 0.025)
    assert model.plan("s", idle, expected_pause_s=40.0) == PausePlan(50.0)
    assert model.plan("s", full, expected_pause_s=40.0) == PausePlan(0.0, True, 38.0)
    assert model.plan("s", full, expected_pause_s=1.0) == PausePlan(1.25)   # 1/1600 s < 10 ms: pays
    assert prefetch_after(3.0) == 1.5 and prefetch_after(0.0) == 0.0      # the lead is at most half the pause


def test_without_a_hint_a_pause_not_worth_a_pin_is_demoted_and_read_back_at_the_likely_return():
    from agentrt.core.leases import PausePlan, prefetch_after

    model = ToolPinTTL(fallback_ttl_s=120.0, max_ttl_s=600.0, min_ttl_s=1.0, slack=0.25)
    full = lambda: stats(used=100)   # noqa: E731
    assert model.plan("s", full) == PausePlan(120.0)           # nothing measured: the fallback, pinned
    model.observe_prefill(1000, 0.001)                         # recompute almost free
    for i, pause in enumerate((30.0, 40.0, 50.0, 60.0)):
        model.tool_call_ended("s", 1000.0 * i)
        model.turn_started("s", 1000.0 * i + pause)
    # the likely return: the LIKELY_QUANTILE (a quarter) of its pauses, 40 s of [30, 40, 50, 60]
    assert model.plan("s", full) == PausePlan(0.0, True, prefetch_after(40.0))
    assert model.plan("s", lambda: stats(used=0)) == PausePlan(60.0 * 1.25)   # no pressure: pinned through

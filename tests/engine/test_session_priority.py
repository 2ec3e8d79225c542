"""Scheduling by agent session (engine/session_priority.py): least attained service per session first,
aging so that nothing starves, fair share between tenants by weight, explicit priority, preemption in
the reverse order, and the admission of later turns before new sessions under overload.

The scheduler runs here without a model: ``Sim`` plays the engine's part of a step (compute the
scheduled tokens, charge them, sample one token when a request's tokens are all computed), with a
clock that advances a tenth of a second per step, so aging is exact and the tests take no CPU time.
The admission tests use the real engine's ``add_request`` (no step runs).
"""

from __future__ import annotations

import pytest

from engine import EngineConfig, EngineOverloaded, InvalidRequest, SamplingParams, SchedulingKey
from engine.hashing import make_seed
from engine.kv_pool import PagePool
from engine.radix_cache import RadixCache
from engine.request import Request
from engine.scheduler import ScheduledBatch, Scheduler
from engine.session_priority import ServiceLedger, SessionOrder, charge

P = 16
DT = 0.1   # seconds of the fake clock per step


class Sim:
    """A scheduler, its ledger and a fake clock; ``order=False`` is first come, first served."""

    def __init__(self, order: bool = True, aging: float = 0.0, pages: int = 256, max_num_seqs: int = 1,
                 budget: int = 256) -> None:
        self.now = 1000.0
        pool = PagePool(pages)
        self.sched = Scheduler(pool, RadixCache(pool, P, lambda salt: make_seed("test", salt)), P, max_num_seqs,
                               budget)
        self.sched.clock = lambda: self.now
        self.ledger = ServiceLedger()
        self.sched.order = SessionOrder(self.ledger, aging) if order else None
        self.finished: list[Request] = []
        self._next_token = 1

    def add(self, name: str, key: SchedulingKey = SchedulingKey(), prompt: int = 32, out: int = 1,
            priority: int = 0) -> Request:
        """A request of ``prompt`` distinct tokens (no prefix shared with another) and ``out`` output tokens."""
        ids = list(range(self._next_token, self._next_token + prompt))
        self._next_token += prompt
        req = Request(name, ids, SamplingParams(max_tokens=out, priority=priority), None, key=key, arrival=self.now)
        self.sched.enqueue(req)
        return req

    def step(self) -> None:
        batch = self.sched.schedule()
        for req, n in zip(batch.requests, batch.num_new):
            req.num_computed += n
            charge(self.ledger, req, n, self.now)
        for req in batch.requests:
            if req.num_computed == req.num_tokens:   # its logits: one token sampled
                req.output_ids.append(7)
                if len(req.output_ids) >= req.params.max_tokens:
                    self.sched.finish(req)
                    self.finished.append(req)
        self.now += DT

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def names(self) -> list[str]:
        return [r.request_id for r in self.finished]


def test_least_attained_session_goes_first_fcfs_keeps_arrival_order():
    for order, expected in ((True, ["short", "long"]), (False, ["long", "short"])):
        sim = Sim(order=order)
        sim.ledger.charge(SchedulingKey("s-long"), 5000, sim.now)   # a session that already had much service
        sim.ledger.charge(SchedulingKey("s-short"), 10, sim.now)    # one that had little
        sim.add("long", SchedulingKey("s-long"))
        sim.add("short", SchedulingKey("s-short"))
        sim.run(4)
        assert sim.names() == expected, order


def test_a_started_session_goes_before_a_new_one_whatever_its_service():
    """A later turn of a session the engine served (its ledger entry, or ``Request.started`` as the
    engine sets it from ``SchedulingKey.continuing``) is admitted before a new session's first turn that
    arrived earlier, however much service it had (among started ones the least served first); FCFS
    keeps arrival order."""
    for order, expected in ((True, ["marked", "later", "first"]), (False, ["first", "later", "marked"])):
        sim = Sim(order=order)
        sim.ledger.charge(SchedulingKey("s-old"), 5000, sim.now)
        sim.add("first", SchedulingKey("s-new"))
        sim.add("later", SchedulingKey("s-old"))
        sim.add("marked", SchedulingKey("s-marked")).started = True
        sim.run(6)
        assert sim.names() == expected, order


def test_a_session_is_charged_every_turn_and_request_without_session_its_own():
    sim = Sim()
    sim.add("t1", SchedulingKey("s"), prompt=32, out=3)
    sim.add("alone", prompt=48, out=1)
    sim.run(10)
    assert sorted(sim.names()) == ["alone", "t1"]
    # 32 prompt tokens, then one decode step per output token but the last (sampled, never computed)
    assert sim.ledger.session("s") == 32 + 2
    assert sim.finished[sim.names().index("alone")].service == 48
    assert sim.ledger.started("s") and not sim.ledger.started("alone") and not sim.ledger.started("")


def newcomers(sim: Sim, steps: int, every: int) -> None:
    """Run ``steps`` steps, a turn of a short started session arriving every ``every`` steps (each takes
    one step; its session had 1 token of service before)."""
    for i in range(steps):
        if i % every == 0:
            sim.ledger.charge(SchedulingKey(f"s-{i}"), 1, sim.now)
            sim.add(f"new-{i}", SchedulingKey(f"s-{i}"))
        sim.step()


def test_aging_a_session_with_much_service_still_finishes():
    """A stream of short started sessions as fast as the engine serves them: without aging the long
    session waits forever; aged by 100 tokens a second, its 1000 tokens of service are forgiven after
    ~10 s (100 steps)."""
    for aging, finishes in ((100.0, True), (0.0, False)):
        sim = Sim(aging=aging)
        sim.ledger.charge(SchedulingKey("s-long"), 1000, sim.now)
        long = sim.add("long", SchedulingKey("s-long"))
        newcomers(sim, 400, every=1)
        assert (long in sim.finished) is finishes, aging
        if finishes:
            waited = long.admitted_at - long.arrival
            assert 9.0 <= waited <= 12.0, waited   # 1000 tokens / 100 per s, and a step or two


def test_explicit_priority_is_strict_and_lower_goes_first():
    sim = Sim()
    sim.ledger.charge(SchedulingKey("busy"), 10_000, sim.now)
    sim.add("p5", SchedulingKey("fresh-1"), priority=5)
    sim.add("p0", SchedulingKey("fresh-2"))
    sim.add("urgent", SchedulingKey("busy"), priority=-1)   # much service, but its priority is lower
    sim.run(8)
    assert sim.names() == ["urgent", "p0", "p5"]


def tenant_share(order: bool, weights: dict[str, float], served: int) -> float:
    """Tenant b's share of the first ``served`` requests when tenant a runs three sessions and b one,
    each with a backlog of equal requests queued at once (a1, a2, a3, b, a1, ...)."""
    sim = Sim(order=order)
    for i in range(12):
        for session, tenant in (("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b")):
            sim.add(f"{session}-{i}", SchedulingKey(session, tenant, weights[tenant]))
    while len(sim.finished) < served:
        sim.step()
    return sum(r.key.tenant == "b" for r in sim.finished[:served]) / served


def test_tenants_share_by_weight_however_many_sessions_each_runs():
    assert tenant_share(True, {"a": 1.0, "b": 1.0}, 16) == pytest.approx(0.5, abs=0.07)
    assert tenant_share(True, {"a": 3.0, "b": 1.0}, 16) == pytest.approx(0.25, abs=0.07)
    assert tenant_share(True, {"a": 1.0, "b": 3.0}, 16) == pytest.approx(0.75, abs=0.07)
    assert tenant_share(False, {"a": 1.0, "b": 1.0}, 16) == pytest.approx(0.25, abs=0.01)   # FCFS: per request


def test_within_a_tenant_the_least_served_session_goes_first():
    sim = Sim()
    for session in ("a1", "a2"):   # both started, with equal service
        sim.ledger.charge(SchedulingKey(session, "a"), 10, sim.now)
    for i in range(3):
        sim.add(f"a1-{i}", SchedulingKey("a1", "a"))
    sim.add("a2-0", SchedulingKey("a2", "a"))
    sim.run(6)
    assert sim.names()[:3] == ["a1-0", "a2-0", "a1-1"]


def test_preemption_takes_the_running_request_of_greatest_key():
    """Three running requests, the pool dry: the victim is the one whose session had the most service
    (under FCFS, the youngest)."""
    for order, victim in ((True, "heavy"), (False, "young")):
        sim = Sim(order=order, max_num_seqs=3)
        sim.ledger.charge(SchedulingKey("s-heavy"), 9000, sim.now)
        reqs = {}
        for name in ("heavy", "light", "young"):
            reqs[name] = sim.add(name, SchedulingKey("s-" + name), out=10)
            sim.now += 1.0
        sim.step()   # all three admitted, decoding
        assert len(sim.sched.running) == 3
        chosen = sim.sched._victim(ScheduledBatch([], []), exclude=reqs["light"])
        assert chosen is reqs[victim], order


def test_preemption_under_memory_pressure_follows_the_order():
    """Two decoding requests, one page left: the one whose session had more service is preempted, and it
    finishes afterwards; under FCFS the younger one is."""
    for order, preempted in ((True, "heavy"), (False, "light")):
        sim = Sim(order=order, pages=8, max_num_seqs=2)   # 7 usable pages
        sim.ledger.charge(SchedulingKey("s-heavy"), 9000, sim.now)
        heavy = sim.add("heavy", SchedulingKey("s-heavy"), prompt=48, out=40)
        sim.now += 1.0
        light = sim.add("light", SchedulingKey("s-light"), prompt=48, out=40)
        sim.run(300)
        assert {r.request_id for r in sim.finished} == {"heavy", "light"}
        reqs = {"heavy": heavy, "light": light}
        assert reqs[preempted].num_preemptions >= 1, order
        assert sum(r.num_preemptions for r in reqs.values()) == reqs[preempted].num_preemptions, order


def test_the_ledger_is_bounded_and_forgets_the_least_recent_session():
    ledger = ServiceLedger(max_sessions=2, max_tenants=1)
    for name in ("a", "b", "c"):
        ledger.charge(SchedulingKey(name, name), 10, 0.0)
    assert (ledger.started("a"), ledger.started("b"), ledger.started("c")) == (False, True, True)
    assert len(ledger) == 2 and ledger.session("a") == 0
    assert ledger.tenant("b", 0.0) == 0.0 and ledger.tenant("c", 0.0) == 10.0   # one tenant kept


def test_tenant_service_halves_every_half_life():
    ledger = ServiceLedger(half_life_s=60.0)
    ledger.charge(SchedulingKey("s", "t"), 800, 0.0)
    assert ledger.tenant("t", 60.0) == pytest.approx(400.0)
    assert ledger.tenant("t", 180.0) == pytest.approx(100.0)
    ledger.charge(SchedulingKey("s", "t"), 100, 180.0)
    assert ledger.tenant("t", 240.0) == pytest.approx(100.0)


def test_bad_keys_and_priorities_are_refused_with_the_reason():
    for bad in (0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(InvalidRequest, match="weight must be a finite number > 0"):
            SchedulingKey("s", "t", bad)
    for bad in (1.5, "1", True, 2**31):
        with pytest.raises(InvalidRequest, match="priority must be an integer") as err:
            SamplingParams(priority=bad).validate()
        assert err.value.param == "priority"
    SamplingParams(priority=-(2**31 - 1)).validate()
    for field, value in (("scheduling_policy", "lifo"), ("scheduling_aging_tokens_per_s", -1.0),
                         ("started_session_reserve", 1.0)):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: value})


# -- admission under overload: the real engine's add_request (no step runs) --------------------------------

@pytest.fixture(scope="module")
def engines():
    from engine import LLMEngine
    made = {policy: LLMEngine(EngineConfig(kv_cache_tokens=4096, max_waiting=4, started_session_reserve=0.5,
                                           scheduling_policy=policy)) for policy in ("session", "fcfs")}
    yield made
    for engine in made.values():
        engine.close()


def fill(engine, keys: list[SchedulingKey]) -> list[bool]:
    """Add one small request per key (nothing steps, so they all stay queued); True where admitted. The
    queue is emptied afterwards (every admitted request aborted) for the next test."""
    admitted, rids = [], []
    try:
        for key in keys:
            try:
                rids.append(engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=2), key=key))
                admitted.append(True)
            except EngineOverloaded as exc:
                assert exc.retry_after_s >= 1.0
                admitted.append(False)
    finally:
        for rid in rids:
            engine.abort_request(rid)
        engine.step()   # the adds, then the aborts: nothing is left to schedule, so no model runs
        assert not engine.has_unfinished()
    return admitted


def test_new_sessions_get_overloaded_before_later_turns_of_started_ones(engines):
    new = [SchedulingKey(f"n{i}") for i in range(3)]
    later = [SchedulingKey(f"c{i}", continuing=True) for i in range(3)]
    # session policy: new sessions fill half of max_waiting 4; later turns the whole queue
    assert fill(engines["session"], new + later) == [True, True, False, True, True, False]
    assert fill(engines["fcfs"], new + later) == [True, True, True, True, False, False]
    engine, rids = engines["session"], []
    with pytest.raises(EngineOverloaded, match="for a new session \\(50% of the queue is kept"):
        try:
            for i in range(3):
                rids.append(engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), key=SchedulingKey(f"x{i}")))
        finally:
            for rid in rids:
                engine.abort_request(rid)
            engine.step()
    assert len(rids) == 2


def test_a_session_the_engine_served_counts_as_started(engines):
    engine = engines["session"]
    engine.ledger.charge(SchedulingKey("served"), 10, 0.0)
    keys = [SchedulingKey("n0"), SchedulingKey("n1"), SchedulingKey("served"), SchedulingKey("n2")]
    assert fill(engine, keys) == [True, True, True, False]
    with pytest.raises(InvalidRequest, match="key must be a SchedulingKey"):
        engine.add_request([1, 2], SamplingParams(max_tokens=2), key={"session": "s"})


def test_the_engine_charges_each_step_to_the_session_and_tenant(engines):
    """A real step: the prompt's computed tokens and each decode step are charged to the key's session
    and tenant; the session is then started for admission."""
    engine = engines["session"]
    key = SchedulingKey("charged", "t-1", 2.0)
    prompt = list(range(300, 340))   # 40 tokens no earlier test computed
    before = engine.ledger.tenant("t-1", 0.0)
    assert before == 0.0 and not engine.ledger.started("charged")
    engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), key=key)
    while engine.has_unfinished():
        engine.step()
    assert engine.ledger.session("charged") == 40 + 2   # the last sampled token is never computed
    assert engine.ledger.started("charged")
    assert engine.stats().waiting_by_priority == {}

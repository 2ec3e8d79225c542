"""Admission control on KV demand: ``max_waiting_tokens`` and the prompt-larger-than-the-pool check.

One small engine: 24 usable pages of 16 tokens (384 tokens of KV), two requests running at
once, and at most 96 tokens of queued prompts.
"""

import pytest

from engine import EngineConfig, EngineOverloaded, InvalidRequest, LLMEngine, SamplingParams
from engine.tokenizer import encode_chat

LIMIT = 96
POOL_TOKENS = 24 * 16
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(kv_cache_tokens=POOL_TOKENS + 16, max_batched_tokens=64, max_num_seqs=2,
                                  max_waiting_tokens=LIMIT))


def prompt(engine, i: int, n: int) -> list[int]:
    """Exactly ``n`` tokens ending in a chat turn that differs with ``i``."""
    ids = encode_chat(engine.tokenizer, [{"role": "user", "content": f"Tell me a fact about the number {i}. " * 60}])
    assert len(ids) >= n
    return ids[-n:]


def check_count(engine) -> None:
    """The counter equals what the waiting requests say they added (and each its own tokens)."""
    waiting = list(engine.scheduler.waiting)
    assert engine.stats().waiting_tokens == sum(r.queued_tokens for r in waiting)
    assert all(r.queued_tokens == r.num_tokens for r in waiting)


def absorb(out: dict[str, dict], outputs) -> None:
    for o in outputs:
        if o.request_id in out:
            out[o.request_id]["tokens"] += o.token_ids
            if o.finished:
                out[o.request_id]["reason"] = o.finish_reason


def run(engine, out: dict[str, dict]) -> dict[str, dict]:
    """Step until every request in ``out`` finishes, checking the counter after each step."""
    while any(o["reason"] is None for o in out.values()):
        absorb(out, engine.step())
        check_count(engine)
    return out


def track(*ids: str) -> dict[str, dict]:
    return {rid: {"tokens": [], "reason": None} for rid in ids}


@pytest.mark.slow
def test_waiting_tokens_past_the_limit_are_refused_and_admitted_ones_finish(engine):
    prompts = [prompt(engine, i, 32) for i in range(4)]
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert engine.stats().waiting_tokens == 0
    ids = [engine.add_request(p, GREEDY) for p in prompts[:3]]  # 3 x 32 = 96: exactly the limit
    st = engine.stats()
    assert (st.waiting, st.waiting_tokens, st.waiting_tokens_limit) == (3, 96, LIMIT)
    with pytest.raises(EngineOverloaded,
                       match=r"^96 tokens of queued requests .* prompt adds 32, over the limit of 96 waiting tokens$"):
        engine.add_request(prompts[3], GREEDY)
    assert engine.stats().waiting_tokens == 96  # the refused request left no trace
    out = track(*ids)
    absorb(out, engine.step())  # two are admitted (max_num_seqs=2), one still waits
    check_count(engine)
    assert engine.stats().waiting_tokens == 32 and engine.stats().running == 2
    ids.append(engine.add_request(prompts[3], GREEDY))  # 32 + 32 <= 96 now
    out[ids[-1]] = {"tokens": [], "reason": None}
    assert engine.stats().waiting_tokens == 64
    run(engine, out)
    assert [out[r]["tokens"] for r in ids] == alone
    assert all(out[r]["reason"] == "length" for r in ids)
    st = engine.stats()
    assert (st.waiting, st.waiting_tokens, st.running) == (0, 0, 0)


@pytest.mark.slow
def test_a_request_over_the_limit_runs_when_nothing_waits(engine):
    big, small = prompt(engine, 7, 150), prompt(engine, 8, 10)
    rid = engine.add_request(big, GREEDY)  # 150 > 96, but the queue is empty
    assert engine.stats().waiting_tokens == 150
    with pytest.raises(EngineOverloaded, match=r"^150 tokens .* adds 10, over the limit of 96 "):
        engine.add_request(small, GREEDY)
    out = run(engine, track(rid))
    assert out[rid]["reason"] == "length" and len(out[rid]["tokens"]) == 8
    assert engine.stats().waiting_tokens == 0
    assert engine.generate([small], GREEDY)[0].finish_reason == "length"


@pytest.mark.slow
def test_a_prompt_the_pool_cannot_hold_is_invalid(engine):
    with pytest.raises(InvalidRequest, match=f"the prompt has {POOL_TOKENS + 1} tokens but the KV cache holds "
                                             f"only {POOL_TOKENS} tokens"):
        engine.add_request(prompt(engine, 9, POOL_TOKENS + 1), GREEDY)
    assert engine.stats().waiting_tokens == 0 and not engine.has_unfinished()
    # exactly the pool: admitted alone, prefilled, and ended by the pool after its first token
    res = engine.generate([prompt(engine, 9, POOL_TOKENS)], GREEDY)[0]
    assert (res.finish_reason, len(res.token_ids), res.error) == ("length", 1, None)


def test_abort_while_queued_or_running_returns_the_count_to_zero(engine):
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    a, b, c = (engine.add_request(prompt(engine, i, 32), long) for i in (11, 12, 13))
    engine.step()
    assert engine.stats().waiting_tokens == 32  # c waits behind a and b
    d = engine.add_request(prompt(engine, 14, 20), long)  # still in the inbox when aborted
    assert engine.stats().waiting_tokens == 52
    for rid in (c, d, a):  # queued, in the inbox, running
        engine.abort_request(rid)
    reasons = {o.request_id: o.finish_reason for o in engine.step() if o.finished}
    assert reasons == {c: "abort", d: "abort", a: "abort"}
    check_count(engine)
    assert engine.stats().waiting_tokens == 0 and engine.stats().running == 1
    engine.abort_request(b)
    assert [o.finish_reason for o in engine.step() if o.finished] == ["abort"]
    st = engine.stats()
    assert (st.waiting_tokens, st.running, st.waiting) == (0, 0, 0)
    assert st.pages_used == st.pages_cached  # nothing leaked: what is left is evictable cache


@pytest.mark.slow
def test_a_preempted_request_counts_its_tokens_until_it_resumes(engine):
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    engine.flush_cache()
    a = engine.add_request(prompt(engine, 21, 100), params)
    engine.step()  # a is admitted, so the queue is empty again: b (100 > 96 tokens) is admitted too
    b = engine.add_request(prompt(engine, 22, 100), params)
    seen = []
    out = {a: None, b: None}
    while None in out.values():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = (o.finish_reason, o.completion_tokens)
        check_count(engine)
        seen += [r.queued_tokens for r in engine.scheduler.waiting if r.output_ids]
    # 2 x 200 tokens need 26 pages of the 24: b was preempted with output, counted with it
    assert engine.scheduler.num_preemptions > 0 and seen and min(seen) > 100
    assert out == {a: ("length", 100), b: ("length", 100)}
    assert engine.stats().waiting_tokens == 0


@pytest.mark.slow
def test_generate_waits_for_room_instead_of_failing(engine):
    prompts = [prompt(engine, 30 + i, 40) for i in range(5)]  # 200 tokens: over the limit at once
    res = engine.generate(prompts, GREEDY)
    assert [r.finish_reason for r in res] == ["length"] * 5
    assert res[4].token_ids == engine.generate([prompts[4]], GREEDY)[0].token_ids
    assert engine.stats().waiting_tokens == 0


def test_config_default_and_validation():
    cfg = EngineConfig(kv_cache_tokens=1024, page_size=16)
    assert cfg.waiting_tokens_limit == 2 * (1024 - 16)
    assert EngineConfig(max_waiting_tokens=5).waiting_tokens_limit == 5
    with pytest.raises(ValueError, match="max_waiting_tokens"):
        EngineConfig(max_waiting_tokens=0)


def test_auto_dtype_is_bf16_only_where_the_cpu_computes_it_natively():
    from engine.config import cpu_has_native_bf16

    xeon = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\n"
    old = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n"
    assert cpu_has_native_bf16(xeon) and not cpu_has_native_bf16(old)
    assert cpu_has_native_bf16("flags : amx_bf16 amx_tile") and not cpu_has_native_bf16("no flags line")
    assert EngineConfig(dtype="float32").resolved_dtype() == "float32"  # an explicit choice is kept
    expected = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert EngineConfig(dtype="auto", device="cpu").resolved_dtype() == expected
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int3")

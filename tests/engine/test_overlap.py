"""Overlap scheduling (engine/overlap.py) against the engine without it, token for token.

The reference is the plain engine of the same configuration (greedy, float32, the default model):
the overlapped engine must give the same tokens, text and finish reasons with stop strings and
tokens, max_tokens, an abort mid-run, speculative decoding, a JSON-schema constrained request among
free ones and a KV pool small enough to preempt; and it must really have run steps ahead (scheduled
step n+1 before step n's tokens were known) on the forward thread.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
import engine.engine as engine_module
from engine.tokenizer import encode_chat
from engine.grammar import constraint_for_request

BASE = dict(kv_cache_tokens=8192, max_batched_tokens=256)   # default_engine's settings, a quarter of its pool (1.5 GB less a side)
TINY = dict(kv_cache_tokens=24 * 16 + 16, max_batched_tokens=64, max_num_seqs=8)
ASKS = ["Name three animals that live in the ocean.", "What is the capital of France? Explain.",
        "Write a haiku about autumn.", "List four prime numbers and say why they are prime.",
        "Describe a bicycle to a child.", "Why is the sky blue?"]
QUOTE = "Repeat the following text exactly, with no change and no comment:\n\n"
COPY = ("The deploy script reads the manifest, checks every service's health endpoint, drains the old "
        "workers one by one and starts the new ones with the same ports and the same limits.")
PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}}}


def chat(tok, text):
    return encode_chat(tok, [{"role": "user", "content": text}])


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def results(rs):
    return [(r.token_ids, r.text, r.finish_reason, r.stop_reason) for r in rs]


class LaunchSpy:
    """Records, for each step the engine launches, whether the next may run ahead of it, and the
    threads the model ran on."""

    def __init__(self, engine: LLMEngine) -> None:
        self.run_ahead: list[bool] = []
        self.threads: set[str] = set()
        launch, execute = engine.executor.launch, engine.runner.execute

        def spy_launch(step, prev):
            self.run_ahead.append(step.run_ahead)
            launch(step, prev)

        def spy_execute(inputs, previous=None):
            self.threads.add(threading.current_thread().name)
            return execute(inputs, previous)
        engine.executor.launch, engine.runner.execute = spy_launch, spy_execute


def assert_idle(engine: LLMEngine) -> None:
    """Nothing left in flight, every page back in the pool or the cache."""
    st = engine.stats()
    assert not engine.has_unfinished() and engine.scheduler.launched_step is None
    assert st.running == 0 and st.waiting == 0 and st.pages_used == st.pages_cached


@pytest.fixture(scope="module")
def overlapped():
    engine = LLMEngine(EngineConfig(**BASE, overlap_schedule=True))
    yield engine
    engine.close()


@pytest.mark.slow
def test_concurrent_requests_and_max_tokens(default_engine, overlapped, tokenizer):
    """Six requests of different lengths (1 to 48 tokens, ending at max_tokens or EOS) and a seeded
    sampled one: the same tokens; requests ending at max_tokens are never scheduled past it."""
    prompts = [chat(tokenizer, a) for a in ASKS] + [chat(tokenizer, ASKS[0])]
    params = [greedy(m) for m in (1, 2, 5, 17, 48, 48)] + [SamplingParams(max_tokens=24, temperature=0.8, seed=7)]
    spy = LaunchSpy(overlapped)
    rows = {}
    schedule = overlapped.scheduler.schedule

    def counting():
        batch = schedule()
        for req in batch.requests:
            rows[req.request_id] = rows.get(req.request_id, 0) + 1
        return batch
    overlapped.scheduler.schedule = counting
    try:
        ref, got = default_engine.generate(prompts, params), overlapped.generate(prompts, params)
    finally:
        del overlapped.scheduler.schedule
    assert results(got) == results(ref)
    assert [len(r.token_ids) for r in got[:4]] == [1, 2, 5, 17]
    assert sum(spy.run_ahead) >= 40
    assert spy.threads and all(t.startswith("agentrt-forward") for t in spy.threads)
    # one prefill step and a step per token after the first, as without overlap: none wasted past max_tokens
    assert [rows[r.request_id] for r in got[:4]] == [1, 2, 5, 17]
    assert_idle(overlapped)


@pytest.mark.slow
def test_stop_strings_and_stop_tokens(default_engine, overlapped, tokenizer):
    """Stops found one step behind: the token computed after the stop is dropped, text cut as before."""
    prompt = chat(tokenizer, QUOTE + COPY)
    ref = default_engine.generate([prompt], greedy(60))[0]
    assert len(ref.text) > 80
    stops = [ref.text[40:46], ref.text[70:73]]
    params = ([greedy(60, stop=[s]) for s in stops] + [greedy(60, stop_token_ids=[ref.token_ids[k]]) for k in (0, 9)]
              + [greedy(60, stop=[ref.text[20:25]], stop_token_ids=[ref.token_ids[30]])])
    off = default_engine.generate([prompt] * len(params), params)
    on = overlapped.generate([prompt] * len(params), params)
    assert results(on) == results(off)
    assert all(r.finish_reason == "stop" for r in on) and len(on[2].token_ids) == 1
    assert_idle(overlapped)


def run_with_abort(engine, prompts, params, victim, after_steps):
    """Step the engine, aborting request ``victim`` after ``after_steps`` steps; (tokens, finish) each."""
    ids = [engine.add_request(p, params) for p in prompts]
    tokens, finish = {rid: [] for rid in ids}, {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                finish[out.request_id] = out.finish_reason
        steps += 1
        if steps == after_steps:
            engine.abort_request(ids[victim])
    return [tokens[r] for r in ids], [finish[r] for r in ids]


@pytest.mark.slow
def test_abort_mid_run(default_engine, overlapped, tokenizer):
    """An abort while the request's step is in flight: its placeholders go, its pages come back, the
    others are unchanged and its streamed tokens are the start of its reply."""
    prompts = [chat(tokenizer, a) for a in ASKS[:4]]
    params = greedy(32, ignore_eos=True)
    full = default_engine.generate(prompts, params)
    for engine in (default_engine, overlapped):
        tokens, finish = run_with_abort(engine, prompts, params, victim=1, after_steps=8)
        assert finish == ["length", "abort", "length", "length"]
        assert [tokens[i] for i in (0, 2, 3)] == [full[i].token_ids for i in (0, 2, 3)]
        assert 0 < len(tokens[1]) < 32 and tokens[1] == full[1].token_ids[:len(tokens[1])]
        assert_idle(engine)


@pytest.mark.slow
def test_speculative_decoding(default_engine, tokenizer):
    """Speculation on: steps whose requests may draft are committed before the next is scheduled; a
    request with logprobs (it never drafts) runs ahead. Tokens as without speculation or overlap."""
    engine = LLMEngine(EngineConfig(**BASE, speculative="suffix", overlap_schedule=True))
    spy = LaunchSpy(engine)
    prompts = [chat(tokenizer, QUOTE + COPY), chat(tokenizer, ASKS[1]), chat(tokenizer, ASKS[2])]
    params = [greedy(64), greedy(24), greedy(80, logprobs=2, ignore_eos=True)]
    ref, got = default_engine.generate(prompts, params), engine.generate(prompts, params)
    assert results(got) == results(ref)
    assert [lp.token_id for lp in got[2].logprobs] == got[2].token_ids
    st = engine.stats()
    assert st.spec_accepted_tokens_total > 20
    assert any(spy.run_ahead) and not all(spy.run_ahead)
    assert_idle(engine)
    engine.close()


@pytest.mark.slow
def test_constrained_request_among_free_ones(default_engine, overlapped, tokenizer):
    """A JSON-schema request runs its steps in sync (its mask needs its last token), the free requests
    beside it too while it samples; alone they run ahead. Same tokens, valid JSON."""
    prompts = [chat(tokenizer, "Give me a JSON person named Ana, aged 31."), chat(tokenizer, ASKS[0]),
               chat(tokenizer, ASKS[4])]
    params = [greedy(64), greedy(40, ignore_eos=True), greedy(80, ignore_eos=True)]

    def cons():
        return [constraint_for_request(tokenizer, response_format=PERSON), None, None]
    spy = LaunchSpy(overlapped)
    ref, got = default_engine.generate(prompts, params, cons()), overlapped.generate(prompts, params, cons())
    assert results(got) == results(ref)
    assert got[0].finish_reason == "stop" and set(json.loads(got[0].text)) == {"name", "age"}
    assert any(spy.run_ahead) and not all(spy.run_ahead)
    assert_idle(overlapped)


@pytest.mark.slow
def test_preemption_with_a_tiny_pool():
    """A pool of 24 pages for six 40-token replies: requests are preempted while their tokens are in
    flight (their placeholders travel with them back to the queue) and resume; same tokens."""
    off, on = LLMEngine(EngineConfig(**TINY)), LLMEngine(EngineConfig(**TINY, overlap_schedule=True))
    tok = off.tokenizer
    prompts = [chat(tok, f"Repeat: {i} apples, {i + 1} pears, {i + 2} plums, {i} apples.") for i in range(6)]
    params = greedy(40, ignore_eos=True)
    spy = LaunchSpy(on)
    ref, got = off.generate(prompts, params), on.generate(prompts, params)
    assert results(got) == results(ref)
    assert all(len(r.token_ids) == 40 for r in got)
    assert off.scheduler.num_preemptions > 0 and on.scheduler.num_preemptions > 0
    assert sum(spy.run_ahead) > 20
    assert_idle(on)
    on.close()


@pytest.mark.slow
def test_a_failed_step_leaves_requests_at_their_last_commit(default_engine, overlapped, tokenizer):
    """A forward that raises: step() raises, the launched steps are forgotten (no placeholder, no row in
    flight left) and stepping on recomputes from the last commit, to the reference's tokens."""
    prompts = [chat(tokenizer, a) for a in ASKS[:3]]
    params = greedy(20, ignore_eos=True)
    ref = default_engine.generate(prompts, params)
    execute, calls = overlapped.runner.execute, [0]

    def flaky(inputs, previous=None):
        calls[0] += 1
        if calls[0] == 6:
            raise RuntimeError("device lost")
        return execute(inputs, previous)
    overlapped.runner.execute = flaky
    ids = [overlapped.add_request(p, params) for p in prompts]
    tokens = {rid: [] for rid in ids}
    failed = 0
    try:
        while overlapped.has_unfinished():
            try:
                outs = overlapped.step()
            except RuntimeError as e:
                assert "device lost" in str(e)
                failed += 1
                live = list(overlapped.scheduler.running) + list(overlapped.scheduler.waiting)
                assert live and all(r.pending == 0 and r.num_inflight == 0 and -1 not in r.output_ids for r in live)
                continue
            for out in outs:
                tokens[out.request_id] += out.token_ids
    finally:
        del overlapped.runner.execute
    assert failed == 1
    assert [tokens[r] for r in ids] == [r.token_ids for r in ref]
    assert_idle(overlapped)


@pytest.mark.slow
def test_streams_through_the_async_engine(default_engine, tokenizer, monkeypatch):
    """The serving loop: AsyncEngine steps an overlapped engine until nothing is in flight; the streamed
    deltas are the plain engine's reply. The model is loaded on the forward thread, which runs it."""
    prompt = chat(tokenizer, ASKS[3])
    ref = default_engine.generate([prompt], greedy(24))[0]
    build, loaded_on = engine_module.build_engine, []

    def recording_build(*args):
        loaded_on.append(threading.current_thread().name)
        return build(*args)
    monkeypatch.setattr(engine_module, "build_engine", recording_build)

    async def run():
        ae = AsyncEngine.from_config(EngineConfig(**BASE, overlap_schedule=True))
        try:
            ids, text = [], ""
            async for out in ae.submit(prompt, greedy(24)):
                ids += out.token_ids
                text += out.text
            return ids, text, ae.engine.has_unfinished()
        finally:
            await ae.shutdown()
            ae.engine.close()

    ids, text, busy = asyncio.run(run())
    assert (ids, text) == (ref.token_ids, ref.text)
    assert not busy
    assert len(loaded_on) == 1 and loaded_on[0].startswith("agentrt-forward")


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="overlap_schedule"):
        EngineConfig(overlap_schedule="yes")
    assert EngineConfig().overlap_schedule is False

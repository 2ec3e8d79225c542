"""Scheduling behaviour with the real default model: cache reuse, page pressure, pins, stops."""

import pytest

from engine import EngineConfig, InvalidRequest, LLMEngine, SamplingParams
from engine.tokenizer import OutputProcessor, encode_chat

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def chat(tok, text, system="You are a careful assistant who answers briefly."):
    return encode_chat(tok, [{"role": "system", "content": system}, {"role": "user", "content": text}])


@pytest.fixture(scope="module")
def small_engine():
    """A deliberately tiny KV pool: 24 pages of 16 tokens."""
    return LLMEngine(EngineConfig(kv_cache_tokens=24 * 16 + 16, max_batched_tokens=64, max_num_seqs=8))


@pytest.mark.slow
def test_cached_prefix_gives_identical_output(default_engine, tokenizer):
    default_engine.flush_cache()
    prompt = chat(tokenizer, "Name a large animal that lives in the ocean.") * 3  # > several pages
    cold = default_engine.generate([prompt], GREEDY)[0]
    assert cold.cached_tokens == 0
    warm = default_engine.generate([prompt], GREEDY)[0]
    assert warm.cached_tokens >= len(prompt) - 16
    assert warm.token_ids == cold.token_ids


@pytest.mark.slow
def test_shared_system_prompt_served_from_cache_while_batched(default_engine, tokenizer):
    default_engine.flush_cache()
    system = "You are an agent with tools. " * 30
    prompts = [chat(tokenizer, f"Question number {i}: what is {i} plus {i}?", system) for i in range(4)]
    res = default_engine.generate(prompts, GREEDY)
    # chunked prefill of the first request is shared with the ones admitted after it
    assert sum(r.cached_tokens for r in res) > 0
    alone = [default_engine.generate([p], GREEDY)[0].token_ids for p in prompts[:2]]
    assert alone == [r.token_ids for r in res[:2]]


@pytest.mark.slow
def test_concurrent_prompts_compute_a_shared_prefix_once(default_engine, tokenizer):
    """Four agent sessions on one system prompt, submitted together: the first computes the prompt,
    the others wait for its pages instead of prefilling them alongside (so each hits every full
    shared page), and the output is what each gives alone."""
    default_engine.flush_cache()
    system = "You are an agent with tools: search, read_file, run_tests, open_issue. " * 25
    prompts = [chat(tokenizer, f"Session {i}: the build of module {i} failed; what next?", system) for i in range(4)]
    shared = next(i for i, toks in enumerate(zip(*prompts)) if len(set(toks)) > 1) // 16 * 16
    assert shared >= 20 * 16
    res = default_engine.generate(prompts, GREEDY)
    assert res[0].cached_tokens == 0
    # every full shared page but at most the last (a request defers while 2 or more are pending)
    assert all(shared - 16 <= r.cached_tokens <= shared for r in res[1:]), ([r.cached_tokens for r in res], shared)
    default_engine.flush_cache()
    assert [default_engine.generate([p], GREEDY)[0].token_ids for p in prompts[1:3]] == [r.token_ids for r in res[1:3]]


@pytest.mark.slow
def test_page_pressure_every_request_finishes(small_engine, tokenizer):
    prompts = [chat(tokenizer, f"Tell me a fact about the number {i}.") for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    res = small_engine.generate(prompts, params)
    assert all(r.finish_reason == "length" and len(r.token_ids) == 40 for r in res)
    assert small_engine.scheduler.num_preemptions > 0  # memory really ran out
    # preemption + resume does not change greedy output
    for p, r in zip(prompts[:2], res[:2]):
        assert small_engine.generate([p], params)[0].token_ids == r.token_ids
    st = small_engine.stats()
    assert st.running == 0 and st.waiting == 0
    assert st.pages_used == st.pages_cached  # everything left is evictable cache


def test_request_larger_than_pool_is_refused_at_once(small_engine, tokenizer):
    too_long = chat(tokenizer, "word " * 600)
    with pytest.raises(InvalidRequest, match=f"the prompt has {len(too_long)} tokens but the KV cache holds "
                                             "only 384 tokens"):
        small_engine.add_request(too_long, SamplingParams(max_tokens=4, temperature=0))
    assert not small_engine.has_unfinished()
    res = small_engine.generate([chat(tokenizer, "hi")], SamplingParams(max_tokens=4, temperature=0))
    assert res[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_pin_survives_pressure_until_released(small_engine, tokenizer):
    small_engine.flush_cache()
    prompt = chat(tokenizer, "Remember this sentence about pinning.")
    small_engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
    small_engine.pin("p1", prompt, ttl_s=60)
    small_engine.step()
    assert small_engine.stats().num_pins == 1
    assert small_engine.generate([prompt], GREEDY)[0].cached_tokens > 0
    # pressure: pins give way instead of failing requests
    others = [chat(tokenizer, f"Unrelated question {i} about rivers and mountains.") for i in range(5)]
    res = small_engine.generate(others, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert all(r.finish_reason == "length" for r in res)
    small_engine.unpin("p1")
    small_engine.step()
    assert small_engine.stats().num_pins == 0


def test_pin_expiry(small_engine, tokenizer):
    prompt = chat(tokenizer, "Short-lived pin.")
    small_engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
    small_engine.pin("short", prompt, ttl_s=0.0)
    small_engine.step()
    assert "short" not in small_engine.scheduler.pins


def test_pin_ttl_on_request(default_engine, tokenizer):
    prompt = chat(tokenizer, "Pin me when done.")
    rid = default_engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0), pin_ttl_s=30)
    while default_engine.has_unfinished():
        default_engine.step()
    assert rid in default_engine.scheduler.pins
    pin = default_engine.scheduler.pins[rid]
    node, deadline = pin.node, pin.expires_at
    # A tool call: the session asks for a longer pin by id; the same cached node stays locked.
    default_engine.extend_pin(rid, 120)
    default_engine.step()
    pin = default_engine.scheduler.pins[rid]
    assert pin.node is node and pin.expires_at >= deadline + 89
    default_engine.extend_pin("no-such-pin", 120)  # an expired or released pin: nothing happens
    default_engine.step()
    assert "no-such-pin" not in default_engine.scheduler.pins
    default_engine.unpin(rid)
    default_engine.step()
    assert rid not in default_engine.scheduler.pins


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_and_batch_independent(default_engine, tokenizer):
    p = chat(tokenizer, "Write one sentence about cats.")
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    a = default_engine.generate([p], params)[0]
    b = default_engine.generate([chat(tokenizer, "other"), p], [GREEDY, params])[1]
    assert a.token_ids == b.token_ids
    c = default_engine.generate([p], SamplingParams(max_tokens=16, temperature=0.9, seed=99))[0]
    assert c.token_ids != a.token_ids


@pytest.mark.slow
def test_stop_strings_and_tokens(default_engine, tokenizer):
    p = chat(tokenizer, "Count from 1 to 10, separated by commas.")
    full = default_engine.generate([p], SamplingParams(max_tokens=40, temperature=0))[0]
    assert "5" in full.text
    cut = default_engine.generate([p], SamplingParams(max_tokens=40, temperature=0, stop=["5"]))[0]
    assert cut.finish_reason == "stop" and "5" not in cut.text
    assert full.text.startswith(cut.text)
    first = full.token_ids[3]
    by_token = default_engine.generate([p], SamplingParams(max_tokens=40, temperature=0,
                                                           stop_token_ids=[first]))[0]
    assert by_token.finish_reason == "stop" and by_token.token_ids[-1] == first


@pytest.mark.slow
def test_streamed_deltas_reassemble_the_text(default_engine, tokenizer):
    """The engine emits tokens only; its output processor's deltas split no character and add up to the
    decoded reply."""
    p = chat(tokenizer, "Say something in French with accents, like café or élève.")
    params = SamplingParams(max_tokens=30, temperature=0, stop=["xyzzy"])
    rid = default_engine.add_request(p, params)
    processor = OutputProcessor(tokenizer, params, tokenizer.eos_token_ids)
    parts, ids = [], []
    while default_engine.has_unfinished():
        for out in default_engine.step():
            if out.request_id == rid:
                assert out.text == ""
                out = processor.process(out)
                parts.append(out.text)
                ids.extend(out.token_ids)
                assert "\ufffd" not in out.text
    assert "".join(parts) == tokenizer.decode(ids)


def test_invalid_requests(default_engine, tokenizer):
    n = default_engine.max_model_len
    with pytest.raises(InvalidRequest, match=str(n)):
        default_engine.add_request([5] * n, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequest, match="max_tokens"):
        default_engine.add_request([5] * 10, SamplingParams(max_tokens=n))
    with pytest.raises(InvalidRequest):
        default_engine.add_request([], SamplingParams())
    with pytest.raises(InvalidRequest):
        default_engine.add_request([10**9], SamplingParams())
    with pytest.raises(InvalidRequest, match="temperature"):
        default_engine.add_request([5], SamplingParams(temperature=-1))


def test_abort_frees_pages(default_engine, tokenizer):
    default_engine.flush_cache()
    default_engine.step()
    before = default_engine.stats().pages_used
    rid = default_engine.add_request(chat(tokenizer, "Write a long story."),
                                     SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    for _ in range(3):
        default_engine.step()
    default_engine.abort_request(rid)
    outs = default_engine.step()
    assert any(o.request_id == rid and o.finish_reason == "abort" for o in outs)
    st = default_engine.stats()
    assert st.running == 0
    assert st.pages_used == st.pages_cached >= before

"""``engine.client``: the request check every engine client runs, and the interface both clients implement."""

from __future__ import annotations

import inspect

import pytest

from engine.engine import AsyncEngine
from engine.client import EngineClient, StructuredOutput, check_request
from engine.types import InvalidRequest, SamplingParams
from router.remote import RemoteEngine

PROTOCOL_METHODS = ("constraint", "submit", "extend_lease", "release_lease", "demote_lease", "prefetch_lease", "stats",
                    "cache_snapshot", "shutdown")


@pytest.mark.parametrize("cls", [AsyncEngine, RemoteEngine])
def test_both_engine_clients_implement_the_protocol_with_its_signatures(cls):
    for name in PROTOCOL_METHODS:
        want = inspect.signature(getattr(EngineClient, name))
        have = inspect.signature(getattr(cls, name))
        assert list(have.parameters) == list(want.parameters), (cls.__name__, name, have, want)
        for p, q in zip(have.parameters.values(), want.parameters.values()):
            assert p.kind == q.kind, (cls.__name__, name, p)
        assert inspect.iscoroutinefunction(getattr(cls, name)) == \
            inspect.iscoroutinefunction(getattr(EngineClient, name)), (cls.__name__, name)


def test_check_request_accepts_what_fits_and_returns_ints():
    assert check_request((1, 2, 3), SamplingParams(max_tokens=5), max_model_len=8, vocab_size=10) == [1, 2, 3]


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "the prompt is empty"),
    ([1, 10], SamplingParams(max_tokens=1), "prompt token ids must be in [0, 10)"),
    ([-1], SamplingParams(max_tokens=1), "prompt token ids must be in [0, 10)"),
    (["a"], SamplingParams(max_tokens=1), "a list of integer token ids"),
    ([1] * 8, SamplingParams(max_tokens=1), "the prompt has 8 tokens but this model's context window is 8"),
    ([1] * 5, SamplingParams(max_tokens=4), "use max_tokens <= 3"),
    ([1], SamplingParams(max_tokens=0), "max_tokens must be an integer >= 1"),
    ([1], SamplingParams(max_tokens=1, temperature=3.0), "temperature must be in [0, 2]"),
])
def test_check_request_says_what_is_wrong(prompt, params, message):
    with pytest.raises(InvalidRequest) as err:
        check_request(prompt, params, max_model_len=8, vocab_size=10)
    assert message in str(err.value)


def test_without_a_vocabulary_token_ids_are_left_to_the_worker():
    assert check_request([10_000], SamplingParams(max_tokens=1), max_model_len=8) == [10_000]


def test_structured_output_is_given_when_any_option_is_set():
    assert not StructuredOutput().given
    assert StructuredOutput(tool_choice="required").given
    assert StructuredOutput(response_format={"type": "json_object"}).given


def test_both_output_streams_say_where_they_run():
    from engine.engine import RequestStream
    from router.remote import RemoteStream

    for cls in (RequestStream, RemoteStream):
        assert inspect.iscoroutinefunction(cls.placed) and inspect.iscoroutinefunction(cls.aclose), cls


def test_a_remote_stream_is_placed_by_its_first_output_and_still_yields_it():
    import asyncio

    from engine.types import RequestOutput
    from router.remote import RemoteStream

    outputs = [RequestOutput("r", "a", [1]), RequestOutput("r", "b", [2], finished=True, finish_reason="stop")]

    def stream_of(fail: BaseException | None = None) -> RemoteStream:
        stream = RemoteStream()

        async def attempts():
            stream.worker = "w-1"  # routed: a failover would name the next worker here
            if fail is not None:
                raise fail
            for out in outputs:
                yield out

        stream._attach(attempts())
        return stream

    async def body():
        placed = stream_of()
        assert placed.worker is None
        assert await placed.placed() == "w-1"
        assert [out async for out in placed] == outputs
        assert await placed.placed() == "w-1"  # once iterated: at once
        unplaced = stream_of()  # never placed: iterating routes it all the same
        assert [out async for out in unplaced] == outputs and await unplaced.placed() == "w-1"
        refused = stream_of(RuntimeError("no live worker"))
        with pytest.raises(RuntimeError, match="no live worker"):
            await refused.placed()
        await refused.aclose()

    asyncio.run(body())

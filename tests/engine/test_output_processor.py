"""The output processor (engine/tokenizer.py): the engine emits token ids, the serving side turns
them into text off the engine thread (detokenizing, stop strings, held-back text), and a stop string it
finds ends the request in the engine as an EOS would (cached, a session turn pinned)."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from engine import SamplingParams
from engine.engine import AsyncEngine
from engine.tokenizer import IncrementalDetokenizer, OutputProcessor, encode_chat
from engine.parsers import OutputParser, parse_output
from engine.types import RequestOutput

REPLY = ("Let me check the weather in Zürich first. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
         "{\"city\": \"Zürich\", \"unit\": \"celsius\"}}\n</tool_call> Then I will answer, with café crème.")


def chunkings(n: int, rng: random.Random, count: int):
    """``count`` random splits of ``n`` tokens into outputs of 1 to 5 tokens (a speculative commit
    delivers several at once), the one-token split first."""
    yield [1] * n
    for _ in range(count - 1):
        sizes, left = [], n
        while left:
            sizes.append(min(left, rng.randint(1, 5)))
            left -= sizes[-1]
        yield sizes


def feed(processor: OutputProcessor, ids: list[int], sizes: list[int], *, finish: str = "length"):
    """Feed ``ids`` in outputs of ``sizes`` tokens, the last one finished by ``finish``, as the engine
    emits them (token counts are totals); the processed outputs, None dropped."""
    outs, at = [], 0
    for k, size in enumerate(sizes):
        at += size
        last = k == len(sizes) - 1
        raw = RequestOutput("r", "", ids[at - size:at], finished=last, finish_reason=finish if last else None,
                            prompt_tokens=7, completion_tokens=at)
        out = processor.process(raw)
        if out is not None:
            outs.append(out)
    return outs


def test_text_is_the_decoded_reply_in_any_chunking(tokenizer):
    ids = tokenizer.encode(REPLY)
    rng = random.Random(0)
    for sizes in chunkings(len(ids), rng, 50):
        outs = feed(OutputProcessor(tokenizer, SamplingParams()), ids, sizes)
        assert "".join(o.text for o in outs) == tokenizer.decode(ids) == REPLY
        assert [t for o in outs for t in o.token_ids] == ids
        assert all("\ufffd" not in o.text for o in outs)
        assert outs[-1].finished and outs[-1].finish_reason == "length" and outs[-1].completion_tokens == len(ids)


def test_a_stop_string_ends_the_output_after_the_token_that_completed_it(tokenizer):
    ids = tokenizer.encode(REPLY)
    stop = "I will answer"   # three tokens: what begins it must wait
    k = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))
    before = REPLY[:REPLY.index(stop)]
    rng = random.Random(1)
    for sizes in chunkings(len(ids), rng, 50):
        processor = OutputProcessor(tokenizer, SamplingParams(stop=["nowhere", stop], logprobs=0))
        outs = feed(processor, ids, sizes)
        # the text before the stop string, never a character of it (what might begin it waits)
        assert "".join(o.text for o in outs) == before
        assert all(not o.finished for o in outs[:-1])
        last = outs[-1]
        assert (last.finished, last.finish_reason, last.stop_reason) == (True, "stop", stop)
        assert [t for o in outs for t in o.token_ids] == ids[:k]
        assert last.completion_tokens == k
        assert processor.stopped == stop and processor.finished
        assert processor.process(RequestOutput("r", "", [1], completion_tokens=k + 1)) is None


def test_eos_and_stop_tokens_write_no_text(tokenizer):
    ids = tokenizer.encode("Done here.")
    eos = tokenizer.eos_token_ids[0]
    out = OutputProcessor(tokenizer, SamplingParams(skip_special_tokens=False), tokenizer.eos_token_ids).process(
        RequestOutput("r", "", ids + [eos], finished=True, finish_reason="stop", completion_tokens=len(ids) + 1))
    assert out.text == "Done here." and out.token_ids == ids + [eos]
    # with ignore_eos the same token is text like any other
    kept = OutputProcessor(tokenizer, SamplingParams(skip_special_tokens=False, ignore_eos=True),
                           tokenizer.eos_token_ids).process(
        RequestOutput("r", "", ids + [eos], finished=True, finish_reason="length", completion_tokens=len(ids) + 1))
    assert kept.text == "Done here." + tokenizer.decode([eos], skip_special_tokens=False)


def test_the_parser_reads_the_processed_stream_once_in_any_chunking(tokenizer):
    """Speculation commits several tokens per output and the processor holds text back; the tool-call
    parser, fed the processor's deltas once each, finds the same content and calls as on the whole text."""
    ids = tokenizer.encode(REPLY)
    whole = parse_output(REPLY, "hermes")
    assert [c.name for c in whole.tool_calls] == ["get_weather"]
    rng = random.Random(2)
    for sizes in chunkings(len(ids), rng, 50):
        parser = OutputParser("hermes", None)
        events = []
        for out in feed(OutputProcessor(tokenizer, SamplingParams(stop=["</answer>"])), ids, sizes):
            events += parser.push(out.text)
        events += parser.finish()
        content = "".join(v for kind, v in events if kind == "content")
        calls = [(v.name, v.arguments) for kind, v in events if kind == "call"]
        assert content == whole.content
        assert calls == [(c.name, c.arguments) for c in whole.tool_calls]


@pytest.mark.slow
def test_the_stream_detokenizes_off_the_engine_thread_and_a_stop_string_pins_the_turn(default_engine, tokenizer,
                                                                                         monkeypatch):
    """Through AsyncEngine: every detokenization runs on the consumer's thread, never the engine's; a
    stop string ends the stream there, and the engine then finishes the request as stopped, so a session
    turn's prefix is pinned as after an EOS (an abort would pin nothing)."""
    threads = set()
    push = IncrementalDetokenizer.push

    def recording_push(self, token_ids):
        threads.add(threading.current_thread().name)
        return push(self, token_ids)
    monkeypatch.setattr(IncrementalDetokenizer, "push", recording_push)
    prompt = encode_chat(tokenizer, [{"role": "user", "content": "Count from 1 to 20, separated by commas."}])
    full = default_engine.generate([prompt], SamplingParams(max_tokens=48, temperature=0))[0]
    assert "7" in full.text
    threads.clear()

    async def run():
        ae = AsyncEngine(default_engine)
        try:
            outs = [o async for o in ae.submit(prompt, SamplingParams(max_tokens=48, temperature=0, stop=["7"]),
                                               "turn-1", lease_ttl_s=60.0)]
            for _ in range(200):   # the engine finishes it at its next step
                if not default_engine.has_unfinished():
                    break
                await asyncio.sleep(0.01)
            return outs, default_engine.has_unfinished()
        finally:
            await ae.shutdown()

    outs, busy = asyncio.run(run())
    assert threads == {threading.current_thread().name}
    text = "".join(o.text for o in outs)
    assert text == full.text[:full.text.index("7")]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", "7")
    ids = [t for o in outs for t in o.token_ids]
    assert ids == full.token_ids[:len(ids)] and "7" in tokenizer.decode(ids) and "7" not in tokenizer.decode(ids[:-1])
    assert not busy
    assert default_engine.pin_active("turn-1")
    default_engine.unpin("turn-1")
    default_engine.step()
    assert not default_engine.pin_active("turn-1")


@pytest.mark.slow
@pytest.mark.parametrize("stop", [["7"], []])
def test_generate_ends_at_the_stop_string_and_leaves_nothing_running(default_engine, tokenizer, stop):
    prompt = encode_chat(tokenizer, [{"role": "user", "content": "Count from 1 to 20, separated by commas."}])
    r = default_engine.generate([prompt], SamplingParams(max_tokens=48, temperature=0, stop=stop))[0]
    assert not default_engine.has_unfinished()
    assert r.text == tokenizer.decode(r.token_ids) if not stop else "7" not in r.text
    if stop:
        assert r.finish_reason == "stop" and r.stop_reason == "7" and "7" in tokenizer.decode(r.token_ids)


def test_a_bad_stop_is_the_engine_checks_invalid_request(default_engine):
    """The stream's processor is built after the engine's check: a stop that is not a list of strings is a
    clear InvalidRequest (a 400), never a TypeError from the processor."""
    from engine.types import InvalidRequest

    async def run():
        ae = AsyncEngine(default_engine)
        try:
            with pytest.raises(InvalidRequest, match="stop must be a list of non-empty strings"):
                ae.submit([1, 2, 3], SamplingParams(max_tokens=2, stop=[5]))
        finally:
            await ae.shutdown()
    asyncio.run(run())
    assert not default_engine.has_unfinished()

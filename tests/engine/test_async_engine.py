"""AsyncEngine built from a config loads the model in its own thread and runs it there (every torch
operation of a server in one thread: AsyncEngine's docstring says why), streams as before, and a load
that fails raises in the caller with the engine's own error."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams


def test_from_config_loads_and_steps_in_the_engine_thread(monkeypatch):
    threads = {}
    build, step = LLMEngine.__init__, LLMEngine.step

    def recording_init(self, *args, **kwargs):
        threads["load"] = threading.current_thread().name
        build(self, *args, **kwargs)

    def recording_step(self):
        threads.setdefault("step", threading.current_thread().name)
        return step(self)

    monkeypatch.setattr(LLMEngine, "__init__", recording_init)
    monkeypatch.setattr(LLMEngine, "step", recording_step)

    async def run() -> list[int]:
        ae = AsyncEngine.from_config(EngineConfig(kv_cache_tokens=2048))
        try:
            ids = []
            async for out in ae.submit([1, 9690, 198, 2683], SamplingParams(max_tokens=5, temperature=0,
                                                                           ignore_eos=True)):
                ids += out.token_ids
            return ids
        finally:
            await ae.shutdown()

    ids = asyncio.run(run())
    assert len(ids) == 5
    assert threads == {"load": "agentrt-engine", "step": "agentrt-engine"}
    assert threading.current_thread().name != "agentrt-engine"


def test_a_failed_load_raises_in_the_caller():
    with pytest.raises(FileNotFoundError, match="expected a .gguf file or a Hugging Face directory"):
        AsyncEngine.from_config(EngineConfig(model="/nonexistent/model.bin"))


PROMPT = [1, 9690, 198, 2683]


def twice(params: SamplingParams) -> tuple[list, list | RuntimeError]:
    """Two requests one after the other on a fresh AsyncEngine (2 minutes at most, so a hang fails): the
    first one's outputs, and the second one's or the ``RuntimeError`` its submit raised."""
    async def run():
        ae = AsyncEngine.from_config(EngineConfig(kv_cache_tokens=2048))
        try:
            first = [out async for out in ae.submit(PROMPT, params)]
            try:
                second = [out async for out in ae.submit(PROMPT, params)]
            except RuntimeError as exc:
                second = exc
            return first, second
        finally:
            await ae.shutdown()

    return asyncio.run(asyncio.wait_for(run(), 120))


def test_a_step_that_raises_fails_what_runs_and_the_loop_serves_on(monkeypatch):
    """A step that raises (a kernel fault, an out-of-memory): the requests running or waiting end with
    finish reason "error" and the exception as their error; the next request is served normally."""
    step = LLMEngine.step
    faults = []

    def faulty_step(self):
        if self.has_unfinished() and not faults:
            faults.append(1)
            outputs = self.core._drain_inbox()   # the request is queued, then the step fails
            assert not outputs
            raise RuntimeError("planted fault")
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", faulty_step)
    first, second = twice(SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert [(o.finished, o.finish_reason) for o in first] == [(True, "error")]
    assert "planted fault" in first[-1].error
    assert second[-1].finish_reason == "length" and sum(len(o.token_ids) for o in second) == 4


def test_a_fault_outside_a_step_fails_open_streams_and_refuses_new_requests(monkeypatch):
    """The loop itself fails (here: a step hands back something that is no output): the open request
    ends with finish reason "error" naming the fault instead of hanging, and the next submit is refused."""
    step = LLMEngine.step

    def bad_step(self):
        outputs = step(self)
        return [object()] if self.has_unfinished() else outputs

    monkeypatch.setattr(LLMEngine, "step", bad_step)
    outs, refused = twice(SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert outs[-1].finished and outs[-1].finish_reason == "error"
    assert "the engine loop stopped" in outs[-1].error and "request_id" in outs[-1].error
    assert isinstance(refused, RuntimeError) and "the engine loop stopped after an internal error" in str(refused)

"""The agent protocols through ``agentrt up --workers 2``: a Responses chain (``previous_response_id``),
an Anthropic Messages conversation named by ``X-Claude-Code-Session-Id`` and a Chat Completions
conversation named by ``prompt_cache_key``, driven by the official SDKs.

Each conversation stays on one worker (every reply names it in ``x-agentrt-worker``) and each turn
reads the previous turn's prompt and reply from the cache. Then that worker is SIGKILLed: the
conversation's next turn runs on the other worker at the first attempt, with its whole history (the
Responses chain from its session record in Redis, the others from the history the client resends).
One cluster per protocol: where a conversation's first turn lands is the router's choice, so three
conversations in one cluster need not share the worker that is killed.
"""

from __future__ import annotations

import os
import signal
import uuid

import anthropic
import openai
import pytest

from tests.router import cluster as c

MODEL = "SmolLM2-135M-Instruct"
WORKER = "x-agentrt-worker"
# long enough that one turn's new text is well under a tenth of the context it continues
SYSTEM = ("You are the on-call assistant of a build farm: you read failing CI steps and name the likely cause "
          "in a few words. ") * 12


@pytest.fixture
def up(tmp_path_factory):
    group = c.procs(tmp_path_factory.mktemp("protocols"))
    try:
        server = group.redis(appendonly=False)
        proc = c.up(group, server.url)
        yield proc
    finally:
        group.stop(timeout_s=60.0)


class Turns:
    """One conversation's turns: the worker each ran on, the tokens its prompt read from the cache,
    and its prompt and reply token counts."""

    def __init__(self) -> None:
        self.workers: list[str] = []
        self.cached: list[int] = []
        self.totals: list[int] = []

    def add(self, worker: str, cached: int, prompt: int, completion: int) -> None:
        self.workers.append(worker)
        self.cached.append(cached)
        self.totals.append(prompt + completion)

    def reuses_the_previous_turn(self, t: int) -> bool:
        return self.cached[t] >= 0.9 * self.totals[t - 1]


class Responses(Turns):
    def __init__(self, url: str) -> None:
        super().__init__()
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.previous: str | None = None

    def turn(self, text: str) -> None:
        raw = self.client.responses.with_raw_response.create(
            model=MODEL, instructions=SYSTEM, input=text, max_output_tokens=8, temperature=0,
            **({"previous_response_id": self.previous} if self.previous else {}))
        r = raw.parse()
        self.previous = r.id
        self.add(raw.headers[WORKER], r.usage.input_tokens_details.cached_tokens, r.usage.input_tokens,
                 r.usage.output_tokens)


class Messages(Turns):
    def __init__(self, url: str) -> None:
        super().__init__()
        self.client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
        self.session = str(uuid.uuid4())
        self.history: list[dict] = []

    def turn(self, text: str) -> None:
        self.history.append({"role": "user", "content": text})
        raw = self.client.messages.with_raw_response.create(
            model=MODEL, system=SYSTEM, messages=self.history, max_tokens=8, extra_body={"temperature": 0},
            extra_headers={"X-Claude-Code-Session-Id": self.session})
        m = raw.parse()
        self.history.append({"role": "assistant", "content": "".join(b.text for b in m.content if b.type == "text")})
        u = m.usage
        prompt = u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
        self.add(raw.headers[WORKER], u.cache_read_input_tokens or 0, prompt, u.output_tokens)


class Chat(Turns):
    def __init__(self, url: str) -> None:
        super().__init__()
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.key = "conv-" + uuid.uuid4().hex
        self.history: list[dict] = [{"role": "system", "content": SYSTEM}]

    def turn(self, text: str) -> None:
        self.history.append({"role": "user", "content": text})
        raw = self.client.chat.completions.with_raw_response.create(
            model=MODEL, messages=self.history, max_tokens=8, temperature=0, prompt_cache_key=self.key)
        r = raw.parse()
        self.history.append({"role": "assistant", "content": r.choices[0].message.content})
        self.add(raw.headers[WORKER], r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens,
                 r.usage.completion_tokens)


@pytest.mark.parametrize("protocol", ["responses", "messages", "chat"])
def test_a_conversation_stays_on_its_worker_and_moves_with_its_history_when_it_dies(up, protocol):
    conv = {"responses": Responses, "messages": Messages, "chat": Chat}[protocol](up.url)
    for t in range(6):
        conv.turn(f"Step {t} of the pipeline failed on file {t}.py; why?")
    assert len(set(conv.workers)) == 1 and conv.workers[0] in ("worker-0", "worker-1"), conv.workers
    assert all(conv.reuses_the_previous_turn(t) for t in range(1, 6)), (conv.cached, conv.totals)
    victim = conv.workers[0]
    survivor = ({"worker-0", "worker-1"} - {victim}).pop()

    os.kill(c.up_worker_pid(up, victim), signal.SIGKILL)
    for t in (6, 7):  # no retry by the client: the router fails over at once
        conv.turn(f"Step {t} of the pipeline failed too; why?")
    assert conv.workers[6:] == [survivor, survivor], conv.workers
    # the survivor had none of it cached: turn 7 carries the whole history, and turn 8 reads it back
    assert conv.totals[6] > conv.totals[5] and conv.reuses_the_previous_turn(7), (conv.cached, conv.totals)
    if protocol != "responses":
        assert len(conv.history) == (16 if protocol == "messages" else 17)  # what the client resent

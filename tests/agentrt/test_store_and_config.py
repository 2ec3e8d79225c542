"""Units without a server: the in-memory session store's contract and ServerConfig sources."""

from __future__ import annotations

import asyncio

import pytest

from agentrt.cli import build_parser
from agentrt.config import ServerConfig
from agentrt.store import InMemorySessionStore, SessionLimitReached, SessionNotFound, SessionRecord, TurnRecord


def turn(turn_id: str, index: int) -> TurnRecord:
    return TurnRecord(turn_id=turn_id, index=index, message={"role": "assistant", "content": "ok"},
                      finish_reason="stop", prompt_tokens=10, completion_tokens=2, cached_tokens=4, created_at=0.0)


def test_append_turn_once_is_atomic_and_idempotent():
    async def main():
        store = InMemorySessionStore(max_sessions=1)
        await store.create(SessionRecord(id="s1", model="m"))
        user = [{"role": "user", "content": "hi"}]
        record, new = await store.append_turn_once("s1", "t1", user, turn("t1", 1))
        again, new_again = await store.append_turn_once("s1", "t1", user, turn("t1", 1))
        assert new and not new_again
        assert again.messages == user + [{"role": "assistant", "content": "ok"}]
        assert again.usage() == {"prompt_tokens": 10, "completion_tokens": 2, "cached_tokens": 4, "total_tokens": 12}
        record.messages.append({"role": "user", "content": "mutating a copy"})
        assert len((await store.get("s1")).messages) == 2
        with pytest.raises(SessionLimitReached):
            await store.create(SessionRecord(id="s2", model="m"))
        assert (await store.delete("s1")).id == "s1" and await store.get("s1") is None
        with pytest.raises(SessionNotFound):
            await store.append_turn_once("s1", "t2", user, turn("t2", 3))

    asyncio.run(main())


def test_config_from_env_then_flags():
    env = {"AGENTRT_PORT": "9001", "AGENTRT_API_KEYS": "a, b", "AGENTRT_PIN_TTL_S": "5",
           "AGENTRT_KV_CACHE_TOKENS": "4096"}
    cfg = ServerConfig.from_sources({"port": 9002, "model": None}, environ=env)
    assert (cfg.port, cfg.api_keys, cfg.pin_ttl_s, cfg.kv_cache_tokens) == (9002, ("a", "b"), 5.0, 4096)
    with pytest.raises(ValueError, match="AGENTRT_PORT"):
        ServerConfig.from_sources(environ={"AGENTRT_PORT": "eighty"})
    with pytest.raises(ValueError, match="max_pin_ttl_s"):
        ServerConfig(pin_ttl_tool_s=1000)
    with pytest.raises(ValueError, match="device"):
        ServerConfig(device="tpu")


def test_serve_flags_cover_every_config_field():
    args = build_parser().parse_args(["serve", "--port", "0", "--api-key", "k", "--pin-ttl-s", "2.5"])
    assert (args.port, args.api_keys, args.pin_ttl_s, args.host) == (0, ["k"], 2.5, None)


def test_max_waiting_tokens_from_env_and_flag_reaches_the_engine():
    cfg = ServerConfig.from_sources(environ={"AGENTRT_MAX_WAITING_TOKENS": "5000"})
    assert cfg.max_waiting_tokens == 5000 and cfg.engine_config().waiting_tokens_limit == 5000
    # unset: the engine's default, twice the KV pool (32768 tokens, one 16-token page reserved)
    assert ServerConfig().engine_config().waiting_tokens_limit == 2 * (32768 - 16)
    args = build_parser().parse_args(["serve", "--max-waiting-tokens", "77"])
    assert args.max_waiting_tokens == 77
    with pytest.raises(ValueError, match="max_waiting_tokens must be >= 1"):
        ServerConfig(max_waiting_tokens=0).engine_config()


def test_every_flag_of_every_subcommand_says_what_it_does():
    """``agentrt <cmd> --help`` describes each flag in words, not just its default and env variable."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "serve" in a.choices).choices
    assert {"serve", "worker", "router", "up", "chat", "status"} <= set(subparsers)
    missing = []
    for name, sub in subparsers.items():
        for action in sub._actions:
            if not action.option_strings or action.dest == "help":
                continue
            words = (action.help or "").split("(default")[0].strip()
            if len(words) < 8:
                missing.append(f"agentrt {name} {action.option_strings[-1]}: {action.help!r}")
    assert not missing, "flags without a description:\n" + "\n".join(missing)

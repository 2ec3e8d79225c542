"""Units without a server: the in-memory session store's contract, and the settings (ServerConfig,
RouterConfig, WorkerSettings): their sources, flags and errors."""

from __future__ import annotations

import asyncio

import pytest

from agentrt_cli import build_parser
import dataclasses

from agentrt.config import (MODEL_FIELDS, ConfigError, EngineSettings, ModelSettings, RouterServerConfig, ServerConfig,
                            ServingSettings)
from agentrt.metrics import Metrics
from engine import EngineConfig, EngineStats
from router.commands import CONNECTION, ROUTER_FIELDS, WORKER_FIELDS
from router.config import RouterConfig, WorkerSettings
from agentrt.core.store import InMemorySessionStore, SessionLimitReached, SessionNotFound, SessionRecord, TurnRecord


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


def test_speculative_settings_reach_the_engine_and_metrics():
    served = ServerConfig().engine_config()
    assert served.speculative == "auto" and served.resolved_speculative() == "suffix"   # on this CPU
    assert EngineConfig(speculative="auto", device="cuda").resolved_speculative() == "off"
    assert EngineConfig().speculative == "off"
    cfg = ServerConfig.from_sources(environ={"AGENTRT_SPECULATIVE": "ngram", "AGENTRT_NUM_SPECULATIVE_TOKENS": "6"})
    assert (cfg.engine_config().speculative, cfg.engine_config().num_speculative_tokens) == ("ngram", 6)
    args = build_parser().parse_args(["serve", "--speculative", "ngram", "--num-speculative-tokens", "3"])
    assert (args.speculative, args.num_speculative_tokens) == ("ngram", 3)
    with pytest.raises(ConfigError, match="speculative"):
        ServerConfig.from_sources({"speculative": "draft-model"}, environ={})
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer from 1 to 16"):
        ServerConfig(num_speculative_tokens=17)
    metrics = Metrics()
    metrics.attach_engine(lambda: EngineStats(
        running=0, waiting=0, pages_total=8, pages_used=0, pages_free=8, pages_cached=0, pages_pinned=0, num_pins=0,
        prompt_tokens_total=0, cached_tokens_total=0, generation_tokens_total=30, num_preemptions=0, page_size=16,
        spec_draft_tokens_total=40, spec_accepted_tokens_total=30, spec_verifications_total=10))
    text = metrics.render().decode()
    for line in ("agentrt_spec_draft_tokens_total 40.0", "agentrt_spec_accepted_tokens_total 30.0",
                 "agentrt_spec_verifications_total 10.0", "agentrt_spec_acceptance_rate 0.75",
                 "agentrt_spec_mean_accepted_length 4.0"):
        assert line in text, line


def test_kv_cache_dtype_reaches_the_engine_and_metrics_and_fp8_is_refused():
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8", "--kv-cache-memory-bytes", "1000000"])
    assert (args.kv_cache_dtype, args.kv_cache_memory_bytes) == ("int8", 1000000)
    cfg = ServerConfig.from_sources(environ={"AGENTRT_KV_CACHE_DTYPE": "int8"})
    assert cfg.engine_config().kv_cache_dtype == "int8" and ServerConfig().engine_config().kv_cache_dtype == "auto"
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp8' is not implemented"):
        ServerConfig.from_sources({"kv_cache_dtype": "fp8"}, environ={})
    metrics = Metrics()
    metrics.attach_engine(lambda: EngineStats(
        running=0, waiting=0, pages_total=8, pages_used=0, pages_free=8, pages_cached=0, pages_pinned=0, num_pins=0,
        prompt_tokens_total=0, cached_tokens_total=0, generation_tokens_total=0, num_preemptions=0, page_size=16,
        kv_cache_bytes_per_token=12240))
    assert "agentrt_kv_cache_bytes_per_token 12240.0" in metrics.render().decode()


def _subparsers():
    parser = build_parser()
    return next(a for a in parser._actions if a.choices and "serve" in a.choices).choices


def test_flags_are_generated_from_the_settings_fields():
    """serve, worker, router and status: one flag per settings field, its help the field's description,
    default and environment variable; the engine settings' defaults are the engine's but for the three
    the server chooses itself."""
    commands = {"serve": [(ServerConfig, None)],
                "worker": [(ServerConfig, None), (RouterConfig, WORKER_FIELDS), (WorkerSettings, None)],
                "router": [(RouterServerConfig, None), (RouterConfig, ROUTER_FIELDS)],
                "status": [(RouterConfig, CONNECTION)]}
    subparsers = _subparsers()
    for command, models in commands.items():
        actions = {a.dest: a for a in subparsers[command]._actions}
        for cls, names in models:
            for name in names or cls.model_fields:
                action = actions[name]
                assert action.option_strings == [cls.flag_name(name)] and action.default is None
                assert action.help.startswith(cls.model_fields[name].description), (command, name)
                assert f"env AGENTRT_{name.upper()}" in action.help, (command, name)
    assert ServerConfig.flag_name("api_keys") == "--api-key" and RouterConfig.flag_name("redis_url") == "--redis"
    engine, server = EngineConfig(), ServerConfig()
    for name in ("max_num_seqs", "max_waiting", "enable_prefix_cache", "turn_coalesce_max_s", "ep_placement"):
        assert getattr(server, name) == getattr(engine, name)
    differ = {f.name for f in dataclasses.fields(EngineConfig) if getattr(server, f.name) != getattr(engine, f.name)}
    assert differ == {"device", "dtype", "kv_cache_tokens", "speculative"}
    for name in differ:  # said where the default is declared
        assert f"engine library's default is {getattr(engine, name)}" in ServerConfig.model_fields[name].description


def _own_fields(cls) -> set[str]:
    """The fields a settings class declares itself (not inherited)."""
    inherited = set().union(*(getattr(base, "model_fields", {}) for base in cls.__bases__))
    return set(cls.model_fields) - inherited


def test_no_setting_is_declared_twice():
    """Each setting has one declaration: the engine's in EngineConfig (its help line and choices there, the
    server's flag generated from it), the serving ones in ServingSettings, the router's in RouterConfig and
    WorkerSettings; the composed models (ServerConfig, RouterServerConfig) declare nothing of their own."""
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(EngineSettings.model_fields) == engine_fields and set(ModelSettings.model_fields) == set(MODEL_FIELDS)
    for f in dataclasses.fields(EngineConfig):
        assert EngineSettings.model_fields[f.name].description.startswith(f.metadata["help"])
    assert _own_fields(ServerConfig) == set() and _own_fields(RouterServerConfig) == set()
    declared = [ServingSettings, ModelSettings, EngineSettings, RouterConfig, WorkerSettings]
    seen: dict[str, str] = {}
    for cls in declared:
        for name in _own_fields(cls):
            assert name not in seen, f"{name} declared in both {seen[name]} and {cls.__name__}"
            seen[name] = cls.__name__
    assert engine_fields <= set(seen)


def test_router_help_lists_no_engine_flag():
    """``agentrt router`` runs no engine: of the engine settings it offers only the model's (its tokenizer and
    template); ``agentrt serve`` and ``agentrt worker`` offer every engine setting."""
    subparsers = _subparsers()
    router_flags = {s for a in subparsers["router"]._actions for s in a.option_strings}
    engine_only = {EngineSettings.flag_name(f.name) for f in dataclasses.fields(EngineConfig)
                   if f.name not in MODEL_FIELDS}
    assert not router_flags & engine_only, sorted(router_flags & engine_only)
    assert {"--model", "--served-model-name", "--max-model-len"} <= router_flags
    for command in ("serve", "worker"):
        flags = {s for a in subparsers[command]._actions for s in a.option_strings}
        assert engine_only <= flags, (command, sorted(engine_only - flags))
    help_lines = [a.help for cmd in ("serve", "worker", "router", "status", "up") for a in subparsers[cmd]._actions]
    assert all(help_lines), "every flag has help text"


def test_router_and_worker_settings_take_flag_then_env_then_default():
    args = build_parser().parse_args(["router", "--redis", "redis://flag:1/0", "--policy-option", "a=2",
                                      "--policy-option", "b=0.5", "--tentative-ttl-s", "0"])
    env = {"AGENTRT_REDIS_URL": "redis://env:1/0", "AGENTRT_DEPLOYMENT": "blue", "AGENTRT_KEY_PREFIX": ""}
    cfg = RouterConfig.from_args(args, environ=env)
    assert (cfg.redis_url, cfg.deployment, cfg.key_prefix) == ("redis://flag:1/0", "blue", "agentrt:")
    assert cfg.policy_options == {"a": 2, "b": 0.5} and cfg.tentative_ttl_s == 0 and cfg.policy == "agentrt"
    assert RouterConfig.from_sources(environ={"AGENTRT_POLICY_OPTIONS": "a=3, c=1.0"}).policy_options == \
        {"a": 3, "c": 1.0}
    with pytest.raises(ConfigError, match=r"--policy-option \['a'\]: .*NAME=NUMBER"):
        RouterConfig.from_sources({"policy_options": ["a"]}, environ={})
    with pytest.raises(ConfigError, match="AGENTRT_HEARTBEAT_TTL_S='soon': Input should be a valid number"):
        RouterConfig.from_sources(environ={"AGENTRT_HEARTBEAT_TTL_S": "soon"})
    with pytest.raises(ConfigError, match="given: AGENTRT_HEARTBEAT_INTERVAL_S='30'"):
        RouterConfig.from_sources(environ={"AGENTRT_HEARTBEAT_INTERVAL_S": "30"})
    worker = build_parser().parse_args(["worker", "--port", "8100", "--worker-id", "w1"])
    settings = WorkerSettings.from_args(worker, environ={"AGENTRT_ADVERTISE_URL": "http://gpu-a:8100"})
    assert (settings.worker_id, settings.advertise_url) == ("w1", "http://gpu-a:8100")
    resolved = WorkerSettings.from_sources(environ={}).resolve(ServerConfig(host="10.0.0.7", port=8100))
    assert resolved.advertise_url == "http://10.0.0.7:8100" and resolved.worker_id.endswith("-8100")


def test_bad_flags_name_the_flag_and_what_is_allowed(capsys):
    cases = ((["serve", "--device", "tpu"], "argument --device: Input should be 'auto', 'cpu' or 'cuda'"),
             (["serve", "--port", "70000"], "argument --port: Input should be less than or equal to 65535"),
             (["router", "--heartbeat-ttl-s", "x"], "argument --heartbeat-ttl-s: Input should be a valid number"))
    for argv, message in cases:
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert message in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"must be >= 1, got 0 \(given: --max-waiting-tokens 0\)"):
        ServerConfig.from_sources({"max_waiting_tokens": 0}, environ={})


def test_every_flag_of_every_subcommand_says_what_it_does():
    """``agentrt <cmd> --help`` describes each flag in words, not just its default and env variable."""
    subparsers = _subparsers()
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

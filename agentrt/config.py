"""Settings, declared once: each is a field of a pydantic-settings model, with its default and a
one-line description.

From a field come its environment variable ``AGENTRT_<FIELD>`` (upper case), its command-line flag
``--<field-name>`` (:func:`add_flags`; the description is its ``--help`` line) and its validation.
A flag given on the command line wins over the environment, which wins over the default.
:class:`ServerConfig` here is ``agentrt serve``'s (and the HTTP side of ``agentrt worker`` and
``agentrt router``); ``router/config.py`` declares the router's and the worker's the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from contextvars import ContextVar
from typing import Annotated, Any, Callable, Iterable, Literal, Mapping, Self, Union, get_args, get_origin

from pydantic import Field, TypeAdapter, ValidationError, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict

from engine.config import EngineConfig
from engine.parsers import REASONING_PARSERS, TOOL_PARSERS

from agentrt import tracing

ENV_PREFIX = "AGENTRT_"
# How long an idle HTTP connection stays open. Longer than clients keep idle connections (httpx,
# so the official openai client: 5 s), so a client never sends a request on a connection the
# server is closing at that moment (uvicorn's own default is also 5 s: under load those requests
# failed with a reset connection).
KEEP_ALIVE_S = 75


@dataclasses.dataclass(frozen=True)
class Flag:
    """Field metadata for :func:`add_flags`: the flag's name when it is not ``--<field-name>``, and
    the placeholder ``--help`` shows for its value."""

    name: str | None = None
    metavar: str | None = None


class ConfigError(ValueError):
    """Settings that do not validate; each problem names the flag or environment variable it came from."""


# The environment ``Settings.from_sources`` reads instead of os.environ, while it builds one model.
_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("agentrt_settings_environ", default=None)


class _MappingEnvSource(EnvSettingsSource):
    """The ``AGENTRT_*`` environment source, reading a given mapping instead of ``os.environ``."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        super().__init__(settings_cls)
        self.env_vars = {(k if self.case_sensitive else k.lower()): v for k, v in environ.items()
                         if not (self.env_ignore_empty and v == "")}


class Settings(BaseSettings):
    """Base of agentrt's settings models: frozen, environment variables ``AGENTRT_<FIELD>`` (an
    empty one counts as unset), no unknown fields. Constructing one reads the environment; keyword
    arguments win over it."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid", env_ignore_empty=True)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        environ = _ENVIRON.get()
        return init_settings, (env_settings if environ is None else _MappingEnvSource(settings_cls, environ))

    @classmethod
    def env_name(cls, name: str) -> str:
        return ENV_PREFIX + name.upper()

    @classmethod
    def flag_name(cls, name: str) -> str:
        flag = _marker(cls.model_fields[name], Flag)
        return flag.name if flag is not None and flag.name else "--" + name.replace("_", "-")

    @classmethod
    def from_sources(cls, overrides: Mapping[str, Any] | None = None,
                     environ: Mapping[str, str] | None = None) -> Self:
        """Defaults, then ``AGENTRT_*`` variables of ``environ`` (default ``os.environ``), then
        ``overrides`` (flags; None = unset). A bad value is a :class:`ConfigError` naming its flag or
        variable and what is allowed."""
        given = {name: value for name, value in (overrides or {}).items() if value is not None}
        token = _ENVIRON.set(environ)
        try:
            return cls(**given)
        except ValidationError as exc:
            raise ConfigError(_describe(cls, exc, given, os.environ if environ is None else environ)) from None
        finally:
            _ENVIRON.reset(token)

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Self:
        """:meth:`from_sources` with the flags of this model that ``args`` has (see :func:`add_flags`)."""
        return cls.from_sources({name: getattr(args, name) for name in cls.model_fields if hasattr(args, name)},
                                environ)


def _marker(field: FieldInfo, kind: type) -> Any:
    return next((m for m in field.metadata if isinstance(m, kind)), None)


def _describe(cls: type[Settings], exc: ValidationError, given: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    """One line per problem, each naming where the value came from: ``--port 70000: ...``,
    ``AGENTRT_PORT='eighty': ...``; a rule over several settings names those that were given."""
    env_given = {name: raw for key, raw in environ.items() for name in cls.model_fields
                 if key.upper() == cls.env_name(name) and raw != ""}

    def source(name: str) -> str:
        if name in given:
            return f"{cls.flag_name(name)} {given[name]!r}"
        if name in env_given:
            return f"{cls.env_name(name)}={env_given[name]!r}"
        return name

    problems = []
    for error in exc.errors(include_url=False):
        message = error["msg"].removeprefix("Value error, ")
        if error["loc"]:
            problems.append(f"{source(str(error['loc'][0]))}: {message}")
            continue
        named = [source(name) for name in cls.model_fields
                 if (name in given or name in env_given) and re.search(rf"\b{name}\b", message)]
        problems.append(message + (f" (given: {', '.join(named)})" if named else ""))
    return "; ".join(problems)


# ------------------------------------------------------------ flags (agentrt serve, worker, router)


def add_flags(parser: argparse.ArgumentParser, cls: type[Settings], names: Iterable[str] | None = None) -> None:
    """One flag per field of ``cls`` (or the fields ``names``): ``--pin-ttl-s`` for ``pin_ttl_s``, its
    value checked against the field's type, its help the field's description, default and variable.
    Unset flags are None, so the environment and then the default apply (:meth:`Settings.from_args`).
    Tuple and dict fields are repeatable flags (their variable is comma-separated)."""
    for name in names or cls.model_fields:
        field = cls.model_fields[name]
        flag = _marker(field, Flag)
        metavar = flag.metavar if flag is not None and flag.metavar else _metavar(field.annotation)
        repeatable = get_origin(field.annotation) in (tuple, dict)
        default = "" if field.default in (None, (), {}) else f"default {_show(field.default)}; "
        env = cls.env_name(name) + (", comma-separated" if repeatable else "")
        help = f"{field.description} ({default}env {env})".replace("%", "%%")
        if repeatable:
            parser.add_argument(cls.flag_name(name), dest=name, action="append", default=None, metavar=metavar,
                                help=help)
        else:
            parser.add_argument(cls.flag_name(name), dest=name, type=_flag_type(name, field), default=None,
                                metavar=metavar, help=help)


def _value_type(annotation: Any) -> Any:
    """``X`` for ``X | None`` (a flag given always has a value)."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _metavar(annotation: Any) -> str | None:
    kind = _value_type(annotation)
    if get_origin(kind) is Literal:
        return "{" + ",".join(str(a) for a in get_args(kind)) + "}"
    if kind is bool:
        return "{true,false}"
    return {int: "INT", float: "FLOAT"}.get(kind)  # text: argparse's, the name in capitals


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


def _flag_type(name: str, field: FieldInfo) -> Callable[[str], Any]:
    """The flag's text as the field's type, within the field's bounds; argparse reports the error."""
    kind = _value_type(field.annotation)
    constraints = [m for m in field.metadata if not isinstance(m, Flag)]
    adapter = TypeAdapter(Annotated[(kind, *constraints)] if constraints else kind)

    def parse(raw: str) -> Any:
        try:
            return adapter.validate_python(raw)
        except ValidationError as exc:
            raise argparse.ArgumentTypeError(f"{exc.errors()[0]['msg']}, got {raw!r}") from None

    parse.__name__ = name
    return parse


# ------------------------------------------------------------ agentrt serve

# Engine settings are declared once, as engine.config.EngineConfig's fields (each with its help line and
# choices); the settings models below are generated from them. A server on a laptop chooses four defaults of
# its own, each with the reason; the engine library keeps its defaults.
SERVED_DEFAULTS: dict[str, tuple[Any, str]] = {
    "device": ("cpu", "cpu unless asked"),
    "dtype": ("auto", "the fastest exact-enough precision this machine computes natively"),
    # 1.5 GB of fp32 KV for the default model, 0.75 GB bf16
    "kv_cache_tokens": (32768, "a laptop's share"),
    # chosen by benchmarks/speculative.py (docs/benchmarking.md)
    "speculative": ("auto", "suffix drafting on the CPU, where it was measured to win"),
}
# The settings that name the model: the router needs them too (its tokenizer and chat template).
MODEL_FIELDS = ("model", "served_model_name", "max_model_len")


def _engine_settings(names: Iterable[str]) -> dict[str, Any]:
    """pydantic fields for the EngineConfig fields ``names``: the engine's type (a Literal of its choices
    for a text field with choices), default (or the served one) and help line."""
    hints = typing.get_type_hints(EngineConfig)
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    out = {}
    for name in names:
        f = fields[name]
        choices, description = f.metadata["choices"], f.metadata["help"]
        annotation = Literal[choices] if choices else hints[name]
        default = f.default
        if name in SERVED_DEFAULTS:
            default, why = SERVED_DEFAULTS[name]
            description += f" (served default {default}: {why}; the engine library's default is {f.default})"
        out[name] = (annotation, Field(default, description=description))
    return out


ModelSettings = create_model(
    "ModelSettings", __base__=Settings, __doc__="The model a process serves or routes for (engine settings the "
    "router needs as well: its tokenizer and chat template come from the model files).",
    **_engine_settings(MODEL_FIELDS))

EngineSettings = create_model(
    "EngineSettings", __base__=ModelSettings, __doc__="Every engine.EngineConfig field, as a setting.",
    **_engine_settings(f.name for f in dataclasses.fields(EngineConfig) if f.name not in MODEL_FIELDS))


class ServingSettings(Settings):
    """How an HTTP front (``agentrt serve``, ``agentrt worker``, ``agentrt router``) serves: the listener,
    the limits it enforces, authentication, sessions and tracing.

    ``max_concurrent_requests`` (generations in flight, the HTTP admission limit): past it a request
    gets 429 with ``Retry-After``, and with ``concurrency_reserve`` a request that does not continue a
    started session (``SchedulingKey.continuing``) already past that share less of it. ``tenants_file`` (``agentrt/core/tenants.py``) replaces ``api_keys``;
    neither means no authentication. Sessions: ``pin_ttl_s`` keeps a session's KV prefix pinned between
    turns (``pin_ttl_tool_s`` after a tool call), ``max_pin_ttl_s`` caps what a session may ask for;
    ``affinity_turns`` gives a request with an affinity key (``agentrt/core/affinity.py``) the same pins.
    ``otlp_endpoint`` switches request tracing on (``agentrt/tracing.py``); without the ``agentrt[otel]``
    packages it is a configuration error saying to install them.
    """

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    api_keys: Annotated[tuple[Annotated[str, Field(min_length=1)], ...], NoDecode, Flag("--api-key", "KEY")] = Field(
        (), description="accept this API key (repeatable; default: no authentication)")
    tenants_file: str | None = Field(None, description="JSON or TOML file of tenants: hashed API keys, limits, "
                                     "cache isolation (replaces --api-key; default: none)")
    max_body_bytes: int = Field(4 << 20, ge=1, description="largest request body accepted, in bytes")
    max_concurrent_requests: int = Field(64, ge=1, description="generations in flight before new requests get 429")
    concurrency_reserve: float = Field(0.0, ge=0, lt=1, description="the share of max_concurrent_requests kept for "
                                       "later turns of started sessions: a new session's first turn (or a request of "
                                       "no session) gets 429 past the rest (0: none)")
    retry_after_s: int = Field(1, ge=1, description="the Retry-After seconds sent with 429 and 503 answers")
    slo_ttft_s: float = Field(2.0, gt=0, description="latency SLO, time to first token: a request (a session turn) "
                              "meets the SLO when its first token came within this many seconds and its time per "
                              "output token within slo_tpot_s; counted in agentrt_requests_slo and goodput")
    slo_tpot_s: float = Field(0.25, gt=0, description="latency SLO, mean seconds per output token after the first "
                              "(see slo_ttft_s)")
    default_max_tokens: int = Field(1024, ge=1, description="reply token limit when a request gives none "
                                    "(capped by what is left of the context window)")
    tool_call_parser: Literal[TOOL_PARSERS] | None = Field(None, description="how tool calls are read from "
                                                           "replies, by vLLM's name (default: chosen from the chat "
                                                           "template, logged at start)")
    reasoning_parser: Literal[REASONING_PARSERS] | None = Field(None, description="how reasoning is split from "
                                                                "replies, by vLLM's name (default: chosen from the "
                                                                "chat template)")
    max_sessions: int = Field(10_000, ge=1, description="most sessions held at once")
    session_idle_ttl_s: float = Field(3600.0, gt=0, description="delete a session nobody used for this many seconds")
    pin_ttl_s: float = Field(30.0, gt=0, description="seconds a session's cached prefix stays pinned after a turn")
    pin_ttl_tool_s: float = Field(120.0, gt=0, description="seconds the prefix stays pinned when the reply ended "
                                  "in a tool call")
    max_pin_ttl_s: float = Field(600.0, gt=0, description="the longest pin a session may ask for, in seconds")
    pin_ttl_policy: Literal["fixed", "cost"] = Field(
        "cost", description="the pin after a tool call: fixed (pin_ttl_tool_s) or cost (from the session's measured "
        "tool pauses, the pool's pressure and the recompute cost, agentrt/core/leases.py; pin_ttl_tool_s until three "
        "pauses were measured)")
    affinity_turns: bool = Field(True, description="treat a request that names its conversation (prompt_cache_key, "
                                 "a session header) as a session turn: its prefix stays pinned for pin_ttl_s until "
                                 "the conversation's next request, and the engine holds its next step for that "
                                 "request")
    sweep_interval_s: float = Field(1.0, gt=0, description="seconds between sweeps for idle sessions and expired "
                                    "pins")
    shutdown_timeout_s: float = Field(10.0, gt=0, description="seconds a graceful shutdown waits for requests in "
                                      "flight")
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        "info", description="how much the server logs: critical, error, warning, info, debug or trace")
    otlp_endpoint: str | None = Field(None, description="trace requests with OpenTelemetry, sending the spans to "
                                      "this OTLP/HTTP collector, e.g. http://127.0.0.1:4318 (needs the agentrt[otel] "
                                      "extra; default: no tracing)")
    otel_service_name: str | None = Field(None, min_length=1, description="service.name of this process's traces "
                                          "(default: OTEL_SERVICE_NAME, else agentrt, agentrt-worker or "
                                          "agentrt-router)")

    @field_validator("api_keys", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        """``AGENTRT_API_KEYS=a,b`` (spaces around a key are dropped)."""
        if isinstance(value, str):
            return tuple(k.strip() for k in value.split(",") if k.strip())
        return value

    @field_validator("otlp_endpoint")
    @classmethod
    def _tracing_available(cls, value: str | None) -> str | None:
        """An http(s) URL, and the OpenTelemetry packages to send to it installed (agentrt[otel])."""
        if value is not None:
            tracing.traces_url(value)
            tracing.check_available()
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.tenants_file is not None and self.api_keys:
            raise ValueError("give either tenants_file or api_keys, not both")
        if max(self.pin_ttl_s, self.pin_ttl_tool_s) > self.max_pin_ttl_s:
            raise ValueError(f"pin_ttl_s ({self.pin_ttl_s}) and pin_ttl_tool_s ({self.pin_ttl_tool_s}) "
                             f"must not exceed max_pin_ttl_s ({self.max_pin_ttl_s})")
        return self


class RouterServerConfig(ServingSettings, ModelSettings):
    """``agentrt router``'s HTTP side: serving settings and the model it routes for (no engine runs there)."""


class ServerConfig(ServingSettings, EngineSettings):
    """How ``agentrt serve`` (and the HTTP side of ``agentrt worker``) runs: the serving settings and every
    engine setting (``engine.EngineConfig``'s fields, :meth:`engine_config`; the engine validates them)."""

    @model_validator(mode="after")
    def _engine_valid(self) -> Self:
        self.engine_config()  # the engine's own checks, now rather than when the model loads
        return self

    def engine_config(self) -> EngineConfig:
        """The ``engine.EngineConfig`` these settings describe."""
        return EngineConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)})


def configure_serve(parser: argparse.ArgumentParser) -> None:
    """``agentrt serve``'s flags: one per :class:`ServerConfig` field."""
    add_flags(parser, ServerConfig)


def configure_router_http(parser: argparse.ArgumentParser) -> None:
    """``agentrt router``'s HTTP flags: one per :class:`RouterServerConfig` field (no engine flag)."""
    add_flags(parser, RouterServerConfig)

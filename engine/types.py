"""Request-level types of the public engine API: sampling parameters and outputs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


GREEDY_TEMPERATURE_EPS = 1e-5  # temperatures below this sample greedily (as vLLM does)
MAX_PRIORITY = 2**31 - 1  # |SamplingParams.priority| at most (a 32-bit integer, as clients send it)

# ``RequestOutput.stop_reason`` of a constrained output that its constraint closed (completed with
# the shortest closing it found) because the token budget was running out; finish_reason is "stop".
CLOSED_BY_BUDGET = "max_tokens_closed"


class InvalidRequest(ValueError):
    """A request the engine cannot serve; the message says what was wrong and what is allowed, and
    ``param`` names the request field at fault when one is (``"max_tokens"``), for the HTTP error."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to sample one request. Names follow OpenAI / vLLM.

    ``temperature == 0`` is greedy. ``top_k <= 0`` disables top-k. ``seed`` makes a
    sampled request reproducible. ``stop`` strings are removed from the output text;
    ``stop_token_ids`` (and EOS unless ``ignore_eos``) end the request. ``priority`` is vLLM's: with
    ``scheduling_policy="session"`` a lower value is scheduled earlier (default 0); FCFS ignores it.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token + top k
    skip_special_tokens: bool = True  # False: the text keeps them (tool-call markers of some families)
    priority: int = 0  # lower is earlier (vLLM's meaning), with scheduling_policy="session"

    def validate(self) -> None:
        if not isinstance(self.priority, int) or isinstance(self.priority, bool) or \
                not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise InvalidRequest(f"priority must be an integer from {-MAX_PRIORITY} to {MAX_PRIORITY} (lower is "
                                 f"scheduled earlier), got {self.priority!r}", param="priority")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequest(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop must be a list of non-empty strings")
        if len(self.stop) > 16:
            raise InvalidRequest(f"at most 16 stop strings are allowed, got {len(self.stop)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequest(f"top logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        # below this, logits / temperature overflows to inf (NaN probabilities); it is argmax anyway
        return self.temperature < GREEDY_TEMPERATURE_EPS


@dataclass(frozen=True)
class SchedulingKey:
    """Whom a request serves, as the scheduler orders requests (engine/session_priority.py).

    ``session``: the agent session the request is a turn of ("": the request is a session of its own);
    ``tenant``: who owns it, for fair share between tenants, with ``weight`` its share (a tenant of
    weight 2 is due twice the service of a tenant of weight 1); ``continuing``: the session already ran
    a turn (its caller knows: a session with history), so the request is a later turn of a started
    session, admitted before new sessions under overload. The engine also counts a session it has
    computed tokens for as started."""

    session: str = ""
    tenant: str = ""
    weight: float = 1.0
    continuing: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.session, str) or not isinstance(self.tenant, str):
            raise InvalidRequest("a scheduling key's session and tenant must be strings")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or \
                not math.isfinite(self.weight) or self.weight <= 0:
            raise InvalidRequest(f"a tenant's weight must be a finite number > 0, got {self.weight!r}",
                                 param="weight")
        if not isinstance(self.continuing, bool):
            raise InvalidRequest(f"continuing must be true or false, got {self.continuing!r}")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first


@dataclass
class RequestOutput:
    """One streamed update of a request: the text and tokens new since the last update. ``LLMEngine.step``
    leaves ``text`` empty (the engine speaks tokens); the request's output processor fills it
    (engine/tokenizer.py, run by ``AsyncEngine``'s streams and ``LLMEngine.generate``).

    ``finish_reason`` is one of ``"stop"`` (EOS, stop token or stop string, or constrained
    output complete), ``"length"`` (max_tokens or the context window), ``"abort"`` or ``"error"``.
    ``stop_reason`` says more of a ``"stop"``: the stop string or stop token id that ended it,
    ``CLOSED_BY_BUDGET`` for constrained output closed early to fit the budget, else None.
    Token counts are totals so far.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    # cached_tokens by where they were found: {"device", "host", "disk"} (engine/kv_tier.py)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)


class EngineOverloaded(RuntimeError):
    """The engine's waiting queue is full: retry later (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class GenerationResult:
    """A finished request, as :meth:`LLMEngine.generate` returns it."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    ttft_s: float | None = None
    stop_reason: str | int | None = None  # as RequestOutput.stop_reason
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # as RequestOutput's


@dataclass
class EngineStats:
    running: int
    waiting: int
    pages_total: int
    pages_used: int
    pages_free: int
    pages_cached: int
    pages_pinned: int
    num_pins: int
    prompt_tokens_total: int
    cached_tokens_total: int
    generation_tokens_total: int
    num_preemptions: int
    page_size: int
    waiting_tokens: int = 0        # KV demand queued for admission (see EngineConfig.max_waiting_tokens)
    waiting_tokens_limit: int = 0
    # cached pages no running request or pin holds: the radix cache evicts them when a request needs
    # room, so they count as free for utilisation (pages_used - pages_evictable cannot be reclaimed)
    pages_evictable: int = 0
    # speculative decoding (EngineConfig.speculative): draft tokens proposed and verified, those of
    # them the model accepted, and the verifications (one per request per step that had a draft)
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_verifications_total: int = 0
    # KV tiers (engine/kv_tier.py): per medium ("host", "disk") its TierStats as a dict: pages,
    # hit_tokens, loads, load_time_s, bytes_written, bytes_read, corrupt, dropped, errors, enabled
    kv_tiers: dict = field(default_factory=dict)
    # the CPU kernels (engine/cpu_build.py KERNELS) and whether this engine runs each: Engine.active_kernels
    cpu_kernels: dict = field(default_factory=dict)
    # bytes of K and V a token takes in the pool over every layer (EngineConfig.kv_cache_dtype)
    kv_cache_bytes_per_token: int = 0
    # waiting requests by priority class ("high": priority < 0, "normal": 0, "low": > 0) and whether their
    # session already ran a turn ("started") or not ("new"), keyed "<class>/<new|started>"
    waiting_by_priority: dict = field(default_factory=dict)
    # prompt tokens a second on recent prefill steps of 64+ tokens (EWMA; 0 before the first): what a
    # router weighs a KV transfer against (router/move_cost.py)
    prefill_tokens_per_s: float = 0.0
    # the sliding layers' own pool (engine/window_pool.py), where a model's layers slide and
    # sliding_window_cache is on: its capacity and pages in use, in pages of page_size tokens (0, 0 otherwise)
    window_pages_total: int = 0
    window_pages_used: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted draft tokens over drafted ones (0 before any draft)."""
        return self.spec_accepted_tokens_total / self.spec_draft_tokens_total if self.spec_draft_tokens_total else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens committed per verification: the accepted draft tokens plus the model's own next
        token (1 would be no gain; 0 before any verification). Stop conditions cutting a verified
        run short are not counted against it."""
        v = self.spec_verifications_total
        return (self.spec_accepted_tokens_total + v) / v if v else 0.0

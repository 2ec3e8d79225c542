"""The serving side of a request's outputs: the engine's token ids in, text out (vLLM v1's output processor).

The engine speaks tokens. Each step it emits the token ids a request gained, and it ends a request only
on what tokens say: EOS or a stop token id, ``max_tokens``, the context window, a constraint that
completed. Everything about text happens here, on the thread that consumes the outputs (the event loop
reading an ``AsyncEngine`` stream, or ``LLMEngine.generate``'s caller), never on the engine thread:

- incremental detokenization (``IncrementalDetokenizer``: no UTF-8 character split across outputs);
- stop strings: the output whose text completes one is the request's last, cut after the token that
  completed it, with the text before the stop string; the owner then asks the engine to finish the
  request as stopped (``LLMEngine.stop_request``: its KV is cached, and a session turn's pinned, as for
  an EOS), and the tokens the engine computed meanwhile are never delivered;
- holding back text that may begin a stop string until it cannot.

The tool-call and reasoning parsers (engine/parsers) read this text next, once per request, in the
serving layer that answers the client (``agentrt.core.generation.Generation``): a router's, when the engine is
a worker behind it. That is the only place a model's output format is parsed; the speculative drafter
(engine/speculative.py) works on the same token ids and parses nothing.
"""

from __future__ import annotations

from typing import Sequence

from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.types import RequestOutput, SamplingParams


class OutputProcessor:
    """One request's outputs, token ids to text; :meth:`process` each engine output in order.

    ``stopped`` is the stop string this processor ended the request on (None until then): the engine
    has not seen it, so the owner calls ``stop_request`` unless the engine's own output was finished too.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, eos_token_ids: Sequence[int] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self._stops = list(params.stop)
        self._longest = max(map(len, self._stops), default=0)
        # the tokens that end a request in the engine and write no text (engine/stop_checks.py's rule)
        self._textless = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.text = ""     # all text so far (cut at a stop string)
        self._sent = 0     # how much of it was handed out
        self.finished = False
        self.stopped: str | None = None

    def process(self, out: RequestOutput) -> RequestOutput | None:
        """The engine's output with its text; None for an output after this request finished here (the
        engine's tokens past a stop string)."""
        if self.finished:
            return None
        ids = out.token_ids
        for i, tok in enumerate(ids):
            if tok in self._textless:
                continue
            before = len(self.text)
            self.text += self._detok.push((tok,))
            if self._stop_at(before):
                return self._cut(out, i + 1)
        if out.finished and out.finish_reason in ("stop", "length"):
            before = len(self.text)
            self.text += self._detok.flush()
            if self._stop_at(before):
                return self._cut(out, len(ids))
        end = len(self.text)
        if not out.finished and self._stops:  # text that may begin a stop string waits
            end = max(self._sent, end - (self._longest - 1))
        self.finished = out.finished
        return self._with_text(out, end)

    def _stop_at(self, before: int) -> bool:
        """Whether the text after ``before`` completes a stop string: the text is cut where the earliest
        one begins, and ``stopped`` names it."""
        if not self._stops:
            return False
        start = max(0, before - self._longest + 1)   # a new match ends in the new text
        hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self._stops) if i >= 0]
        if not hits:
            return False
        idx, stop = min(hits)
        self.text = self.text[:idx]
        self.stopped = stop
        return True

    def _cut(self, out: RequestOutput, keep: int) -> RequestOutput:
        """The request's last output: its first ``keep`` tokens, finished by ``self.stopped``."""
        self.finished = True
        dropped = len(out.token_ids) - keep
        cut = RequestOutput(
            request_id=out.request_id, text="", token_ids=list(out.token_ids[:keep]), finished=True,
            finish_reason="stop", stop_reason=self.stopped, prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens, completion_tokens=out.completion_tokens - dropped,
            logprobs=None if out.logprobs is None else list(out.logprobs[:keep]),
            cached_tokens_by_tier=out.cached_tokens_by_tier)
        return self._with_text(cut, len(self.text))

    def _with_text(self, out: RequestOutput, end: int) -> RequestOutput:
        out.text = self.text[self._sent:end]
        self._sent = end
        return out

"""The token-level stop checks: what one committed token says about its request.

A sampled token is written into the request (``Request.place_token``) and queued for its next output;
then, in order: a constraint that rejects it ends the request with an error; EOS (unless
``ignore_eos``) or one of ``stop_token_ids`` stops it; a constraint that completed stops it; reaching
``max_tokens`` or the context window ends it at ``length``. Stop strings are text, and so the output
processor's (engine/tokenizer.py), never checked here.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import Request, Status
from engine.types import CLOSED_BY_BUDGET, TokenLogprob


@dataclass(frozen=True)
class StopRule:
    """What ends every request of an engine, beside its own sampling parameters."""
    eos_token_ids: frozenset[int]
    max_model_len: int


def append_token(req: Request, tok: int, lp: TokenLogprob | None, rule: StopRule,
                 constraint_accepted: bool = False, check_complete: bool = True) -> None:
    """Commit ``tok`` to ``req`` and apply the stop checks. ``constraint_accepted``: the constraint took
    the token already (a verified draft's); ``check_complete``: ask the constraint whether it is done."""
    p = req.params
    req.place_token(tok)
    req.pending_ids.append(tok)   # stop tokens included (as vLLM does); their text is not
    if lp is not None:
        req.pending_logprobs.append(lp)
    if req.constraint is not None and not constraint_accepted and not req.constraint.accept(tok):
        _end(req, "error")
        req.error = "the constraint rejected a sampled token"
        return
    eos = tok in rule.eos_token_ids and not p.ignore_eos
    if eos or tok in p.stop_token_ids:
        _end(req, "stop")
        req.stop_reason = None if eos else tok
    elif check_complete and req.constraint is not None and req.constraint.is_terminated():
        _end(req, "stop")
    if not req.finished and (len(req.output_ids) - req.pending >= p.max_tokens
                             or req.num_known >= rule.max_model_len):
        _end(req, "length")
    if req.finish_reason == "stop" and req.stop_reason is None and req.constraint is not None \
            and req.constraint.closed_by_budget:
        req.stop_reason = CLOSED_BY_BUDGET


def _end(req: Request, reason: str) -> None:
    req.finish_reason = reason
    req.status = Status.FINISHED

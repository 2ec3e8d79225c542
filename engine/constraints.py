"""The interface the sampler uses for constrained decoding (grammars, JSON schemas).

A constraint belongs to one request and moves with it (through preemption and
resume: its state is the tokens it has accepted, not the KV cache).
"""

from __future__ import annotations

import torch


class TokenConstraint:
    """Per-request token constraint, advanced with every sampled token.

    Contract:
    - ``allowed_mask(vocab_size)`` returns a bool tensor ``[vocab_size]`` of tokens
      that may come next (True = allowed), or ``None`` when everything is allowed.
      It is called once per decoding step, before sampling (via ``apply_to_logits``).
    - ``accept(token_id)`` advances the state; it returns False if the token was not
      allowed (the engine then ends the request with ``finish_reason="error"``).
    - ``is_terminated()`` is True once the constrained output is complete; the engine
      then ends the request with ``finish_reason="stop"``.
    - ``rollback(n)`` undoes the last ``n`` accepted tokens.
    - ``valid_prefix(tokens)`` counts the leading tokens it would accept in a row, state unchanged.
    - Closing within a token budget (optional: ``closes_outputs`` says whether it is
      implemented; the defaults below do nothing). ``closing_plan()`` is a list of tokens
      that completes the output from the current state (``[]``: it may end now), or None
      when none was found. ``fit_budget(token_id, budget)`` is called with each sampled
      token and the tokens the request may still emit, that one included, and returns the
      token to emit: the sampled one while a valid completion still fits after it, else the
      first of a closing it then forces step by step, after which ``is_terminated()`` is
      True. ``closed_by_budget`` is True once it forced one.
    """

    closes_outputs: bool = False
    closed_by_budget: bool = False

    def allowed_mask(self, vocab_size: int) -> torch.Tensor | None:
        raise NotImplementedError

    def apply_to_logits(self, logits: torch.Tensor) -> None:
        """Set disallowed entries of one request's logits row ``[vocab]`` to -inf, in place.

        The default goes through ``allowed_mask``; implementations with a faster
        native path (xgrammar's bitmask kernel) override it and are tested against it.
        """
        mask = self.allowed_mask(logits.shape[-1])
        if mask is not None:
            logits.masked_fill_(~mask.to(logits.device), float("-inf"))

    def accept(self, token_id: int) -> bool:
        raise NotImplementedError

    def is_terminated(self) -> bool:
        return False

    def rollback(self, n: int) -> None:
        raise NotImplementedError

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the constraint accepts one after another from its current state,
        which it is left in (speculative decoding ends a draft there). The default accepts and
        rolls back; implementations that can check on a copy of their state override it."""
        n = 0
        for t in tokens:
            if not self.accept(t):
                break
            n += 1
        if n:
            self.rollback(n)
        return n

    def closing_plan(self) -> list[int] | None:
        return None

    def fit_budget(self, token_id: int, budget: int) -> int:
        return token_id

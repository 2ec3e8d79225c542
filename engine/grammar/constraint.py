"""`TokenConstraint` backed by an xgrammar `GrammarMatcher`.

Per decoding step the matcher fills a packed bitmask of allowed tokens
(``int32[ceil(V/32)]``, bit ``t % 32`` of word ``t // 32``; 1-10 µs with the
compiled grammar's mask cache), and the logits of disallowed tokens are set to
-inf in place. ``allowed_mask`` unpacks the same bitmask with plain torch ops:
it is the reference path the fast paths are tested against.

Masking a CPU row: xgrammar's CPU kernel writes -inf token by token, ~7 µs for a
mask that allows almost everything (inside a JSON string) but ~250 µs for one
that allows a handful (after ``{"``), measured on the 49k-token default vocab.
For those sparse masks we keep the few allowed logits, fill the row with -inf
and put them back (~15 µs). On CUDA, xgrammar's Triton kernel does the row.

End of output: the matcher allows EOS only where the grammar may end. Once the
grammar is complete and nothing but EOS may follow (a closed JSON object, the
last tool call), ``is_terminated()`` is True at once, so the engine stops without
spending a decode step on sampling a forced EOS.

Closing within the budget (``fit_budget``): the invariant is that a verified closing
plan (engine/grammar/closing.py) of at most ``budget`` tokens exists from the current
state. The plan from the state after the sampled token is computed on a fork; if it
does not fit in what is left after that token, the sampled token is replaced by the
first token of the current state's plan and the rest of that plan is forced, one token
a step, after which ``is_terminated()`` is True. The plan from the state after an
accepted token is kept, so the current state's plan is never computed twice.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import xgrammar as xgr

from engine.constraints import TokenConstraint
from engine.grammar.closing import TokenCodec, closing_tokens, completes

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def _apply_backend(device: torch.device) -> str:
    """xgrammar kernel for logits on ``device``: its C++ loop on CPU, Triton on CUDA when present."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401  (only probing whether the Triton kernel can run)
            return "triton"
        except ImportError:
            return "torch_native"
    return "torch_native"


_SPARSE_FRACTION = 16  # a mask allowing fewer than V / 16 tokens is applied by "keep, fill, restore"


_BIT_INDEX = np.arange(32)


def _set_bits(words: np.ndarray) -> np.ndarray:
    """Ids of the set bits of a packed ``uint32[W]`` mask, expanding only its non-zero words."""
    nz = np.flatnonzero(words)
    bits = np.unpackbits(words[nz].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little").astype(bool)
    return (nz[:, None] * 32 + _BIT_INDEX)[bits]  # (k, 32) -> the set ones, in order


def _mask_row_cpu(row: torch.Tensor, bits: torch.Tensor, vocab_size: int) -> None:
    """-inf where the packed ``bits`` (``int32[W]``) have a 0, for ``row[:vocab_size]``, in place."""
    words = bits.numpy().view(np.uint32)
    if int(np.bitwise_count(words).sum()) * _SPARSE_FRACTION < vocab_size:
        allowed = _set_bits(words)
        if row.dtype in (torch.float32, torch.float16) and row.is_contiguous():
            values = row.numpy()  # numpy indexing costs ~10 us here, torch's ~75 us
            keep = values[allowed]
            values[:vocab_size] = -np.inf
            values[allowed] = keep
        else:
            idx = torch.from_numpy(allowed)
            with torch.inference_mode():  # the engine's logits are inference tensors
                keep = row[idx]
                row[:vocab_size] = float("-inf")
                row[idx] = keep
    else:
        xgr.apply_token_bitmask_inplace(row.view(1, -1), bits.view(1, -1), vocab_size=vocab_size, backend="cpu")


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed ``int32[W]`` bitmask -> ``bool[vocab_size]`` (ids beyond ``32 * W`` are False)."""
    # (W, 1) >> (32,) -> (W, 32): bit j of word w is token 32 * w + j
    unpacked = ((bits.unsqueeze(1) >> _BIT_SHIFTS.to(bits.device)) & 1).bool().reshape(-1)
    out = torch.zeros(vocab_size, dtype=torch.bool, device=bits.device)
    n = min(vocab_size, unpacked.shape[0])
    out[:n] = unpacked[:n]
    return out


class XGrammarConstraint(TokenConstraint):
    """One request's grammar state. Not thread-safe: the engine thread alone drives it.

    ``vocab_size`` is the number of token ids the compiled grammar knows (its
    tokenizer info); logits wider than that (padded LM heads) get -inf beyond it.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, stop_token_ids: Sequence[int],
                 label: str = "grammar", codec: TokenCodec | None = None) -> None:
        self.label = label  # what the request asked for ("json_schema", "tool_choice=required", ...)
        self._compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled)
        self._vocab_size = vocab_size
        self._stop_ids = tuple(int(t) for t in stop_token_ids)
        self._codec = codec            # None: this constraint cannot close its output (fit_budget is a no-op)
        self.reuse_plans = True        # False: compute every plan afresh (the reference path)
        self._reset_closing()
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # (1, ceil(V/32)) int32, CPU
        self._mask_state = -1       # number of accepted tokens the bitmask was filled at (-1: stale)
        self._mask_is_full = False  # the last fill allowed every token
        self._num_accepted = 0
        self._device_bitmask: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"XGrammarConstraint({self.label}, accepted={self._num_accepted})"

    @property
    def num_accepted(self) -> int:
        """Tokens accepted so far (what ``rollback`` can undo)."""
        return self._num_accepted

    def clone(self) -> "XGrammarConstraint":
        """An independent constraint in the same state (for ``n > 1`` samples of one prompt)."""
        twin = XGrammarConstraint(self._compiled, self._vocab_size, self._stop_ids, self.label, self._codec)
        twin._matcher = self._matcher.fork()
        twin._num_accepted = self._num_accepted
        return twin

    # -- the mask ------------------------------------------------------------------------
    def _fill(self) -> torch.Tensor:
        """The packed mask ``int32[1, W]`` of the current state (filled at most once per state)."""
        if self._mask_state != self._num_accepted:
            if self._matcher.is_terminated():
                # After EOS was accepted nothing may follow; keep EOS so sampling stays defined.
                self._bitmask.zero_()
                self._set_stop_bits()
                self._mask_is_full = False
            else:
                self._mask_is_full = not self._matcher.fill_next_token_bitmask(self._bitmask)
            self._mask_state = self._num_accepted
        return self._bitmask

    def _set_stop_bits(self) -> None:
        words = self._bitmask[0].numpy().view(np.uint32)
        for t in self._stop_ids:
            words[t >> 5] |= np.uint32(1 << (t & 31))

    def allowed_mask(self, vocab_size: int) -> torch.Tensor | None:
        """``bool[vocab_size]`` of tokens the grammar allows next (the reference path)."""
        return unpack_bitmask(self._fill()[0], vocab_size)

    def apply_to_logits(self, logits: torch.Tensor) -> None:
        """Mask one row ``[V]`` in place (see the module docstring for the CPU and CUDA paths)."""
        bitmask = self._fill()
        n = min(self._vocab_size, logits.shape[-1])
        if self._mask_is_full:
            pass
        elif logits.device.type == "cpu":
            _mask_row_cpu(logits, bitmask[0], n)
        else:
            if self._device_bitmask is None or self._device_bitmask.device != logits.device:
                self._device_bitmask = torch.empty_like(bitmask, device=logits.device)
            self._device_bitmask.copy_(bitmask)  # synchronous: the CPU buffer is refilled next step
            xgr.apply_token_bitmask_inplace(logits.view(1, -1), self._device_bitmask, vocab_size=n,
                                            backend=_apply_backend(logits.device))
        if logits.shape[-1] > self._vocab_size:
            with torch.inference_mode():
                logits[self._vocab_size:] = float("-inf")

    # -- closing within the budget ------------------------------------------------------
    def _reset_closing(self) -> None:
        self._plan: list[int] | None = None   # closing plan from the state after ``_plan_at`` tokens
        self._plan_at = -1
        self._next: tuple[int, list[int] | None] | None = None  # (sampled token, plan after it)
        self._forced: list[int] | None = None  # committed closing: tokens still to emit (None: free)
        self.closed_by_budget = False

    @property
    def closes_outputs(self) -> bool:
        return self._codec is not None

    def closing_plan(self) -> list[int] | None:
        """Token ids that complete the output from the current state (``[]``: it may end now), or
        None if none was found (no codec, or longer than the closer's limit). Cached per state."""
        if self._plan_at != self._num_accepted:
            self._plan = self._plan_from(self._matcher)
            self._plan_at = self._num_accepted
        return self._plan

    def _plan_from(self, matcher: xgr.GrammarMatcher) -> list[int] | None:
        if self._codec is None:
            return None
        if matcher.is_terminated():
            return []
        return closing_tokens(matcher, self._codec)

    def _plan_after(self, token_id: int, budget: int) -> list[int] | None:
        """A closing plan from the state after ``token_id`` (None if it is refused or none is found).

        The fast path reuses the current state's plan (its tail when ``token_id`` is its first
        token): inside a string most tokens leave it valid, and checking it on a fork costs a few
        µs. It is taken when it is valid and fits ``budget``; otherwise the closer runs afresh
        (``reuse_plans = False`` always does: the reference the fast path is tested against).
        """
        fork = self._matcher.fork()
        if not fork.accept_token(int(token_id)):
            return None
        plan = self._plan if self.reuse_plans and self._plan_at == self._num_accepted else None
        if plan is not None:
            reused = plan[1:] if plan and plan[0] == token_id else plan
            if len(reused) <= budget and completes(fork, reused):
                return reused
        return self._plan_from(fork)

    def _shortest_plan(self) -> list[int] | None:
        """The current state's plan, or a fresh one if that is shorter (a reused plan may not be)."""
        plan = self.closing_plan()
        if self.reuse_plans and plan:
            fresh = self._plan_from(self._matcher)
            if fresh is not None and len(fresh) < len(plan):
                plan = self._plan = fresh
        return plan

    def fit_budget(self, token_id: int, budget: int) -> int:
        """The token to emit instead of the sampled ``token_id`` so that the output can still be
        completed with at most ``budget`` tokens, this one included (see the module docstring).
        Unchanged when no closing is possible (no codec, or no plan fits ``budget``)."""
        if self._forced is not None:
            return self._forced[0] if self._forced else self._stop_ids[0]
        after = self._plan_after(token_id, budget - 1)
        if after is not None and len(after) <= budget - 1:
            self._next = (int(token_id), after)
            return token_id
        plan = self._shortest_plan()
        if plan is None or len(plan) > budget:
            return token_id
        self._forced, self.closed_by_budget = list(plan), True
        return plan[0] if plan else self._stop_ids[0]  # may end now: end it

    # -- state -------------------------------------------------------------------------
    def accept(self, token_id: int) -> bool:
        if not self._matcher.accept_token(int(token_id)):
            return False
        self._num_accepted += 1
        if self._forced:
            if self._forced[0] == token_id:
                self._forced.pop(0)
            else:  # something else was appended (an engine bug): the plan no longer applies
                self._forced = None
        elif self._next is not None and self._next[0] == token_id:
            self._plan, self._plan_at = self._next[1], self._num_accepted
        self._next = None
        return True

    def is_terminated(self) -> bool:
        """True once the output is complete: EOS was accepted, only EOS may come next, or a
        closing forced by ``fit_budget`` has been emitted."""
        if self._matcher.is_terminated():
            return True
        if self._forced == [] and self._matcher.is_completed():
            return True
        if not self._matcher.is_completed():
            return False
        words = self._fill()[0].numpy().view(np.uint32).copy()
        for t in self._stop_ids:
            words[t >> 5] &= ~np.uint32(1 << (t & 31))
        return not words.any()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar accepts in a row from here, checked on a fork of the
        matcher (the state, closing plans included, is untouched)."""
        fork = self._matcher.fork()
        n = 0
        for t in tokens:
            # once a stop token is in, nothing more is accepted: asking (a draft goes on past the stop)
            # would only have xgrammar print a warning on the server's console
            if fork.is_terminated() or not fork.accept_token(int(t)):
                break
            n += 1
        return n

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (an engine bug if ``n`` exceeds what was accepted)."""
        if not 0 <= n <= self._num_accepted:
            raise ValueError(f"cannot roll back {n} tokens: {self._num_accepted} were accepted")
        if n:
            self._matcher.rollback(n)
            self._num_accepted -= n
            self._mask_state = -1
            self._reset_closing()


def apply_constraints(logits: torch.Tensor, constraints: Sequence[TokenConstraint | None]) -> None:
    """Mask a whole batch ``logits [B, V]`` in place, row ``i`` by ``constraints[i]``.

    Equivalent to calling ``apply_to_logits`` row by row (which is what it does on
    CPU); on CUDA the xgrammar rows share one bitmask, one host-to-device copy and
    one kernel launch. Rows without a constraint are left alone.
    """
    if logits.device.type == "cpu":
        for i, c in enumerate(constraints):
            if c is not None:
                c.apply_to_logits(logits[i])
        return
    rows: list[int] = []
    masks: list[torch.Tensor] = []
    width = None
    for i, c in enumerate(constraints):
        if c is None:
            continue
        if isinstance(c, XGrammarConstraint) and (width is None or c._vocab_size == width):
            width = c._vocab_size
            bits = c._fill()
            if not c._mask_is_full:
                rows.append(i)
                masks.append(bits[0])
            if logits.shape[-1] > width:
                with torch.inference_mode():
                    logits[i, width:] = float("-inf")
        else:
            c.apply_to_logits(logits[i])
    if not rows:
        return
    bitmask = torch.zeros((logits.shape[0], masks[0].shape[0]), dtype=torch.int32)  # (B, W), CPU
    bitmask[rows] = torch.stack(masks)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(width, logits.shape[-1]),
                                    indices=rows, backend=_apply_backend(logits.device))

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
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import xgrammar as xgr

from engine.constraints import TokenConstraint

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
                 label: str = "grammar") -> None:
        self.label = label  # what the request asked for ("json_schema", "tool_choice=required", ...)
        self._compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled)
        self._vocab_size = vocab_size
        self._stop_ids = tuple(int(t) for t in stop_token_ids)
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
        twin = XGrammarConstraint(self._compiled, self._vocab_size, self._stop_ids, self.label)
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

    # -- state -------------------------------------------------------------------------
    def accept(self, token_id: int) -> bool:
        if not self._matcher.accept_token(int(token_id)):
            return False
        self._num_accepted += 1
        return True

    def is_terminated(self) -> bool:
        """True once the output is complete: EOS was accepted, or only EOS may come next."""
        if self._matcher.is_terminated():
            return True
        if not self._matcher.is_completed():
            return False
        words = self._fill()[0].numpy().view(np.uint32).copy()
        for t in self._stop_ids:
            words[t >> 5] &= ~np.uint32(1 << (t & 31))
        return not words.any()

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (an engine bug if ``n`` exceeds what was accepted)."""
        if not 0 <= n <= self._num_accepted:
            raise ValueError(f"cannot roll back {n} tokens: {self._num_accepted} were accepted")
        if n:
            self._matcher.rollback(n)
            self._num_accepted -= n
            self._mask_state = -1


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

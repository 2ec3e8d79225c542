"""Compiling grammars against one tokenizer, with a cache keyed by the request's spec text.

xgrammar needs the vocabulary as decoded strings (``TokenizerInfo``) and compiles a
grammar into per-state token-mask tables for that vocabulary. Building the info
takes ~20 ms and a JSON schema compiles in a few ms, so both are done once: one
:class:`GrammarCompilerCache` per tokenizer, and compiled grammars are kept in a
bounded LRU keyed by the text that specifies them (schema JSON, or the tool-call
spec), so a session that sends the same tools every turn compiles them once.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable

import xgrammar as xgr
from tokenizers import decoders

from engine.grammar.closing import TokenCodec
from engine.tokenizer import Tokenizer
from engine.types import InvalidRequest

# xgrammar's C++ errors read "[12:34:56] /project/cpp/json_schema_converter.cc:5082: <message>".
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


def _vocab_type(tokenizer: Tokenizer) -> tuple[xgr.VocabType, bool]:
    """(vocabulary encoding, add_prefix_space) of a `tokenizers` tokenizer."""
    detect = getattr(xgr.TokenizerInfo, "_detect_metadata_from_hf", None)
    if detect is not None:
        meta = detect(tokenizer.hf.to_str())
        return meta["vocab_type"], bool(meta["add_prefix_space"])
    if isinstance(tokenizer.hf.decoder, decoders.ByteLevel):
        return xgr.VocabType.BYTE_LEVEL, False
    if tokenizer.hf.token_to_id("<0x0A>") is not None:
        return xgr.VocabType.BYTE_FALLBACK, True
    return xgr.VocabType.RAW, False


def build_tokenizer_info(tokenizer: Tokenizer, vocab_size: int | None = None) -> xgr.TokenizerInfo:
    """xgrammar's view of ``tokenizer``: decoded vocabulary, stop ids, special tokens.

    ``vocab_size`` is the width of the model's logits when it differs from the
    tokenizer's (padded LM heads); ids without a token are never allowed. Special
    (control) tokens other than EOS are given an empty string, which xgrammar
    treats as "never part of grammar text": a grammar never lets the model emit
    ``<|im_start|>`` or ``<file_sep>`` inside a JSON string.
    """
    n = tokenizer.vocab_size
    size = vocab_size or n
    encoded = [tokenizer.hf.id_to_token(i) or "" for i in range(min(n, size))]
    for tid, added in tokenizer.hf.get_added_tokens_decoder().items():
        if added.special and tid < len(encoded):
            encoded[tid] = ""
    vocab_type, prefix_space = _vocab_type(tokenizer)
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=size,
                             stop_token_ids=list(tokenizer.eos_token_ids), add_prefix_space=prefix_space)


def build_token_codec(tokenizer: Tokenizer, info: xgr.TokenizerInfo) -> TokenCodec:
    """The closer's view of ``tokenizer`` (engine/grammar/closing.py): its encoder, and the token of
    each byte that has a single-byte token. It holds the ``tokenizers`` object, not ``tokenizer``
    itself, so the registry below can still let ``tokenizer`` go."""
    hf = tokenizer.hf
    byte_tokens: dict[int, int] = {}
    for i, raw in enumerate(info.decoded_vocab):
        if len(raw) == 1:
            byte_tokens.setdefault(raw[0], i)
    return TokenCodec(encode=lambda text: hf.encode(text, add_special_tokens=False).ids, byte_tokens=byte_tokens)


def xgrammar_error_text(exc: BaseException) -> str:
    """The useful first line of an xgrammar error, without the C++ file and line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CPP_PREFIX.sub("", text)


class GrammarCompilerCache:
    """One per tokenizer: xgrammar's ``TokenizerInfo`` + ``GrammarCompiler`` + an LRU of results, and the
    tokenizer's ``codec`` the constraints close their outputs with.

    Thread-safe: the HTTP layer compiles while the engine thread matches. Two
    threads that miss on the same key at once both compile; one result is kept.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None,
                 max_entries: int = 256, max_threads: int = 2) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.info = build_tokenizer_info(tokenizer, vocab_size)
        self.vocab_size = self.info.vocab_size
        self.stop_token_ids = tuple(self.info.stop_token_ids)
        self.codec = build_token_codec(tokenizer, self.info)
        # Our own LRU replaces xgrammar's cache, so that it is bounded by entries and observable.
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=False)
        self._max_entries = max_entries
        self._entries: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    # -- the one lookup every compile goes through ---------------------------------------
    def get(self, key: str, compile_fn: Callable[[], xgr.CompiledGrammar], what: str) -> xgr.CompiledGrammar:
        """The compiled grammar for ``key``; ``compile_fn`` builds it on a miss.

        Any failure of xgrammar (unsupported keyword, bad regex, unknown ``$ref``,
        invalid grammar) becomes :class:`InvalidRequest` naming ``what``.
        """
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return hit
            self.misses += 1
        try:
            compiled = compile_fn()
        except InvalidRequest:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError/pydantic errors; all are the input's fault
            raise InvalidRequest(f"{what} is not supported: {xgrammar_error_text(exc)}") from exc
        with self._lock:
            self._entries[key] = compiled
            self._entries.move_to_end(key)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._entries)

    # -- grammars --------------------------------------------------------------------------
    def json_schema(self, schema: dict[str, Any] | bool, what: str = "response_format.json_schema.schema"
                    ) -> xgr.CompiledGrammar:
        """Compact JSON (``", "`` and ``": "`` separators, no other whitespace) matching ``schema``."""
        text = json.dumps(schema, ensure_ascii=False)
        return self.get("json_schema:" + text,
                        lambda: self.compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True),
                        what)

    def json_object(self) -> xgr.CompiledGrammar:
        """Any JSON object (OpenAI's ``{"type": "json_object"}``), compact as above."""
        return self.get("json_object", lambda: self.compiler.compile_json_schema(
            '{"type": "object"}', any_whitespace=False, strict_mode=False), "response_format json_object")

    def structural_tag(self, key: str, build: Callable[[], xgr.StructuralTag], what: str
                       ) -> xgr.CompiledGrammar:
        """A structural tag (text with tagged, schema-constrained regions), cached under ``key``."""
        return self.get("structural_tag:" + key, lambda: self.compiler.compile_structural_tag(build()), what)


class _CacheRegistry:
    """The process-wide memo from a live tokenizer to its compiler cache.

    ``Tokenizer`` is an unhashable dataclass, so entries are keyed by ``id()`` and
    removed by a finalizer when the tokenizer is garbage-collected (an id is never
    reused while its object lives).
    """

    def __init__(self) -> None:
        self._caches: dict[int, tuple[weakref.ref, GrammarCompilerCache]] = {}
        self._lock = threading.Lock()

    def _lookup(self, tokenizer: Tokenizer) -> GrammarCompilerCache | None:
        entry = self._caches.get(id(tokenizer))
        return entry[1] if entry is not None and entry[0]() is tokenizer else None

    def for_tokenizer(self, tokenizer: Tokenizer) -> GrammarCompilerCache:
        with self._lock:
            cache = self._lookup(tokenizer)
        if cache is not None:
            return cache
        cache = GrammarCompilerCache(tokenizer)
        with self._lock:
            existing = self._lookup(tokenizer)
            if existing is not None:
                return existing
            key = id(tokenizer)
            self._caches[key] = (weakref.ref(tokenizer), cache)
            weakref.finalize(tokenizer, self._caches.pop, key, None)
        return cache


_REGISTRY = _CacheRegistry()


def compiler_cache_for(tokenizer: Tokenizer | GrammarCompilerCache) -> GrammarCompilerCache:
    """The shared :class:`GrammarCompilerCache` of ``tokenizer`` (built on first use, ~20 ms)."""
    if isinstance(tokenizer, GrammarCompilerCache):
        return tokenizer
    return _REGISTRY.for_tokenizer(tokenizer)

"""Request fields of the OpenAI and vLLM APIs that this server does not implement, and unknown ones.

A Chat Completions, Completions, Responses or ``/tokenize`` body (and a worker's SGLang ``/generate``,
router/sglang_api.py) may carry fields from OpenAI's API reference or from vLLM's (SGLang's) extensions
that agentrt does not implement (``logit_bias``, ``min_p``, ``guided_json``, ...). Dropping one
silently gives output that looks right and is not what was asked, so each is accepted only at the value
that asks for nothing (its neutral value: absent, ``null``, or the API's default) and refused with a 400
naming it otherwise. A field that neither API defines is refused as OpenAI refuses it ("Unrecognized
request argument supplied"), so a misspelt name is not ignored either. The fields the server does
implement are declared on the request models (agentrt/protocol.py) and never reach this check.
"""

from __future__ import annotations

from typing import Any

from agentrt.core.errors import bad_request

_STRUCTURED_HINT = "; use response_format (json_object or json_schema) or tools with tool_choice"
_EMPTY = (None, [], {})

# name -> (the values that ask for nothing, what they are in words, a hint), for both endpoints
_BOTH: dict[str, tuple[tuple[Any, ...], str, str]] = {
    "logit_bias": (_EMPTY, "an empty map", ""),
    "store": ((None, False), "false", "; stored completions are not kept here (a Responses call with store "
                                      "or a session keeps a conversation)"),
    "service_tier": ((None, "auto", "default"), "'auto' or 'default'", ""),
    "metadata": ((), "", ""),                 # any: only read with store, which is refused
    "safety_identifier": ((), "", ""),        # any: an abuse-monitoring tag, with no effect on the output
    "request_id": ((), "", ""),               # any: vLLM's name for the request in its logs
    "min_p": ((None, 0, 0.0), "0", ""),
    "repetition_penalty": ((None, 1, 1.0), "1", ""),
    "length_penalty": ((None, 1, 1.0), "1", ""),
    "min_tokens": ((None, 0), "0", ""),
    "use_beam_search": ((None, False), "false", ""),
    "include_stop_str_in_output": ((None, False), "false", ""),
    "spaces_between_special_tokens": ((None, True), "true", ""),
    "bad_words": (_EMPTY, "an empty list", ""),
    "allowed_token_ids": ((None,), "null", ""),
    "prompt_logprobs": ((None,), "null", ""),
    "truncate_prompt_tokens": ((None,), "null", "; a prompt over the context window is refused"),
    "logits_processors": ((None,), "null", ""),
    "return_tokens_as_token_ids": ((None, False), "false", ""),
    "guided_json": ((None,), "null", _STRUCTURED_HINT),
    "guided_regex": ((None,), "null", _STRUCTURED_HINT),
    "guided_choice": ((None,), "null", _STRUCTURED_HINT),
    "guided_grammar": ((None,), "null", _STRUCTURED_HINT),
    "guided_decoding_backend": ((None,), "null", _STRUCTURED_HINT),
    "guided_whitespace_pattern": ((None,), "null", _STRUCTURED_HINT),
    "structured_outputs": ((None,), "null", _STRUCTURED_HINT),
    "kv_transfer_params": ((None,), "null", ""),
    "vllm_xargs": ((None,), "null", ""),
}

CHAT: dict[str, tuple[tuple[Any, ...], str, str]] = {
    **_BOTH,
    "modalities": ((None, ["text"]), "['text']", "; this model reads and writes text"),
    "audio": ((None,), "null", "; this model reads and writes text"),
    "prediction": ((None,), "null", ""),
    "web_search_options": ((None,), "null", "; only function tools are served"),
    "verbosity": ((None, "medium"), "'medium'", ""),
    "functions": ((None,), "null", "; use tools"),
    "function_call": ((None,), "null", "; use tool_choice with tools"),
    "best_of": ((None, 1), "1", ""),
    "skip_special_tokens": ((None, True), "true", "; the reply's special tokens are read by its tool-call and "
                                                  "reasoning parsers"),
    "return_token_ids": ((None, False), "false", "; /v1/completions returns them"),
    "echo": ((None, False), "false", ""),
    "add_generation_prompt": ((None, True), "true", ""),
    "continue_final_message": ((None, False), "false", ""),
    "add_special_tokens": ((None, False), "false", ""),
    "documents": ((None,), "null", ""),
    "chat_template": ((None,), "null", "; the model's own chat template is used"),
    "mm_processor_kwargs": ((None,), "null", "; this model reads text"),
}

COMPLETIONS: dict[str, tuple[tuple[Any, ...], str, str]] = {
    **_BOTH,
    "best_of": ((None, 1), "1", ""),
}

# Responses declares OpenAI's fields itself (those it cannot honour are refused by ResponsesService.start)
RESPONSES: dict[str, tuple[tuple[Any, ...], str, str]] = {
    **_BOTH,
    "prompt_cache_retention": ((None, "in_memory", "in-memory"), "'in_memory'",
                               "; cached prefixes are kept while the KV pool holds them (docs/kv_cache.md)"),
}

# vLLM's /tokenize fields agentrt does not implement
TOKENIZE: dict[str, tuple[tuple[Any, ...], str, str]] = {
    "continue_final_message": CHAT["continue_final_message"],
    "chat_template": CHAT["chat_template"],
    "mm_processor_kwargs": CHAT["mm_processor_kwargs"],
}


def check_extra_fields(extra: dict[str, Any] | None, known: dict[str, tuple[tuple[Any, ...], str, str]],
                       prefix: str = "") -> None:
    """400 for the first field of ``extra`` (a request model's ``model_extra``: the fields it does not declare)
    that ``known`` lists at a value other than its neutral ones, or that ``known`` does not list. ``prefix``:
    where the fields sit in the body (``sampling_params.``), for the message and ``param``."""
    for name, value in (extra or {}).items():
        where = prefix + name
        if name not in known:
            raise bad_request(f"Unrecognized request argument supplied: {where} (the fields this endpoint takes "
                              "are in /openapi.json)", param=where)
        neutral, words, hint = known[name]
        if neutral and not any(type(value) is type(v) and value == v for v in neutral):
            raise bad_request(f"{where} is not supported by this server (only {words}){hint}", param=where)

"""Refuse JSON-schema keywords the grammar engine would silently not enforce.

xgrammar compiles most of JSON Schema into a grammar, and reports what it cannot
parse. A few keywords it accepts but ignores (measured on xgrammar 0.2.9: the
output of ``{"not": {"type": "string"}}`` may be a string), so a grammar built
from them could produce output that fails validation. We reject those up front
with the schema path, as a 400, rather than promise what we do not enforce.

``oneOf`` is compiled as ``anyOf``: output matches at least one branch. That is
exact for disjoint branches (discriminated unions, ``type``-distinct options),
which is what frameworks generate.
"""

from __future__ import annotations

from typing import Any

from engine.types import InvalidRequest

# Keywords xgrammar accepts without enforcing them.
_UNENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
               "$dynamicRef", "$recursiveRef")

# Keywords whose value is one subschema / a map of subschemas / a list of subschemas.
_ONE = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains",
        "additionalItems", "unevaluatedItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")


def _pointer(path: list[str]) -> str:
    return "#" + "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in path)


def check_schema(schema: Any, what: str) -> None:
    """Raise :class:`InvalidRequest` if ``schema`` uses a keyword we cannot enforce."""
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(f"{what} must be a JSON schema object, got {type(schema).__name__}")
    _walk(schema, [], what)


def _walk(node: Any, path: list[str], what: str) -> None:
    if not isinstance(node, dict):
        return  # booleans are valid subschemas; anything else xgrammar itself reports
    for key in _UNENFORCED:
        if key in node:
            _refuse(what, path + [key], f"the keyword '{key}'")
    if node.get("uniqueItems") is True:
        _refuse(what, path + ["uniqueItems"], "'uniqueItems: true'")
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        _refuse(what, path + ["allOf"], "'allOf' with more than one subschema")
    for key in _ONE:
        if key in node:
            _walk(node[key], path + [key], what)
    for key in _MAP:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _walk(sub, path + [key, str(name)], what)
    for key in _LIST:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                _walk(sub, path + [key, str(i)], what)
    items = node.get("items")
    if isinstance(items, list):
        for i, sub in enumerate(items):
            _walk(sub, path + ["items", str(i)], what)
    elif items is not None:
        _walk(items, path + ["items"], what)


def _refuse(what: str, path: list[str], part: str) -> None:
    raise InvalidRequest(f"{what}: {part} at {_pointer(path)} is not supported by constrained decoding "
                         "(the output could not be guaranteed to match it)")

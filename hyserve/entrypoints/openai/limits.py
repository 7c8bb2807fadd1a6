"""Limits on what a request body may hold, checked at the API edge before anything else reads it.

Every string must be valid Unicode: JSON may escape a lone surrogate ("\\udfff"), which no encoder can turn
into UTF-8, and such a string must be refused here rather than fail deep inside the engine (a cache salt
once killed the engine loop that way). JSON values nest at most `MAX_JSON_DEPTH` levels below the field
that holds them, and the schema-like fields (tools, response formats, structured outputs) hold at most
`MAX_JSON_NODES` values: recursive code on the way (chat rendering, pickling for the engine process,
grammar compilation) would otherwise fail on a hostile schema with RecursionError or run for minutes.

The walk is iterative, so it cannot itself hit the recursion limit it guards.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError

# Containers (objects and arrays) below a field. Real JSON schemas nest far less: OpenAI allows 10
# levels of object nesting in structured outputs (about 20 containers); xgrammar's own limit is 10000.
MAX_JSON_DEPTH = 64
# Values in one schema-like field; OpenAI allows 5000 object properties in a structured-output schema.
MAX_JSON_NODES = 100_000
# Fields whose values are JSON schemas or other free-form documents that code walks recursively (chat's
# and completions'; each API's request models name theirs, `strict_models.RequestBody.schema_fields`).
SCHEMA_FIELDS = frozenset({"tools", "tool_choice", "response_format", "structured_outputs", "chat_template_kwargs"})
# Whole request bodies (a 413 beyond it): a prompt of a million tokens as ids is about 8 MB of JSON.
MAX_BODY_BYTES = 64 << 20
_SCALARS = {int, float, bool, type(None)}


def _path(parts: list[Any], keep: int = 8) -> str:
    """`tools[0].function.parameters`; a deep path keeps its first `keep` steps."""
    out = ""
    for p in parts[:keep]:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return _safe(out + ("..." if len(parts) > keep else ""))


def _safe(text: str) -> str:
    """Text fit for an error message: a field name may itself be the invalid text."""
    return text.encode("utf-8", "backslashreplace").decode()


def _refuse(kind: str, message: str, field: str) -> PydanticCustomError:
    return PydanticCustomError(kind, "{message}", {"message": message, "param": _safe(field)})


def _check_text(text: str, parts: list[Any], field: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _refuse("invalid_unicode", f"{_path(parts)} is not valid Unicode: {e.reason} "
                      f"({text[e.start:e.end]!r} at position {e.start})", field) from None


def check_field(field: str, value: Any, schema_fields: frozenset[str] = SCHEMA_FIELDS) -> None:
    """Raise a PydanticCustomError naming the limit when `value` (the request's `field`) breaks one; the
    size limit applies to `schema_fields` only."""
    nodes = 0
    stack: list[tuple[Any, list[Any], int]] = [(value, [field], 0)]
    while stack:
        node, parts, depth = stack.pop()
        if isinstance(node, str):
            _check_text(node, parts, field)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise _refuse("json_too_deep", f"{field} nests deeper than {MAX_JSON_DEPTH} levels at {_path(parts)} "
                          f"(the limit is {MAX_JSON_DEPTH} nested objects or arrays per field)", field)
        nodes += len(node)
        if field in schema_fields and nodes > MAX_JSON_NODES:
            raise _refuse("json_too_large", f"{field} holds more than {MAX_JSON_NODES} JSON values "
                          f"(the limit is {MAX_JSON_NODES})", field)
        if isinstance(node, list) and set(map(type, node)) <= _SCALARS:
            continue  # token ids and the like: nothing inside to look at, and quick to tell
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            if isinstance(k, str):
                _check_text(k, parts + [k], field)
            # numbers, booleans and nulls need no look: only text and containers go on the stack
            if isinstance(v, (str, dict, list)):
                stack.append((v, parts + [k], depth + 1))


def check_body(data: Any, schema_fields: frozenset[str] = SCHEMA_FIELDS) -> Any:
    """A model `before` validator: every top-level field of a request body within the limits."""
    if isinstance(data, dict):
        for field, value in data.items():
            if isinstance(field, str):
                _check_text(field, [field], field)
            check_field(str(field), value, schema_fields)
    return data

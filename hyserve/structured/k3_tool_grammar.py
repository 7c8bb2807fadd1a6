"""K3 forced tool calls as a grammar: XTML call blocks whose arguments follow each tool's `parameters`.

A call is `<|open|>call tool="NAME" index="i"<|sep|>`, its arguments, `<|close|>call<|sep|>` (docs/ARCHITECTURE.md §8.1). Each declared property is one `argument key="K" type="T"` block in declared order, optional unless
required, and its type attribute goes with its value: a `string` value is raw text (xgrammar's
`kimi_k3_xml` style for a lone value), every other type is JSON. The parser decodes by that attribute,
so a value is checked against the property schema restricted to the attribute's type.

Parameters this shape cannot express (top-level keywords beyond properties/required/additionalProperties,
a property whose types cannot be read off) become one `json type="object"` block holding the whole
arguments object: the same grammar as any JSON schema, which the K3 parser reads as well.
"""

from __future__ import annotations

from typing import Any

from hyserve.structured.grammar_formats import Markup, const, json_value, sequence

# Call indices after the first: the encoder numbers calls from 1 (at most 9 digits).
_INDEX = {"type": "regex", "pattern": "[1-9][0-9]{0,8}"}
ALL_TYPES = ("string", "number", "boolean", "null", "object", "array")
_PER_ARGUMENT_KEYWORDS = {"type", "properties", "required", "additionalProperties", "title", "description",
                          "$defs", "definitions", "$schema", "$id", "$comment", "examples", "default"}


class _NotPerArgument(Exception):
    """The parameters need the `json` block."""


def attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def k3_calls_format(value: dict, m: Markup) -> dict:
    """`<|open|>tools<|sep|>`, one call to one of value["tools"] (more when parallel), `<|close|>tools<|sep|>`."""
    def call(index: dict) -> dict:
        return {"type": "or", "elements": [_call_block(t, index, m) for t in value["tools"]]}

    elements = [m.literal("<|open|>tools<|sep|>"), call(const("1"))]
    if value.get("parallel", True):
        elements.append({"type": "star", "content": call(_INDEX)})
    elements.append(m.literal("<|close|>tools<|sep|>"))
    return sequence(*elements)


def _call_block(tool: dict, index: dict, m: Markup) -> dict:
    head = [m.literal(f'<|open|>call tool="{attr(tool["name"])}" index="'), index, m.literal('"<|sep|>')]
    params = tool.get("parameters") or {"type": "object", "properties": {}}
    try:
        args = _arguments(params, m)
    except _NotPerArgument:
        args = [m.literal('<|open|>json type="object"<|sep|>'), json_value(params), m.literal("<|close|>json<|sep|>")]
    return sequence(*head, *args, m.literal("<|close|>call<|sep|>"))


def _arguments(params: dict, m: Markup) -> list[dict]:
    props, required = params.get("properties") or {}, params.get("required") or []
    if (not isinstance(params, dict) or set(params) - _PER_ARGUMENT_KEYWORDS
            or params.get("type", "object") != "object" or not isinstance(props, dict) or set(required) - set(props)):
        raise _NotPerArgument
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    out = []
    for key, sub in props.items():
        block = _argument(key, sub, params, defs, m)
        out.append(block if key in required else {"type": "optional", "content": block})
    return out


def _argument(key: str, sub: Any, root: dict, defs: dict, m: Markup) -> dict:
    alternatives = []
    for t in _value_types(sub, root):
        value = {**_restrict(sub, t, root), **defs}
        fmt = {"type": "json_schema", "json_schema": value, "style": "kimi_k3_xml"} if t == "string" \
            else json_value(value)
        alternatives.append(sequence(const(("number" if t == "integer" else t) + '"'), m.token("<|sep|>"), fmt))
    return sequence(m.literal(f'<|open|>argument key="{attr(key)}" type="'),
                    {"type": "or", "elements": alternatives}, m.literal("<|close|>argument<|sep|>"))


def _deref(sub: Any, root: dict, depth: int = 0) -> dict:
    """A local `$ref` (#/$defs/X, #/definitions/X) followed; a ref with other keywords beside it, or one
    that leads elsewhere, needs the json block."""
    if not isinstance(sub, dict):
        raise _NotPerArgument
    ref = sub.get("$ref")
    if ref is None:
        return sub
    parts = ref.split("/") if isinstance(ref, str) else []
    if len(sub) > 1 or depth > 8 or len(parts) != 3 or parts[0] != "#" or parts[1] not in ("$defs", "definitions"):
        raise _NotPerArgument
    target = (root.get(parts[1]) or {}).get(parts[2])
    return _deref(target, root, depth + 1)


def _type_of(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {str: "string", float: "number", type(None): "null", dict: "object", list: "array"}[type(value)]


def _value_types(sub: Any, root: dict) -> list[str]:
    """The JSON types a value of `sub` can have, in a stable order; integer folds into number when both."""
    sub = _deref(sub, root)
    if "allOf" in sub:
        raise _NotPerArgument
    if "const" in sub:
        types = [_type_of(sub["const"])]
    elif "enum" in sub:
        types = [_type_of(v) for v in sub["enum"]]
    elif isinstance(sub.get("type"), (str, list)):
        types = [sub["type"]] if isinstance(sub["type"], str) else list(sub["type"])
    elif "anyOf" in sub or "oneOf" in sub:
        types = [t for b in sub.get("anyOf", sub.get("oneOf")) for t in _value_types(b, root)]
    else:
        types = list(ALL_TYPES)
    types = list(dict.fromkeys(types))
    return [t for t in types if not (t == "integer" and "number" in types)]


def _covering(types: list[str], t: str) -> str | None:
    """The type to restrict a branch of `types` to, for a value of type `t` (a number branch may be integer)."""
    if t in types:
        return t
    return "integer" if t == "number" and "integer" in types else None


def _matches(value: Any, t: str) -> bool:
    got = _type_of(value)
    return got == t or (t == "number" and got == "integer")


def _restrict(sub: Any, t: str, root: dict) -> dict:
    """`sub` narrowed to values of JSON type `t`."""
    sub = _deref(sub, root)
    out = {k: v for k, v in sub.items() if k not in ("type", "enum", "anyOf", "oneOf")}
    if "enum" in sub:
        out["enum"] = [v for v in sub["enum"] if _matches(v, t)]
    for key in ("anyOf", "oneOf"):
        if key in sub:
            branches = [(b, _covering(_value_types(b, root), t)) for b in sub[key]]
            out[key] = [_restrict(b, bt, root) for b, bt in branches if bt is not None]
    out["type"] = t
    return out

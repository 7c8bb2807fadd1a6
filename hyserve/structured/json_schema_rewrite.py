"""JSON schemas spelled the way xgrammar enforces them exactly (docs/ARCHITECTURE.md, "Structured outputs").

`check_schema` (json_schema_support.py) has refused what the grammar cannot enforce; what it enforces only
through another spelling is rewritten here before compiling: loose format grammars become exact patterns,
optional groups become {0,1} repeats, an untyped schema gets the type its keywords imply, and a lower bound
past the declared items or properties opens the rest.
"""

from __future__ import annotations

from typing import Any

from hyserve.structured.json_schema_support import SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_VALUES, implied_types

_DATE = (r"(?:(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
         r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
         r"|(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)-02-29)")
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:[.][0-9]{1,9})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
# Formats whose xgrammar grammar is looser than the format, spelled as exact patterns instead.
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}T{_TIME}$",
    "ipv4": rf"^(?:{_OCTET}[.]){{3}}{_OCTET}$",
}


def optional_groups_as_repeats(pattern: str) -> str:
    """`(...)?` spelled `(...){0,1}`: in JSON strings xgrammar drops the first element of an optional group
    that holds a repetition (`a(?:c[0-9]+)?b` takes "a9b"); the same group as {0,1} is exact."""
    out, in_class, i = [], False, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == ")" and pattern[i + 1:i + 2] == "?":
            out.append("){0,1}")
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def grammar_schema(schema: Any) -> Any:
    """`schema` as handed to xgrammar: formats it enforces loosely become their exact patterns."""
    if isinstance(schema, list):
        return [grammar_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: grammar_schema(v) if k in SCHEMA_VALUES or k in SCHEMA_LISTS else v for k, v in schema.items()}
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: grammar_schema(sub) for name, sub in schema[key].items()}
    if schema.get("format") in FORMAT_PATTERNS:
        out["pattern"] = FORMAT_PATTERNS[out.pop("format")]
    if isinstance(out.get("pattern"), str):
        out["pattern"] = optional_groups_as_repeats(out["pattern"])
    if len(implied := implied_types(schema)) == 1:
        out["type"] = implied[0]  # a value of that type meeting the keywords satisfies the untyped schema
    # xgrammar reads a missing `items` / `additionalProperties` as false (fine: fewer values, all valid),
    # so a lower bound past the declared ones would fail to compile: there they mean "any".
    if out.get("minItems", 0) > len(out.get("prefixItems") or []) and "items" not in out:
        out["items"] = True
    if out.get("minProperties", 0) > len(out.get("properties") or {}) and "additionalProperties" not in out:
        out["additionalProperties"] = True
    return out

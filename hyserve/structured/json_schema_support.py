"""Which JSON-schema keywords the grammar enforces: everything else is refused by name (docs/ARCHITECTURE.md, "Structured outputs").

xgrammar turns a schema into a grammar but skips some keywords, sometimes with only a log line (a
`multipleOf` on a number, `minLength` beside `pattern`, a lookahead in a pattern) and sometimes silently
(`uniqueItems`, `not`, `if`/`then`/`else`, unknown `format`s, a `required` key with no property); some of
its format grammars are looser than the formats, and its regex path emits pattern characters unescaped. A
structured-output request must get what its schema says, so `check_schema` refuses, naming the keyword and
where it is, what the grammar would not enforce (json_schema_rewrite.py spells the rest the way xgrammar
enforces exactly). The supported set is what tests/test_json_schema_corpus.py samples and validates with
`jsonschema`.
"""

from __future__ import annotations

from typing import Any

# Keywords not listed anywhere here assert nothing the grammar must know (annotations such as `title`,
# `description`, `default`, `examples`, unknown vendor keywords): validators ignore them too.
# Standard assertions and applicators the grammar does not enforce: refused wherever they appear.
UNENFORCED = frozenset({
    "not", "if", "then", "else", "contains", "minContains", "maxContains", "uniqueItems", "dependentRequired",
    "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems", "additionalItems",
    "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor", "$vocabulary",
})
# String formats the grammar enforces: xgrammar's own grammars, and (json_schema_rewrite.py) exact patterns
# for those its grammars take too loosely (`date` takes Feb 31, `ipv4` leading zeros).
FORMATS = frozenset({"email", "uuid", "ipv6", "uri", "uri-reference", "duration", "json-pointer",
                     "date", "time", "date-time", "ipv4"})

SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_VALUES = ("additionalProperties", "propertyNames", "items", "not", "if", "then", "else", "contains",
                 "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# Keywords that constrain one JSON type: xgrammar applies them only when the schema names that type.
TYPE_KEYWORDS = {
    "number": frozenset({*_RANGE, "multipleOf"}),
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems"}),
    "object": frozenset({"properties", "required", "additionalProperties", "patternProperties", "propertyNames",
                         "minProperties", "maxProperties"}),
}
_TYPED_ELSEWHERE = ("type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf")


class UnsupportedSchemaError(ValueError):
    """A schema asks for something the grammar would not enforce."""


def check_schema(schema: Any, where: str = "json schema") -> None:
    """Raise UnsupportedSchemaError naming the first keyword of `schema` the grammar cannot enforce."""
    for path, node in subschemas(schema):
        if not isinstance(node, (dict, bool)):
            raise UnsupportedSchemaError(f"{where}: the schema at {path} must be an object or a boolean")
        if isinstance(node, dict) and (problem := _problem(node, schema)) is not None:
            raise UnsupportedSchemaError(f"{where}: {problem} at {path} is not supported by structured outputs "
                                         "(the grammar cannot enforce it)")


def subschemas(node: Any, path: str = "#"):
    """(JSON pointer, schema) of `node` and of every schema inside it."""
    yield path, node
    if not isinstance(node, dict):
        return
    for key in SCHEMA_MAPS:
        for name, sub in (node.get(key) or {}).items():
            yield from subschemas(sub, f"{path}/{key}/{name}")
    for key in SCHEMA_LISTS:
        for i, sub in enumerate(node.get(key) or []):
            yield from subschemas(sub, f"{path}/{key}/{i}")
    for key in SCHEMA_VALUES:
        sub = node.get(key)
        if isinstance(sub, list):
            for i, item in enumerate(sub):
                yield from subschemas(item, f"{path}/{key}/{i}")
        elif sub is not None:
            yield from subschemas(sub, f"{path}/{key}")


def _problem(node: dict, root: Any) -> str | None:
    """What in this one schema object the grammar would not enforce, or None."""
    unenforced = sorted(UNENFORCED & set(node))
    if unenforced:
        return f"keyword {unenforced[0]!r}"
    fmt, pattern = node.get("format"), node.get("pattern")
    if fmt is not None and fmt not in FORMATS:
        return f"format {fmt!r} (supported: {', '.join(sorted(FORMATS))})"
    if (fmt is not None or pattern is not None) and ("minLength" in node or "maxLength" in node):
        return f"minLength/maxLength together with {'pattern' if pattern is not None else 'format'}"
    if pattern is not None and (why := pattern_problem(pattern)) is not None:
        return f"pattern {pattern!r} ({why})"
    families = implied_types(node)
    if len(families) > 1:
        return f"keywords of several types without a 'type' ({', '.join(families)})"
    if "multipleOf" in node and (node.get("type") != "integer" or not isinstance(node["multipleOf"], int)
                                 or any(k in node for k in _RANGE)):
        return "keyword 'multipleOf' (supported only on an integer without a range)"
    if any(isinstance(node.get(k), bool) for k in ("exclusiveMinimum", "exclusiveMaximum")):
        return "a boolean exclusiveMinimum/exclusiveMaximum (draft 4; give the bound as a number)"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "keyword 'allOf' with more than one schema"
    if isinstance(node.get("items"), list):
        return "an 'items' list (use 'prefixItems')"
    ref = node.get("$ref")
    if ref is not None and (not isinstance(ref, str) or (ref != "#" and resolve_ref(ref, root) is None)):
        return f"$ref {ref!r} (only references into this schema, '#/...')"
    missing = [k for k in node.get("required") or [] if k not in (node.get("properties") or {})]
    if missing:
        return f"required property {missing[0]!r}, which 'properties' does not declare"
    if isinstance(node.get("oneOf"), list) and not _pairwise_disjoint(node["oneOf"], root):
        return "keyword 'oneOf' whose schemas may overlap (a value matching two would be invalid; use anyOf)"
    return None


def pattern_problem(pattern: str) -> str | None:
    """Why xgrammar would not emit exactly the strings `pattern` matches, as valid JSON, or None.

    Its regex path works on bytes, copies pattern characters into the JSON string unescaped and mangles
    escapes (`\\.` matches any character), so only printable-ASCII patterns without quotes, escapes other
    than `\\d` and `\\w`, `.` wildcards or negated classes are exact. A literal `.` is written `[.]`."""
    in_class = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if not " " <= c <= "~" or c == '"':
            return "a character outside printable ASCII, or a quote"
        if c == "\\":
            nxt = pattern[i + 1:i + 2]
            if nxt not in ("d", "w"):
                return f"the escape \\{nxt} (only \\d and \\w; write a literal character in a class, e.g. [.])"
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            if pattern.startswith("[^", i):
                return "a negated class, which reaches past ASCII"
            in_class = True
        elif c == ".":
            return "'.', which reaches past ASCII (a literal dot is [.])"
        elif pattern.startswith("(?", i) and not pattern.startswith("(?:", i):
            return "a lookaround or group flag"
        elif (c == "^" and i > 0) or (c == "$" and i < len(pattern) - 1):
            return "an anchor inside the pattern"
        i += 1
    return None


def implied_types(node: dict) -> list[str]:
    """The types an untyped schema's type-specific keywords belong to (empty when it is typed)."""
    if any(k in node for k in _TYPED_ELSEWHERE):
        return []
    return [t for t, keys in TYPE_KEYWORDS.items() if keys & set(node)]


def resolve_ref(ref: str, root: Any) -> Any:
    """The schema a local `$ref` ('#', '#/$defs/X', any JSON pointer into `root`) points at, or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _value_sets(node: Any, root: Any, depth: int = 0) -> tuple[set[str], dict[str, list]]:
    """(JSON types a value may have, {required property: its allowed const/enum values}) of a oneOf branch."""
    if isinstance(node, dict) and isinstance(node.get("$ref"), str) and depth < 8:
        return _value_sets(resolve_ref(node["$ref"], root), root, depth + 1)
    if not isinstance(node, dict):
        return {"any"}, {}
    if "const" in node or "enum" in node:
        values = [node["const"]] if "const" in node else list(node["enum"])
        return {_json_type(v) for v in values}, {}
    t = node.get("type")
    types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else {"any"}
    if "integer" in types:
        types.add("number")
    tags = {}
    for key in node.get("required") or []:
        prop = (node.get("properties") or {}).get(key)
        if isinstance(prop, dict) and ("const" in prop or "enum" in prop):
            tags[key] = [prop["const"]] if "const" in prop else list(prop["enum"])
    return types, tags


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", type(None): "null", dict: "object", list: "array"}[type(value)]


def _pairwise_disjoint(branches: list, root: Any) -> bool:
    sets = [_value_sets(b, root) for b in branches]
    for i, (ta, tags_a) in enumerate(sets):
        for tb, tags_b in sets[i + 1:]:
            if "any" not in ta and "any" not in tb and not ta & tb:
                continue
            if ta == tb == {"object"} and any(not set(map(repr, tags_a[k])) & set(map(repr, tags_b[k]))
                                              for k in tags_a.keys() & tags_b.keys()):
                continue  # a discriminated union: a required tag property tells the branches apart
            return False
    return True

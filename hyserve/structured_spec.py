"""What a structured-output request constrains: `StructuredSpec`, plain picklable data the server builds
and puts in `SamplingParams.structured`, and its grammar as an xgrammar structural tag in the K3 and K2
chat formats (`build_format`). The engine compiles and matches it (engine/structured.py).

Markers such as `<|open|>` (K3) or `<|tool_call_begin|>` (K2) are special ids, never the bytes that spell
them; the grammars list them as `excludes`, so no marker text can appear inside constrained strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The specials a grammar may write, per tokenizer family: K3 XTML markers, K2 tool-call markers. The K2
# turn end `<|im_end|>` is not among them: it is an end id (see `StructuredSpec.end_token_ids`), and may
# be the tokenizer's EOS, which xgrammar reserves as its stop token.
MARKER_TOKENS: dict[str, tuple[str, ...]] = {
    "k3": ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"),
    "k2": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
}


@dataclass
class StructuredSpec:
    """What to constrain, as data. `kind`: json (value = schema dict, None = any object), regex,
    choice (list of strings), grammar (EBNF text) or tool_call (value = {"tools": [{name, parameters}],
    "parallel": bool, "first_index": int | None}; `first_index` is the K2 call counter's next value, None
    for any number). `wrapper="k3"` adds the XTML response channel around json/regex/choice/grammar
    output; `open_response` says whether the grammar itself must write `<|open|>response<|sep|>` (it
    must when the prompt opened `think` instead). `think_prefix`: the first token may be `<think>`
    (K2 thinking models open their think block themselves)."""

    kind: str
    value: Any = None
    wrapper: str | None = None
    open_response: bool = False
    reasoning: str | None = None
    end_token_ids: list[int] = field(default_factory=list)
    think_prefix: bool = False


# ---------------------------------------------------------------------------------------------------
# Grammars, as xgrammar structural tags


_TAIL = "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"


def _const(value: str) -> dict:
    return {"type": "const_string", "value": value}


def _json(schema: dict | None, family: str) -> dict:
    # Whitespace is capped: a random or weak model would otherwise pad the JSON until max_tokens. The
    # markers are excluded so that no string value can hold a marker (its text is its special id).
    return {"type": "json_schema", "json_schema": schema if schema is not None else {"type": "object"},
            "style": "json", "excludes": list(MARKER_TOKENS[family]), "max_whitespace_cnt": 1}


def body_format(spec: StructuredSpec, family: str = "k3") -> dict:
    """The structural-tag format of a json/regex/choice/grammar constraint."""
    if spec.kind == "json":
        return _json(spec.value, family)
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.value}
    if spec.kind == "choice":
        return {"type": "or", "elements": [_const(str(c)) for c in spec.value]}
    if spec.kind == "grammar":
        return {"type": "grammar", "grammar": spec.value}
    raise ValueError(f"unknown structured output kind {spec.kind!r}")


def tool_call_format(xgr, spec: StructuredSpec) -> dict:
    """K3 forced calls: an empty response channel, then one or more XTML calls (xgrammar's kimi_k3
    tag for the calls, so arguments follow the `kimi_k3_xml` style), then the message end."""
    tools = [{"type": "function", "function": t} for t in spec.value["tools"]]
    tag = xgr.get_model_structural_tag("kimi_k3", tools=tools, tool_choice="required", reasoning=False)
    elements = tag.model_dump(exclude_none=True)["format"]["elements"]
    calls = next(e for e in elements if e.get("type") == "sequence")
    for e in calls["elements"]:
        if e.get("type") == "tags_with_separator":
            e["stop_after_first"] = not spec.value.get("parallel", True)
    _cap_whitespace(calls)
    head = ("<|open|>response<|sep|>" if spec.open_response else "") + "<|close|>response<|sep|>"
    return {"type": "sequence", "elements": [
        _const(head), calls, _const("<|close|>message<|sep|><|end_of_msg|>"),
    ]}


def _cap_whitespace(node: Any) -> None:
    """Bound free whitespace in every JSON-schema element (argument values pad endlessly otherwise)."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema":
            node["max_whitespace_cnt"] = 1
        for v in node.values():
            _cap_whitespace(v)
    elif isinstance(node, list):
        for v in node:
            _cap_whitespace(v)


# Any call index after a known first one: the model numbers its parallel calls (at most 9 digits).
_INDEX = {"type": "regex", "pattern": "0|[1-9][0-9]{0,8}"}


def k2_tool_call_format(spec: StructuredSpec) -> dict:
    """K2 forced calls (the K2 tool-call format): `<|tool_calls_section_begin|>`, one call (more when parallel), then
    `<|tool_calls_section_end|>`; the turn end `<|im_end|>` comes from the end ids. A call is
    `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>`; the first
    IDX is the conversation's next call index when known, later ones are any number."""
    tools = spec.value["tools"]
    first = spec.value.get("first_index")

    def call(index: dict) -> dict:
        return {"type": "or", "elements": [{"type": "sequence", "elements": [
            _const(f"<|tool_call_begin|>functions.{t['name']}:"), index, _const("<|tool_call_argument_begin|>"),
            _json(t.get("parameters"), "k2"), _const("<|tool_call_end|>"),
        ]} for t in tools]}

    elements = [_const("<|tool_calls_section_begin|>"), call(_INDEX if first is None else _const(str(first)))]
    if spec.value.get("parallel", True):
        elements.append({"type": "star", "content": call(_INDEX)})
    elements.append(_const("<|tool_calls_section_end|>"))
    return {"type": "sequence", "elements": elements}


def build_format(xgr, spec: StructuredSpec, family: str) -> dict:
    """The structural-tag format of `spec` for a tokenizer of `family` ("k3" or "k2")."""
    k3 = family == "k3"
    if spec.kind == "tool_call":
        return tool_call_format(xgr, spec) if k3 else k2_tool_call_format(spec)
    body = body_format(spec, family)
    if spec.wrapper != "k3" or not k3:
        return body
    elements = [body, _const(_TAIL)]
    if spec.open_response:
        elements.insert(0, _const("<|open|>response<|sep|>"))
    return {"type": "sequence", "elements": elements}

"""xgrammar structural-tag formats for hyserve's constraints (docs/ARCHITECTURE.md, "Structured outputs"), with markers as token ids.

Markers such as `<|open|>` (K3) or `<|tool_call_begin|>` (K2) must be written as their special ids, never as
the bytes that spell them, because the output parsers work on ids. So the grammar names each marker by its
token id (`{"type": "token"}`), and in xgrammar's vocabulary a marker's bytes are ones no text can hold
(see `structured.GrammarBackend`): no string, regex or free text can ever produce a marker, and none needs
xgrammar's `excludes` (which would drop the JSON schema's length limits).

The constraint covers the whole assistant turn. With thinking on, the completion starts inside a think
block: free text that cannot end the message (no marker, no end id), closed by the family's think end, and
only then the constrained answer and the turn's end.
"""

from __future__ import annotations

from typing import Any

# The specials a grammar may write, per tokenizer family: K3 XTML markers; K2 tool-call markers and think
# markers. The K2 turn end `<|im_end|>` is not among them: it is an end id (`StructuredSpec.end_token_ids`),
# and may be the tokenizer's EOS, which xgrammar reserves as its stop token.
MARKER_TOKENS: dict[str, tuple[str, ...]] = {
    "k3": ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"),
    "k2": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"),
}

K3_TAIL = "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
# Any call index after a known first one: the model numbers its parallel calls (at most 9 digits).
INDEX = {"type": "regex", "pattern": "0|[1-9][0-9]{0,8}"}


class Markup:
    """A family's marker tokens: literal text with markers in it becomes text and token elements."""

    def __init__(self, ids: dict[str, int]) -> None:
        self.ids = ids
        self._longest_first = sorted(ids, key=len, reverse=True)

    def token(self, marker: str) -> dict:
        if marker not in self.ids:
            raise ValueError(f"the tokenizer has no special token {marker!r}")
        return {"type": "token", "token": self.ids[marker]}

    def literal(self, text: str) -> dict:
        parts: list[dict] = []
        while text:
            hits = [(text.find(m), m) for m in self._longest_first if m in text]
            if not hits:
                parts.append(const(text))
                break
            at, marker = min(hits)
            if at:
                parts.append(const(text[:at]))
            parts.append(self.token(marker))
            text = text[at + len(marker):]
        return parts[0] if len(parts) == 1 else {"type": "sequence", "elements": parts}


def const(value: str) -> dict:
    return {"type": "const_string", "value": value}


def sequence(*elements: dict) -> dict:
    return {"type": "sequence", "elements": list(elements)}


def json_value(schema: Any) -> dict:
    # Whitespace is capped: a random or weak model would otherwise pad the JSON until max_tokens.
    return {"type": "json_schema", "json_schema": schema if schema is not None else {"type": "object"},
            "style": "json", "max_whitespace_cnt": 1}


def body_format(kind: str, value: Any) -> dict:
    """The format of a json/regex/choice/grammar constraint's text."""
    if kind == "json":
        return json_value(value)
    if kind == "regex":
        return {"type": "regex", "pattern": value}
    if kind == "choice":
        return {"type": "or", "elements": [const(str(c)) for c in value]}
    if kind == "grammar":
        return {"type": "grammar", "grammar": value}
    raise ValueError(f"unknown structured output kind {kind!r}")


def think_block(family: str, m: Markup) -> dict:
    """Reasoning the completion starts in: free tokens but no marker (so no end of message), then the
    think end. A K2 model may write the optional `<think>` first."""
    free = {"type": "any_tokens", "exclude_tokens": sorted(m.ids.values())}
    if family == "k3":
        return sequence(free, m.literal("<|close|>think<|sep|>"))
    return sequence({"type": "optional", "content": m.token("<think>")}, free, m.token("</think>"))


def k2_tool_calls(value: dict, m: Markup) -> dict:
    """K2 forced calls (spec §1b): `<|tool_calls_section_begin|>`, one call (more when parallel), then
    `<|tool_calls_section_end|>`; the turn end `<|im_end|>` comes from the end ids. A call is
    `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>`; the first
    IDX is the conversation's next call index when known, later ones are any number."""
    tools, first = value["tools"], value.get("first_index")

    def call(index: dict) -> dict:
        return {"type": "or", "elements": [sequence(
            m.literal(f"<|tool_call_begin|>functions.{t['name']}:"), index, m.token("<|tool_call_argument_begin|>"),
            json_value(t.get("parameters")), m.token("<|tool_call_end|>"),
        ) for t in tools]}

    elements = [m.token("<|tool_calls_section_begin|>"), call(INDEX if first is None else const(str(first)))]
    if value.get("parallel", True):
        elements.append({"type": "star", "content": call(INDEX)})
    elements.append(m.token("<|tool_calls_section_end|>"))
    return sequence(*elements)

"""Chat answers enforced by structured decoding (docs/ARCHITECTURE.md §8.2): `tool_choice` "required" or a
named function, and `response_format` / `structured_outputs`.

K3 forces XTML call blocks; K2 forces a tool-call section. Either way the grammar writes the markers as
their special ids, so the output parser always finds the calls. With thinking on, every constraint starts
with the think block, free text that cannot end the turn, so a turn that stops has its answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyserve.entrypoints.chat import ChatEncoder
from hyserve.entrypoints.chat.k2_encoding import IM_END, next_call_index
from hyserve.structured.constraint import StructuredSpec
from hyserve.tokenizer import Tokenizer


def response_format_spec(encoder: ChatEncoder, tokenizer: Tokenizer, kind: str, value: Any,
                         kwargs: dict[str, Any]) -> StructuredSpec:
    """The constraint for a json/regex/choice/grammar answer: K3 inside its response channel."""
    opens_thinking = encoder.prompt_opens_thinking(**kwargs)
    return StructuredSpec(kind, value, wrapper="k3" if encoder.family == "k3" else None, open_response=opens_thinking,
                          reasoning=encoder.family if opens_thinking else None,
                          end_token_ids=encoder.stop_token_ids(tokenizer))


def forced_tool_call_spec(
    encoder: ChatEncoder, tokenizer: Tokenizer, functions: Sequence[dict], messages: Sequence[dict], *,
    parallel: bool, kwargs: dict[str, Any],
) -> StructuredSpec:
    """The constraint for a forced call to one of `functions` (the named one alone, for a named choice).

    A function without `parameters` takes any JSON object. `kwargs` are the encoder's options. With
    thinking on, the grammar starts with the think block (free text that cannot end the turn) and the
    turn ends only after the calls.
    """
    tools = [{"name": f["name"], "parameters": f.get("parameters") or {"type": "object", "properties": {}}}
             for f in functions]
    opens_thinking = encoder.prompt_opens_thinking(**kwargs)
    reasoning = encoder.family if opens_thinking else None
    if encoder.family == "k3":
        return StructuredSpec("tool_call", {"tools": tools, "parallel": parallel}, wrapper="k3",
                              open_response=opens_thinking, reasoning=reasoning,
                              end_token_ids=encoder.stop_token_ids(tokenizer))
    # K2: the section is the whole answer, so the turn ends right after it with `<|im_end|>` (not [EOS]).
    value = {"tools": tools, "parallel": parallel, "first_index": next_call_index(messages)}
    return StructuredSpec("tool_call", value, reasoning=reasoning, end_token_ids=[tokenizer.special_id(IM_END)])

"""Structured-output matchers, driven by a random walk over the tokens they allow.

A random walk is the harshest "model": whatever it picks among the allowed tokens must still parse. The
walks run on the K3 byte tokenizer, where every marker could also be spelled byte by byte.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from hyserve.entrypoints.chat.tool_calls import make_output_parser
from hyserve.structured.constraint import StructuredSpec, compile_spec
from hyserve.tokenizer import ByteTokenizer

TOK = ByteTokenizer("k3")
VOCAB = TOK.vocab_size
END = [TOK.special_id("<|end_of_msg|>"), TOK.special_id("[EOS]")]
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}, "n": {"type": "integer"}},
          "required": ["color", "n"], "additionalProperties": False}


def walk(spec: StructuredSpec, seed: int, prefix: list[int] = (), limit: int = 3000) -> list[int]:
    """Feed `prefix`, then pick uniformly among allowed tokens until an end id (which is kept)."""
    matcher = compile_spec(spec, TOK, VOCAB).new_matcher()
    rng = random.Random(seed)
    out = list(prefix)
    for t in prefix:
        matcher.allowed_mask(VOCAB)
        matcher.accept(t)
    for _ in range(limit):
        allowed = matcher.allowed_mask(VOCAB).nonzero().flatten().tolist()
        tok = rng.choice(allowed)
        matcher.accept(tok)
        out.append(tok)
        if tok in END:
            return out
    raise AssertionError("the walk never ended")


@pytest.mark.parametrize("seed", range(5))
def test_json_without_wrapper_is_valid_and_ends_with_an_end_id(seed):
    ids = walk(StructuredSpec("json", SCHEMA, end_token_ids=END), seed)
    obj = json.loads(TOK.decode(ids[:-1]))
    assert obj["color"] in ("red", "blue") and isinstance(obj["n"], int)


@pytest.mark.parametrize("seed", range(5))
def test_k3_forced_tool_call_uses_special_markers_and_parses(seed):
    tools = [{"name": "pick", "parameters": {"type": "object", "properties": {
        "color": {"enum": ["red", "blue"]}, "n": {"type": "integer"}}, "required": ["color", "n"]}}]
    spec = StructuredSpec("tool_call", {"tools": tools, "parallel": False}, wrapper="k3", end_token_ids=END)
    ids = walk(spec, seed)
    assert "<|" not in TOK.decode(ids, skip_special_tokens=True), "a marker was spelled with bytes"
    parsed = make_output_parser("k3", TOK, prompt_opens_thinking=False, tools_enabled=True).parse(ids)
    (call,) = parsed.tool_calls
    args = json.loads(call.arguments)
    assert call.name == "pick" and args["color"].strip() in ("red", "blue")


def allowed(matcher) -> list[int]:
    return matcher.allowed_mask(VOCAB).nonzero().flatten().tolist()


def test_k3_thinking_is_free_text_that_cannot_end_the_message_then_the_response_wrapper_follows():
    spec = StructuredSpec("json", SCHEMA, wrapper="k3", open_response=True, reasoning="k3", end_token_ids=END)
    matcher = compile_spec(spec, TOK, VOCAB).new_matcher()
    close, sep, opener = (TOK.special_id(m) for m in ("<|close|>", "<|sep|>", "<|open|>"))
    thought = TOK.encode("hmm, <|close|>think fake\n")
    for t in thought:
        ok = allowed(matcher)
        assert set(END).isdisjoint(ok), "thinking cannot end the message"
        assert close in ok and opener not in ok and sep not in ok, "the think block only closes"
        assert {ord("a"), ord("{"), ord("<"), ord("\n")} <= set(ok), "thinking is free text"
        matcher.accept(t)
    for t in [close, *TOK.encode("think")]:
        matcher.accept(t)
    assert allowed(matcher) == [sep]
    matcher.accept(sep)
    assert allowed(matcher) == [opener], "the response channel opens with the special marker"
    ids = walk(spec, seed=1, prefix=thought + [close, *TOK.encode("think"), sep])
    parsed = make_output_parser("k3", TOK, prompt_opens_thinking=True, tools_enabled=False).parse(ids)
    assert parsed.reasoning == "hmm, <|close|>think fake\n"
    assert json.loads(parsed.content)["color"] in ("red", "blue")


@pytest.mark.parametrize("seed", range(6))
def test_k3_thinking_on_json_always_ends_with_the_answer(seed):
    spec = StructuredSpec("json", SCHEMA, wrapper="k3", open_response=True, reasoning="k3", end_token_ids=END)
    parsed = make_output_parser("k3", TOK, prompt_opens_thinking=True, tools_enabled=False).parse(walk(spec, seed))
    assert parsed.content is not None and json.loads(parsed.content)["color"] in ("red", "blue")


@pytest.mark.parametrize("seed", range(4))
def test_k3_thinking_on_forced_tool_call_always_ends_with_the_call(seed):
    tools = [{"name": "pick", "parameters": SCHEMA}]
    spec = StructuredSpec("tool_call", {"tools": tools, "parallel": False}, wrapper="k3", open_response=True,
                          reasoning="k3", end_token_ids=END)
    parsed = make_output_parser("k3", TOK, prompt_opens_thinking=True, tools_enabled=True).parse(walk(spec, seed))
    (call,) = parsed.tool_calls
    assert call.name == "pick" and json.loads(call.arguments)["color"] in ("red", "blue")


def test_choice_and_regex():
    ids = walk(StructuredSpec("choice", ["yes", "no"], end_token_ids=END), seed=0)
    assert TOK.decode(ids[:-1]) in ("yes", "no")
    ids = walk(StructuredSpec("regex", "[a-c]{2}-[0-9]", end_token_ids=END), seed=0)
    text = TOK.decode(ids[:-1])
    assert len(text) == 4 and text[2] == "-"


@pytest.mark.parametrize(("kind", "value"), [("regex", "("), ("json", {"type": "nonsense"}), ("grammar", "root ::=")])
def test_invalid_constraints_raise_value_error(kind, value):
    with pytest.raises(ValueError, match=kind):
        compile_spec(StructuredSpec(kind, value, end_token_ids=END), TOK, VOCAB)


def test_mask_is_a_bool_vector_over_the_vocab():
    mask = compile_spec(StructuredSpec("json", None, end_token_ids=END), TOK, VOCAB).new_matcher().allowed_mask(VOCAB)
    assert mask.dtype == torch.bool and mask.shape == (VOCAB,)
    assert mask.nonzero().flatten().tolist() == [ord("{")]


@pytest.mark.parametrize("seed", range(6))
def test_constrained_text_is_valid_utf8_across_token_boundaries(seed):
    ids = walk(StructuredSpec("json", {"type": "array", "items": {"type": "string", "maxLength": 3},
                                       "minItems": 4, "maxItems": 4}, end_token_ids=END), seed)
    raw = TOK.ids_to_bytes(ids[:-1])
    raw.decode("utf-8")  # strict: a surrogate or an overlong form would raise
    assert all(len(s) <= 3 for s in json.loads(raw))

"""Every JSON-schema keyword is enforced or refused by name (serving.md §3).

A fixed corpus of schemas (tests/data/json_schema_corpus.json) covers the keywords the grammar enforces; each
is walked at random through its matcher (the harshest model: any allowed token) and sampled at temperature 1
on k3-tiny, and every output that stops must validate with `jsonschema`, formats included. Keywords the
grammar cannot enforce are refused with an error that names them.
"""

from __future__ import annotations

import json
import os
import random

import jsonschema
import pytest

from hyserve import LLM, SamplingParams
from hyserve.entrypoints.chat.tool_calls import make_output_parser
from hyserve.structured.constraint import StructuredSpec, compile_spec
from hyserve.tokenizer import ByteTokenizer

with open(os.path.join(os.path.dirname(__file__), "data", "json_schema_corpus.json")) as f:
    CORPUS: dict = json.load(f)
TOKENIZERS = {"k3": ByteTokenizer("k3"), "k2": ByteTokenizer("k2")}
TOK = TOKENIZERS["k3"]
END = [TOK.special_id("<|end_of_msg|>"), TOK.special_id("[EOS]")]
OBJECTS = sorted(n for n, s in CORPUS.items() if isinstance(s, dict) and (s.get("type") == "object" or "properties" in s))


def validate(value, schema) -> None:
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    jsonschema.Draft202012Validator(schema, format_checker=checker).validate(value)


def walk(spec: StructuredSpec, family: str, seed: int, ends: list[int], limit: int = 2000) -> list[int] | None:
    """A random walk over the allowed tokens, taking an allowed end id most of the time it is offered."""
    tok = TOKENIZERS[family]
    matcher = compile_spec(spec, tok, tok.vocab_size).new_matcher()
    rng = random.Random(seed)
    out: list[int] = []
    for _ in range(limit):
        allowed = matcher.allowed_mask(tok.vocab_size).nonzero().flatten().tolist()
        offered = [t for t in allowed if t in ends]
        token = offered[0] if offered and rng.random() < 0.7 else rng.choice(allowed)
        matcher.accept(token)
        out.append(token)
        if token in ends:
            return out
    return None


def test_the_corpus_has_more_than_fifty_schemas():
    assert len(CORPUS) >= 50


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_a_random_walk_through_the_grammar_yields_json_that_validates(name):
    schema = CORPUS[name]
    for seed in range(3):
        ids = walk(StructuredSpec("json", schema, end_token_ids=END), "k3", seed, END)
        assert ids is not None, "the walk never ended"
        validate(json.loads(TOK.decode(ids[:-1])), schema)


@pytest.fixture(scope="module")
def llm():
    return LLM("k3-tiny", device="cpu", max_num_seqs=len(CORPUS), seed=0)


def test_k3_tiny_sampled_at_temperature_1_every_output_that_stops_validates(llm):
    names = sorted(CORPUS)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=160, stop_token_ids=END,
                             structured=compile_spec(StructuredSpec("json", CORPUS[n], end_token_ids=END), TOK,
                                                     TOK.vocab_size))
              for i, n in enumerate(names)]
    prompts = [TOK.encode(f"JSON for {n}: ") for n in names]
    stopped = 0
    for name, out in zip(names, llm.generate(prompts, params, use_tqdm=False)):
        c = out.outputs[0]
        if c.finish_reason != "stop":
            continue
        stopped += 1
        validate(json.loads(TOK.decode(c.token_ids[:-1])), CORPUS[name])
    assert stopped >= len(names) // 2, f"only {stopped} of {len(names)} stopped: the test would check little"


@pytest.mark.parametrize("family", ["k3", "k2"])
@pytest.mark.parametrize("name", OBJECTS)
def test_forced_tool_call_arguments_validate_against_the_parameters(name, family):
    tok = TOKENIZERS[family]
    ends = [tok.special_id("<|end_of_msg|>" if family == "k3" else "<|im_end|>")]
    value = {"tools": [{"name": "f", "parameters": CORPUS[name]}], "parallel": False, "first_index": 0}
    spec = StructuredSpec("tool_call", value, wrapper="k3" if family == "k3" else None, end_token_ids=ends)
    for seed in range(2):
        ids = walk(spec, family, seed, ends)
        assert ids is not None, "the walk never ended"
        (call,) = make_output_parser(family, tok, prompt_opens_thinking=False, tools_enabled=True).parse(ids).tool_calls
        validate(json.loads(call.arguments), CORPUS[name])


def test_k3_call_arguments_are_argument_blocks_whose_type_goes_with_the_value():
    value = {"tools": [{"name": "f", "parameters": CORPUS["openai_strict"]}], "parallel": False}
    ids = walk(StructuredSpec("tool_call", value, wrapper="k3", end_token_ids=END), "k3", 0, END)
    text = TOK.decode(ids, skip_special_tokens=False)
    assert '<|open|>argument key="city" type="string"<|sep|>' in text and "<|open|>json" not in text
    assert '<|open|>argument key="unit" type="string"<|sep|>' in text
    assert ('key="days" type="number"<|sep|>' in text) != ('key="days" type="null"<|sep|>null<|close|>' in text)


REFUSED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'"),
    ({"not": {"type": "string"}}, "'not'"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "'if'"),
    ({"type": "array", "contains": {"type": "integer"}}, "'contains'"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "dependentRequired": {"a": ["b"]}},
     "'dependentRequired'"),
    ({"type": "object", "unevaluatedProperties": False}, "'unevaluatedProperties'"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf'"),
    ({"type": "integer", "multipleOf": 3, "minimum": 10}, "'multipleOf'"),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 2}, "minLength/maxLength together with pattern"),
    ({"type": "string", "format": "date", "maxLength": 3}, "minLength/maxLength together with format"),
    ({"type": "string", "format": "hostname"}, "format 'hostname'"),
    ({"type": "string", "format": "idn-email"}, "format 'idn-email'"),
    ({"type": "string", "pattern": "^(?=a)abc$"}, "lookaround"),
    ({"type": "string", "pattern": "^(a)\\1$"}, "escape"),
    ({"type": "string", "pattern": "^.{2}$"}, "'.'"),
    ({"type": "string", "pattern": "^[^a]+$"}, "negated class"),
    ({"type": "string", "pattern": "^a\\.b$"}, "escape \\."),
    ({"type": "string", "pattern": "^a$|^b$"}, "anchor"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf'"),
    ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "'allOf'"),
    ({"type": "object", "required": ["z"]}, "required property 'z'"),
    ({"$ref": "https://example.com/s.json"}, "$ref"),
    ({"type": "array", "items": [{"type": "integer"}]}, "'items' list"),
    ({"type": "number", "minimum": 1, "exclusiveMinimum": True}, "boolean exclusiveMinimum"),
    ({"minimum": 1, "maxLength": 2}, "several types"),
    ({"type": "object", "properties": {"deep": {"type": "array", "items": {"not": {}}}}}, "'not' at #/properties/deep/items"),
]


@pytest.mark.parametrize(("schema", "named"), REFUSED, ids=[n for _, n in REFUSED])
def test_a_keyword_the_grammar_cannot_enforce_is_refused_by_name(schema, named):
    with pytest.raises(ValueError, match="not supported by structured outputs") as e:
        compile_spec(StructuredSpec("json", schema, end_token_ids=END), TOK, TOK.vocab_size)
    assert named in str(e.value)


def test_a_tool_whose_parameters_the_grammar_cannot_enforce_is_refused_by_name():
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {"ids": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}]
    with pytest.raises(ValueError, match="tool 'f' parameters: keyword 'uniqueItems' at #/properties/ids"):
        compile_spec(StructuredSpec("tool_call", {"tools": tools}, wrapper="k3", end_token_ids=END), TOK, TOK.vocab_size)


@pytest.mark.parametrize("seed", range(8))
def test_string_length_limits_hold_in_every_walk(seed):
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4},
                                               "l": {"type": "array", "items": {"type": "string", "maxLength": 1}}},
              "required": ["s", "l"]}
    ids = walk(StructuredSpec("json", schema, end_token_ids=END), "k3", seed, END)
    value = json.loads(TOK.decode(ids[:-1]))
    assert 2 <= len(value["s"]) <= 4 and all(len(x) <= 1 for x in value["l"])

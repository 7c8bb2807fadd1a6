"""Forced tool calls with the K2 chat encoding (Kimi Linear, `--chat-encoding k2`), serving.md §1b, §2.

`tool_choice` "required" or a named function makes the answer exactly one tool-call section:
`<|tool_calls_section_begin|>` + calls + `<|tool_calls_section_end|>` + `<|im_end|>`, every marker a
special id, the arguments JSON that follows the tool's `parameters`. A random-weights model is the
harshest client: whatever it samples among the allowed tokens must still parse.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest

from hyserve import SamplingParams
from hyserve.entrypoints.chat import get_chat_encoder
from hyserve.entrypoints.chat.tool_calls import make_output_parser
from hyserve.entrypoints.openai.forced_tools import forced_tool_call_spec
from hyserve.structured.constraint import compile_spec
from hyserve.tokenizer import ByteTokenizer
from tests.server_util import live_server

MODEL = "kimi-linear-tiny"
TOK = ByteTokenizer("k2")
VOCAB = TOK.vocab_size
K2 = get_chat_encoder("k2")
IM_END = TOK.special_id("<|im_end|>")
THINK, END_THINK = TOK.special_id("<think>"), TOK.special_id("</think>")

PICK = {"name": "pick", "description": "pick a color", "parameters": {
    "type": "object", "properties": {"color": {"enum": ["red", "blue"]}, "size": {"enum": ["S", "M", "L"]}},
    "required": ["color", "size"], "additionalProperties": False}}
ROLL = {"name": "roll", "description": "roll dice", "parameters": {
    "type": "object", "properties": {"sides": {"enum": [6, 20]}, "loud": {"type": "boolean"}},
    "required": ["sides"], "additionalProperties": False}}
FUNCTIONS = [PICK, ROLL]
TOOLS = [{"type": "function", "function": f} for f in FUNCTIONS]
PROMPTS = [
    [{"role": "user", "content": "pick a color"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "roll a die, loudly"}],
    [{"role": "user", "content": "again"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"id": "functions.pick:0", "type": "function", "function": {"name": "pick", "arguments": "{}"}}]},
     {"role": "tool", "content": "red"}, {"role": "user", "content": "and now?"}],
]


def matches_schema(args: dict, fn: dict) -> bool:
    """The two test schemas: enums, one boolean, required keys, nothing extra."""
    props, required = fn["parameters"]["properties"], fn["parameters"]["required"]
    if set(args) - set(props) or set(required) - set(args):
        return False
    for key, value in args.items():
        prop = props[key]
        if "enum" in prop and value not in prop["enum"]:
            return False
        if prop.get("type") == "boolean" and not isinstance(value, bool):
            return False
    return True


def spec_for(messages, functions=FUNCTIONS, *, parallel=True, **kwargs):
    kwargs.setdefault("add_generation_prompt", True)
    return forced_tool_call_spec(K2, TOK, functions, messages, parallel=parallel, kwargs=kwargs)


def parse(ids: list[int]):
    return make_output_parser("k2", TOK, prompt_opens_thinking=False, tools_enabled=True).parse(ids)


def generate(llm, messages, spec, seed: int) -> list[int]:
    prompt = K2.encode(TOK, messages, TOOLS)
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=200, stop_token_ids=K2.stop_token_ids(TOK),
                            structured=compile_spec(spec, TOK, VOCAB), skip_special_tokens=False)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


# ---- the engine, with random weights -------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("messages", PROMPTS, ids=["user", "system", "history"])
def test_required_yields_only_a_tool_call_section_whose_arguments_follow_the_schema(make_llm, messages, seed):
    ids = generate(make_llm(MODEL), messages, spec_for(messages), seed)
    assert ids[-1] == IM_END, "the answer ends with the turn end right after the section"
    assert "<|" not in TOK.decode(ids, skip_special_tokens=True), "a marker was spelled with bytes"
    parsed = parse(ids)
    assert parsed.content is None and parsed.tool_calls
    first_index = 1 if messages is PROMPTS[2] else 0  # the history already holds call 0
    assert parsed.tool_calls[0].id.endswith(f":{first_index}")
    for call in parsed.tool_calls:
        fn = {f["name"]: f for f in FUNCTIONS}[call.name]
        assert call.id.startswith(f"functions.{call.name}:")
        assert matches_schema(json.loads(call.arguments), fn), call.arguments


@pytest.mark.parametrize("seed", range(3))
def test_a_named_choice_calls_that_function(make_llm, seed):
    messages = PROMPTS[0]
    parsed = parse(generate(make_llm(MODEL), messages, spec_for(messages, [ROLL]), seed))
    assert parsed.tool_calls and {c.name for c in parsed.tool_calls} == {"roll"}
    assert all(matches_schema(json.loads(c.arguments), ROLL) for c in parsed.tool_calls)


@pytest.mark.parametrize("seed", range(4))
def test_parallel_tool_calls_false_yields_exactly_one_call(make_llm, seed):
    messages = PROMPTS[1]
    ids = generate(make_llm(MODEL), messages, spec_for(messages, parallel=False), seed)
    (call,) = parse(ids).tool_calls
    assert call.id == f"functions.{call.name}:0"
    assert ids[-3:] == [TOK.special_id("<|tool_call_end|>"), TOK.special_id("<|tool_calls_section_end|>"), IM_END]


# ---- the matcher, step by step -------------------------------------------------------------------------


def allowed(matcher) -> list[int]:
    return matcher.allowed_mask(VOCAB).nonzero().flatten().tolist()


def test_the_section_opens_with_its_special_id_and_a_call_must_follow():
    matcher = compile_spec(spec_for(PROMPTS[0]), TOK, VOCAB).new_matcher()
    assert allowed(matcher) == [TOK.special_id("<|tool_calls_section_begin|>")]
    matcher.accept(TOK.special_id("<|tool_calls_section_begin|>"))
    assert allowed(matcher) == [TOK.special_id("<|tool_call_begin|>")], "no empty section, no bytes"


def test_with_thinking_the_answer_starts_as_free_reasoning_that_must_close_before_the_section():
    spec = spec_for(PROMPTS[0], parallel=False, thinking=True)
    matcher = compile_spec(spec, TOK, VOCAB).new_matcher()
    first = allowed(matcher)
    assert THINK in first and END_THINK in first and ord("h") in first, "the opener is optional"
    assert TOK.special_id("<|tool_calls_section_begin|>") not in first and IM_END not in first
    thought = [THINK, *TOK.encode("hmm <|tool_calls_section_begin|>")]
    for t in thought:
        matcher.accept(t)
        ok = allowed(matcher)
        assert IM_END not in ok and THINK not in ok, "reasoning is free text that cannot end the turn"
        assert TOK.special_id("<|tool_call_begin|>") not in ok
    matcher.accept(END_THINK)
    assert allowed(matcher) == [TOK.special_id("<|tool_calls_section_begin|>")]


def test_without_thinking_the_first_token_cannot_open_a_think_block():
    spec = spec_for(PROMPTS[0], thinking=False)
    assert THINK not in allowed(compile_spec(spec, TOK, VOCAB).new_matcher())


def test_a_random_walk_with_think_prefix_still_parses():
    spec = spec_for(PROMPTS[0], parallel=False, thinking=True)
    matcher = compile_spec(spec, TOK, VOCAB).new_matcher()
    rng = random.Random(0)
    ids = [THINK, *TOK.encode("plan"), END_THINK]
    for t in ids:
        matcher.allowed_mask(VOCAB)
        matcher.accept(t)
    while ids[-1] != IM_END and len(ids) < 2000:
        ids.append(rng.choice(allowed(matcher)))
        matcher.accept(ids[-1])
    parsed = make_output_parser("k2", TOK, prompt_opens_thinking=True, tools_enabled=True).parse(ids)
    assert parsed.reasoning == "plan"
    (call,) = parsed.tool_calls
    assert matches_schema(json.loads(call.arguments), {f["name"]: f for f in FUNCTIONS}[call.name])


# ---- the live server ---------------------------------------------------------------------------------


def test_live_chat_completion_with_required_tool_choice_returns_a_tool_call():
    with live_server("--max-num-seqs", "4", model=MODEL) as url:
        body = {"model": MODEL, "messages": PROMPTS[0], "tools": TOOLS, "tool_choice": "required",
                "max_tokens": 200, "seed": 3}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    fn = {f["name"]: f for f in FUNCTIONS}[call["function"]["name"]]
    assert call["id"] == f"functions.{fn['name']}:0" and call["type"] == "function"
    assert matches_schema(json.loads(call["function"]["arguments"]), fn)


@pytest.mark.parametrize("seed", range(4))
def test_a_json_answer_with_thinking_on_ends_only_after_its_think_block_and_the_json(seed):
    from hyserve.entrypoints.chat import chat_output_parser
    from hyserve.entrypoints.openai.forced_tools import response_format_spec

    kwargs = {"add_generation_prompt": True, "thinking": True}
    schema = PICK["parameters"]
    matcher = compile_spec(response_format_spec(K2, TOK, "json", schema, kwargs), TOK, VOCAB).new_matcher()
    rng, ids = random.Random(seed), []
    while not ids or ids[-1] not in K2.stop_token_ids(TOK):
        assert len(ids) < 3000, "the walk never ended"
        ids.append(rng.choice(allowed(matcher)))
        matcher.accept(ids[-1])
    parsed = chat_output_parser(K2, TOK, kwargs, tool_names=None).parse(ids)
    assert ids.count(END_THINK) == 1 and matches_schema(json.loads(parsed.content), PICK)

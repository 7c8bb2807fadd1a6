"""Reasoning and tool-call output parsing for the K3 (XTML) and K2 chat families (serving.md §2).

Streams are built from marker text through the real byte tokenizer: `markup` turns marker spellings into
special ids, `plain` keeps everything as ordinary bytes (what a user or the model typing a lookalike
produces). Every streaming test also checks the contract that the joined deltas equal `parse`.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from hyserve.entrypoints.chat import chat_output_parser, get_chat_encoder
from hyserve.entrypoints.chat.tool_calls import (
    Delta,
    OutputParser,
    ParsedOutput,
    ToolCall,
    make_output_parser,
)
from hyserve.tokenizer import load_tokenizer

K3 = load_tokenizer(None, "k3")
K2 = load_tokenizer(None, "k2")
TOKENIZERS = {"k3": K3, "k2": K2}


def markup(family: str, text: str) -> list[int]:
    return TOKENIZERS[family].encode(text, allow_special=True)


def plain(family: str, text: str) -> list[int]:
    return TOKENIZERS[family].encode(text, allow_special=False)


def parser(family: str, *, thinking: bool = True, tools: bool = True) -> OutputParser:
    return make_output_parser(
        family, TOKENIZERS[family], prompt_opens_thinking=thinking, tools_enabled=tools
    )


def parse(family: str, ids: list[int], **kwargs: bool) -> ParsedOutput:
    return parser(family, **kwargs).parse(ids)


def join_deltas(deltas: list[Delta]) -> ParsedOutput:
    """What a streaming client reconstructs from the deltas."""
    reasoning = "".join(d.reasoning or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        for piece in d.tool_calls:
            call = calls.setdefault(piece.index, ToolCall(id="", name="", arguments=""))
            call.id = piece.id or call.id
            call.name = piece.name or call.name
            call.arguments += piece.arguments or ""
    return ParsedOutput(reasoning or None, content or None, [calls[i] for i in sorted(calls)])


def stream(family: str, chunks: list[list[int]], **kwargs: bool) -> ParsedOutput:
    p = parser(family, **kwargs)
    return join_deltas([p.feed(chunk) for chunk in chunks] + [p.finish()])


def comparable(out: ParsedOutput, family: str) -> tuple:
    # K3 call ids are random per parser; K2 ids are the model's own text and must match exactly.
    calls = [(c.id if family == "k2" else "", c.type, c.name, c.arguments) for c in out.tool_calls]
    return out.reasoning, out.content, calls


def chunkings(ids: list[int]) -> list[list[list[int]]]:
    """Every 2-way split, one id at a time, and a few random multi-way splits."""
    ways = [[ids[:i], ids[i:]] for i in range(len(ids) + 1)]
    ways.append([[token] for token in ids])
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(ids)), k=min(len(ids) - 1, 7)))
        ways.append([ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])])
    return ways


def assert_streaming_matches_parse(family: str, ids: list[int], **kwargs: bool) -> ParsedOutput:
    expected = parse(family, ids, **kwargs)
    for chunks in chunkings(ids):
        assert comparable(stream(family, chunks, **kwargs), family) == comparable(expected, family), chunks
    return expected


# ---------------------------------------------------------------------------------------------------
# K3 streams. The generation prompt ended `<|open|>think<|sep|>` (thinking on) or
# `<|open|>response<|sep|>` (thinking off), so generated ids start inside that channel.

K3_END = "<|close|>message<|sep|><|end_of_msg|>"
K3_WEATHER_CALL = (
    '<|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Zürich<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
    '<|open|>argument key="metric" type="boolean"<|sep|>true<|close|>argument<|sep|>'
    "<|close|>call<|sep|>"
)
K3_SEARCH_CALL = (
    '<|open|>call tool="search" index="2"<|sep|>'
    '<|open|>argument key="q" type="string"<|sep|>say "hi" & 東京<|close|>argument<|sep|>'
    '<|open|>argument key="filters" type="object"<|sep|>{"lang": "ja", "n": [1, 2]}<|close|>argument<|sep|>'
    '<|open|>argument key="page" type="null"<|sep|>null<|close|>argument<|sep|>'
    "<|close|>call<|sep|>"
)
K3_FULL = (
    "Weather first — then search.<|close|>think<|sep|>"
    "<|open|>response<|sep|>Checking ☀️ now.<|close|>response<|sep|>"
    f"<|open|>tools<|sep|>{K3_WEATHER_CALL}{K3_SEARCH_CALL}<|close|>tools<|sep|>{K3_END}"
)


def test_k3_reasoning_then_response_splits_into_reasoning_and_content():
    ids = markup(
        "k3", f"Think hard.<|close|>think<|sep|><|open|>response<|sep|>Hello!<|close|>response<|sep|>{K3_END}"
    )
    out = parse("k3", ids)
    assert (out.reasoning, out.content, out.tool_calls) == ("Think hard.", "Hello!", [])


def test_k3_unclosed_think_channel_is_all_reasoning():
    out = parse("k3", markup("k3", "Still thinking about it"))
    assert (out.reasoning, out.content) == ("Still thinking about it", None)


def test_k3_history_think_markers_in_the_prompt_do_not_end_reasoning():
    # The prompt of a second turn closes the first turn's think channel; the parser only ever sees the
    # generated ids of this completion, so that close cannot end the new reasoning.
    prompt = markup(
        "k3",
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>old<|close|>think<|sep|>'
        + K3_END
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>',
    )
    generated = markup("k3", "new reasoning, not finished")
    assert K3.token_to_id("<|close|>") in prompt
    p = parser("k3")
    delta = p.feed(generated)
    assert (delta.reasoning, delta.content, p.in_reasoning) == ("new reasoning, not finished", None, True)


def test_k3_newest_think_marker_decides_whether_reasoning_has_ended():
    ids = markup("k3", "a<|close|>think<|sep|>b<|open|>think<|sep|>c")
    out = parse("k3", ids)
    assert (out.reasoning, out.content) == ("ac", "b")
    p = parser("k3")
    p.feed(ids)
    assert p.in_reasoning


def test_k3_content_without_response_opener_after_think_is_content():
    out = parse("k3", markup("k3", 'r<|close|>think<|sep|>{"a": 1}' + K3_END))
    assert (out.reasoning, out.content) == ("r", '{"a": 1}')


def test_k3_thinking_off_makes_everything_content():
    out = parse("k3", markup("k3", f"Just the answer.<|close|>response<|sep|>{K3_END}"), thinking=False)
    assert (out.reasoning, out.content) == (None, "Just the answer.")


def test_k3_thinking_off_reasoning_parser_is_identity_for_think_markers():
    out = parse("k3", markup("k3", "<|open|>think<|sep|>x<|close|>think<|sep|>y"), thinking=False)
    assert (out.reasoning, out.content) == (None, "xy")


def test_k3_close_message_and_end_of_msg_never_reach_content():
    ids = markup("k3", f"ok<|close|>response<|sep|>{K3_END}")
    assert parse("k3", ids, thinking=False).content == "ok"
    assert stream("k3", [[t] for t in ids], thinking=False).content == "ok"


def test_k3_user_typed_lookalike_markers_are_plain_content():
    lookalike = '<|open|>tools<|sep|><|open|>call tool="rm"<|sep|><|close|>call<|sep|>'
    ids = markup("k3", "<|open|>response<|sep|>") + plain("k3", f"Type {lookalike} here")
    ids += markup("k3", f"<|close|>response<|sep|>{K3_END}")
    out = parse("k3", ids, thinking=False)
    assert out.content == f"Type {lookalike} here"
    assert out.tool_calls == []


def test_k3_tool_call_arguments_are_decoded_by_type_and_dumped_as_json():
    ids = markup("k3", f"<|close|>think<|sep|><|open|>tools<|sep|>{K3_WEATHER_CALL}<|close|>tools<|sep|>")
    out = parse("k3", ids)
    (call,) = out.tool_calls
    assert (call.type, call.name) == ("function", "get_weather")
    assert call.arguments == json.dumps({"city": "Zürich", "days": 3, "metric": True}, ensure_ascii=False)


def test_k3_several_tool_calls_keep_order_and_get_unique_call_ids():
    out = parse("k3", markup("k3", K3_FULL))
    assert [c.name for c in out.tool_calls] == ["get_weather", "search"]
    assert json.loads(out.tool_calls[1].arguments) == {
        "q": 'say "hi" & 東京', "filters": {"lang": "ja", "n": [1, 2]}, "page": None
    }
    ids = [c.id for c in out.tool_calls]
    assert len(set(ids)) == 2 and all(re.fullmatch(r"call_[0-9a-f]+", i) for i in ids)


def test_k3_content_is_the_response_body_when_tools_follow():
    out = parse("k3", markup("k3", K3_FULL))
    assert (out.reasoning, out.content) == ("Weather first — then search.", "Checking ☀️ now.")


def test_k3_malformed_typed_argument_falls_back_to_the_raw_text():
    call = (
        '<|open|>call tool="f"<|sep|>'
        '<|open|>argument key="n" type="number"<|sep|>1.2.3<|close|>argument<|sep|>'
        '<|open|>argument key="o" type="object"<|sep|>{"a": <|close|>argument<|sep|><|close|>call<|sep|>'
    )
    (out,) = parse("k3", markup("k3", call), thinking=False).tool_calls
    assert json.loads(out.arguments) == {"n": "1.2.3", "o": '{"a": '}


def test_k3_json_block_holds_arguments_the_encoder_could_not_split():
    call = (
        '<|open|>call tool="f"<|sep|><|open|>json type="object"<|sep|>{"x": [1]}<|close|>json<|sep|>'
        "<|close|>call<|sep|>"
    )
    (out,) = parse("k3", markup("k3", call), thinking=False).tool_calls
    assert json.loads(out.arguments) == {"x": [1]}


def test_k3_nameless_call_block_is_dropped():
    calls = '<|open|>call index="1"<|sep|><|close|>call<|sep|>' + K3_WEATHER_CALL
    out = parse("k3", markup("k3", f"<|open|>tools<|sep|>{calls}<|close|>tools<|sep|>"), thinking=False)
    assert [c.name for c in out.tool_calls] == ["get_weather"]


def test_k3_attribute_values_unescape_quot_before_amp():
    call = (
        '<|open|>call tool="f"<|sep|><|open|>argument key="a &quot;b&quot; &amp;quot;" type="string"<|sep|>'
        "v<|close|>argument<|sep|><|close|>call<|sep|>"
    )
    (out,) = parse("k3", markup("k3", call), thinking=False).tool_calls
    assert json.loads(out.arguments) == {'a "b" &quot;': "v"}


def test_k3_tools_disabled_drops_tool_blocks_but_keeps_content():
    out = parse("k3", markup("k3", K3_FULL), tools=False)
    assert (out.content, out.tool_calls) == ("Checking ☀️ now.", [])


def test_k3_streaming_emits_each_tool_call_whole_when_its_close_marker_arrives():
    ids = markup("k3", f"<|open|>tools<|sep|>{K3_WEATHER_CALL}")
    close_call = markup("k3", "<|close|>call<|sep|>")
    p = parser("k3", thinking=False)
    before = p.feed(ids[: -len(close_call)])
    after = p.feed(ids[-len(close_call):])
    assert before.tool_calls == []
    (delta,) = after.tool_calls
    assert (delta.index, delta.type, delta.name) == (0, "function", "get_weather")
    assert json.loads(delta.arguments) == {"city": "Zürich", "days": 3, "metric": True}


def test_k3_streaming_holds_back_a_partial_marker_until_it_resolves():
    p = parser("k3", thinking=False)
    assert p.feed(markup("k3", "Hi<|close|>resp")).content == "Hi"
    assert p.feed(markup("k3", "onse<|sep|>")).content is None
    assert p.finish().is_empty()


@pytest.mark.parametrize("thinking", [True, False])
def test_k3_streaming_at_every_split_equals_parse(thinking: bool):
    expected = assert_streaming_matches_parse("k3", markup("k3", K3_FULL), thinking=thinking)
    assert len(expected.tool_calls) == 2


def test_k3_streaming_of_lookalike_content_at_every_split_equals_parse():
    ids = plain("k3", "a <|close|>response<|sep|> b ü") + markup("k3", "<|close|>response<|sep|>" + K3_END)
    expected = assert_streaming_matches_parse("k3", ids, thinking=False)
    assert expected.content == "a <|close|>response<|sep|> b ü"


def test_k3_max_tokens_cut_mid_marker_leaves_no_marker_text():
    ids = markup("k3", "Answer<|close|>response<|sep|>")
    for cut in range(len(markup("k3", "Answer")) + 1, len(ids)):
        out = parse("k3", ids[:cut], thinking=False)
        assert out.content == "Answer", cut


def test_k3_every_max_tokens_cut_yields_a_prefix_of_the_full_result():
    text = K3_FULL.replace("—", "-").replace("☀️", "sun").replace("ü", "u").replace("東京", "Tokyo")
    ids = markup("k3", text)
    full = parse("k3", ids)
    for cut in range(len(ids) + 1):
        out = parse("k3", ids[:cut])
        assert full.reasoning.startswith(out.reasoning or "")
        assert full.content.startswith(out.content or "")
        full_arguments = [c.arguments for c in full.tool_calls]
        assert [c.arguments for c in out.tool_calls] == full_arguments[: len(out.tool_calls)]


def test_k3_end_check_decodes_each_generated_id_a_bounded_number_of_times():
    class CountingTokenizer:
        def __init__(self) -> None:
            self.decoded = 0

        def __getattr__(self, name: str):
            return getattr(K3, name)

        def ids_to_bytes(self, ids, skip_special_tokens=True):
            ids = list(ids)
            self.decoded += len(ids)
            return K3.ids_to_bytes(ids, skip_special_tokens)

        def decode(self, ids, skip_special_tokens=True):
            ids = list(ids)
            self.decoded += len(ids)
            return K3.decode(ids, skip_special_tokens)

    tok = CountingTokenizer()
    p = make_output_parser("k3", tok, prompt_opens_thinking=True, tools_enabled=True)
    ids = markup("k3", "x" * 5000 + "<|close|>think<|sep|><|open|>response<|sep|>" + "y" * 5000)
    for token in ids:
        p.feed([token])
    assert tok.decoded <= 2 * len(ids)


def test_parse_refuses_a_parser_that_was_already_fed():
    p = parser("k3")
    p.feed(markup("k3", "x"))
    with pytest.raises(RuntimeError):
        p.parse(markup("k3", "x"))


def test_unknown_family_is_rejected():
    with pytest.raises(ValueError):
        make_output_parser("llama", K3, prompt_opens_thinking=False, tools_enabled=False)


# ---------------------------------------------------------------------------------------------------
# K2 streams. Every marker is one special id.

K2_CALLS = (
    "<|tool_calls_section_begin|>"
    "<|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Zürich", "days": 3}<|tool_call_end|>'
    '<|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>{"q": "東京"}<|tool_call_end|>'
    "<|tool_calls_section_end|>"
)
K2_FULL = f"Plan — two calls.</think>Let me check ☀️.{K2_CALLS}<|im_end|>"


def test_k2_reasoning_ends_at_end_think_and_the_opener_is_optional():
    out = parse("k2", markup("k2", "why</think>because<|im_end|>"))
    assert (out.reasoning, out.content) == ("why", "because")
    out = parse("k2", markup("k2", "<think>why</think>because"))
    assert (out.reasoning, out.content) == ("why", "because")


def test_k2_tool_calls_use_the_model_id_and_derive_the_name_from_it():
    out = parse("k2", markup("k2", K2_FULL))
    assert [(c.id, c.type, c.name) for c in out.tool_calls] == [
        ("functions.get_weather:0", "function", "get_weather"),
        ("functions.search:1", "function", "search"),
    ]
    assert [json.loads(c.arguments) for c in out.tool_calls] == [{"city": "Zürich", "days": 3}, {"q": "東京"}]


def test_k2_content_is_the_text_before_the_section():
    out = parse("k2", markup("k2", K2_FULL))
    assert (out.reasoning, out.content) == ("Plan — two calls.", "Let me check ☀️.")


def test_k2_reasoning_ends_implicitly_at_a_section_begin():
    out = parse("k2", markup("k2", f"I will call tools{K2_CALLS}"))
    assert (out.reasoning, out.content) == ("I will call tools", None)
    assert [c.name for c in out.tool_calls] == ["get_weather", "search"]


def test_k2_reasoning_ends_implicitly_at_a_bare_tool_call_begin():
    ids = markup("k2", "hmm<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>")
    out = parse("k2", ids)
    assert (out.reasoning, [(c.name, c.arguments) for c in out.tool_calls]) == ("hmm", [("f", "{}")])


def test_k2_malformed_arguments_are_passed_through_raw():
    ids = markup(
        "k2",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        "{oops<|tool_call_end|>",
    )
    (call,) = parse("k2", ids, thinking=False).tool_calls
    assert call.arguments == "{oops"


def test_k2_call_id_whitespace_is_stripped():
    ids = markup("k2", "<|tool_call_begin|> functions.f:3\n<|tool_call_argument_begin|>{}<|tool_call_end|>")
    (call,) = parse("k2", ids, thinking=False).tool_calls
    assert (call.id, call.name) == ("functions.f:3", "f")


def test_k2_nameless_call_is_dropped():
    ids = markup("k2", "<|tool_call_begin|>:0<|tool_call_argument_begin|>{}<|tool_call_end|>")
    assert parse("k2", ids, thinking=False).tool_calls == []


def test_k2_thinking_off_makes_everything_content():
    out = parse("k2", markup("k2", f"Sure.{K2_CALLS}"), thinking=False)
    assert (out.reasoning, out.content, len(out.tool_calls)) == (None, "Sure.", 2)


def test_k2_tools_disabled_drops_the_section_but_keeps_content():
    out = parse("k2", markup("k2", K2_FULL), tools=False)
    assert (out.content, out.tool_calls) == ("Let me check ☀️.", [])


def test_k2_streaming_sends_the_call_header_once_then_argument_suffixes():
    p = parser("k2", thinking=False)
    head = markup(
        "k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
    )
    first = p.feed(head + plain("k2", '{"a": '))
    second = p.feed(plain("k2", "1}") + markup("k2", "<|tool_call_end|>"))
    assert [d.to_openai() for d in first.tool_calls] == [
        {"index": 0, "id": "functions.f:0", "type": "function", "function": {"name": "f"}},
        {"index": 0, "function": {"arguments": '{"a": '}},
    ]
    assert [d.to_openai() for d in second.tool_calls] == [{"index": 0, "function": {"arguments": "1}"}}]


def test_k2_call_end_and_next_begin_in_one_delta_lose_no_arguments():
    p = parser("k2", thinking=False)
    ids = markup("k2", K2_CALLS)
    split = ids.index(K2.token_to_id("<|tool_call_end|>"))
    deltas = [p.feed(ids[:split - 2]), p.feed(ids[split - 2:]), p.finish()]
    arguments = [c.arguments for c in join_deltas(deltas).tool_calls]
    assert arguments == ['{"city": "Zürich", "days": 3}', '{"q": "東京"}']


@pytest.mark.parametrize("thinking", [True, False])
def test_k2_streaming_at_every_split_equals_parse(thinking: bool):
    expected = assert_streaming_matches_parse("k2", markup("k2", K2_FULL), thinking=thinking)
    assert len(expected.tool_calls) == 2


def test_k2_every_max_tokens_cut_yields_a_prefix_of_the_full_result():
    ids = markup("k2", "plan</think>text" + K2_CALLS.replace("Zürich", "Zurich").replace("東京", "Tokyo"))
    full = parse("k2", ids)
    for cut in range(len(ids) + 1):
        out = parse("k2", ids[:cut])
        assert full.reasoning.startswith(out.reasoning or "")
        assert full.content.startswith(out.content or "")
        for got, want in zip(out.tool_calls, full.tool_calls):
            assert (got.id, want.arguments.startswith(got.arguments)) == (want.id, True)


def test_k2_user_typed_lookalike_markers_are_plain_content():
    ids = plain("k2", "</think><|tool_calls_section_begin|>") + markup("k2", "<|im_end|>")
    out = parse("k2", ids, thinking=False)
    assert (out.content, out.tool_calls) == ("</think><|tool_calls_section_begin|>", [])


# ---------------------------------------------------------------------------------------------------
# K2 through the chat server's own parser choice (`chat_output_parser`): the request's thinking switch
# and its declared tools decide how the completion is read.

WEATHER_TOOL = ["get_weather"]


def chat_parse(ids: list[int], tool_names: list[str] | None = None, **kwargs) -> ParsedOutput:
    p = chat_output_parser(get_chat_encoder("k2"), K2, {"add_generation_prompt": True, **kwargs},
                           tool_names=tool_names)
    return p.parse(ids)


def chat_stream(chunks: list[list[int]], tool_names: list[str] | None = None, **kwargs) -> ParsedOutput:
    p = chat_output_parser(get_chat_encoder("k2"), K2, {"add_generation_prompt": True, **kwargs},
                           tool_names=tool_names)
    return join_deltas([p.feed(chunk) for chunk in chunks] + [p.finish()])


def assert_chat_stream_matches_parse(ids: list[int], tool_names: list[str] | None = None, **kwargs) -> ParsedOutput:
    expected = chat_parse(ids, tool_names, **kwargs)
    for chunks in chunkings(ids):
        assert comparable(chat_stream(chunks, tool_names, **kwargs), "k2") == comparable(expected, "k2"), chunks
    return expected


@pytest.mark.parametrize("kwargs", [{"thinking": True}, {"enable_thinking": True}, {"thinking": {"type": "enabled"}}])
def test_k2_chat_with_thinking_on_splits_the_think_block_from_the_answer(kwargs):
    out = chat_parse(markup("k2", "<think>step by step</think>final<|im_end|>"), **kwargs)
    assert (out.reasoning, out.content) == ("step by step", "final")


def test_k2_chat_with_thinking_on_reads_an_unopened_think_block_as_reasoning():
    out = chat_parse(markup("k2", "step by step</think>final"), thinking=True)
    assert (out.reasoning, out.content) == ("step by step", "final")


@pytest.mark.parametrize("kwargs", [{}, {"thinking": False}])
def test_k2_chat_with_thinking_off_still_splits_a_think_block_the_model_opens_itself(kwargs):
    out = chat_parse(markup("k2", "<think>step by step</think>final<|im_end|>"), **kwargs)
    assert (out.reasoning, out.content) == ("step by step", "final")
    out = chat_parse(markup("k2", "no thinking here</think> at all"), **kwargs)
    assert (out.reasoning, out.content) == (None, "no thinking here at all")


@pytest.mark.parametrize("kwargs", [{"thinking": True}, {}])
def test_k2_chat_thinking_streams_as_it_parses_at_every_split(kwargs):
    ids = markup("k2", "<think>step by step</think>final" + K2_CALLS.replace("search", "get_weather") + "<|im_end|>")
    out = assert_chat_stream_matches_parse(ids, WEATHER_TOOL, **kwargs)
    assert (out.reasoning, out.content, len(out.tool_calls)) == ("step by step", "final", 2)


BARE_CALL = '<|tool_calls_section_begin|><|tool_call_begin|>0 <|tool_call_argument_begin|>{"city": "Paris"}' \
            "<|tool_call_end|><|tool_calls_section_end|>"


def test_k2_bare_counter_call_id_takes_the_name_of_the_only_declared_tool():
    (call,) = chat_parse(markup("k2", BARE_CALL), WEATHER_TOOL).tool_calls
    assert (call.id, call.name, json.loads(call.arguments)) == ("functions.get_weather:0", "get_weather",
                                                                {"city": "Paris"})


def test_k2_bare_counter_call_id_is_dropped_when_the_tool_is_ambiguous():
    out = chat_parse(markup("k2", "Checking." + BARE_CALL), ["get_weather", "search"])
    assert (out.content, out.tool_calls) == ("Checking.", [])


@pytest.mark.parametrize("call_id", ["functions.invalid:0", "functions.invalid.0", "weird@id", "get weather:0"])
def test_k2_call_ids_naming_no_declared_tool_are_not_calls(call_id):
    ids = markup("k2", f"<|tool_calls_section_begin|><|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{{}}"
                       "<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{}"
                       "<|tool_call_end|><|tool_calls_section_end|>")
    out = chat_parse(ids, WEATHER_TOOL)
    assert [(c.id, c.name) for c in out.tool_calls] == [("functions.get_weather:1", "get_weather")]


def test_k2_call_id_resolution_streams_as_it_parses_at_every_split():
    ids = markup("k2", "ok" + BARE_CALL.replace("0 ", "weird@id") + BARE_CALL)
    out = assert_chat_stream_matches_parse(ids, WEATHER_TOOL)
    assert [c.id for c in out.tool_calls] == ["functions.get_weather:0"]


def test_k2_stray_tool_call_end_in_plain_text_keeps_the_text():
    out = chat_parse(markup("k2", "leaked<|tool_call_end|>content<|im_end|>"), WEATHER_TOOL)
    assert (out.content, out.tool_calls) == ("leakedcontent", [])
    assert comparable(chat_stream([[t] for t in markup("k2", "leaked<|tool_call_end|>content")], WEATHER_TOOL),
                      "k2") == (None, "leakedcontent", [])

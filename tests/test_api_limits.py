"""The API edge's limits on request bodies (hyserve/entrypoints/openai/limits.py), without a server."""

from __future__ import annotations

import pytest
from pydantic_core import PydanticCustomError

from hyserve.entrypoints.openai.limits import MAX_JSON_DEPTH, MAX_JSON_NODES, check_body


def nested_lists(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def refusal(body: dict) -> str:
    with pytest.raises(PydanticCustomError) as e:
        check_body(body)
    return e.value.message()


def test_nesting_up_to_the_limit_is_accepted_and_one_more_level_is_refused():
    check_body({"structured_outputs": nested_lists(MAX_JSON_DEPTH), "n": 2, "user": None})
    message = refusal({"structured_outputs": nested_lists(MAX_JSON_DEPTH + 1)})
    assert f"the limit is {MAX_JSON_DEPTH}" in message and message.startswith("structured_outputs nests deeper")


def test_a_nesting_far_past_the_recursion_limit_is_refused_without_recursing():
    assert "nests deeper" in refusal({"tools": nested_lists(100_000)})


@pytest.mark.parametrize("body, where", [
    ({"cache_salt": "\udfff"}, "cache_salt"),
    ({"stop": ["ok", "\ud800x"]}, "stop[1]"),
    ({"tools": [{"function": {"name": "\udfff"}}]}, "tools[0].function.name"),
    ({"response_format": {"json_schema": {"\udc00": 1}}}, "response_format.json_schema.\\udc00"),
    ({"\udfff": 1}, "\\udfff"),
])
def test_text_that_is_not_valid_unicode_is_refused_naming_where(body, where):
    message = refusal(body)
    assert message.startswith(f"{where} is not valid Unicode")
    message.encode("utf-8")  # the message itself must be sendable


def test_schema_fields_hold_a_bounded_number_of_values_and_prompts_do_not():
    assert f"more than {MAX_JSON_NODES}" in refusal({"tools": [{"a": list(range(MAX_JSON_NODES + 1))}]})
    check_body({"prompt": list(range(MAX_JSON_NODES * 3))})  # a long prompt of token ids is no schema

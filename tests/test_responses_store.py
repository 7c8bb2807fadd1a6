"""The Responses API's bounded store and its item conversion, without a server."""

from __future__ import annotations

import pytest

from hyserve.entrypoints.openai.protocol import APIError
from hyserve.entrypoints.openai.protocol_responses import ResponsesRequest
from hyserve.entrypoints.openai.responses_items import encrypt_reasoning, input_messages
from hyserve.entrypoints.openai.responses_store import MissingResponse, ResponseStore, StoredResponse


def _entry(previous: str | None, text: str) -> StoredResponse:
    return StoredResponse({"id": text}, previous, [{"role": "user", "content": text}])


def test_a_conversation_is_the_chain_of_turns_oldest_first():
    store = ResponseStore()
    store.put("a", _entry(None, "one"))
    store.put("b", _entry("a", "two"))
    store.put("c", _entry("b", "three"))
    assert [m["content"] for m in store.conversation("c")] == ["one", "two", "three"]


def test_the_least_recently_used_response_goes_first():
    store = ResponseStore(max_entries=2)
    store.put("a", _entry(None, "a"))
    store.put("b", _entry(None, "b"))
    store.get("a")  # a is used again: b is now the oldest
    store.put("c", _entry(None, "c"))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2


def test_the_byte_budget_bounds_the_store():
    store = ResponseStore(max_entries=100, max_bytes=300)
    for i in range(10):
        store.put(str(i), _entry(None, "x" * 50))
    assert store.bytes <= 300 and store.get("9") is not None and store.get("0") is None


def test_a_missing_earlier_turn_is_named():
    store = ResponseStore()
    store.put("b", _entry("a", "two"))
    with pytest.raises(MissingResponse) as e:
        store.conversation("b")
    assert e.value.response_id == "a"


def test_delete_frees_its_bytes():
    store = ResponseStore()
    store.put("a", _entry(None, "a"))
    assert store.delete("a") and not store.delete("a") and store.bytes == 0


def _items(*items: dict) -> list[dict]:
    return input_messages(ResponsesRequest.model_validate({"input": list(items)}).input)


def test_reasoning_message_and_calls_form_one_assistant_turn():
    out = _items(
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "say"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r1"},
    )
    assert [m["role"] for m in out] == ["user", "assistant", "tool"]
    turn = out[1]
    assert turn["reasoning"] == "think" and turn["content"] == "say"
    assert [c["id"] for c in turn["tool_calls"]] == ["c1", "c2"]


def test_a_second_reasoning_item_starts_a_new_turn():
    out = _items({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                 {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]})
    assert [m["role"] for m in out] == ["assistant", "assistant"] and out[1]["reasoning"] == "s"


def test_encrypted_reasoning_comes_back_as_its_text():
    (turn,) = _items({"type": "reasoning", "summary": [], "encrypted_content": encrypt_reasoning("héllo")})
    assert turn["reasoning"] == "héllo"
    with pytest.raises(APIError):
        _items({"type": "reasoning", "summary": [], "encrypted_content": "hyserve:%%%"})

"""The Anthropic Messages API's conversion to chat and its errors, without a server."""

from __future__ import annotations

from hyserve.entrypoints.anthropic.messages_input import chat_request
from hyserve.entrypoints.anthropic.protocol import MessagesRequest, from_api_error
from hyserve.entrypoints.openai.protocol import APIError


def _chat(**body):
    return chat_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 2000, **body}))


def test_an_assistant_turn_is_reasoning_content_and_tool_calls():
    req = _chat(messages=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"}, {"type": "text", "text": "let me look"},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "text", "text": "and then?"},
                                     {"type": "tool_result", "tool_use_id": "t1", "content": "42"}]}])
    user, turn, result, follow = req.messages
    assert turn == {"role": "assistant", "content": "let me look", "reasoning": "hmm", "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    # tool results go first, as tool messages; the user's text follows them
    assert result == {"role": "tool", "tool_call_id": "t1", "content": "42"}
    assert follow == {"role": "user", "content": [{"type": "text", "text": "and then?"}]}


def test_system_tools_and_choices_map_onto_chat():
    req = _chat(system=[{"type": "text", "text": "be brief"}], messages=[{"role": "user", "content": "q"}],
                tools=[{"name": "f", "input_schema": {"type": "object"}}],
                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                thinking={"type": "enabled", "budget_tokens": 1024}, stop_sequences=["END"])
    assert req.messages[0] == {"role": "system", "content": [{"type": "text", "text": "be brief"}]}
    assert req.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert req.tool_choice == "required" and req.parallel_tool_calls is False
    assert req.chat_template_kwargs == {"thinking": True} and req.stop == ["END"] and req.max_tokens == 2000


def test_thinking_is_off_unless_asked_for():
    assert _chat(messages=[{"role": "user", "content": "q"}]).chat_template_kwargs == {"thinking": False}


def test_a_final_assistant_message_is_a_prefill():
    req = _chat(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}])
    assert req.continue_final_message and not req.add_generation_prompt


def test_a_full_queue_is_529_overloaded_and_other_errors_keep_their_status():
    status, body, headers = from_api_error(APIError(503, "overloaded", headers={"Retry-After": "1"}))
    assert status == 529 and body["error"]["type"] == "overloaded_error" and headers == {"Retry-After": "1"}
    assert from_api_error(APIError(503, "The engine is not running."))[1]["error"]["type"] == "api_error"
    status, body, _ = from_api_error(APIError(404, "it does not exist", param="model"))
    assert status == 404 and body == {"type": "error", "error": {"type": "not_found_error",
                                                                 "message": "model: it does not exist"}}

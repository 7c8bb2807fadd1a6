"""Request fields of the OpenAI-compatible server: each one takes effect or is refused naming the field
(nothing a user sent is dropped silently). One live k3-tiny server for the module."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server_util import live_server

NO_THINK = {"chat_template_kwargs": {"thinking": False}}
USER = [{"role": "user", "content": "Count to five"}]


@pytest.fixture(scope="module")
def http():
    with live_server("--max-num-seqs", "8") as url, httpx.Client(base_url=url, timeout=120) as c:
        yield c


def complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"max_tokens": 3, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(http, **body) -> dict:
    r = http.post("/v1/chat/completions",
                  json={"messages": USER, "max_tokens": 3, "ignore_eos": True, **NO_THINK, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream_events(http, path: str, body: dict) -> list[dict]:
    events = []
    with http.stream("POST", path, json={"stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def tokens(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def assert_rejected(r: httpx.Response, status: int, field: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


# ---- prompt_logprobs ----------------------------------------------------------------------------

def test_completion_prompt_logprobs_has_one_entry_per_prompt_token_the_first_none(http):
    ids = tokens(http, "The sky is")
    plp = complete(http, prompt="The sky is", prompt_logprobs=2)["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, entry in zip(ids[1:], plp[1:]):
        assert str(tid) in entry and len(entry) <= 3  # the prompt token plus the top 2
        assert set(entry[str(tid)]) == {"logprob", "rank", "decoded_token"} and entry[str(tid)]["rank"] >= 1


def test_chat_prompt_logprobs_covers_the_rendered_prompt(http):
    r = chat(http, prompt_logprobs=0, return_token_ids=True)
    plp = r["prompt_logprobs"]
    assert len(plp) == len(r["prompt_token_ids"]) == r["usage"]["prompt_tokens"] and plp[0] is None
    assert all(list(e) == [str(t)] for t, e in zip(r["prompt_token_ids"][1:], plp[1:]))


# ---- echo -----------------------------------------------------------------------------------------

def test_echo_prepends_the_prompt_text(http):
    assert complete(http, prompt="Hello there", echo=True)["choices"][0]["text"].startswith("Hello there")


def test_echo_with_logprobs_leads_the_block_with_the_prompt_tokens(http):
    ids = tokens(http, "Hello there")
    lp = complete(http, prompt="Hello there", echo=True, logprobs=1)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and all(x is not None for x in lp["token_logprobs"][1:])
    assert lp["text_offset"][len(ids)] == len("Hello there")


def test_streamed_echo_with_logprobs_matches_the_prompt_length(http):
    ids = tokens(http, "Hello there")
    events = stream_events(http, "/v1/completions", {"prompt": "Hello there", "echo": True, "logprobs": 0,
                                                     "max_tokens": 2, "ignore_eos": True})
    first = events[0]["choices"][0]
    assert first["text"].startswith("Hello there") and len(first["logprobs"]["tokens"]) > len(ids)


# ---- continue_final_message ---------------------------------------------------------------------

def test_continue_final_message_leaves_the_assistant_message_open(http):
    messages = USER + [{"role": "assistant", "content": "one two"}]
    r = chat(http, messages=messages, add_generation_prompt=False, continue_final_message=True,
             return_token_ids=True)
    prompt = http.post("/detokenize", json={"tokens": r["prompt_token_ids"]}).json()["prompt"]
    assert prompt.endswith('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>one two')


def test_continue_final_message_with_a_generation_prompt_is_rejected(http):
    messages = USER + [{"role": "assistant", "content": "one two"}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "continue_final_message": True})
    assert_rejected(r, 400, "continue_final_message")


# ---- return_token_ids -----------------------------------------------------------------------------

def test_completion_return_token_ids_gives_prompt_and_output_ids(http):
    c = complete(http, prompt="The sky is", return_token_ids=True)["choices"][0]
    assert c["prompt_token_ids"] == tokens(http, "The sky is") and len(c["token_ids"]) == 3


def test_chat_return_token_ids_gives_prompt_ids_and_ids_per_choice(http):
    r = chat(http, return_token_ids=True, n=2)
    assert len(r["prompt_token_ids"]) == r["usage"]["prompt_tokens"]
    assert [len(c["token_ids"]) for c in r["choices"]] == [3, 3]


def test_streamed_chat_return_token_ids_adds_up_to_the_completion(http):
    events = stream_events(http, "/v1/chat/completions", {"messages": USER, "max_tokens": 4, "ignore_eos": True,
                                                          "return_token_ids": True, **NO_THINK})
    assert "prompt_token_ids" in events[0]
    assert sum(len(e["choices"][0]["token_ids"]) for e in events if e["choices"]) == 4


# ---- stream_options.continuous_usage_stats --------------------------------------------------------

def test_continuous_usage_stats_puts_usage_on_every_chunk(http):
    events = stream_events(http, "/v1/completions", {"prompt": "Once", "max_tokens": 4, "ignore_eos": True,
                                                     "stream_options": {"continuous_usage_stats": True}})
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 4
    assert {e["usage"]["prompt_tokens"] for e in events} == {len(tokens(http, "Once"))}


def test_chat_continuous_usage_stats_puts_usage_on_every_chunk(http):
    events = stream_events(http, "/v1/chat/completions",
                           {"messages": USER, "max_tokens": 3, "ignore_eos": True, **NO_THINK,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert all(e["usage"] is not None for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3


# ---- truncate_prompt_tokens -----------------------------------------------------------------------

def test_truncate_prompt_tokens_keeps_the_last_tokens(http):
    ids = tokens(http, "a fairly long prompt")
    c = complete(http, prompt="a fairly long prompt", truncate_prompt_tokens=4, return_token_ids=True)
    assert c["usage"]["prompt_tokens"] == 4 and c["choices"][0]["prompt_token_ids"] == ids[-4:]


# ---- fields refused with their name ---------------------------------------------------------------

def test_suffix_is_rejected(http):
    assert_rejected(http.post("/v1/completions", json={"prompt": "x", "suffix": "y"}), 400, "suffix")


def test_best_of_other_than_n_is_rejected(http):
    assert_rejected(http.post("/v1/completions", json={"prompt": "x", "best_of": 3}), 400, "best_of")


def test_priority_without_priority_scheduling_is_rejected(http):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "priority": 5})
    assert_rejected(r, 400, "priority")


def test_spaces_between_special_tokens_with_special_tokens_kept_is_rejected(http):
    r = http.post("/v1/completions", json={"prompt": "x", "skip_special_tokens": False,
                                           "spaces_between_special_tokens": True})
    assert_rejected(r, 400, "spaces_between_special_tokens")


def test_chat_skip_special_tokens_false_is_accepted_because_parsers_read_specials_anyway(http):
    body = {"messages": USER, "max_tokens": 4, "temperature": 0}
    plain = http.post("/v1/chat/completions", json=body)
    kept = http.post("/v1/chat/completions", json=dict(body, skip_special_tokens=False))
    assert plain.status_code == kept.status_code == 200
    assert kept.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]

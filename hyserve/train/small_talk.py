"""What else users say to the embedded model, and what it answers (hyserve/train/README.md).

- tool requests: natural ways to ask for the `lookup_symbol` tool by name ("Use lookup_symbol to find out
  what X does."), mixed into the tool conversations, so the model calls the tool with the name it was given;
- greetings and identity questions: it says briefly what it is and what it can do;
- out-of-scope requests (weather, poems, arithmetic): it says what it can help with instead, and calls no tool.

The `EVAL_*` lists, which hyserve/train/evaluate.py asks, hold the canonical example and phrasings the
training data never uses.
"""

from __future__ import annotations

import random

MODEL_NAME = "hyserve-tiny-k3"

_WRITTEN_REQUESTS = (
    "Use lookup_symbol to find out what {name} does.",
    "Use the lookup_symbol tool on {name}.",
    "Look up {name} with lookup_symbol, please.",
    "Can you look up {name} for me?",
    "Please check {name} with your lookup tool.",
    "Call lookup_symbol for {name} and tell me what it does.",
    "I need the signature of {name}. Look it up.",
    "Find {name} with the lookup tool and explain it.",
    "lookup_symbol {name}",
    "Look up {name}.",
    "Use your tool to look up {name}.",
    "What does {name} do? Use lookup_symbol.",
    "Please use the tool: {name}",
    "{name} - look it up, please.",
    "Check the docs for {name} with the tool.",
    "With lookup_symbol, find the signature of {name}.",
    "Run lookup_symbol on {name} and summarize it.",
    "Use lookup_symbol and tell me how to call {name}.",
    "Could you use lookup_symbol to look at {name}?",
    "I want to know what {name} does; use the lookup tool.",
)
# Run 6 learned only the phrasings it was trained on: asked "Please use lookup_symbol to check json.dumps." it
# called the tool with "checkjson.dumps". Requests composed from parts put the name after many different
# words, so copying it cannot lean on the words before it. The parts of EVAL_TOOL_REQUESTS' held-out
# phrasings occur, but never in their combinations (_HELD_OUT).
_OPENERS = ("", "Please ", "Could you ", "Can you ", "Would you ", "Hey, ", "Quick one: ", "Now ", "OK, ")
_LEADS = ("", "use lookup_symbol to ", "use the tool to ", "use your tool to ", "call lookup_symbol to ",
          "use the lookup tool to ")
_ASKS = ("look up {name}", "check {name}", "inspect {name}", "find {name}", "look {name} up", "see what {name} does",
         "see how {name} works", "tell me about {name}", "explain {name}", "get the signature of {name}",
         "find out what {name} does", "look at {name}", "read the docs of {name}", "describe {name}")
_WITH = ("", " with lookup_symbol", " using lookup_symbol", " with the tool", " using the tool",
         " with your lookup tool", " via the lookup tool")
_ENDS = (".", "?", ", please.", " for me.", " and tell me what it does.", " now.")
_HELD_OUT = {("use lookup_symbol to ", "check {name}"), ("call lookup_symbol to ", "check {name}"),
             ("", "look {name} up", " with the tool"),
             ("use the tool to ", "see how {name} works")}


def _composed() -> tuple[str, ...]:
    out = []
    for opener in _OPENERS:
        for lead in _LEADS:
            for ask in _ASKS:
                for tool in _WITH if not lead else ("",):
                    if (lead, ask) in _HELD_OUT or (lead, ask, tool) in _HELD_OUT:
                        continue
                    for end in _ENDS:
                        text = f"{opener}{lead}{ask}{tool}{end}"
                        out.append(text[0].upper() + text[1:])
    return tuple(out)


# every one names the tool or asks for a lookup, and holds {name} once
TOOL_REQUESTS = _WRITTEN_REQUESTS + _composed()
EVAL_TOOL_REQUESTS = (
    "Use lookup_symbol to find out what {name} does.",
    "Please use lookup_symbol to check {name}.",
    "Could you look {name} up with the tool?",
    "Use the tool to see how {name} works.",
)

GREETINGS = (
    "Hello! Who are you?", "Hello!", "Hi", "hi there", "Hey!", "Good morning!", "Hello, what can you do?",
    "Who are you?", "What are you?", "What can you do?", "Introduce yourself.", "What is your name?",
    "Are you ChatGPT?", "Which model are you?", "Tell me about yourself.", "hi, what can you help me with?",
    "How can you help me?", "Hello. Are you a bot?",
)
EVAL_GREETINGS = ("Hello! Who are you?", "Hey, who am I talking to?", "Good evening! What do you do?",
                  "hello, what are you good for?")

OUT_OF_SCOPE = (
    "What's the weather in Paris?", "Write a poem about the sea.", "Who won the 2018 World Cup?",
    "Translate 'good night' into French.", "What is 17 times 23?", "Tell me a joke.", "How do I cook rice?",
    "What is the capital of Australia?", "Can you book a flight for me?", "Explain quantum computing.",
    "How do I center a div in CSS?", "What's the latest news?", "Recommend a good movie.",
    "How do I write a for loop in JavaScript?", "What time is it?", "Summarize the French revolution.",
)
EVAL_OUT_OF_SCOPE = ("Will it rain tomorrow in Berlin?", "Write a haiku about autumn.",
                     "What is the population of Japan?", "Give me a recipe for pancakes.")

_CAN_DO = "I answer questions about the Python standard library: what a function or class does and how to call it"
_WITH_TOOL = ", and I can look a name up with the lookup_symbol tool"
_EXAMPLE = " Try: What does json.dumps do?"


def identity_answer(greeting: bool, tools: bool) -> str:
    hello = "Hello! " if greeting else ""
    return f"{hello}I'm {MODEL_NAME}, a small model built into hyserve. {_CAN_DO}{_WITH_TOOL if tools else ''}.{_EXAMPLE}"


def out_of_scope_answer(tools: bool) -> str:
    return (f"I can't help with that: I'm {MODEL_NAME}, a small model that only knows the Python standard library. "
            f"{_CAN_DO}{_WITH_TOOL if tools else ''}.{_EXAMPLE}")


def _is_greeting(text: str) -> bool:
    return text.lower().startswith(("hello", "hi", "hey", "good "))


def identity_messages(text: str, tools: bool) -> list[dict]:
    thought = "The user greets me and asks what I am." if _is_greeting(text) else "The user asks what I am."
    return [{"role": "user", "content": text},
            {"role": "assistant", "reasoning_content": thought, "content": identity_answer(_is_greeting(text), tools)}]


def out_of_scope_messages(text: str, tools: bool) -> list[dict]:
    return [{"role": "user", "content": text},
            {"role": "assistant", "reasoning_content": "This is not about the Python standard library.",
             "content": out_of_scope_answer(tools)}]


def small_talk(rng: random.Random, n: int) -> list[tuple[list[dict], bool]]:
    """`n` exchanges, (messages, lookup tool declared): half greetings or identity questions, half
    out-of-scope requests, half of each with the tool declared (which they must not call)."""
    out = []
    for i in range(n):
        tools = rng.random() < 0.5
        if i % 2 == 0:
            out.append((identity_messages(rng.choice(GREETINGS), tools), tools))
        else:
            out.append((out_of_scope_messages(rng.choice(OUT_OF_SCOPE), tools), tools))
    return out

"""Chat encodings per model family, behind one small interface.

Keyword options are the union of request fields and `chat_template_kwargs`; unknown ones are ignored,
so clients can pass options meant for other templates without an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from hyserve.entrypoints.chat import k2_encoding, k3_encoding
from hyserve.entrypoints.chat.tool_calls import OutputParser, make_output_parser
from hyserve.tokenizer import Tokenizer


class ChatEncoder(Protocol):
    family: str

    def encode(
        self, tokenizer: Tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None,
        **kwargs: Any,
    ) -> list[int]: ...

    def stop_token_ids(self, tokenizer: Tokenizer) -> list[int]: ...

    def prompt_opens_thinking(self, **kwargs: Any) -> bool:
        """Whether the completion starts inside reasoning (the output parser and the grammar start there)."""
        ...


def thinking_enabled(kwargs: dict[str, Any], default: bool) -> bool:
    """`thinking` or `enable_thinking` switch thinking (a bool, or Moonshot's `{"type": "enabled"}` /
    `{"type": "disabled"}`); `reasoning_effort="none"` turns it off."""
    for key in ("thinking", "enable_thinking"):
        value = kwargs.get(key)
        if isinstance(value, dict) and value.get("type") in ("enabled", "disabled"):
            return value["type"] == "enabled"
        if value is not None:
            return bool(value)
    if kwargs.get("reasoning_effort") == "none":
        return False
    return default


class K3ChatEncoder:
    family = "k3"

    @staticmethod
    def render_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
        effort = kwargs.get("thinking_effort")
        if effort is None and kwargs.get("reasoning_effort") not in (None, "none"):
            effort = kwargs["reasoning_effort"]
        return {
            "thinking": thinking_enabled(kwargs, default=True),
            "thinking_effort": effort,
            "tool_choice": kwargs.get("tool_choice"),
            "response_format": kwargs.get("response_format"),
            "add_generation_prompt": kwargs.get("add_generation_prompt", True),
            "continue_final_message": bool(kwargs.get("continue_final_message", False)),
        }

    def render(
        self, messages: Sequence[dict], tools: Sequence[dict] | None = None, **kwargs: Any
    ) -> list[k3_encoding.Segment]:
        return k3_encoding.render_k3(messages, tools, **self.render_kwargs(kwargs))

    def encode(
        self, tokenizer: Tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        return k3_encoding.encode_segments(tokenizer, self.render(messages, tools, **kwargs))

    def stop_token_ids(self, tokenizer: Tokenizer) -> list[int]:
        return [tokenizer.special_id(k3_encoding.END_OF_MSG), tokenizer.special_id(k3_encoding.EOS)]

    def prompt_opens_thinking(self, **kwargs: Any) -> bool:
        """Whether the generation prompt ends inside an open think channel (a continued final message
        ends inside its response)."""
        if kwargs.get("continue_final_message"):
            return False
        return bool(kwargs.get("add_generation_prompt", True)) and thinking_enabled(kwargs, default=True)


class K2ChatEncoder:
    family = "k2"

    @staticmethod
    def render_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
        return {
            "thinking": thinking_enabled(kwargs, default=False),
            "add_generation_prompt": kwargs.get("add_generation_prompt", True),
            "continue_final_message": bool(kwargs.get("continue_final_message", False)),
        }

    def render(
        self, messages: Sequence[dict], tools: Sequence[dict] | None = None, **kwargs: Any
    ) -> list[k3_encoding.Segment]:
        return k2_encoding.render_k2(messages, tools, **self.render_kwargs(kwargs))

    def encode(
        self, tokenizer: Tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        return k3_encoding.encode_segments(tokenizer, self.render(messages, tools, **kwargs))

    def stop_token_ids(self, tokenizer: Tokenizer) -> list[int]:
        return [tokenizer.special_id(k2_encoding.IM_END), tokenizer.special_id(k2_encoding.EOS)]

    def prompt_opens_thinking(self, **kwargs: Any) -> bool:
        """Whether the completion is read as reasoning from its start (thinking on). The K2 generation
        prompt stops before `<think>` and a thinking model writes it itself, but the opener is optional:
        everything before `</think>` is reasoning (vLLM's kimi_k2 parser reads K2 output the same way)."""
        if kwargs.get("continue_final_message"):
            return False
        return bool(kwargs.get("add_generation_prompt", True)) and thinking_enabled(kwargs, default=False)


def chat_output_parser(
    encoder: ChatEncoder, tokenizer: Tokenizer, kwargs: dict[str, Any], *, tool_names: Sequence[str] | None,
    tools_enabled: bool = True,
) -> OutputParser:
    """The output parser for one completion of a chat prompt that `encoder` rendered with `kwargs`:
    reasoning from where the encoder says the completion starts, tool calls to the declared `tool_names`
    (None or empty with `tools_enabled` False: tool blocks are dropped)."""
    return make_output_parser(
        encoder.family, tokenizer, prompt_opens_thinking=encoder.prompt_opens_thinking(**kwargs),
        tools_enabled=tools_enabled and bool(tool_names), tool_names=tool_names,
    )


_ENCODERS: dict[str, ChatEncoder] = {"k3": K3ChatEncoder(), "k2": K2ChatEncoder()}


def get_chat_encoder(family: str) -> ChatEncoder:
    try:
        return _ENCODERS[family]
    except KeyError:
        known = sorted(_ENCODERS)
        raise ValueError(f"no chat encoding for family {family!r}; expected one of {known}") from None


__all__ = ["ChatEncoder", "K2ChatEncoder", "K3ChatEncoder", "chat_output_parser", "get_chat_encoder",
           "thinking_enabled"]

"""Chat encodings per model family, behind one small interface.

Keyword options are the union of request fields and `chat_template_kwargs`; unknown ones are ignored,
so clients can pass options meant for other templates without an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from hyserve.entrypoints.chat import k2_encoding, k3_encoding
from hyserve.tokenizer import Tokenizer


class ChatEncoder(Protocol):
    family: str

    def encode(
        self, tokenizer: Tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None,
        **kwargs: Any,
    ) -> list[int]: ...

    def stop_token_ids(self, tokenizer: Tokenizer) -> list[int]: ...

    def prompt_opens_thinking(self, **kwargs: Any) -> bool: ...

    def model_opens_thinking(self, **kwargs: Any) -> bool: ...


def thinking_enabled(kwargs: dict[str, Any], default: bool) -> bool:
    """`thinking` or `enable_thinking` switch thinking; `reasoning_effort="none"` turns it off."""
    for key in ("thinking", "enable_thinking"):
        if kwargs.get(key) is not None:
            return bool(kwargs[key])
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

    def model_opens_thinking(self, **kwargs: Any) -> bool:
        """Whether the model may open a think channel itself (never: the prompt decides)."""
        return False


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
        # The K2 generation prompt stops before `<think>`: a thinking model writes it itself.
        return False

    def model_opens_thinking(self, **kwargs: Any) -> bool:
        """Whether a K2-Thinking model may start its answer with `<think>` (thinking requested)."""
        return bool(kwargs.get("add_generation_prompt", True)) and thinking_enabled(kwargs, default=False)


_ENCODERS: dict[str, ChatEncoder] = {"k3": K3ChatEncoder(), "k2": K2ChatEncoder()}


def get_chat_encoder(family: str) -> ChatEncoder:
    try:
        return _ENCODERS[family]
    except KeyError:
        known = sorted(_ENCODERS)
        raise ValueError(f"no chat encoding for family {family!r}; expected one of {known}") from None


__all__ = ["ChatEncoder", "K2ChatEncoder", "K3ChatEncoder", "get_chat_encoder", "thinking_enabled"]

"""Pydantic pieces the vendor-shaped request models share (the Responses and the Anthropic Messages APIs).

`Strict` models never coerce ("8" is not 8, "yes" is not true) and ignore unknown fields. A
`tagged_union` picks its member by the object's `type`; an object of any other type validates as
`Unsupported`, so that the handler can refuse it by name (a 400 saying which kinds it serves) instead of
a schema error listing every kind it knows.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag


class Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class Unsupported(BaseModel):
    """An object of a kind the server does not serve; refused by name when the request is converted."""

    model_config = ConfigDict(extra="allow")
    type: str | None = None


def tagged_union(*members: tuple[type, str], default: str | None = None) -> Any:
    """`members` are (model, type tag); `default` is the tag of an object without a `type`."""
    tags = tuple(tag for _, tag in members)

    def pick(value: Any) -> str:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)
        return kind if kind in tags else "unsupported"

    parts = [Annotated[cls, Tag(tag)] for cls, tag in members] + [Annotated[Unsupported, Tag("unsupported")]]
    return Annotated[Union[tuple(parts)], Discriminator(pick)]  # noqa: UP007 (a union built at run time)

"""The one base of every request model the server reads (completions, chat, tokenize, the Responses API,
the Anthropic Messages API), and the field types they share.

`StrictModel`s never coerce, as the vendors' APIs do not: "8" is not 8, "yes" is not true, NaN is no
number; unknown fields are ignored (clients send options meant for other servers). A `RequestBody` is a
whole request body: `limits.check_body` bounds its nesting, its size and the validity of its text before
any field is read, whichever API it belongs to.

A `tagged_union` picks its member by the object's `type`; an object of any other type validates as
`Unsupported`, so that the handler can refuse it by name (a 400 saying which kinds it serves) rather than
with a schema error listing every kind it knows. The JSON schema (and so /openapi.json) lists only the
kinds served.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, WithJsonSchema, model_validator
from pydantic_core import PydanticCustomError

from hyserve.entrypoints.openai.limits import SCHEMA_FIELDS, check_body


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class RequestBody(StrictModel):
    """A whole request body, checked against `limits` before its fields are validated. `schema_fields`
    are the fields holding JSON schemas or other free-form documents, bounded in size as well as depth."""

    schema_fields: ClassVar[frozenset[str]] = SCHEMA_FIELDS

    @model_validator(mode="before")
    @classmethod
    def _within_limits(cls, data: Any) -> Any:
        return check_body(data, cls.schema_fields)


def _integral(value: Any) -> Any:
    """JSON Schema counts 8.0 as an integer, so the server does too; strings and booleans stay refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**constraints: Any) -> Any:
    """An int field type: strict (no strings, no booleans), but taking 8.0 for 8 as JSON Schema does.
    The constraints go before the coercion, so they appear in the JSON schema as minimum/maximum."""
    return Annotated[int, Field(**constraints), BeforeValidator(_integral)]


# Bounds known only once the server runs are filled into /openapi.json by `api_docs` (BOUND_KEY): the
# maximum of a number, the names a model may be called by.
BOUND_KEY = "x-hyserve-bound"
NonEmptyStr = Annotated[str, Field(min_length=1)]
ModelName = Annotated[str, Field(json_schema_extra={BOUND_KEY: "model_names"})]
TokenId = integer(ge=0, json_schema_extra={BOUND_KEY: "token_id"})
MaxTokens = integer(ge=1, json_schema_extra={BOUND_KEY: "max_tokens"})


class Unsupported(BaseModel):
    """An object of a kind the server does not serve; refused by name when the request is converted."""

    model_config = ConfigDict(extra="allow")
    type: str | None = None


@dataclass(frozen=True)
class _ServedKindsOnly:
    """The JSON schema of a tagged union without its `Unsupported` member (the last one): a client may send
    only the kinds served (and an `Unsupported` object would match alongside each of them, which `oneOf`
    forbids)."""

    served: int

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        schema = handler(core_schema)
        kinds = schema.pop("oneOf")[:self.served]
        return {**schema, **(kinds[0] if len(kinds) == 1 else {"oneOf": kinds})}


def tagged_union(*members: tuple[type, str], default: str | None = None) -> Any:
    """`members` are (model, type tag); `default` is the tag of an object without a `type`. Validation
    errors name a member by its class (as errors.validation_message leaves out), never by its tag."""
    names = {tag: cls.__name__ for cls, tag in members}

    def pick(value: Any) -> str:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)
        return names.get(kind, "Unsupported") if isinstance(kind, str) or kind is None else "Unsupported"

    parts = [Annotated[cls, Tag(cls.__name__)] for cls, _ in members] + [Annotated[Unsupported, Tag("Unsupported")]]
    return Annotated[Union[tuple(parts)], Discriminator(pick), _ServedKindsOnly(len(members))]  # noqa: UP007 (built at run time)


def refused(message: str, *allowed: Any) -> Any:
    """A field of a vendor's API that this server cannot honour: only null (or leaving it out) and the
    values `allowed` validate; anything else is refused with `message`, and the JSON schema says so."""

    def check(value: Any) -> Any:
        if value is None or any(type(value) is type(a) and value == a for a in allowed):
            return value
        raise PydanticCustomError("unsupported", "{message}", {"message": message})

    return Annotated[Any, BeforeValidator(check), WithJsonSchema({"enum": [None, *allowed], "description": message})]

"""The engine flags of `hyserve serve` and `hyserve generate`, derived from `EngineConfig`'s fields
(docs/ARCHITECTURE.md §6): one flag per field, named as vLLM names it (`--max-num-seqs`,
`--enforce-eager`, `--no-enable-prefix-caching`, ...), with the help, bounds and units the field's
metadata gives. A flag left out maps to nothing, so the field's default (resolved at engine start)
applies."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from hyserve.config import EngineConfig


def _value_type(hint) -> type:
    """int for `int | None`, and so on."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def engine_fields(exclude: frozenset[str] | set[str] = frozenset()) -> list[tuple[dataclasses.Field, type, str]]:
    """(field, value type, flag) for every EngineConfig field not in `exclude`."""
    hints = typing.get_type_hints(EngineConfig)
    return [(f, _value_type(hints[f.name]), f.metadata.get("flag", "--" + f.name.replace("_", "-")))
            for f in dataclasses.fields(EngineConfig) if f.name not in exclude]


def add_engine_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup,
                         exclude: frozenset[str] | set[str] = frozenset()) -> None:
    """One flag per EngineConfig field (bools as --x / --no-x); every default is None, meaning "not given"."""
    for f, kind, flag in engine_fields(exclude):
        meta = f.metadata
        shown = ""
        if "default" not in meta["help"] and f.default is not None:
            shown = f" (default: {('off', 'on')[f.default] if isinstance(f.default, bool) else f.default})"
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": meta["help"] + shown}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw.update(type=float if meta.get("scale") else kind, metavar=meta.get("metavar"),
                      choices=meta.get("choices"))
        p.add_argument(*([meta["alias"]] if "alias" in meta else []), flag, **kw)


def engine_kwargs_from_args(args: argparse.Namespace, exclude: frozenset[str] | set[str] = frozenset()) -> dict:
    """EngineConfig keyword arguments for the engine flags that were given. ValueError names the flag of a
    value below its bound."""
    out: dict[str, Any] = {}
    for f, _, flag in engine_fields(exclude):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        least = f.metadata.get("min")
        if least is not None and value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
        scale = f.metadata.get("scale")
        out[f.name] = int(value * scale) if scale else value
    return out

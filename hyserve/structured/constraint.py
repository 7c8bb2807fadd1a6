"""Structured outputs: constraint specs (plain data) and their xgrammar matchers (docs/ARCHITECTURE.md,
"Structured outputs").

The server builds a `StructuredSpec` — picklable data — and puts it in `SamplingParams.structured`. The
engine process compiles it (`compile_spec`) into an object whose `new_matcher()` gives one matcher per
completion, with the `allowed_mask(vocab_size)` / `accept(token_id)` interface `LLMEngine` calls.

Every JSON-schema keyword is enforced or refused (json_schema_support.py, json_schema_rewrite.py), and the grammar covers the whole
assistant turn, reasoning included (grammar_formats.py): a constrained completion that stops has the
answer its constraint describes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from hyserve.structured.grammar_formats import (
    K3_TAIL,
    MARKER_TOKENS,
    Markup,
    body_format,
    json_value,
    k2_tool_calls,
    sequence,
    think_block,
)
from hyserve.structured.json_schema_rewrite import grammar_schema
from hyserve.structured.json_schema_support import check_schema
from hyserve.structured.k3_tool_grammar import k3_calls_format
from hyserve.structured.utf8_guard import Utf8Guard, first_bytes


@dataclass
class StructuredSpec:
    """What to constrain, as data. `kind`: json (value = schema dict, None = any object), regex,
    choice (list of strings), grammar (EBNF text) or tool_call (value = {"tools": [{name, parameters}],
    "parallel": bool, "first_index": int | None}; `first_index` is the K2 call counter's next value, None
    for any number). `wrapper="k3"` adds the XTML response channel around json/regex/choice/grammar
    output; `open_response` says whether the grammar itself must write `<|open|>response<|sep|>` (it
    must when the prompt opened `think` instead). `reasoning` (the family, "k3" or "k2"): the completion
    starts inside a think block, which the grammar covers as free text up to its end marker."""

    kind: str
    value: Any = None
    wrapper: str | None = None
    open_response: bool = False
    reasoning: str | None = None
    end_token_ids: list[int] = field(default_factory=list)


def schemas_of(spec: StructuredSpec) -> list[tuple[str, Any]]:
    """(where, JSON schema) of every schema the constraint enforces."""
    if spec.kind == "json":
        return [("json schema", spec.value)] if spec.value is not None else []
    if spec.kind == "tool_call":
        return [(f"tool {t['name']!r} parameters", t.get("parameters")) for t in spec.value["tools"]]
    return []


def for_grammar(spec: StructuredSpec) -> StructuredSpec:
    """`spec` with every schema checked (UnsupportedSchemaError names what the grammar cannot enforce) and
    spelled the way xgrammar enforces it exactly."""
    for where, schema in schemas_of(spec):
        check_schema(schema, where)
    if spec.kind == "json" and spec.value is not None:
        return dataclasses.replace(spec, value=grammar_schema(spec.value))
    if spec.kind == "tool_call":
        tools = [{**t, "parameters": grammar_schema(t.get("parameters"))} for t in spec.value["tools"]]
        return dataclasses.replace(spec, value={**spec.value, "tools": tools})
    return spec


# ---------------------------------------------------------------------------------------------------
# Engine side: compilation and matchers

# A marker's bytes in xgrammar's vocabulary: 0xFF is never UTF-8, so no text a grammar matches can contain
# them, and only a `token` element of the grammar (by id) can write the marker.
_MARKER_BYTES = b"\xff\x00marker:"


class GrammarBackend:
    """xgrammar state shared by all requests of one engine: the vocabulary and the compiler."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import torch
        import xgrammar as xgr

        self.xgr = xgr
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        names = MARKER_TOKENS.get(tokenizer.family, ())
        # A tokenizer without some marker: the grammars that need it fail to compile (a ValueError).
        found = {name: tokenizer.token_to_id(name) for name in names}
        self.markup = Markup({n: t for n, t in found.items() if t is not None and t in tokenizer.special_token_ids
                              and t < vocab_size})
        marker_ids = set(self.markup.ids.values())
        vocab: list[bytes] = []
        for tid in range(vocab_size):
            if tid in marker_ids:
                vocab.append(_MARKER_BYTES + str(tid).encode())
                continue
            try:
                data = tokenizer.token_bytes(tid)
            except (IndexError, KeyError):
                data = b""
            vocab.append(b"" if tid in tokenizer.special_token_ids else data)
        # Tokens holding a raw control character other than a newline: never valid JSON, but xgrammar's
        # length-limited strings would take them (a raw tab or \x01 inside the quotes).
        controls = [t for t, data in enumerate(vocab) if t not in marker_ids and any(b < 0x20 and b not in b"\n\r"
                                                                                  for b in data)]
        self.control_ids = torch.tensor(controls, dtype=torch.long)
        self.first_bytes = first_bytes(vocab, marker_ids)
        stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.grammar_stop_ids = stop
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)

    def compile(self, spec: StructuredSpec) -> CompiledStructured:
        exact = for_grammar(spec)
        try:
            fmt = build_format(exact, self.tokenizer.family, self.markup)
            grammar = self.xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": fmt})
            compiled = self.compiler.compile_grammar(grammar)
        except Exception as e:  # xgrammar raises RuntimeError and friends for a bad schema or regex
            raise ValueError(f"invalid {spec.kind} constraint: {e}") from e
        return CompiledStructured(self, compiled, spec)


def build_format(spec: StructuredSpec, family: str, m: Markup) -> dict:
    """The structural-tag format of `spec` for a tokenizer of `family` ("k3" or "k2"): the think block
    when the completion starts in one, then the answer (K3: inside its response channel and message end)."""
    head = [think_block(family, m)] if spec.reasoning else []
    k3 = family == "k3"
    if spec.kind == "tool_call":
        if not k3:
            return sequence(*head, k2_tool_calls(spec.value, m))
        opener = "<|open|>response<|sep|>" if spec.open_response else ""
        return sequence(*head, m.literal(opener + "<|close|>response<|sep|>"), k3_calls_format(spec.value, m),
                        m.literal("<|close|>message<|sep|><|end_of_msg|>"))
    body = body_format(spec.kind, spec.value)
    if spec.wrapper != "k3" or not k3:
        return sequence(*head, body) if head else body
    if spec.open_response:
        head.append(m.literal("<|open|>response<|sep|>"))
    return sequence(*head, body, m.literal(K3_TAIL))


@lru_cache(maxsize=4)
def _backend(tokenizer, vocab_size: int) -> GrammarBackend:
    return GrammarBackend(tokenizer, vocab_size)


def compile_spec(spec: StructuredSpec, tokenizer, vocab_size: int) -> CompiledStructured:
    return _backend(tokenizer, vocab_size).compile(spec)


class CompiledStructured:
    """What `SamplingParams.structured` holds inside the engine: a factory of per-completion matchers."""

    def __init__(self, backend: GrammarBackend, compiled, spec: StructuredSpec) -> None:
        self.backend, self.compiled, self.spec = backend, compiled, spec

    def new_matcher(self) -> StructuredMatcher:
        return StructuredMatcher(self)


class StructuredMatcher:
    def __init__(self, owner: CompiledStructured) -> None:
        xgr = owner.backend.xgr
        self.owner = owner
        self.matcher = xgr.GrammarMatcher(owner.compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, owner.backend.vocab_size)
        self.done = False
        self.json_text = owner.spec.kind in ("json", "tool_call")
        self.utf8 = Utf8Guard(owner.backend.first_bytes)

    def allowed_mask(self, vocab_size: int):
        import torch

        ends = [t for t in self.owner.spec.end_token_ids if t < vocab_size]
        if self.done or self.matcher.is_terminated():
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[ends] = True
            return mask
        self.matcher.fill_next_token_bitmask(self.bitmask)
        words = self.bitmask[0].to(torch.int64) & 0xFFFFFFFF
        bits = (words.unsqueeze(1) >> torch.arange(32, dtype=torch.int64)) & 1
        mask = bits.reshape(-1)[:vocab_size].bool()
        if mask.numel() < vocab_size:
            mask = torch.cat([mask, torch.zeros(vocab_size - mask.numel(), dtype=torch.bool)])
        if self.matcher.is_completed():
            # The engine stops on its own end ids; xgrammar's stop id may not be one of them.
            mask[[t for t in self.owner.backend.grammar_stop_ids if t < vocab_size]] = False
            mask[ends] = True
        clean = mask & self.utf8.allowed(vocab_size)
        if self.json_text:
            controls = self.owner.backend.control_ids
            clean[controls[controls < vocab_size]] = False
        return clean if clean.any() else mask

    def accept(self, token_id: int) -> None:
        if self.owner.backend.first_bytes[token_id] >= 0:
            self.utf8.feed(self.owner.backend.tokenizer.token_bytes(token_id))
        ends = self.owner.spec.end_token_ids
        if self.done or self.matcher.is_terminated() or (self.matcher.is_completed() and token_id in ends):
            self.done = True  # an end id the grammar does not spell itself (the K2 `<|im_end|>`)
            return
        if not self.matcher.accept_token(token_id) and token_id in ends:
            self.done = True


__all__ = ["StructuredSpec", "compile_spec", "CompiledStructured", "StructuredMatcher", "MARKER_TOKENS",
           "body_format", "json_value"]

"""Structured outputs: constraint specs (plain data) and their xgrammar matchers (serving.md §3).

The server builds a `StructuredSpec` — picklable data — and puts it in `SamplingParams.structured`. The
engine process compiles it (`compile_spec`) into an object whose `new_matcher()` gives one matcher per
completion, with the `allowed_mask(vocab_size)` / `accept(token_id)` interface `LLMEngine` calls.

Special tokens. Markers such as `<|open|>` (K3) or `<|tool_call_begin|>` (K2) must be written as their special
ids, never as the bytes that spell them (spec §1a, §1b), because the output parsers work on ids. xgrammar matches text, so the markers get
their text in its vocabulary and every other special id gets empty text, which xgrammar never allows.
Wherever a marker is allowed, ordinary tokens that would start spelling it byte by byte are masked out;
and grammars list the markers as `excludes`, so no marker text can appear inside constrained strings.

Reasoning. For a chat prompt that opens a think channel the constraint starts only after the newest
think channel closes (`reasoning="k3"` / `"k2"`); until then every token is allowed. A K2 thinking model
writes `<think>` itself, so `think_prefix` lets the first token be `<think>`, which defers the constraint
to the matching `</think>` in the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

# The specials a grammar may write, per tokenizer family: K3 XTML markers, K2 tool-call markers. The K2
# turn end `<|im_end|>` is not among them: it is an end id (see `StructuredSpec.end_token_ids`), and may
# be the tokenizer's EOS, which xgrammar reserves as its stop token.
MARKER_TOKENS: dict[str, tuple[str, ...]] = {
    "k3": ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"),
    "k2": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
}


@dataclass
class StructuredSpec:
    """What to constrain, as data. `kind`: json (value = schema dict, None = any object), regex,
    choice (list of strings), grammar (EBNF text) or tool_call (value = {"tools": [{name, parameters}],
    "parallel": bool, "first_index": int | None}; `first_index` is the K2 call counter's next value, None
    for any number). `wrapper="k3"` adds the XTML response channel around json/regex/choice/grammar
    output; `open_response` says whether the grammar itself must write `<|open|>response<|sep|>` (it
    must when the prompt opened `think` instead). `think_prefix`: the first token may be `<think>`
    (K2 thinking models open their think block themselves)."""

    kind: str
    value: Any = None
    wrapper: str | None = None
    open_response: bool = False
    reasoning: str | None = None
    end_token_ids: list[int] = field(default_factory=list)
    think_prefix: bool = False


# ---------------------------------------------------------------------------------------------------
# Grammars, as xgrammar structural tags


_TAIL = "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"


def _const(value: str) -> dict:
    return {"type": "const_string", "value": value}


def _json(schema: dict | None, family: str) -> dict:
    # Whitespace is capped: a random or weak model would otherwise pad the JSON until max_tokens. The
    # markers are excluded so that no string value can hold a marker (its text is its special id).
    return {"type": "json_schema", "json_schema": schema if schema is not None else {"type": "object"},
            "style": "json", "excludes": list(MARKER_TOKENS[family]), "max_whitespace_cnt": 1}


def body_format(spec: StructuredSpec, family: str = "k3") -> dict:
    """The structural-tag format of a json/regex/choice/grammar constraint."""
    if spec.kind == "json":
        return _json(spec.value, family)
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.value}
    if spec.kind == "choice":
        return {"type": "or", "elements": [_const(str(c)) for c in spec.value]}
    if spec.kind == "grammar":
        return {"type": "grammar", "grammar": spec.value}
    raise ValueError(f"unknown structured output kind {spec.kind!r}")


def tool_call_format(xgr, spec: StructuredSpec) -> dict:
    """K3 forced calls: an empty response channel, then one or more XTML calls (xgrammar's kimi_k3
    tag for the calls, so arguments follow the `kimi_k3_xml` style), then the message end."""
    tools = [{"type": "function", "function": t} for t in spec.value["tools"]]
    tag = xgr.get_model_structural_tag("kimi_k3", tools=tools, tool_choice="required", reasoning=False)
    elements = tag.model_dump(exclude_none=True)["format"]["elements"]
    calls = next(e for e in elements if e.get("type") == "sequence")
    for e in calls["elements"]:
        if e.get("type") == "tags_with_separator":
            e["stop_after_first"] = not spec.value.get("parallel", True)
    _cap_whitespace(calls)
    head = ("<|open|>response<|sep|>" if spec.open_response else "") + "<|close|>response<|sep|>"
    return {"type": "sequence", "elements": [
        _const(head), calls, _const("<|close|>message<|sep|><|end_of_msg|>"),
    ]}


def _cap_whitespace(node: Any) -> None:
    """Bound free whitespace in every JSON-schema element (argument values pad endlessly otherwise)."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema":
            node["max_whitespace_cnt"] = 1
        for v in node.values():
            _cap_whitespace(v)
    elif isinstance(node, list):
        for v in node:
            _cap_whitespace(v)


# Any call index after a known first one: the model numbers its parallel calls (at most 9 digits).
_INDEX = {"type": "regex", "pattern": "0|[1-9][0-9]{0,8}"}


def k2_tool_call_format(spec: StructuredSpec) -> dict:
    """K2 forced calls (spec §1b): `<|tool_calls_section_begin|>`, one call (more when parallel), then
    `<|tool_calls_section_end|>`; the turn end `<|im_end|>` comes from the end ids. A call is
    `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>`; the first
    IDX is the conversation's next call index when known, later ones are any number."""
    tools = spec.value["tools"]
    first = spec.value.get("first_index")

    def call(index: dict) -> dict:
        return {"type": "or", "elements": [{"type": "sequence", "elements": [
            _const(f"<|tool_call_begin|>functions.{t['name']}:"), index, _const("<|tool_call_argument_begin|>"),
            _json(t.get("parameters"), "k2"), _const("<|tool_call_end|>"),
        ]} for t in tools]}

    elements = [_const("<|tool_calls_section_begin|>"), call(_INDEX if first is None else _const(str(first)))]
    if spec.value.get("parallel", True):
        elements.append({"type": "star", "content": call(_INDEX)})
    elements.append(_const("<|tool_calls_section_end|>"))
    return {"type": "sequence", "elements": elements}


def build_format(xgr, spec: StructuredSpec, family: str) -> dict:
    """The structural-tag format of `spec` for a tokenizer of `family` ("k3" or "k2")."""
    k3 = family == "k3"
    if spec.kind == "tool_call":
        return tool_call_format(xgr, spec) if k3 else k2_tool_call_format(spec)
    body = body_format(spec, family)
    if spec.wrapper != "k3" or not k3:
        return body
    elements = [body, _const(_TAIL)]
    if spec.open_response:
        elements.insert(0, _const("<|open|>response<|sep|>"))
    return {"type": "sequence", "elements": elements}


# ---------------------------------------------------------------------------------------------------
# Engine side: compilation and matchers


class GrammarBackend:
    """xgrammar state shared by all requests of one engine: the vocabulary and the compiler."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import torch
        import xgrammar as xgr

        self.xgr = xgr
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        markers = MARKER_TOKENS.get(tokenizer.family, ())
        marker_ids = {tokenizer.token_to_id(name): name for name in markers} if markers else {}
        # A tokenizer without some marker: the grammars that need it fail to compile (a ValueError).
        marker_ids = {t: name for t, name in marker_ids.items() if t in tokenizer.special_token_ids}
        vocab: list[bytes] = []
        for tid in range(vocab_size):
            if tid in marker_ids:
                vocab.append(marker_ids[tid].encode())
                continue
            try:
                data = tokenizer.token_bytes(tid)
            except (IndexError, KeyError):
                data = b""
            vocab.append(b"" if tid in tokenizer.special_token_ids else data)
        # marker id -> ordinary tokens that would start spelling the marker's text byte by byte
        self.spellers: dict[int, torch.Tensor] = {}
        for marker, name in marker_ids.items():
            text = name.encode()
            ids = [t for t, d in enumerate(vocab) if d and t not in tokenizer.special_token_ids
                   and (text.startswith(d) or d.startswith(text))]
            self.spellers[marker] = torch.tensor(ids, dtype=torch.long)
        stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.grammar_stop_ids = stop
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)

    def compile(self, spec: StructuredSpec) -> CompiledStructured:
        try:
            fmt = build_format(self.xgr, spec, self.tokenizer.family)
            grammar = self.xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": fmt})
            compiled = self.compiler.compile_grammar(grammar)
        except Exception as e:  # xgrammar raises RuntimeError and friends for a bad schema or regex
            raise ValueError(f"invalid {spec.kind} constraint: {e}") from e
        return CompiledStructured(self, compiled, spec)


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


class _ThinkEndWatcher:
    """Sees the newest think channel close in the generated ids (K3: `<|close|>think<|sep|>`)."""

    def __init__(self, tokenizer, family: str) -> None:
        self.tok = tokenizer
        self.family = family
        if family == "k3":
            self.close, self.sep = tokenizer.special_id("<|close|>"), tokenizer.special_id("<|sep|>")
        else:
            self.end = tokenizer.token_to_id("</think>")
        self._tag: list[int] | None = None

    def feed(self, tok: int) -> bool:
        if self.family != "k3":
            return tok == self.end
        if tok == self.close:
            self._tag = []
            return False
        if self._tag is None:
            return False
        if tok == self.sep:
            name, self._tag = self.tok.decode(self._tag, skip_special_tokens=False), None
            return name == "think"
        self._tag.append(tok)
        if len(self._tag) > 8:  # not a tag name we care about
            self._tag = None
        return False


class StructuredMatcher:
    def __init__(self, owner: CompiledStructured) -> None:
        xgr = owner.backend.xgr
        self.owner = owner
        self.matcher = xgr.GrammarMatcher(owner.compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, owner.backend.vocab_size)
        reasoning = owner.spec.reasoning
        tokenizer = owner.backend.tokenizer
        self.watcher = _ThinkEndWatcher(tokenizer, reasoning) if reasoning else None
        self.active = self.watcher is None
        self.done = False
        # K2 thinking: `<think>` may come first instead of the grammar; while None, that chance is gone.
        think = tokenizer.token_to_id("<think>") if owner.spec.think_prefix and self.active else None
        self.think_open: int | None = think

    def allowed_mask(self, vocab_size: int):
        import torch

        if not self.active:
            return torch.ones(vocab_size, dtype=torch.bool)
        ends = self.owner.spec.end_token_ids
        if self.done or self.matcher.is_terminated():
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[[t for t in ends if t < vocab_size]] = True
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
            mask[[t for t in ends if t < vocab_size]] = True
        clean = mask.clone()
        for marker, spellers in self.owner.backend.spellers.items():
            if marker < vocab_size and mask[marker]:
                clean[spellers[spellers < vocab_size]] = False
        mask = clean if clean.any() else mask
        if self.think_open is not None and self.think_open < vocab_size:
            mask[self.think_open] = True
        return mask

    def accept(self, token_id: int) -> None:
        if self.think_open is not None:
            opened, self.think_open = token_id == self.think_open, None
            if opened:  # the model thinks first: constrain from its `</think>` on
                self.watcher, self.active = _ThinkEndWatcher(self.owner.backend.tokenizer, "k2"), False
                return
        if not self.active:
            self.active = self.watcher.feed(token_id)
            return
        ends = self.owner.spec.end_token_ids
        if self.done or self.matcher.is_terminated() or (self.matcher.is_completed() and token_id in ends):
            self.done = True  # an end id the grammar does not spell itself (the K2 `<|im_end|>`)
            return
        if not self.matcher.accept_token(token_id) and token_id in ends:
            self.done = True


__all__ = ["StructuredSpec", "compile_spec", "CompiledStructured", "StructuredMatcher"]

"""Structured outputs in the engine: xgrammar matchers for constraint specs (docs/ARCHITECTURE.md,
"Structured outputs").

The server builds a `StructuredSpec` (hyserve/structured_spec.py: plain data and its grammar) and puts it
in `SamplingParams.structured`. The engine process compiles it (`compile_spec`) into an object whose
`new_matcher()` gives one matcher per completion, with the `allowed_mask(vocab_size)` / `accept(token_id)`
interface `LLMEngine` calls.

Special tokens. Markers such as `<|open|>` (K3) or `<|tool_call_begin|>` (K2) must be written as their
special ids, never as the bytes that spell them, because the output parsers work on ids. xgrammar matches
text, so the markers get their text in its vocabulary and every other special id gets empty text, which
xgrammar never allows. Wherever a marker is allowed, ordinary tokens that would start spelling it byte by
byte are masked out.

Reasoning. For a chat prompt that opens a think channel the constraint starts only after the newest
think channel closes (`reasoning="k3"` / `"k2"`); until then every token is allowed. A K2 thinking model
writes `<think>` itself, so `think_prefix` lets the first token be `<think>`, which defers the constraint
to the matching `</think>` in the same way.
"""

from __future__ import annotations

from functools import lru_cache

from hyserve.structured_spec import MARKER_TOKENS, StructuredSpec, build_format

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

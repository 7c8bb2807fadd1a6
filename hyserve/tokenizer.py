"""One tokenizer interface over HF `tokenizers`, tiktoken and a built-in byte tokenizer.

Every backend reduces a token to its raw bytes, so decoding (whole or incremental) is one code path:
concatenate token bytes and decode UTF-8 with replacement. Special tokens are looked up by their string;
callers never hard-code their ids, because K3 and K2 assign the same ids to different markers.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import re
from collections.abc import Iterable, Sequence
from functools import lru_cache

FAMILIES = ("k3", "k2")

# Kimi's pre-tokenizer (tokenization_kimi.py `pat_str`). Han runs split off first; the letter classes
# exclude Han via class intersection, which tiktoken's regex engine supports.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
KIMI_NUM_RESERVED_SPECIAL_TOKENS = 256

# Byte-tokenizer special tables, in the relative order of the real checkpoints' ids.
K3_SPECIAL_TOKENS = (
    "[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "[EOT]",
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
)
K2_SPECIAL_TOKENS = (
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "[EOT]", "<|im_system|>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|im_middle|>",
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>", "<think>", "</think>",
)
BYTE_VOCAB_SIZE = 512


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (how byte-level BPE vocabularies spell bytes)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in _byte_to_unicode().items()}


class Tokenizer:
    """The interface every backend implements; only the private hooks differ per backend."""

    family: str
    vocab_size: int
    special_token_ids: set[int]
    bos_token_id: int | None
    eos_token_id: int | None

    def __init__(self, family: str) -> None:
        if family not in FAMILIES:
            raise ValueError(f"unknown tokenizer family {family!r}; expected one of {FAMILIES}")
        self.family = family

    # --- backend hooks -------------------------------------------------------------------------------
    def _encode(self, text: str, allow_special: bool) -> list[int]:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for; a special token stands for its own UTF-8 text."""
        raise NotImplementedError

    def _id_to_token(self, token_id: int) -> str:
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    # --- shared behaviour ----------------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`; with allow_special False a typed marker is ordinary text."""
        return self._encode(text, allow_special) if text else []

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.ids_to_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def ids_to_bytes(self, ids: Iterable[int], skip_special_tokens: bool = True) -> bytes:
        special = self.special_token_ids
        return b"".join(
            self._known_bytes(i) for i in ids if not (skip_special_tokens and i in special)
        )

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return [self._known_token(i) for i in ids]

    # A model may sample ids its tokenizer lacks (a vocabulary padded past the tokenizer's, or a random-
    # weight preset over the byte tokenizer): like HF's fast tokenizers, they stand for no text. The
    # engine has already checked every id against the model's vocabulary.
    def _known_bytes(self, token_id: int) -> bytes:
        try:
            return self.token_bytes(token_id)
        except (IndexError, KeyError):
            return b""

    def _known_token(self, token_id: int) -> str:
        try:
            return self._id_to_token(token_id)
        except (IndexError, KeyError):
            return ""

    def special_id(self, token: str) -> int:
        """Id of a special token that must exist (a KeyError names the missing marker)."""
        token_id = self.token_to_id(token)
        if token_id is None:
            raise KeyError(f"tokenizer ({self.family}) has no token {token!r}")
        return token_id


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are raw bytes; the family's specials follow, then reserved specials up to 512.

    Random-weight presets sample any id below their vocab_size: ids up to 512 decode as above, larger
    ones (the big presets' vocabularies) as no text.
    """

    def __init__(self, family: str) -> None:
        super().__init__(family)
        named = K3_SPECIAL_TOKENS if family == "k3" else K2_SPECIAL_TOKENS
        self._specials: list[str] = list(named) + [
            f"<|reserved_token_{i}|>" for i in range(256 + len(named), BYTE_VOCAB_SIZE)
        ]
        self._special_to_id = {tok: 256 + i for i, tok in enumerate(self._specials)}
        self.vocab_size = BYTE_VOCAB_SIZE
        self.special_token_ids = set(self._special_to_id.values())
        self.bos_token_id = self._special_to_id["[BOS]"]
        self.eos_token_id = self._special_to_id["[EOS]"]
        # Longest first, so no marker can shadow a longer one that starts with it.
        alternatives = sorted(named, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(t) for t in alternatives))

    def _encode(self, text: str, allow_special: bool) -> list[int]:
        if not allow_special:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            ids.extend(text[pos : m.start()].encode("utf-8"))
            ids.append(self._special_to_id[m.group()])
            pos = m.end()
        ids.extend(text[pos:].encode("utf-8"))
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < 256:
            return bytes([token_id])
        return self._id_to_token(token_id).encode("utf-8")

    def _id_to_token(self, token_id: int) -> str:
        if 0 <= token_id < 256:
            return _byte_to_unicode()[token_id]
        if 256 <= token_id < BYTE_VOCAB_SIZE:
            return self._specials[token_id - 256]
        raise IndexError(f"token id {token_id} out of range for the byte tokenizer")

    def token_to_id(self, token: str) -> int | None:
        if token in self._special_to_id:
            return self._special_to_id[token]
        if len(token) == 1 and token in _unicode_to_byte():
            return _unicode_to_byte()[token]
        return None


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: object) -> str | None:
    """tokenizer_config.json spells a token either as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer(Tokenizer):
    """A `tokenizer.json` (HF tokenizers) model directory."""

    def __init__(self, model_dir: str, family: str) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        super().__init__(family)
        path = os.path.join(model_dir, "tokenizer.json")
        self._tok = RustTokenizer.from_file(path)
        # A second instance with special matching off: the flag is per instance, and flipping it on a
        # shared instance would race between concurrent requests.
        self._plain = RustTokenizer.from_file(path)
        self._plain.encode_special_tokens = True
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))

        added = self._tok.get_added_tokens_decoder()
        self._added_ids = set(added)
        self.special_token_ids = {i for i, t in added.items() if t.special}
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            if entry.get("special", True) and self._tok.token_to_id(entry["content"]) == int(key):
                self.special_token_ids.add(int(key))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._lookup(_token_content(config.get("bos_token")))
        self.eos_token_id = self._lookup(_token_content(config.get("eos_token")))
        with open(path, encoding="utf-8") as f:
            self._byte_level = _uses_byte_level_decoder(json.load(f).get("decoder"))

    def _lookup(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _encode(self, text: str, allow_special: bool) -> list[int]:
        tok = self._tok if allow_special else self._plain
        return tok.encode(text, add_special_tokens=False).ids

    def token_bytes(self, token_id: int) -> bytes:
        token = self._tok.id_to_token(token_id)
        if token is None:
            raise IndexError(f"token id {token_id} out of range")
        if token_id in self._added_ids:
            return token.encode("utf-8")
        if self._byte_level:
            table = _unicode_to_byte()
            return bytes(table[c] for c in token)
        # Not byte-level (e.g. a byte-fallback SentencePiece vocabulary): use the backend's own
        # spelling of the lone token, which is exact except for leading-space conventions.
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", token)
        if m:
            return bytes([int(m.group(1), 16)])
        return token.replace("\u2581", " ").encode("utf-8")

    def _id_to_token(self, token_id: int) -> str:
        token = self._tok.id_to_token(token_id)
        if token is None:
            raise IndexError(f"token id {token_id} out of range")
        return token

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def _uses_byte_level_decoder(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_uses_byte_level_decoder(d) for d in decoder.get("decoders") or [])


class TiktokenTokenizer(Tokenizer):
    """Kimi's `tiktoken.model` (BPE ranks) plus 256 reserved specials named in tokenizer_config.json."""

    def __init__(self, model_dir: str, family: str) -> None:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        super().__init__(family)
        ranks = load_tiktoken_bpe(os.path.join(model_dir, "tiktoken.model"))
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        num_base = len(ranks)
        named = {
            int(k): v["content"] for k, v in (config.get("added_tokens_decoder") or {}).items()
        }
        num_special = max(KIMI_NUM_RESERVED_SPECIAL_TOKENS, max(named, default=0) + 1 - num_base)
        self._specials: dict[str, int] = {}
        for token_id in range(num_base, num_base + num_special):
            self._specials[named.get(token_id, f"<|reserved_token_{token_id}|>")] = token_id
        self._id_to_special = {i: t for t, i in self._specials.items()}
        self._enc = tiktoken.Encoding(
            name=os.path.basename(os.path.abspath(model_dir)),
            pat_str=KIMI_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=self._specials,
        )
        self._ranks = ranks
        self._rank_to_bytes = {r: b for b, r in ranks.items()}
        self.vocab_size = num_base + num_special
        self.special_token_ids = set(self._specials.values())
        self.bos_token_id = self._specials.get(_token_content(config.get("bos_token")) or "[BOS]")
        self.eos_token_id = self._specials.get(_token_content(config.get("eos_token")) or "[EOS]")

    def _encode(self, text: str, allow_special: bool) -> list[int]:
        if allow_special:
            return self._enc.encode(text, allowed_special="all")
        # disallowed_special=() makes tiktoken treat marker text as ordinary bytes instead of raising.
        return self._enc.encode(text, allowed_special=set(), disallowed_special=())

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._id_to_special:
            return self._id_to_special[token_id].encode("utf-8")
        return self._rank_to_bytes[token_id]

    def _id_to_token(self, token_id: int) -> str:
        if token_id in self._id_to_special:
            return self._id_to_special[token_id]
        table = _byte_to_unicode()
        return "".join(table[b] for b in self._rank_to_bytes[token_id])

    def token_to_id(self, token: str) -> int | None:
        if token in self._specials:
            return self._specials[token]
        try:
            raw = bytes(_unicode_to_byte()[c] for c in token)
        except KeyError:
            return None
        return self._ranks.get(raw)


def _has_tokenizer_files(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tiktoken.model"))


def tokenizer_source(model: str, tokenizer: str | None = None, load_format: str = "auto") -> str | None:
    """Where an engine's tokenizer comes from: `tokenizer` (--tokenizer), else the model directory. None,
    the family's byte tokenizer, for a preset, and for a directory that holds only a config and is run
    with dummy weights (so `--load-format dummy` runs any config)."""
    if tokenizer:
        return tokenizer
    if not os.path.isdir(model):
        return None
    if load_format == "dummy" and not _has_tokenizer_files(model):
        logging.getLogger(__name__).warning("%s has no tokenizer files: using the byte tokenizer with dummy weights",
                                            model)
        return None
    return model


def load_tokenizer(path: str | None, family: str) -> Tokenizer:
    """A model directory's tokenizer, or the family's byte tokenizer for None or a preset name."""
    if path is not None and os.path.isdir(path):
        if os.path.exists(os.path.join(path, "tokenizer.json")):
            return HFTokenizer(path, family)
        if os.path.exists(os.path.join(path, "tiktoken.model")):
            return TiktokenTokenizer(path, family)
        raise FileNotFoundError(f"{path} has neither tokenizer.json nor tiktoken.model")
    return ByteTokenizer(family)


def parse_prompt(prompt: str | list[int] | dict, tokenizer: Tokenizer | None) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt as the offline API takes it (vLLM's forms): a string, token ids, or a
    dict with 'prompt' and/or 'prompt_token_ids'. Raises ValueError for anything else."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" not in prompt:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer, and this engine has none (skip_tokenizer_init=True): "
                             "pass token ids, e.g. {'prompt_token_ids': [...]}")
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise ValueError(f"unsupported prompt type {type(prompt).__name__}")


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    Bytes of an incomplete character are held back until it completes; `finish()` flushes what is
    left. The deltas joined (with `finish()`) equal `tokenizer.decode(all_ids, skip_special_tokens)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Python's incremental UTF-8 decoder replaces invalid bytes exactly as a one-shot decode does.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.token_ids: list[int] = []

    def step(self, new_ids: int | Sequence[int]) -> str:
        """Feed the newest token id(s); return the text that is now complete."""
        ids = [new_ids] if isinstance(new_ids, int) else list(new_ids)
        self.token_ids.extend(ids)
        data = self.tokenizer.ids_to_bytes(ids, self.skip_special_tokens)
        return self._decoder.decode(data, final=False)

    def finish(self) -> str:
        """Flush held-back bytes (an unfinished character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)


__all__ = [
    "BYTE_VOCAB_SIZE",
    "ByteTokenizer",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "K2_SPECIAL_TOKENS",
    "K3_SPECIAL_TOKENS",
    "KIMI_PAT_STR",
    "TiktokenTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "parse_prompt",
]


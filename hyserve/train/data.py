"""Training data for the embedded model, built from the Python standard library on this machine.

Three kinds of example, all deterministic for one Python installation and never fetched:
  code  - module sources (plain text, loss on every token);
  chat  - "what does X do / how do I call X" in the K3 encoding; the assistant thinks one line and
          answers with the signature and the docstring's first line (loss on assistant turns only);
  tool  - the same questions with a `lookup_symbol` tool: the assistant calls it, the tool message
          returns signature + docstring, and the assistant answers from it (copying the signature).
  copy  - tool conversations about made-up symbols (real parts recombined, or random syllables), so that
          the only way to call the tool with the right name and to answer is to copy from the question
          and the tool result; without them a small model memorises names and never learns to copy.
The split is by module (`held_out`), so evaluation asks about code the model never saw.
"""

from __future__ import annotations

import importlib
import inspect
import io
import json
import pkgutil
import random
import re
import sys
import warnings
import zlib
from collections.abc import Iterable, Sequence
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field

from hyserve.entrypoints.chat.k3_encoding import END_OF_MSG, OPEN, SEP, Segment, render_k3
from hyserve.tokenizer import Tokenizer
from hyserve.train.small_talk import TOOL_REQUESTS, small_talk

# Modules with side effects on import (a browser, a GUI, printing, test suites) or nothing to teach.
_SKIP = {
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "ensurepip",
    "pydoc_data", "__future__", "__hello__", "__phello__", "pip", "distutils", "msilib", "winreg",
    "winsound", "msvcrt", "_winapi", "nt", "xxsubtype", "xxlimited", "xxlimited_35", "venv", "sre_compile",
    "sre_constants", "sre_parse", "curses", "readline", "site", "sitecustomize", "usercustomize",
}
HELD_OUT_FRACTION = 0.12
MAX_DOC_CHARS = 600
CODE_CHUNK_CHARS = 3000

TOOL_NAME = "lookup_symbol"
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Look up a Python standard library function or class by its dotted name and "
        "return its signature and docstring.",
        "parameters": {
            "type": "object",
            "properties": {"name": {"type": "string", "description": "dotted name, e.g. os.path.join"}},
            "required": ["name"],
        },
    },
}

_QUESTIONS = (
    "What does {name} do?",
    "How do I call {name}?",
    "What is the signature of {name}?",
    "Explain {name} briefly.",
    "what does `{name}` do in Python?",
    "Can you tell me how to use {name}?",
    "What arguments does {name} take?",
    "Describe the Python function {name}.",
)


@dataclass(frozen=True)
class Symbol:
    module: str
    name: str  # dotted, e.g. "json.dumps" or "collections.OrderedDict.move_to_end"
    signature: str  # e.g. "dumps(obj, *, skipkeys=False, ...)"
    summary: str  # the docstring's first line
    doc: str  # the cleaned docstring, truncated

    @property
    def call(self) -> str:
        """The signature spelled with the full dotted name, as answers write it."""
        return self.name.rsplit(".", 1)[0] + "." + self.signature


def stdlib_modules() -> list[str]:
    """Public stdlib modules (top level, one level of package submodules, and os.path) that import
    cleanly here, sorted: the determinism anchor."""
    names = sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in _SKIP)
    out = []
    for name in names:
        mod = _import(name)
        if mod is None:
            continue
        out.append(name)
        for info in pkgutil.iter_modules(getattr(mod, "__path__", None) or []):
            sub = f"{name}.{info.name}"
            if not info.name.startswith(("_", "test")) and _import(sub) is not None:
                out.append(sub)
    return sorted(out + ["os.path"])


def _import(name: str):
    try:
        with warnings.catch_warnings(), redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except BaseException:  # noqa: BLE001 - platform modules raise anything from ImportError to SystemExit
        return None


def held_out(module: str) -> bool:
    """A stable hash split by top-level package: the same modules are held out on every run, and a
    package's submodules fall on the same side as the package."""
    top = module.split(".")[0]
    return zlib.crc32(top.encode()) % 1000 < HELD_OUT_FRACTION * 1000


def split_modules(modules: Sequence[str]) -> tuple[list[str], list[str]]:
    return [m for m in modules if not held_out(m)], [m for m in modules if held_out(m)]


def _clean_doc(obj) -> str | None:
    doc = inspect.getdoc(obj)
    if not doc:
        return None
    doc = doc.strip()
    return doc[:MAX_DOC_CHARS].rstrip() if len(doc) > MAX_DOC_CHARS else doc


def _signature(name: str, obj) -> str | None:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None
    # object reprs in defaults carry memory addresses, which would make the data nondeterministic
    if " at 0x" in sig or len(sig) > 160:
        return None
    return name + sig


def _symbol(module: str, dotted: str, obj) -> Symbol | None:
    doc = _clean_doc(obj)
    sig = _signature(dotted.rsplit(".", 1)[1], obj)
    if doc is None or sig is None:
        return None
    summary = doc.split("\n\n")[0].replace("\n", " ").strip()
    if not summary or len(summary) > 200:
        return None
    return Symbol(module, dotted, sig, summary, doc)


def module_symbols(module: str) -> list[Symbol]:
    """Public functions and classes defined in `module`, and the public methods of those classes."""
    mod = _import(module)
    if mod is None:
        return []
    out: list[Symbol] = []
    for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
        if not isinstance(attr, str) or attr.startswith("_"):
            continue
        obj = getattr(mod, attr, None)
        if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
            continue
        if getattr(obj, "__module__", None) not in (module, "_" + module, mod.__name__):
            continue  # re-exports belong to the module that defines them
        sym = _symbol(module, f"{module}.{attr}", obj)
        if sym:
            out.append(sym)
        if inspect.isclass(obj):
            for meth in sorted(vars(obj)):
                fn = vars(obj)[meth]
                if not meth.startswith("_") and inspect.isfunction(fn):
                    sym = _symbol(module, f"{module}.{attr}.{meth}", fn)
                    if sym:
                        out.append(sym)
    return out


def collect_symbols(modules: Iterable[str]) -> list[Symbol]:
    return [s for m in modules for s in module_symbols(m)]


def code_documents(modules: Iterable[str]) -> list[str]:
    """Module sources cut at top-level definitions into chunks of about CODE_CHUNK_CHARS."""
    docs: list[str] = []
    for module in modules:
        mod = _import(module)
        try:
            src = inspect.getsource(mod) if mod is not None else ""
        except (OSError, TypeError):
            continue
        pieces = re.split(r"(?m)^(?=(?:def|class|async def) )", src)
        chunk = ""
        for piece in pieces:
            if chunk and len(chunk) + len(piece) > CODE_CHUNK_CHARS:
                docs.append(chunk)
                chunk = ""
            chunk += piece[: 4 * CODE_CHUNK_CHARS]
        if chunk.strip():
            docs.append(chunk)
    return docs


# --- conversations ---------------------------------------------------------------------------------

def question(sym: Symbol, rng: random.Random) -> str:
    return rng.choice(_QUESTIONS).format(name=sym.name)


def tool_question(sym: Symbol, rng: random.Random) -> str:
    """What a user with the tool declared asks: a question about the symbol, or a request for the tool."""
    return rng.choice(TOOL_REQUESTS if rng.random() < 0.5 else _QUESTIONS).format(name=sym.name)


def answer(sym: Symbol) -> str:
    return f"`{sym.call}`\n\n{sym.summary}"


def chat_messages(sym: Symbol, rng: random.Random) -> list[dict]:
    return [
        {"role": "user", "content": question(sym, rng)},
        {"role": "assistant", "reasoning_content": f"The user asks about {sym.name}.", "content": answer(sym)},
    ]


def tool_result(sym: Symbol) -> str:
    return f"{sym.call}\n\n{sym.doc}"


def tool_messages(sym: Symbol, rng: random.Random, *, complete: bool = True) -> list[dict]:
    """A tool-use conversation; with complete=False it stops after the question (an eval prompt)."""
    msgs = [{"role": "user", "content": question(sym, rng) if not complete else tool_question(sym, rng)}]
    if not complete:
        return msgs
    call = {"id": f"{TOOL_NAME}:0", "type": "function",
            "function": {"name": TOOL_NAME, "arguments": json.dumps({"name": sym.name})}}
    return msgs + [
        {"role": "assistant", "reasoning_content": f"I should look up {sym.name}.", "content": "",
         "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"{TOOL_NAME}:0", "content": tool_result(sym)},
        {"role": "assistant", "reasoning_content": "The tool returned the signature.", "content": answer(sym)},
    ]


# --- encoding with a loss mask ---------------------------------------------------------------------

def _tag_end(segments: Sequence[Segment], i: int) -> int:
    """Index just past the `<|sep|>` that ends the tag opened at segments[i]."""
    while not (segments[i].allow_special and segments[i].text == SEP):
        i += 1
    return i + 1


def _opens_assistant_turn(segments: Sequence[Segment], i: int) -> bool:
    texts = [s.text for s in segments[i : i + 5]]
    return segments[i].allow_special and texts[:2] == [OPEN, "message"] and texts[2:] == [" role", '="', "assistant"]


def assistant_flags(segments: Sequence[Segment]) -> list[bool]:
    """Per segment: True for what the model generates after the generation prompt
    (`<|open|>message role="assistant"<|sep|><|open|>think<|sep|>`), up to and including <|end_of_msg|>."""
    flags: list[bool] = []
    inside, i = False, 0
    while i < len(segments):
        if not inside and _opens_assistant_turn(segments, i):
            start = _tag_end(segments, _tag_end(segments, i))  # the header and the channel opener
            flags += [False] * (start - i)
            inside, i = True, start
            continue
        flags.append(inside)
        if inside and segments[i].text == END_OF_MSG and segments[i].allow_special:
            inside = False
        i += 1
    return flags


def encode_chat(tok: Tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """(ids, mask) of a whole conversation; mask 1 on assistant-generated tokens."""
    return encode_segments(tok, render_k3(messages, tools, add_generation_prompt=False))


def encode_segments(tok: Tokenizer, segments: list[Segment]) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    mask: list[int] = []
    for seg, flag in zip(segments, assistant_flags(segments)):
        part = tok.encode(seg.text, allow_special=seg.allow_special)
        ids += part
        mask += [int(flag)] * len(part)
    return ids, mask


_SYLLABLES = ("ka", "lo", "mi", "tor", "pex", "an", "ul", "zer", "bri", "qua", "fen", "dos", "vy", "gor",
              "set", "ix", "ru", "nal", "ob", "stre", "cim", "hu", "wep", "ald", "jo", "tre", "sy", "mon")


def _made_up_word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))


def _fragments(words: Iterable[str]) -> list[str]:
    """Identifier pieces: snake_case words and CamelCase humps."""
    return sorted({f for w in words for part in w.split("_") for f in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+", part)})


def _made_up_symbol(rng: random.Random, real: Sequence[Symbol], pieces: Sequence[str], taken: set[str]) -> Symbol:
    """A symbol no one can have memorised, named one of three ways: real parts recombined (module, leaf
    name), real identifier pieces recombined (names that look real), or random syllables. Its parameters
    and docstring come from two other real symbols. Never a name in `taken` (the real symbols): that
    would teach a wrong answer about a real one."""
    while (sym := _made_up_candidate(rng, real, pieces)).name in taken:
        pass
    return sym


_DEFAULTS = ("None", "True", "False", "0", "1", "-1", "''", "'utf-8'", "()", "8192", "0.5")


def _made_up_params(rng: random.Random, pieces: Sequence[str]) -> str:
    """A parameter list of 0-6 made-up names: positional, keyword-only after `*`, with defaults, and
    sometimes `/`, `*args` or `**kwargs`."""
    names = list(dict.fromkeys("_".join(rng.choice(pieces).lower() for _ in range(rng.randint(1, 2)))
                               for _ in range(rng.randint(0, 6))))
    parts, defaults, star, slash = [], False, False, False
    for i, name in enumerate(names):
        if not star and i and rng.random() < 0.15:
            parts.append("*")
            star = True
        defaults = defaults or star or rng.random() < 0.35
        parts.append(f"{name}={rng.choice(_DEFAULTS)}" if defaults else name)
        if not (star or defaults or slash) and rng.random() < 0.1:
            parts.append("/")
            slash = True
    if not star and rng.random() < 0.15:
        parts.append("*args")
    if rng.random() < 0.15:
        parts.append("**kwargs")
    return "(" + ", ".join(parts) + ")"


def _made_up_candidate(rng: random.Random, real: Sequence[Symbol], pieces: Sequence[str]) -> Symbol:
    doc_from, params_from = rng.choice(real), rng.choice(real)
    # half the parameter lists are made up too: a real one can be recalled instead of copied
    params = params_from.signature[params_from.signature.index("(") :] if rng.random() < 0.5 \
        else _made_up_params(rng, pieces)
    style = rng.random()
    if style < 0.3:
        module = rng.choice(real).module
        leaf = rng.choice(real).name.rsplit(".", 1)[1]
    else:
        word = (lambda: "".join(rng.choice(pieces).lower() for _ in range(rng.randint(1, 2)))) if style < 0.7 \
            else (lambda: _made_up_word(rng))
        module = ".".join(word() for _ in range(rng.randint(1, 2)))
        words = [word() for _ in range(rng.randint(1, 3))]
        leaf = "".join(w.title() for w in words) if rng.random() < 0.3 else "_".join(words)
    if rng.random() < 0.25:  # a method: Class.method
        leaf = _made_up_word(rng).title() + rng.choice(pieces).title() + "." + leaf
    return Symbol(module, f"{module}.{leaf}", leaf.rsplit(".", 1)[-1] + params, doc_from.summary, doc_from.doc)


@dataclass
class Corpus:
    code: list[str]
    chat: list[list[dict]]
    tool: list[list[dict]]
    symbols: list[Symbol]
    copy: list[list[dict]] = field(default_factory=list)
    # one exchange each, under `tool_choice` "required" (the call) and "none" (a direct answer with the
    # tool declared): the encoding announces either choice in an internal message the model must obey
    forced: list[list[dict]] = field(default_factory=list)
    declined: list[list[dict]] = field(default_factory=list)
    talk: list[tuple[list[dict], bool]] = field(default_factory=list)  # (messages, lookup tool declared)


def build_corpus(modules: Sequence[str], seed: int = 0, phrasings: int = 3, copies: float = 0.0,
                 choices: float = 0.0, talk: float = 0.0) -> Corpus:
    """Code chunks plus `phrasings` chat and tool conversations per symbol of `modules`, `copies`
    made-up-symbol tool conversations per real symbol, `choices` exchanges per symbol under each of
    tool_choice "required" and "none", and `talk` small-talk exchanges per symbol (a third of them go on
    with a question about a symbol)."""
    rng = random.Random(seed)
    symbols = collect_symbols(modules)
    chat, tool = [], []
    for sym in symbols:
        for _ in range(phrasings):
            chat.append(chat_messages(sym, rng))
            tool.append(tool_messages(sym, rng))
    pieces = _fragments(part for s in symbols for part in s.name.split("."))
    taken = {s.name for s in symbols}
    copy = [tool_messages(_made_up_symbol(rng, symbols, pieces, taken), rng) for _ in range(int(copies * len(symbols)))]
    n_choice = int(choices * len(symbols))
    forced = [tool_messages(sym, rng)[:2] for sym in rng.sample(symbols, min(n_choice, len(symbols)))]
    declined = [chat_messages(sym, rng) for sym in rng.sample(symbols, min(n_choice, len(symbols)))]
    chats = small_talk(rng, int(talk * len(symbols)))
    for i, (messages, tools) in enumerate(chats):
        if i % 3 == 2 and symbols:  # then a real question: small talk must not stick
            sym = rng.choice(symbols)
            messages += tool_messages(sym, rng) if tools else chat_messages(sym, rng)
    return Corpus(code_documents(modules), chat, tool, symbols, copy, forced, declined, chats)


def choice_segments(messages: list[dict], tool_choice: str) -> list[Segment]:
    """A (user, assistant) exchange with the lookup tool declared and `tool_choice` announced where a
    request with that choice puts it: after the user's message, before the assistant's turn."""
    user = render_k3(messages[:1], [LOOKUP_TOOL], add_generation_prompt=False)
    announced = render_k3(messages[:1], [LOOKUP_TOOL], tool_choice=tool_choice, add_generation_prompt=False)
    whole = render_k3(messages, [LOOKUP_TOOL], add_generation_prompt=False)
    if whole[: len(user)] != user:
        raise AssertionError("the rendering of a conversation does not start with that of its first message")
    return announced + whole[len(user) :]


def corpus_texts(corpus: Corpus) -> Iterable[str]:
    """Plain text for tokenizer training: code, docstrings and rendered conversations."""
    yield from corpus.code
    for conv in corpus.chat[::3] + corpus.tool[::3] + [m for m, _ in corpus.talk[::3]]:
        yield "".join(s.text for s in render_k3(conv, [LOOKUP_TOOL] if len(conv) > 2 else None,
                                                add_generation_prompt=False))


def encode_corpus(tok: Tokenizer, corpus: Corpus, max_len: int) -> list[tuple[list[int], list[int]]]:
    """Every example as (ids, mask) no longer than max_len; code chunks are cut into windows."""
    out = []
    for text in corpus.code:
        ids = tok.encode(text)
        for i in range(0, len(ids), max_len):
            piece = ids[i : i + max_len]
            if len(piece) > 16:
                out.append((piece, [1] * len(piece)))
    for conv in corpus.chat:
        out.append(encode_chat(tok, conv))
    for conv in corpus.tool + corpus.copy:
        out.append(encode_chat(tok, conv, [LOOKUP_TOOL]))
    for convs, choice in ((corpus.forced, "required"), (corpus.declined, "none")):
        out += [encode_segments(tok, choice_segments(conv, choice)) for conv in convs]
    out += [encode_chat(tok, conv, [LOOKUP_TOOL] if tools else None) for conv, tools in corpus.talk]
    return [(ids[:max_len], mask[:max_len]) for ids, mask in out]

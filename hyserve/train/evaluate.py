"""Quality of a trained checkpoint on the held-out modules (docs/BENCHMARKS.md):

    python -m hyserve.train.evaluate MODEL_DIR --split .traindata/split.json [--n 200] [--out eval.json]

- perplexity on held-out code and on held-out chat assistant turns;
- tool-call rate: greedy generations for tool-use prompts that parse into a `lookup_symbol` call with
  JSON-object arguments (the server's own K3 output parser), and how many name the right symbol;
- signature rate: answers that contain the right signature, end to end (the model's own call is answered
  by the tool, then the model answers), after the right tool result, and in plain chat without tools
  (recall of modules never seen: expected near zero);
- tool phrasings: requests that name the tool ("Use lookup_symbol to find out what X does.", phrasings the
  data never uses among them) for common stdlib names, answered with a call naming the symbol;
- small talk: greetings and identity questions answered with what the model is, out-of-scope requests
  with what it can do instead, neither with a tool call (phrasings the data never uses, tool on and off).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys

import torch

from hyserve.entrypoints.chat.k3_encoding import encode_k3
from hyserve.entrypoints.chat.tool_calls import make_output_parser
from hyserve.train.data import (
    LOOKUP_TOOL,
    TOOL_NAME,
    Symbol,
    chat_messages,
    code_documents,
    encode_chat,
    question,
    tool_messages,
    tool_result,
)
from hyserve.train.small_talk import EVAL_GREETINGS, EVAL_OUT_OF_SCOPE, EVAL_TOOL_REQUESTS, MODEL_NAME

# Names users ask about most; the rate is over these times EVAL_TOOL_REQUESTS.
COMMON_SYMBOLS = (
    "json.dumps", "json.loads", "os.path.join", "os.listdir", "re.sub", "re.match", "math.sqrt", "random.choice",
    "time.sleep", "shutil.copy", "glob.glob", "textwrap.dedent", "copy.deepcopy", "heapq.heappush",
    "bisect.insort", "statistics.mean", "itertools.chain", "functools.reduce", "base64.b64encode", "subprocess.run",
)


@torch.no_grad()
def perplexity(model, examples: list[tuple[list[int], list[int]]], batch: int = 16) -> float:
    from hyserve.train.packed import masked_lm_loss

    total, count = 0.0, 0
    for i in range(0, len(examples), batch):
        part = examples[i : i + batch]
        loss, n = masked_lm_loss(model, [e[0] for e in part], [e[1] for e in part])
        total, count = total + loss.item() * n, count + n
    return math.exp(total / max(count, 1))


def tool_prompt(tok, sym: Symbol, rng: random.Random) -> list[int]:
    return encode_k3(tok, tool_messages(sym, rng, complete=False), [LOOKUP_TOOL])


def answer_prompt(tok, sym: Symbol, rng: random.Random) -> list[int]:
    """The conversation up to the tool result: the next assistant turn should copy the signature."""
    return encode_k3(tok, tool_messages(sym, rng)[:-1], [LOOKUP_TOOL])


def after_call(sym: Symbol, name: str | None, by_name: dict[str, Symbol], rng: random.Random) -> list[dict]:
    """The conversation after the model called lookup_symbol(name): the tool answers what was asked for."""
    msgs = tool_messages(sym, rng)[:-1]
    msgs[1]["reasoning_content"] = f"I should look up {name}."
    msgs[1]["tool_calls"][0]["function"]["arguments"] = json.dumps({"name": name})
    msgs[2]["content"] = tool_answer(name, by_name)
    return msgs


def tool_answer(name: object, by_name: dict[str, Symbol]) -> str:
    """What lookup_symbol returns for `name` (any JSON value the model wrote): the symbol's signature and
    docstring, or that there is none."""
    found = by_name.get(name) if isinstance(name, str) else None
    return tool_result(found) if found else f"No symbol named {name!r}."


def parsed_call(tok, ids: list[int]) -> tuple[bool, str | None]:
    """(a lookup_symbol call with JSON-object arguments was parsed, its `name` argument)."""
    out = make_output_parser("k3", tok, prompt_opens_thinking=True, tools_enabled=True).parse(ids)
    for call in out.tool_calls:
        if call.name != TOOL_NAME:
            continue
        try:
            args = json.loads(call.arguments)
        except ValueError:
            continue
        if isinstance(args, dict):
            return True, args.get("name")
    return False, None


def content_of(tok, ids: list[int]) -> str:
    out = make_output_parser("k3", tok, prompt_opens_thinking=True, tools_enabled=True).parse(ids)
    return out.content or ""


def _greedy(max_tokens: int):
    from hyserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, skip_special_tokens=False)


def tool_phrasing_rate(llm) -> float:
    """Share of COMMON_SYMBOLS x EVAL_TOOL_REQUESTS answered with a lookup_symbol call naming the symbol."""
    tok = llm.get_tokenizer()
    asks = [(name, phrasing.format(name=name)) for name in COMMON_SYMBOLS for phrasing in EVAL_TOOL_REQUESTS]
    prompts = [encode_k3(tok, [{"role": "user", "content": text}], [LOOKUP_TOOL]) for _, text in asks]
    gens = llm.generate(prompts, _greedy(96), use_tqdm=False)
    return sum(parsed_call(tok, g.outputs[0].token_ids)[1] == name for (name, _), g in zip(asks, gens)) / len(asks)


def identity_reply_ok(content: str, called: bool) -> bool:
    """Says what the model is and what it does, briefly, without calling a tool."""
    return not called and MODEL_NAME in content and "standard library" in content and len(content) < 400


def small_talk_rates(llm) -> dict[str, float]:
    """Greetings answered with what the model is; out-of-scope requests with what it can do instead."""
    tok = llm.get_tokenizer()
    cases = [(kind, text, tools) for kind, texts in (("identity", EVAL_GREETINGS), ("out_of_scope", EVAL_OUT_OF_SCOPE))
             for text in texts for tools in (None, [LOOKUP_TOOL])]
    prompts = [encode_k3(tok, [{"role": "user", "content": text}], tools) for _, text, tools in cases]
    # brevity is judged in characters (identity_reply_ok); 160 tokens only bound the generation
    gens = llm.generate(prompts, _greedy(160), use_tqdm=False)
    ok: dict[str, list[bool]] = {"identity": [], "out_of_scope": []}
    for (kind, _, _), g in zip(cases, gens):
        out = make_output_parser("k3", tok, prompt_opens_thinking=True, tools_enabled=True).parse(g.outputs[0].token_ids)
        content = out.content or ""
        good = identity_reply_ok(content, bool(out.tool_calls)) if kind == "identity" else \
            not out.tool_calls and "standard library" in content and len(content) < 400
        ok[kind].append(good)
    return {f"{kind}_answer": sum(v) / len(v) for kind, v in ok.items()}


def evaluate(model_dir: str, symbols: list[Symbol], eval_modules: list[str], n: int = 200, **llm_kwargs) -> dict:
    from hyserve import LLM, SamplingParams

    llm = LLM(model=model_dir, **llm_kwargs)
    tok, model = llm.get_tokenizer(), llm.engine.model
    rng = random.Random(1)
    syms = (symbols * (1 + n // max(len(symbols), 1)))[:n] if symbols else []
    code = [ids[i : i + 512] for d in code_documents(eval_modules) for ids in [tok.encode(d)]
            for i in range(0, len(ids), 512)][:64]
    chat = [encode_chat(tok, chat_messages(s, rng)) for s in syms]
    res: dict = {"n": len(syms), "code_ppl": perplexity(model, [(c, [1] * len(c)) for c in code if len(c) > 1]),
                 "chat_ppl": perplexity(model, chat)}
    greedy = SamplingParams(temperature=0.0, max_tokens=96, skip_special_tokens=False)
    gens = llm.generate([tool_prompt(tok, s, rng) for s in syms], greedy, use_tqdm=False)
    calls = [parsed_call(tok, g.outputs[0].token_ids) for g in gens]
    res["example_tool_generation"] = tok.decode(gens[0].outputs[0].token_ids, skip_special_tokens=False)[:400]
    res["tool_call_rate"] = sum(ok for ok, _ in calls) / len(syms)
    res["tool_call_right_name"] = sum(name == s.name for (_, name), s in zip(calls, syms)) / len(syms)
    by_name = {s.name: s for s in symbols}
    follow = [encode_k3(tok, after_call(s, name, by_name, rng), [LOOKUP_TOOL]) for (_, name), s in zip(calls, syms)]
    gens = llm.generate(follow, greedy, use_tqdm=False)
    res["signature_end_to_end"] = sum(ok and s.call in content_of(tok, g.outputs[0].token_ids)
                                      for (ok, _), g, s in zip(calls, gens, syms)) / len(syms)
    gens = llm.generate([answer_prompt(tok, s, rng) for s in syms], greedy, use_tqdm=False)
    res["signature_after_tool"] = sum(s.call in content_of(tok, g.outputs[0].token_ids)
                                      for g, s in zip(gens, syms)) / len(syms)
    plain = [encode_k3(tok, [{"role": "user", "content": question(s, rng)}]) for s in syms]
    gens = llm.generate(plain, greedy, use_tqdm=False)
    res["signature_plain_chat"] = sum(s.call in content_of(tok, g.outputs[0].token_ids)
                                      for g, s in zip(gens, syms)) / len(syms)
    res["tool_phrasing_right_name"] = tool_phrasing_rate(llm)
    res.update(small_talk_rates(llm))
    return res


def evaluate_split(model_dir: str, split_path: str, n: int = 200, **llm_kwargs) -> dict:
    """`evaluate` on the held-out symbols and modules that `prepare` wrote to split.json."""
    with open(split_path) as f:
        split = json.load(f)
    symbols = [Symbol(**s) for s in split["eval_symbols"]]
    random.Random(0).shuffle(symbols)
    return evaluate(model_dir, symbols, split["eval_modules"], n, **llm_kwargs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hyserve.train.evaluate")
    p.add_argument("model")
    p.add_argument("--split", required=True, help="split.json written by `python -m hyserve.train prepare`")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    kwargs = {"device": args.device, "enforce_eager": True} if args.device else {}
    res = evaluate_split(args.model, args.split, args.n, **kwargs)
    print(json.dumps(res, indent=1))
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

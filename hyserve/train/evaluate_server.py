"""The tool-use evaluation through a live OpenAI-compatible server (the issue's measurement, end to end):

    hyserve serve &        # the embedded model
    python -m hyserve.train.evaluate_server --split .traindata/split.json --n 200 [--base-url URL]

For each held-out symbol a user asks about it with the `lookup_symbol` tool offered. A response counts as a
tool call when the server's parser returns a `tool_calls` entry naming `lookup_symbol` whose arguments are
a JSON object. The tool is then answered with what was asked for (the real symbol's signature and
docstring, or "no such symbol"), and the final answer counts when it contains the right signature
(`signature`, end to end). `signature_after_tool` asks once more with the right call and the right tool
result already in the conversation: does the answer carry the signature the tool returned?
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor

from hyserve.train.data import LOOKUP_TOOL, TOOL_NAME, Symbol, question, tool_messages
from hyserve.train.evaluate import tool_answer


def answer_after_tool(client, model: str, sym: Symbol, rng: random.Random) -> bool:
    """The final answer to the right call and tool result contains the symbol's signature."""
    r = client.chat.completions.create(model=model, messages=tool_messages(sym, rng)[:3], tools=[LOOKUP_TOOL],
                                       temperature=0, max_tokens=160)
    return sym.call in (r.choices[0].message.content or "")


def ask(client, model: str, sym: Symbol, by_name: dict[str, Symbol], rng: random.Random) -> dict:
    after = answer_after_tool(client, model, sym, random.Random(rng.random()))
    messages = [{"role": "user", "content": question(sym, rng)}]
    r = client.chat.completions.create(model=model, messages=messages, tools=[LOOKUP_TOOL], temperature=0,
                                       max_tokens=96)
    msg = r.choices[0].message
    calls = [c for c in msg.tool_calls or [] if c.function.name == TOOL_NAME]
    try:
        args = json.loads(calls[0].function.arguments) if calls else None
    except ValueError:
        args = None
    if not isinstance(args, dict):
        return {"tool_call": False, "right_name": False, "signature": False, "signature_after_tool": after}
    messages += [msg.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": calls[0].id, "content": tool_answer(args.get("name"), by_name)}]
    r = client.chat.completions.create(model=model, messages=messages, tools=[LOOKUP_TOOL], temperature=0,
                                       max_tokens=160)
    return {"tool_call": True, "right_name": args.get("name") == sym.name,
            "signature": sym.call in (r.choices[0].message.content or ""), "signature_after_tool": after}


def evaluate_server(base_url: str, split_path: str, n: int = 200, concurrency: int = 16,
                    model: str | None = None) -> dict:
    import openai

    with open(split_path) as f:
        symbols = [Symbol(**s) for s in json.load(f)["eval_symbols"]]
    random.Random(0).shuffle(symbols)
    syms = symbols[:n]
    by_name = {s.name: s for s in symbols}
    client = openai.OpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key="unused", max_retries=0, timeout=600)
    model = model or client.models.list().data[0].id
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(lambda i: ask(client, model, syms[i], by_name, random.Random(i)), range(len(syms))))
    return {"n": len(rows), **{k: sum(r[k] for r in rows) / max(len(rows), 1)
                               for k in ("tool_call", "right_name", "signature", "signature_after_tool")}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hyserve.train.evaluate_server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--split", required=True, help="split.json written by `python -m hyserve.train prepare`")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--model", default=None, help="served model name (default: the server's first)")
    args = p.parse_args(argv)
    print(json.dumps(evaluate_server(args.base_url, args.split, args.n, args.concurrency, args.model), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

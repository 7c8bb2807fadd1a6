"""The markdown summary of a `python -m hyserve.train all` run, from its summary.json.

    python -m hyserve.train.report OUT/summary.json
"""

from __future__ import annotations

import json
import sys

_EVAL_ROWS = (
    ("code_ppl", "held-out code perplexity", "{:.2f}"),
    ("chat_ppl", "held-out chat (assistant turns) perplexity", "{:.2f}"),
    ("tool_call_rate", "tool prompts answered with a parsed lookup_symbol call", "{:.1%}"),
    ("tool_call_right_name", "... naming the right symbol", "{:.1%}"),
    ("signature_end_to_end", "answers with the right signature (own tool call, then the answer)", "{:.1%}"),
    ("signature_after_tool", "signature copied from the right tool result", "{:.1%}"),
    ("signature_plain_chat", "signature recalled without tools (unseen modules)", "{:.1%}"),
    ("tool_phrasing_right_name", "requests naming the tool (common names) answered with a call naming the symbol",
     "{:.1%}"),
    ("identity_answer", "greetings and identity questions answered with what the model is", "{:.1%}"),
    ("out_of_scope_answer", "out-of-scope requests answered with what it can do, no tool call", "{:.1%}"),
)


def markdown(summary: dict) -> str:
    t, ev, sec = summary["train"], summary["eval"], summary["seconds"]
    losses = summary["losses"]
    lines = [
        "# hyserve-tiny-k3 training run",
        "",
        f"- model: {t['size']}, {t['parameters'] / 1e6:.1f}M parameters, on {t['device']} (fla KDA path: {t['used_fla']})",
        f"- steps: {t['steps']} of {t['config']['rows']} x {t['config']['row_len']} tokens in {t['train_s']:.0f}s "
        f"({t['tokens_per_s']:,.0f} tokens/s; {t['trained_tokens']:,} trained targets); "
        f"warm-up pass {t['warmup_s']:.0f}s, steady step {t['step_s'] * 1e3:.0f} ms",
        f"- loss: {losses[0]:.3f} at the start, {losses[-1]:.3f} at the end",
        f"- wall clock: prepare {sec['prepare']:.0f}s, eval {sec['eval']:.0f}s, total {sec['total']:.0f}s",
        "",
        f"| held-out evaluation (n={ev['n']}) | value |",
        "| --- | --- |",
    ]
    lines += [f"| {label} | {fmt.format(ev[key])} |" for key, label, fmt in _EVAL_ROWS if key in ev]
    lines += ["", "Example tool-prompt generation:", "", "```", ev.get("example_tool_generation", ""), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(markdown(json.load(f)))

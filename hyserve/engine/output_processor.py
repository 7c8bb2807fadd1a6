"""The output side of a request: its completions' text and stop checks, and the per-step deltas the
engine emits (docs/ARCHITECTURE.md, "Outputs").

Each step the engine emits, per request it touched, what that step added: new token ids, new text, new
logprobs, the finish. Text that might be the start of a stop string is held back until it cannot be,
or the request finishes: a matched stop string is cut out of the text, so no part of it may have been
sent. Whoever wants the whole output accumulates the deltas (`hyserve.outputs.OutputAccumulator`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hyserve.engine.request import Request, RequestStatus
from hyserve.outputs import CompletionDelta, OutputAccumulator, RequestDelta, SampleLogprobs
from hyserve.tokenizer import IncrementalDetokenizer


@dataclass
class CompletionState:
    """What the engine has made and sent of one completion's output."""

    detok: IncrementalDetokenizer | None  # None: the request's text is not made (detokenize off, no tokenizer)
    holdback: int  # characters that might start a stop string
    text: str = ""  # all of it so far (stop strings are searched in its tail)
    new_logprobs: SampleLogprobs | None = None  # not yet sent; None unless the request asks for logprobs
    sent_tokens: int = 0
    sent_chars: int = 0
    finish_sent: bool = False

    @classmethod
    def for_request(cls, req: Request, tokenizer) -> CompletionState:
        p = req.params
        holdback = max((len(s) for s in p.stop or ()), default=1) - 1
        lps = [] if p.logprobs is not None else None
        detok = IncrementalDetokenizer(tokenizer, p.skip_special_tokens) if tokenizer is not None else None
        return cls(detok, holdback, new_logprobs=lps)

    def delta(self, req: Request) -> CompletionDelta | None:
        """What the completion gained since the last delta; None when nothing."""
        done = req.is_finished
        if done and self.finish_sent:
            return None
        text, sent, outs = self.text, self.sent_chars, req.output_token_ids
        end = len(text) if done else max(sent, len(text) - self.holdback)
        ids = outs[self.sent_tokens :]
        if not ids and end == sent and not done:
            return None
        lps = self.new_logprobs
        if lps is not None:
            self.new_logprobs = []
        d = CompletionDelta(req.index, ids, text[sent:end], lps or None, req.status.value if done else None,
                            req.stop_reason, req.cumulative_logprob if lps is not None else None)
        self.sent_tokens, self.sent_chars, self.finish_sent = len(outs), end, done
        return d


@dataclass
class ParentRequest:
    """A user request; n > 1 fans out into n child requests that are scheduled independently."""

    request_id: str
    outputs: OutputAccumulator  # what LLMEngine.step() hands out, per the request's output_kind
    children: list[Request] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    def delta(self) -> RequestDelta | None:
        """The request's news since its last delta; None when there is none."""
        children = self.children
        comps = [d for c in children if (d := c.output.delta(c)) is not None]
        first = children[0]
        finished = first.is_finished if len(children) == 1 else all(c.is_finished for c in children)
        prompt_lps = None
        if first.params.prompt_logprobs is not None and not self.prompt_logprobs_sent and first.prompt_logprobs:
            if len(first.prompt_logprobs) >= first.num_prompt_tokens or finished:  # prefill done
                prompt_lps, self.prompt_logprobs_sent = list(first.prompt_logprobs), True
        if not comps and not finished and prompt_lps is None:
            return None
        if not finished:  # the common case, positional: this runs per request per step
            return RequestDelta(self.request_id, comps, False, False, None, False, first.num_cached_tokens, prompt_lps)
        error = next((c.error for c in children if c.error), None)
        return RequestDelta(self.request_id, comps, True, error=error, num_cached_tokens=first.num_cached_tokens,
                            prompt_logprobs=prompt_lps, metrics=first.metrics)


def check_stop(req: Request, tok: int, eos_token_ids: list[int], max_model_len: int) -> RequestStatus | None:
    """After `tok` landed: the status the request finishes with, or None. A matched stop string is cut
    from the text; otherwise a finishing request's held-back bytes are flushed."""
    p, status = req.params, None
    may_stop = len(req.output_token_ids) >= p.min_tokens
    if may_stop and not p.ignore_eos and tok in eos_token_ids:
        status = RequestStatus.FINISHED_STOPPED
    elif may_stop and tok in (p.stop_token_ids or ()):
        status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
    elif may_stop and p.stop and _stop_string(req):
        return RequestStatus.FINISHED_STOPPED  # the text is cut at the stop string already
    elif len(req.output_token_ids) >= req.max_tokens or req.num_known_tokens >= max_model_len:
        status = RequestStatus.FINISHED_LENGTH
    if status is not None:
        if req.output.detok is not None:
            req.output.text += req.output.detok.finish()
    return status


def _stop_string(req: Request) -> bool:
    out, stops = req.output, req.params.stop
    text = out.text
    window = max(len(s) for s in stops) + 8
    # a stop string can only end inside the newest text: search a bounded tail, not the whole output
    tail_start = max(0, len(text) - window - 64)
    best = None
    for s in stops:
        i = text.find(s, tail_start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return False
    i, s = best
    out.text = text[: i + len(s)] if req.params.include_stop_str_in_output else text[:i]
    req.stop_reason = s
    return True

"""hyserve: an inference and serving engine for the Kimi K3 model family.

The offline API mirrors vLLM's (`LLM`, `SamplingParams`, `RequestOutput`) so scripts carry over.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hyserve.compile_cache import configure_compile_caches

configure_compile_caches()  # before Triton, fla-core or torch read their cache settings

from hyserve.config import DEFAULT_MODEL, EngineConfig  # noqa: E402
from hyserve.outputs import CompletionOutput, Logprob, OutputAccumulator, RequestOutput  # noqa: E402
from hyserve.sampling_params import SamplingParams  # noqa: E402
from hyserve.tokenizer import parse_prompt  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineConfig", "__version__"]

PromptType = str | list[int] | dict


class LLM:
    """Offline generation: `LLM(model="k3-tiny").generate(prompts, SamplingParams(...))`.

    `skip_tokenizer_init=True` (vLLM's) loads no tokenizer, for checkpoints without tokenizer files: prompts
    are token ids (`{"prompt_token_ids": [...]}` or a list of ints) and outputs carry token ids, with
    empty text."""

    def __init__(self, model: str = DEFAULT_MODEL, *, skip_tokenizer_init: bool = False, **kwargs):
        from hyserve.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(EngineConfig(model=model, **kwargs), skip_tokenizer_init=skip_tokenizer_init)
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine) -> LLM:
        """Wrap an existing engine, e.g. one built around an already loaded model (tests, benchmarks)."""
        llm = cls.__new__(cls)
        llm.engine, llm._ids = engine, itertools.count()
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion. A prompt that cannot be served (too long, bad parameters)
        comes back finished with `error` set; the others are unaffected."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if self.engine.tokenizer is None and any(_is_text(p) for p in prompts):
            raise ValueError("text prompts need a tokenizer, and this LLM has none (skip_tokenizer_init=True): "
                             "pass token ids, e.g. {'prompt_token_ids': [...]}")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        results: dict[str, RequestOutput] = {}
        pending: dict[str, OutputAccumulator] = {}
        order = []
        for prompt, p in zip(prompts, params):
            rid = str(next(self._ids))
            order.append(rid)
            try:
                text, ids = parse_prompt(prompt, self.engine.tokenizer)
                self.engine.add_request(rid, {"prompt": text, "prompt_token_ids": ids}, p)
            except ValueError as e:
                results[rid] = RequestOutput(rid, prompt if isinstance(prompt, str) else None, None, None,
                                             [CompletionOutput(0, "", [], None, None, "error")], True, error=str(e))
                continue
            pending[rid] = OutputAccumulator(rid, text, ids, p)
        bar = _progress(len(pending), use_tqdm)
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step_deltas():  # whatever the output_kind, only final outputs go back
                pending[delta.request_id].accumulate(delta)
                if delta.finished:
                    results[delta.request_id] = pending.pop(delta.request_id).output(delta)
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in order]


def _is_text(prompt: PromptType) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt)


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", disable=not enabled or total <= 1, dynamic_ncols=True)

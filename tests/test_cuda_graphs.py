"""Decode steps through the CUDA-graph static buffers (engine/cuda_graphs.py), run on the CPU where the
"graph" is the same padded forward without capture: equal to the eager path (CompareSteps), padding rows
that write only the scratch page and slot, a scratch page and slot no request can get, and eager
fallback for every step a graph cannot serve."""

from __future__ import annotations

import pytest
import torch

from hyserve import SamplingParams
from hyserve.config import EngineConfig
from hyserve.engine import cuda_graphs
from hyserve.engine.cuda_graphs import graph_batch_sizes
from hyserve.engine.llm_engine import LLMEngine
from hyserve.engine.request import Request
from hyserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from hyserve.engine.step_inputs import PendingTokens
from hyserve.models.batch import Batch

MODELS = ["k3-tiny", "kimi-linear-tiny"]


@pytest.fixture
def engine_factory(tiny_model):
    """`make(model, static_decode_buffers, **EngineConfig fields)`; every engine's pools must be empty afterwards."""
    engines: list[LLMEngine] = []

    def make(model: str = "k3-tiny", static_decode_buffers: bool = True, **kwargs) -> LLMEngine:
        kwargs = dict(dict(block_size=16, device="cpu", kv_cache_memory_bytes=32 << 20, max_num_seqs=8), **kwargs)
        weights, tok = tiny_model(model)
        engine = LLMEngine(EngineConfig(model=model, **kwargs), model=weights, tokenizer=tok,
                           static_decode_buffers=static_decode_buffers)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert not engine.has_unfinished_requests()
        engine.kv.check_empty()


def drain(engine: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def _prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 3 * j) % 500 + 1 for j in range(n)]


def _cache_copy(engine: LLMEngine) -> dict[str, torch.Tensor]:
    t = engine.kv.tensors
    return {"pages": t.pages.clone(), "conv": t.conv.clone(), "recurrent": t.recurrent.clone()}


def _restore(engine: LLMEngine, saved: dict[str, torch.Tensor]) -> None:
    for name, value in saved.items():
        getattr(engine.kv.tensors, name).copy_(value)


class CompareSteps:
    """Wraps the runner. Every step the static path serves also runs from the same cache (1) eagerly
    as before and (2) eagerly on the same padded batch built by `Batch.build`. The static path must
    equal (2) bit for bit, logits and whole cache, and (1) up to float rounding (CPU GEMMs of fewer than
    4 rows take another kernel than 4 or more, so padding 3 rows to 4 moves the last bit; bit for bit
    where no padding ran). Between them it may change only the real rows' pages and slots and the
    scratch ones."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.runner = engine, engine.runner
        self.graphs = self.runner.graphs
        self.execute = self.runner.execute
        self.graph_sizes: list[int] = []
        self.eager_steps = 0
        self.failures: list[BaseException] = []  # the engine turns a failing step into failed requests
        self.runner.execute = self

    def _fresh_cache(self, saved: dict[str, torch.Tensor]) -> None:
        _restore(self.engine, saved)
        # zeroed, so the padding rows' writes show (each step's padding writes the same values)
        kv = self.engine.kv
        kv.tensors.pages[kv.scratch_block] = 0
        kv.tensors.conv[kv.scratch_slot] = 0
        kv.tensors.recurrent[kv.scratch_slot] = 0

    @torch.inference_mode()
    def _padded_eager(self, out, size: int) -> torch.Tensor:
        kv, model, seqs = self.engine.kv, self.engine.model, out.seqs
        pad = size - len(seqs)
        batch = Batch.build(
            [1] * size, [s.end for s in seqs] + [1] * pad, [s.req.block_ids for s in seqs] + [[kv.scratch_block]] * pad,
            kv.block_size, [s.req.state_slot for s in seqs] + [kv.scratch_slot] * pad,
            [s.fresh for s in seqs] + [True] * pad,
        )
        ids = torch.tensor([s.req.all_token_ids[s.start] for s in seqs] + [0] * pad)
        return model.compute_logits(model(ids, batch, kv.tensors))[: len(seqs)]

    def __call__(self, out, pending=None):
        assert pending is None  # these engines schedule synchronously
        try:
            return self._compare(out)
        except BaseException as e:
            self.failures.append(e)
            raise

    def _compare(self, out):
        if not self.runner.uses_graph(out):
            self.eager_steps += 1
            return self.execute(out)
        kv, n = self.engine.kv, len(out.seqs)
        size = self.graphs.size_for(n, 0)
        before = _cache_copy(self.engine)
        self.runner.graphs = None
        eager = self.execute(out)
        eager_logits, eager_cache = eager.logits.clone(), _cache_copy(self.engine)
        self.runner.graphs = self.graphs
        self._fresh_cache(before)
        padded_logits, padded_cache = self._padded_eager(out, size), _cache_copy(self.engine)
        self._fresh_cache(before)
        before = _cache_copy(self.engine)
        got = self.execute(out)
        after = _cache_copy(self.engine)

        assert got.sample_rows == eager.sample_rows and not got.prompt_logits
        assert torch.equal(got.logits, padded_logits[got.sample_rows])
        for name in after:
            assert torch.equal(after[name], padded_cache[name]), name
        if size == n:
            assert torch.equal(got.logits, eager_logits)
        torch.testing.assert_close(got.logits, eager_logits, rtol=1e-4, atol=1e-5)
        assert torch.equal(got.logits.argmax(-1), eager_logits.argmax(-1))

        real_blocks = {s.req.block_ids[(s.end - 1) // kv.block_size] for s in out.seqs}
        real_slots = {s.req.state_slot for s in out.seqs}
        changed_blocks = _changed_rows(after["pages"], before["pages"])
        changed_slots = _changed_rows(after["conv"], before["conv"]) | _changed_rows(after["recurrent"], before["recurrent"])
        assert changed_blocks <= real_blocks | {kv.scratch_block}
        assert changed_slots <= real_slots | {kv.scratch_slot}
        for name, rows in (("pages", changed_blocks - {kv.scratch_block}), ("recurrent", changed_slots - {kv.scratch_slot})):
            idx = sorted(rows)
            torch.testing.assert_close(after[name][idx], eager_cache[name][idx], rtol=1e-4, atol=1e-5)
        if size > n:  # padding rows ran, and wrote the scratch page and slot
            assert kv.scratch_block in changed_blocks and kv.scratch_slot in changed_slots
        self.graph_sizes.append(size)
        return got


def _changed_rows(a: torch.Tensor, b: torch.Tensor) -> set[int]:
    return set((a != b).flatten(1).any(1).nonzero().flatten().tolist())


def test_ladder_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(13) == [1, 2, 4, 8, 13]
    assert graph_batch_sizes(64) == [1, 2, 4, *range(8, 65, 8)]
    assert graph_batch_sizes(10_000)[-3:] == [496, 504, 512]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("n", [1, 3, 4, 5])
def test_static_decode_equals_eager_and_padding_writes_only_scratch(engine_factory, model, n):
    engine = engine_factory(model)
    cmp = CompareSteps(engine)
    for i in range(n):  # different lengths: some decode while others still prefill (mixed, eager)
        engine.add_request(str(i), {"prompt_token_ids": _prompt(i, 5 + 9 * i)},
                           SamplingParams(max_tokens=6 + i, temperature=0, ignore_eos=True))
    drain(engine)
    assert not cmp.failures and cmp.eager_steps > 0
    ladder_size = next(s for s in engine.runner.graphs.sizes if s >= n)
    assert ladder_size in cmp.graph_sizes and all(s in engine.runner.graphs.sizes for s in cmp.graph_sizes)


def test_scratch_page_and_slot_are_in_no_pool(engine_factory):
    engine = engine_factory(num_gpu_blocks=12, num_state_slots=6, num_checkpoint_slots=None)
    kv = engine.kv
    assert (kv.blocks.num_blocks, kv.scratch_block) == (11, 11)
    assert kv.slots.num_slots + kv.checkpoint_slots.num_slots == 5 and kv.scratch_slot == 5
    blocks = kv.blocks.allocate(11)
    assert sorted(blocks) == list(range(11)) and kv.blocks.allocate(1) is None
    slots = [kv.slots.allocate() for _ in range(kv.slots.num_slots)]
    ckpts = [kv.checkpoint_slots.allocate() for _ in range(kv.checkpoint_slots.num_slots)]
    assert kv.slots.allocate() is None and kv.checkpoint_slots.allocate() is None
    assert sorted(slots + ckpts) == list(range(5))
    kv.blocks.free(blocks)
    for s in slots:
        kv.slots.free(s)
    for s in ckpts:
        kv.checkpoint_slots.free(s)
    # the sized default keeps max_num_seqs running slots: the scratch slot comes on top
    sized = engine_factory(max_num_seqs=8).kv
    assert sized.slots.num_slots == 8 and sized.scratch_slot == sized.tensors.conv.shape[0] - 1
    assert sized.scratch_block == sized.tensors.pages.shape[0] - 1 == sized.blocks.num_blocks
    eager = engine_factory(static_decode_buffers=False).kv
    assert eager.scratch_block is None and eager.blocks.num_blocks == eager.tensors.pages.shape[0]


def test_warm_up_and_capture_runs_write_only_the_scratch_page_and_slot(engine_factory):
    """What capture() runs before and inside each graph: every row a padding row (CPU: no capture)."""
    engine = engine_factory()
    graphs, kv = engine.runner.graphs, engine.kv
    before = _cache_copy(engine)
    with torch.inference_mode():
        for key in graphs._batches:
            graphs._pad_all(key)
            graphs._step(key, graphs._batches[key])
    after = _cache_copy(engine)
    assert _changed_rows(after["pages"], before["pages"]) == {kv.scratch_block}
    assert _changed_rows(after["recurrent"], before["recurrent"]) | _changed_rows(after["conv"], before["conv"]) == {
        kv.scratch_slot}


def test_mixed_and_prompt_logprobs_steps_run_eagerly(engine_factory):
    engine = engine_factory()
    calls = []
    run = engine.runner.graphs.run
    engine.runner.graphs.run = lambda inputs, prev=None: calls.append(len(inputs.query_lens)) or run(inputs, prev)
    eager = engine_factory(static_decode_buffers=False)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2)
    for e in (engine, eager):  # a one-token prompt: its first step has one token but needs prompt logits
        e.add_request("p", {"prompt_token_ids": [17]}, params)
    step = engine.scheduler.schedule
    seen = []

    def schedule():
        out = step()
        seen.append((engine.runner.uses_graph(out), [s.num_new_tokens for s in out.seqs]))
        return out

    engine.scheduler.schedule = schedule
    got, ref = engine.step()[0], eager.step()[0]
    assert seen[0] == (False, [1]) and calls == []
    assert got.prompt_logprobs == ref.prompt_logprobs == [None] and got.outputs[0].token_ids == ref.outputs[0].token_ids
    # a long prompt joins while "p" decodes: that step mixes a prefill chunk and a decode
    for e in (engine, eager):
        e.add_request("q", {"prompt_token_ids": _prompt(1, 40)}, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    outs, refs = drain(engine), drain(eager)
    assert outs == refs
    assert any(not used and len(lens) == 2 and max(lens) > 1 for used, lens in seen)
    assert calls and all(used == (max(lens) == 1) for used, lens in seen[1:] if lens)


@pytest.mark.parametrize("model", MODELS)
def test_engine_outputs_equal_with_and_without_the_static_path(engine_factory, model):
    def run(engine: LLMEngine) -> dict[str, list[int]]:
        for i in range(6):
            temp = 0.0 if i % 2 == 0 else 0.9
            engine.add_request(f"r{i}", {"prompt_token_ids": _prompt(i, 3 + 11 * i)},
                               SamplingParams(max_tokens=5 + 4 * i, temperature=temp, seed=100 + i, ignore_eos=True))
        engine.add_request("twin", {"prompt_token_ids": _prompt(2, 25) + [9, 9]},
                           SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
        engine.add_request("gone", {"prompt_token_ids": _prompt(7, 12)}, SamplingParams(max_tokens=50, ignore_eos=True))
        for _ in range(4):
            engine.step()
        engine.abort_request("gone")
        return drain(engine)

    # the same usable pool (one page is the scratch), small enough to preempt
    graphed = engine_factory(model, num_gpu_blocks=9, num_checkpoint_slots=2)
    eager = engine_factory(model, static_decode_buffers=False, num_gpu_blocks=8, num_checkpoint_slots=2)
    cmp = CompareSteps(graphed)
    assert run(graphed) == run(eager)
    assert not cmp.failures and cmp.graph_sizes and graphed.stats.num_preemptions == eager.stats.num_preemptions > 0


def _direct_rows(engine: LLMEngine, n: int, blocks_per_row: int) -> tuple[list[list[int]], list[int]]:
    """n rows of real pages and state slots for a hand-made decode step (freed by _free_rows)."""
    kv = engine.kv
    tables = [kv.blocks.allocate(blocks_per_row) for _ in range(n)]
    return tables, [kv.slots.allocate() for _ in range(n)]


def _free_rows(engine: LLMEngine, tables: list[list[int]], slots: list[int]) -> None:
    for t in tables:
        engine.kv.blocks.free(t)
    for s in slots:
        engine.kv.slots.free(s)


def _decode_step(tables, slots, context_lens, last_ids) -> SchedulerOutput:
    """A decode step of one row per table: row i's last token (at context_lens[i] - 1) is last_ids[i],
    or, where that is None, a token sampled by the step before that is still on the device."""
    seqs = []
    for i, (table, slot, ctx, tok) in enumerate(zip(tables, slots, context_lens, last_ids)):
        req = Request(f"d{i}", [1] * (ctx - 1) + ([] if tok is None else [tok]), SamplingParams(), max_tokens=8,
                      block_ids=table, state_slot=slot, num_pending=int(tok is None))
        seqs.append(ScheduledSeq(req, 1, ctx - 1, fresh=True))
    return SchedulerOutput(seqs)


@pytest.mark.parametrize("packed", [True, False], ids=["one-copy", "wide-tables"])
def test_a_narrower_block_table_leaves_no_stale_block_ids(engine_factory, monkeypatch, packed):
    if not packed:  # every size takes the [size, width] copy and the -1 fill
        monkeypatch.setattr(cuda_graphs, "PACKED_TABLE_LIMIT", 0)
    engine = engine_factory(max_model_len=128)
    graphs, kv = engine.runner.graphs, engine.kv
    wide, slots = _direct_rows(engine, 3, 4)
    # a wide step of size 4, then a narrow one of the same size, then one of size 2 (whose layout
    # overlaps size 4's), each must read exactly its own tables
    steps = [(wide, 4 * kv.block_size), ([t[:1] for t in wide], kv.block_size), ([t[:2] for t in wide[:2]], 20)]
    try:
        for tables, ctx in steps:
            n = len(tables)
            engine.runner.execute(_decode_step(tables, slots, [ctx] * n, [5] * n))
            size = graphs.size_for(n, 0)
            got = graphs._views[size, 1].block_tables  # what the graph of that size reads
            want = torch.full((size, graphs.max_blocks), -1, dtype=torch.long)
            for i, t in enumerate(tables):
                want[i, : len(t)] = torch.tensor(t)
            want[n:, 0] = kv.scratch_block
            assert torch.equal(got, want), (n, ctx)
    finally:
        _free_rows(engine, wide, slots)


def _two_runs(engine: LLMEngine, prev: torch.Tensor, sources: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of one 3-row decode step with the real ids on the host, and of the same step from the
    same cache with the ids of the rows that have a source (>= 0) in `prev` on the device."""
    tables, slots = _direct_rows(engine, 3, 1)
    ids = [11, 22, 33]
    try:
        saved = _cache_copy(engine)
        ref = engine.runner.execute(_decode_step(tables, slots, [3, 5, 7], ids)).logits.clone()
        _restore(engine, saved)
        out = _decode_step(tables, slots, [3, 5, 7], [None if j >= 0 else t for t, j in zip(ids, sources)])
        pending = PendingTokens(prev, {s.req: j for s, j in zip(out.seqs, sources) if j >= 0})
        assert engine.runner.uses_graph(out)
        got = engine.runner.execute(out, pending).logits.clone()
    finally:
        _free_rows(engine, tables, slots)
    return got, ref


def test_pending_rows_read_the_previous_steps_device_ids(engine_factory):
    engine = engine_factory()
    # rows 0 and 2 read their ids from the device tensor, row 1 keeps its host id
    got, ref = _two_runs(engine, torch.tensor([7, 33, 9, 11]), [3, -1, 1])
    assert torch.equal(got, ref)


def test_pending_ids_beyond_the_buffer_are_gathered_first(engine_factory):
    engine = engine_factory()
    prev = torch.arange(engine.runner.graphs.max_prev + 5) + 1000  # more sampled rows than the buffer holds
    prev[-1], prev[2] = 11, 33
    got, ref = _two_runs(engine, prev, [prev.numel() - 1, -1, 2])
    assert torch.equal(got, ref)


@pytest.mark.parametrize("model", MODELS)
def test_async_engine_outputs_equal_with_and_without_the_static_path(make_engine, model):
    """Mixed steps (prefill chunks beside decodes, a one-token prompt, seeded sampling, an abort) with
    async scheduling: decode steps take their pending ids inside the static path."""

    def run(engine: LLMEngine) -> dict[str, list[int]]:
        for i in range(5):
            engine.add_request(f"r{i}", {"prompt_token_ids": _prompt(i, 1 + 13 * i)},
                               SamplingParams(max_tokens=4 + 3 * i, temperature=0.8 * (i % 2), seed=i, ignore_eos=True))
        engine.add_request("gone", {"prompt_token_ids": _prompt(9, 6)}, SamplingParams(max_tokens=40, ignore_eos=True))
        for _ in range(3):
            engine.step()
        engine.abort_request("gone")
        return drain(engine)

    kw = dict(async_scheduling=True, max_num_seqs=8, max_num_batched_tokens=32, enable_prefix_caching=False)
    graphed = make_engine(model, static_decode_buffers=True, **kw)
    calls = []
    graph_run = graphed.runner.graphs.run
    graphed.runner.graphs.run = lambda inputs, prev=None: calls.append(inputs.pending) or graph_run(inputs, prev)
    assert run(graphed) == run(make_engine(model, static_decode_buffers=False, **kw))
    assert any(calls)  # some decode step took a pending id inside the static path

"""How a sequence is cut into steps must not change what the model computes.

One-pass prefill == chunked prefill with odd chunk sizes == token-by-token decode, with KDA states and
MLA pages carried between calls in the cache pools, several sequences of different lengths per step
(mixed prefill chunks and decodes), block_size 4 so pages span blocks, and non-contiguous block tables
and state slots. Also the kernels' two forms: chunked vs recurrent KDA, absorbed vs expanded MLA.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

from hyserve.models import KimiForCausalLM, load_model, parse_config
from hyserve.models.batch import Batch, CacheTensors
from hyserve.models.config import ModelConfig
from hyserve.models.layers.kda import KimiDeltaAttention
from hyserve.models.layers.mla import MLAttention
from hyserve.models.presets import preset_config
from hyserve.ops import kda as kda_ops
from hyserve.ops import mla_attention as mla_ops

BLOCK_SIZE = 4
LENGTHS = [37, 61, 22]  # tokens per sequence
SLOTS = [3, 0, 2]  # state slot of each sequence (slot 1 unused)
ODD_CHUNKS = [1, 3, 7, 13, 50]

Step = Callable[[torch.Tensor, Batch, CacheTensors], torch.Tensor]


# ---- a tiny engine: cut sequences into steps, carry the cache -------------------------------------


def block_tables(lengths: list[int]) -> tuple[list[list[int]], int]:
    """Interleaved, reversed block ids so no sequence owns a contiguous range."""
    need = [(n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in lengths]
    total = sum(need)
    ids = list(reversed(range(total)))
    tables: list[list[int]] = [[] for _ in lengths]
    for i in itertools.cycle(range(len(lengths))):
        if len(tables[i]) < need[i]:
            tables[i].append(ids.pop())
        if not ids:
            break
    return tables, total


def chunk_plan(lengths: list[int], sizes: list[int] | None) -> list[list[int]]:
    """Per sequence, its chunk sizes: one chunk (None) or cycling through `sizes` from a per-seq offset."""
    plans = []
    for i, n in enumerate(lengths):
        if sizes is None:
            plans.append([n])
            continue
        plan, done, cyc = [], 0, itertools.cycle(sizes[i % len(sizes) :] + sizes[: i % len(sizes)])
        while done < n:
            c = min(next(cyc), n - done)
            plan.append(c)
            done += c
        plans.append(plan)
    return plans


def run_steps(step: Step, inputs: list[torch.Tensor], cache: CacheTensors, sizes: list[int] | None) -> list[torch.Tensor]:
    """Feed every sequence through `step` in chunks; each step batches the next chunk of every live sequence.

    Returns each sequence's outputs concatenated over its positions."""
    lengths = [len(x) for x in inputs]
    tables, _ = block_tables(lengths)
    plans = chunk_plan(lengths, sizes)
    done = [0] * len(inputs)
    outs: list[list[torch.Tensor]] = [[] for _ in inputs]
    for k in range(max(len(p) for p in plans)):
        live = [i for i, p in enumerate(plans) if k < len(p)]
        qlens = [plans[i][k] for i in live]
        batch = Batch.build(
            qlens, [done[i] + q for i, q in zip(live, qlens)], [tables[i] for i in live], BLOCK_SIZE,
            [SLOTS[i] for i in live], [done[i] == 0 for i in live],
        )
        x = torch.cat([inputs[i][done[i] : done[i] + q] for i, q in zip(live, qlens)])
        y = step(x, batch, cache)
        for j, (i, q) in enumerate(zip(live, qlens)):
            outs[i].append(y[int(batch.cu_seqlens[j]) : int(batch.cu_seqlens[j]) + q])
            done[i] += q
    return [torch.cat(o) for o in outs]


def make_cache(cfg: ModelConfig, n_kda: int, n_mla: int) -> CacheTensors:
    _, blocks = block_tables(LENGTHS)
    p, h, k = cfg.kda_proj_dim, cfg.kda_num_heads, cfg.kda_head_dim
    return CacheTensors(
        pages=torch.zeros(blocks, n_mla, BLOCK_SIZE, cfg.kv_row_width),
        conv=torch.zeros(max(SLOTS) + 1, n_kda, 3 * p, cfg.conv_kernel_size - 1),
        recurrent=torch.zeros(max(SLOTS) + 1, n_kda, h, k, k),
    )


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return module.eval().requires_grad_(False)


def sequences(dim: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, dim, generator=gen) for n in LENGTHS]


CONFIGS = {"kimi-linear-tiny": parse_config(preset_config("kimi-linear-tiny")),
           "k3-tiny": parse_config(preset_config("k3-tiny"))}
SCHEDULES = {"odd-chunks": ODD_CHUNKS, "token-by-token": [1]}


# ---- single layers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("preset", sorted(CONFIGS))
def test_kda_layer_is_independent_of_chunking(preset, schedule):
    cfg = CONFIGS[preset]
    layer = randomize(KimiDeltaAttention(cfg, 0), seed=1)
    xs = sequences(cfg.hidden_size)
    one_cache, cut_cache = make_cache(cfg, 1, 0), make_cache(cfg, 1, 0)
    with torch.no_grad():
        want = run_steps(layer, xs, one_cache, None)
        got = run_steps(layer, xs, cut_cache, SCHEDULES[schedule])
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-5
    # the carried state is the same state: both pools end equal in every used slot
    assert rel_err(cut_cache.recurrent[SLOTS], one_cache.recurrent[SLOTS]) < 1e-5
    assert rel_err(cut_cache.conv[SLOTS], one_cache.conv[SLOTS]) < 1e-6


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("preset", sorted(CONFIGS))
def test_mla_layer_is_independent_of_chunking(preset, schedule):
    cfg = CONFIGS[preset]
    layer = randomize(MLAttention(cfg, 0), seed=2)
    xs = sequences(cfg.hidden_size)
    one_cache, cut_cache = make_cache(cfg, 0, 1), make_cache(cfg, 0, 1)
    with torch.no_grad():
        want = run_steps(layer, xs, one_cache, None)
        got = run_steps(layer, xs, cut_cache, SCHEDULES[schedule])
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-5
    assert rel_err(cut_cache.pages, one_cache.pages) < 1e-6


# ---- whole models -----------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request) -> KimiForCausalLM:
    return load_model(request.param, dtype="float32", seed=3)


def model_step(model: KimiForCausalLM) -> Step:
    return lambda ids, batch, cache: model.compute_logits(model(ids, batch, cache))


def prompts(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in LENGTHS]


def batched_cache(model: KimiForCausalLM) -> CacheTensors:
    _, blocks = block_tables(LENGTHS)
    return model.make_cache(blocks, BLOCK_SIZE, max(SLOTS) + 1)


@pytest.mark.parametrize("schedule", [None, *sorted(SCHEDULES)])
@torch.inference_mode()
def test_model_logits_match_one_pass_prefill_of_each_sequence_alone(model, schedule):
    ids = prompts(model.config.vocab_size)
    want = [model.score(x.tolist()) for x in ids]
    got = run_steps(model_step(model), ids, batched_cache(model), SCHEDULES.get(schedule))
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-5


# ---- the kernels' two forms -------------------------------------------------------------------------


def kda_inputs(t: int, h: int, k: int, seed: int = 5) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, kk = (x / x.norm(dim=-1, keepdim=True) for x in (r(t, h, k), r(t, h, k)))
    v = r(t, h, k)
    g = -torch.rand(t, h, k, generator=gen, dtype=torch.float64) * 0.7
    beta = torch.rand(t, h, generator=gen, dtype=torch.float64)
    state = r(h, k, k)
    return q, kk, v, g, beta, state


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_kda_chunked_form_equals_recurrence_in_float64(chunk_size):
    q, k, v, g, beta, state = kda_inputs(45, 3, 8)
    want_o, want_s = kda_ops.kda_recurrent_seq(q, k, v, g, beta, state, 8**-0.5)
    got_o, got_s = kda_ops.kda_chunk(q, k, v, g, beta, state, 8**-0.5, chunk_size=chunk_size)
    assert got_o.dtype == torch.float64
    assert float((got_o - want_o).abs().max()) < 1e-10
    assert float((got_s - want_s).abs().max()) < 1e-10


def test_mla_absorbed_decode_equals_expanded_form():
    gen = torch.Generator().manual_seed(6)
    h, dn, dr, dv, rank, ctx = 4, 16, 8, 12, 24, 19
    pages = torch.randn(9, 2, BLOCK_SIZE, rank + dr, generator=gen)
    table = torch.tensor([7, 2, 5, 0, 8])  # non-contiguous, 5 blocks cover 19 positions
    kv_b = torch.randn(h * (dn + dv), rank, generator=gen) * 0.2
    q_nope, q_rope = torch.randn(1, h, dn, generator=gen), torch.randn(1, h, dr, generator=gen)
    scale = (dn + dr) ** -0.5
    rows = mla_ops.gather_rows(pages, 1, table, ctx)
    want = mla_ops.mla_expanded(q_nope, q_rope, rows, kv_b, rank, dv, scale, start=ctx - 1)
    got = mla_ops.mla_absorbed_decode(
        q_nope, q_rope, pages, 1, table[None], torch.tensor([ctx]), kv_b, rank, dv, scale
    )
    assert rel_err(got, want) < 1e-5


def test_mla_expanded_in_query_chunks_equals_one_pass(monkeypatch):
    gen = torch.Generator().manual_seed(7)
    h, dn, dr, dv, rank, ctx, nq = 4, 16, 8, 12, 24, 40, 29
    rows = torch.randn(ctx, rank + dr, generator=gen)
    kv_b = torch.randn(h * (dn + dv), rank, generator=gen) * 0.2
    q_nope, q_rope = torch.randn(nq, h, dn, generator=gen), torch.randn(nq, h, dr, generator=gen)
    want = mla_ops.mla_expanded(q_nope, q_rope, rows, kv_b, rank, dv, 0.2, start=ctx - nq)
    monkeypatch.setattr(mla_ops, "SCORES_BYTES", 4 * h * ctx * 6)  # chunks of 6 queries, the last one short
    got = mla_ops.mla_expanded(q_nope, q_rope, rows, kv_b, rank, dv, 0.2, start=ctx - nq)
    assert got.shape == want.shape and rel_err(got, want) < 1e-6

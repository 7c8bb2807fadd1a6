"""DSA for K3.1 (spec/models.md §4): index-key formats byte for byte, the top-k rule, sparse MLA, the
cache, and the k3.1-tiny model giving the same logits however a prompt is split into steps."""

from __future__ import annotations

import struct

import pytest
import torch
from dsa_util import run_steps

from hyserve.config import EngineConfig
from hyserve.engine.kv_cache import plan_cache
from hyserve.models import load_model
from hyserve.models.config import parse_config
from hyserve.models.presets import preset_config
from hyserve.ops import dsa_indexer as dsa
from hyserve.ops import mla_attention as mla_ops
from hyserve.ops.sparse_mla import sparse_mla

# ---- FP8 keys (spec §4.4): 128 e4m3 bytes then the fp32 scale ------------------------------------------


def test_fp8_key_record_is_e4m3_bytes_then_the_fp32_scale_with_round_to_nearest_even():
    # amax 448 gives scale exactly 1.0, so each value's byte can be written down from the e4m3 table:
    # sign | 4 exponent bits (bias 7) | 3 mantissa bits; subnormals are m * 2^-9.
    sub = 2.0**-9
    values_and_bytes = [
        (448.0, 0x7E), (-448.0, 0xFE), (1.0, 0x38), (0.5, 0x30), (1.125, 0x39), (0.0, 0x00),
        (1.0625, 0x38),  # halfway 1.0 / 1.125: the even mantissa (1.0)
        (1.1875, 0x3A),  # halfway 1.125 / 1.25: the even mantissa (1.25)
        (sub, 0x01), (1.5 * sub, 0x02), (2.5 * sub, 0x02),  # subnormal ties go to even too
        (-3.0, 0xC4), (240.0, 0x77),  # 240 = 1.875 * 2^7
    ]
    k = torch.zeros(1, 128)
    for i, (v, _) in enumerate(values_and_bytes):
        k[0, i] = v
    rec = dsa.quantize_fp8_keys(k)
    assert rec.shape == (1, 132) and rec.dtype == torch.uint8
    assert rec[0, : len(values_and_bytes)].tolist() == [b for _, b in values_and_bytes]
    assert bytes(rec[0, 128:].tolist()) == struct.pack("<f", 1.0)


def test_fp8_scale_floors_amax_and_round_trips_exactly():
    k = torch.tensor([[3.0, -1.5] + [0.0] * 126, [1e-6] + [0.0] * 127])
    rec = dsa.quantize_fp8_keys(k)
    scales = [struct.unpack("<f", bytes(r[128:].tolist()))[0] for r in rec]
    assert scales[0] == (torch.tensor(3.0) / 448).item()
    assert scales[1] == torch.tensor(1e-4, dtype=torch.float32).div(448).item()  # the 1e-4 floor
    vals, s = dsa.split_fp8_keys(rec)
    assert torch.equal(dsa.dequantize_fp8_keys(rec), vals * s[:, None])
    assert torch.equal(vals[0, :2], torch.tensor([448.0, -224.0]))  # 3/s = 448; -1.5/s = -224 exactly


def test_ue8m0_scales_are_the_next_power_of_two():
    amax = torch.tensor([448.0, 449.0, 224.0, 1e-9])
    assert dsa.fp8_scale(amax, ue8m0=True).tolist() == [1.0, 2.0, 0.5, 2.0**-22]  # 1e-4/448 -> 2^-22


# ---- MXFP4 keys (spec §4.4): 64 code bytes then 4 E8M0 bytes ---------------------------------------------


def test_mxfp4_record_follows_the_spec_rule_byte_for_byte():
    k = torch.zeros(1, 128)
    # group 0, amax 6: e = ceil(log2(6/6)) = 0, byte 127, values taken as they are
    g0 = [6.0, -6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1]
    k[0, : len(g0)] = torch.tensor(g0)
    # group 1, amax 12: e = 1, byte 128, values halved
    k[0, 32:34] = torch.tensor([12.0, 1.0])
    # group 2 all zero: scale byte 0, codes 0
    # group 3, amax 6.5 just above 6: e = 1 (the ceil rule never clips), 6.5/2 = 3.25 -> 3 (code 5)
    k[0, 96] = 6.5
    rec = dsa.quantize_mxfp4_keys(k)
    assert rec.shape == (1, 68)
    # codes: 6 -> 7, -6 -> 8|7, 0.25 -> 0 (tie to even), 0.75 -> 2 (1.0), 1.25 -> 2, 1.75 -> 4 (2.0),
    # 2.5 -> 4, 3.5 -> 6 (4.0), 5 -> 6, -0.1 -> sign only (-0)
    codes = [0x7, 0xF, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x8]
    expect = [codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(5)]
    assert rec[0, :5].tolist() == expect  # element 2i in the low nibble
    assert rec[0, 16].item() == 0x7 | (0x1 << 4)  # 12/2 = 6 -> 7; 1/2 = 0.5 -> 1
    assert rec[0, 48].item() == 0x5
    assert rec[0, 64:].tolist() == [127, 128, 0, 128]
    dec = dsa.dequantize_mxfp4_keys(rec)
    assert dec[0, :10].tolist() == [6.0, -6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0]
    assert dec[0, 32:34].tolist() == [12.0, 1.0] and dec[0, 96].item() == 6.0


def test_mxfp4_scale_exponent_is_exact_next_to_powers_of_two():
    # a = 6 * 2^e exactly keeps exponent e; one ulp above needs e + 1
    a = torch.tensor([6.0 * 2**-3, torch.nextafter(torch.tensor(6.0 * 2**-3), torch.tensor(1.0)).item(), 3.0])
    assert dsa._mx_exponent(a).tolist() == [-3, -2, -1]


def test_mxfp4_decoding_is_exact_and_never_clips():
    k = torch.randn(32, 128, generator=torch.Generator().manual_seed(4)) * torch.logspace(-3, 2, 32)[:, None]
    rec = dsa.quantize_mxfp4_keys(k)
    dec = dsa.dequantize_mxfp4_keys(rec)
    # never clips: |error| <= half the largest E2M1 step (1) of the group's scale
    scale = torch.exp2(dsa.quantize_mxfp4_keys(k)[:, 64:].float() - 127).repeat_interleave(32, 1)
    assert bool(((dec - k).abs() <= scale).all())


# ---- scores and selection (spec §4.3, §4.4, §1.6) --------------------------------------------------------


def test_folded_query_scale_gives_the_dequantised_score():
    gen = torch.Generator().manual_seed(0)
    q, k, w = torch.randn(5, 4, 128, generator=gen), torch.randn(9, 128, generator=gen), torch.randn(5, 4, generator=gen)
    q8, w_folded = dsa.quantize_queries(q, w)
    k8, s_k = dsa.split_fp8_keys(dsa.quantize_fp8_keys(k))
    r1 = dsa.index_scores_q(q8, w_folded, k8, s_k)
    s_q = dsa.fp8_scale(q.abs().amax(-1))
    deq = dsa.index_scores_r0(q8 * s_q[..., None], w, k8 * s_k[:, None])
    torch.testing.assert_close(r1, deq, rtol=1e-5, atol=1e-6)
    # and R1 is a close approximation of R0 on unquantised values
    torch.testing.assert_close(r1, dsa.index_scores_r0(q, w, k), rtol=0.1, atol=0.1)


def test_topk_breaks_ties_by_lower_position_and_is_causal():
    scores = torch.tensor([[5.0, 1.0, 1.0, 9.0, 1.0, 1.0]] * 3)
    qpos = torch.tensor([1, 4, 5])
    got = dsa.topk_causal(scores, qpos, 3)
    # row t=1 sees positions 0..1 only; pad with -1. t=4: 5 (pos 0) then the tie 1,1,1 at 1,2,4 -> 1,2
    assert got.tolist() == [[0, 1, -1], [3, 0, 1], [3, 0, 1]]


def test_topk_tie_rule_holds_against_a_shuffled_reference():
    gen = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 4, (7, 50), generator=gen).float()  # many ties
    qpos = torch.full((7,), 49)
    got = dsa.topk_causal(scores, qpos, 10)
    for t in range(7):
        ref = sorted(range(50), key=lambda s: (-scores[t, s].item(), s))[:10]
        assert got[t].tolist() == ref


# ---- sparse MLA (spec §4.5) --------------------------------------------------------------------------------


def _pages(gen, blocks=4, bs=4, row=20):
    return torch.randn(blocks, 1, bs, row, generator=gen)


def test_sparse_mla_equals_dense_causal_attention_when_topk_covers_the_context():
    gen = torch.Generator().manual_seed(1)
    h, dn, dr, dv, rank, n = 3, 8, 4, 6, 16, 13
    pages = _pages(gen)
    table = torch.tensor([2, 0, 3, 1])
    q_nope, q_rope = torch.randn(n, h, dn, generator=gen), torch.randn(n, h, dr, generator=gen)
    kv_b = torch.randn(h * (dn + dv), rank, generator=gen)
    qpos = torch.arange(n)
    idx = dsa.topk_causal(torch.randn(n, n, generator=gen), qpos, 16)
    sparse = sparse_mla(q_nope, q_rope, pages, 0, table.expand(n, 4), idx, kv_b, rank, dv, 0.3)
    rows = mla_ops.gather_rows(pages, 0, table, n)
    dense = mla_ops.mla_expanded(q_nope, q_rope, rows, kv_b, rank, dv, 0.3, 0)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)


def test_sparse_mla_equals_dense_attention_masked_to_the_selected_rows():
    gen = torch.Generator().manual_seed(2)
    h, dn, dr, dv, rank, n = 2, 8, 4, 6, 16, 14
    pages, table = _pages(gen), torch.tensor([1, 3, 0, 2])
    q_nope, q_rope = torch.randn(n, h, dn, generator=gen), torch.randn(n, h, dr, generator=gen)
    kv_b = torch.randn(h * (dn + dv), rank, generator=gen)
    idx = dsa.topk_causal(torch.randn(n, n, generator=gen), torch.arange(n), 5)
    got = sparse_mla(q_nope, q_rope, pages, 0, table.expand(n, 4), idx, kv_b, rank, dv, 0.25)
    rows = mla_ops.gather_rows(pages, 0, table, n)
    for t in range(n):
        keep = idx[t][idx[t] >= 0]
        ref = mla_ops.mla_expanded(q_nope[t : t + 1], q_rope[t : t + 1], rows[keep], kv_b, rank, dv, 0.25, len(keep))
        torch.testing.assert_close(got[t], ref[0], rtol=1e-5, atol=1e-5)


# ---- cache bytes ---------------------------------------------------------------------------------------------


def test_sparse_mla_in_row_chunks_and_with_per_sequence_tables_equals_one_pass(monkeypatch):
    from hyserve.ops import sparse_mla as sparse_mod

    gen = torch.Generator().manual_seed(3)
    h, dn, dr, dv, rank = 2, 8, 4, 6, 16
    pages = _pages(gen, blocks=6)
    tables = torch.tensor([[1, 3, 0], [5, 2, 4]])
    seq = torch.tensor([0] * 9 + [1] * 5)
    n = len(seq)
    q_nope, q_rope = torch.randn(n, h, dn, generator=gen), torch.randn(n, h, dr, generator=gen)
    kv_b = torch.randn(h * (dn + dv), rank, generator=gen)
    idx = torch.cat([dsa.topk_causal(torch.randn(9, 12, generator=gen), torch.arange(3, 12), 5),
                     dsa.topk_causal(torch.randn(5, 12, generator=gen), torch.arange(7, 12), 5)])
    one = sparse_mla(q_nope, q_rope, pages, 0, tables[seq], idx, kv_b, rank, dv, 0.3)
    monkeypatch.setattr(sparse_mod, "WORKSPACE_BYTES", 1)  # one row per chunk
    chunked = sparse_mla(q_nope, q_rope, pages, 0, tables, idx, kv_b, rank, dv, 0.3, token_seq=seq)
    torch.testing.assert_close(chunked, one, rtol=1e-5, atol=1e-6)  # BLAS blocking differs by row count


def test_index_key_bytes_are_132_fp8_and_68_mxfp4_per_mla_layer():
    k31 = dict(preset_config("k3-mini"), index_n_heads=32, index_head_dim=128, index_topk=2048)
    k31["linear_attn_config"] = dict(k31["linear_attn_config"], full_attn_layers=list(range(4, 97, 4)),
                                     kda_layers=[i for i in range(1, 97) if i % 4])
    k31["num_hidden_layers"] = 96
    fp8 = parse_config(k31)
    mx = parse_config(dict(k31, index_key_format="mxfp4"))
    assert len(fp8.mla_layers) == 24
    assert fp8.index_key_bytes_per_token() == 24 * 132 and mx.index_key_bytes_per_token() == 24 * 68
    assert parse_config(preset_config("k3-mini")).index_key_bytes_per_token() == 0


def test_cache_rows_hold_index_keys_and_the_plan_counts_them():
    model = load_model("k3.1-tiny")
    cache = model.make_cache(3, 8, 1)
    assert cache.index_keys.shape == (3, 2, 8, 16 + 4) and cache.index_keys.dtype == torch.uint8
    assert load_model("k3-tiny").make_cache(3, 8, 1).index_keys is None
    plan = plan_cache(EngineConfig(block_size=8, num_gpu_blocks=3, num_state_slots=2), model, torch.float32, 16)
    assert plan.index_key_bytes == 8 * 2 * 20
    assert plan.page_bytes == 8 * 2 * model.config.kv_row_width * 4 + 8 * 2 * 20
    assert "index keys" in plan.describe()


@pytest.mark.parametrize("fmt,d", [("fp8", 64), ("mxfp4", 64), ("raw", 16)])
def test_key_records_round_trip_through_split_pages(fmt, d):
    """write_key_records / gather_key_records give every record back, whatever the slot order."""
    rec = dsa.key_record_bytes(fmt, d)
    pool = torch.zeros(5, 2, 8, rec, dtype=torch.uint8)
    k = torch.randn(23, d).to(torch.bfloat16)
    records = dsa.encode_keys(k, fmt)
    slots = torch.randperm(40)[:23]
    dsa.write_key_records(pool, fmt, 1, slots, records)
    assert torch.equal(dsa.gather_key_records(pool, fmt, 1, slots // 8, slots % 8), records)
    assert not pool[:, 0].any()  # the other layer is untouched


def test_a_page_holds_its_fp8_values_contiguously_then_its_scales():
    """The FP8 page layout the kernels read: BS rows of D e4m3 bytes, then BS fp32 scales."""
    d, bs = 64, 8
    pool = torch.zeros(2, 1, bs, d + 4, dtype=torch.uint8)
    records = dsa.quantize_fp8_keys(torch.randn(bs, d))
    dsa.write_key_records(pool, "fp8", 0, torch.arange(bs, 2 * bs), records)
    page = pool[1, 0].flatten()
    assert torch.equal(page[: bs * d].view(bs, d), records[:, :d])
    assert torch.equal(page[bs * d :].view(torch.float32), records[:, d:].contiguous().view(torch.float32).flatten())


def test_a_record_of_the_wrong_width_is_refused():
    pool = torch.zeros(2, 1, 8, 68, dtype=torch.uint8)
    with pytest.raises(ValueError, match="132 bytes"):
        dsa.write_key_records(pool, "fp8", 0, torch.arange(3), torch.zeros(3, 132, dtype=torch.uint8))


# ---- k3.1-tiny: one pass == chunked prefill == token by token (top-8 < context) ---------------------------


@pytest.fixture(scope="module", params=["fp8", "raw"])
def k31(request):
    return load_model("k3.1-tiny", index_key_format=request.param)


def test_chunked_prefill_and_decode_match_one_pass(k31):
    prompt = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    (one,) = run_steps(k31, [prompt], [[37]])
    (chunked,) = run_steps(k31, [prompt], [[5, 11, 1, 20]])
    (decode,) = run_steps(k31, [prompt], [[1] * 37])
    torch.testing.assert_close(chunked, one, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(decode, one, rtol=1e-4, atol=1e-5)


def test_the_indexer_takes_long_prefills_in_row_chunks_with_the_same_selection(k31, monkeypatch):
    gen = torch.Generator().manual_seed(8)
    a, b = torch.randint(0, 512, (40,), generator=gen).tolist(), torch.randint(0, 512, (27,), generator=gen).tolist()
    one = run_steps(k31, [a, b], [[30, 10], [27]])
    monkeypatch.setattr(dsa, "WORKSPACE_BYTES", 24 * 40 * 3)  # three rows per chunk at a 40-token context
    chunked = run_steps(k31, [a, b], [[30, 10], [27]])
    for got, want in zip(chunked, one):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_mixed_batch_matches_sequences_run_alone(k31):
    gen = torch.Generator().manual_seed(6)
    a, b = torch.randint(0, 512, (30,), generator=gen).tolist(), torch.randint(0, 512, (21,), generator=gen).tolist()
    together = run_steps(k31, [a, b], [[12, 1, 1, 16], [3, 9, 9]])
    torch.testing.assert_close(together[0], run_steps(k31, [a], [[30]])[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(together[1], run_steps(k31, [b], [[21]])[0], rtol=1e-4, atol=1e-5)


def test_selection_is_really_sparse_and_dense_when_topk_covers_the_context():
    prompt = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(7)).tolist()
    sparse = load_model("k3.1-tiny", index_key_format="raw")
    (got,) = run_steps(sparse, [prompt], [[30]])
    for layer in sparse.model.layers:
        if getattr(layer.self_attn, "indexer", None) is not None:
            layer.self_attn.indexer.topk = 64
    (dense,) = run_steps(sparse, [prompt], [[30]])
    # the first 8 positions see at most 8 tokens: identical; later rows drop context
    torch.testing.assert_close(got[:8], dense[:8], rtol=1e-4, atol=1e-5)
    assert (got[8:] - dense[8:]).abs().max() > 1e-3
    # with top-k covering the context the indexer's scored path agrees with the K3 dense MLA path
    k3 = load_model("k3-tiny")
    k3.load_state_dict({k: v for k, v in sparse.state_dict().items() if ".indexer." not in k})
    (plain,) = run_steps(k3, [prompt], [[30]])
    torch.testing.assert_close(dense, plain, rtol=1e-4, atol=1e-5)


def test_mxfp4_index_keys_run_end_to_end():
    cfg = dict(preset_config("k3.1-tiny"), index_head_dim=32, index_key_format="mxfp4")
    from hyserve.models.loader import build_model, random_init

    model = build_model(parse_config(cfg), torch.float32, "cpu")
    random_init(model, 0)
    prompt = list(range(3, 40))
    (one,) = run_steps(model, [prompt], [[37]])
    (decode,) = run_steps(model, [prompt], [[30] + [1] * 7])
    assert model.make_cache(1, 8, 1).index_keys.shape[-1] == 16 + 1
    torch.testing.assert_close(decode, one, rtol=1e-4, atol=1e-5)

"""KDA GPU fast paths against the torch references (spec §2.4), on the 48B head shape, random inputs."""

from __future__ import annotations

import pytest
import torch

from hyserve.models.layers.norm import gated_rms_norm, l2_normalize
from hyserve.ops import arrival
from hyserve.ops import kda as ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
H, K, W = 32, 128, 4
P = H * K


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values in the fast result"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _params(gen):
    dev = "cuda"
    return dict(
        cw=torch.randn(3 * P, W, device=dev, generator=gen) * 0.3,
        alog=torch.log(torch.rand(H, device=dev, generator=gen) * 15 + 1),
        dtb=torch.rand(P, device=dev, generator=gen) * 2 - 1,
        onw=torch.rand(K, device=dev, generator=gen) + 0.5,
    )


# the launch options besides the default (PDL on an H200): kwargs of kda_decode / kda_decode_multi
OPTIONS = {
    "no-pdl": dict(pdl=False),
    "three-launches": dict(fused_finish=False, pdl=False),
    "pdl": dict(pdl=True),
    "pdl-three-launches": dict(pdl=True, fused_finish=False),
}


@pytest.mark.parametrize("option", list(OPTIONS))  # the default is PDL on an H200
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("n", [1, 7, 64, 300])
def test_decode_kernel_matches_reference(lower_bound, n, option):
    from hyserve.ops.kda_decode import kda_decode

    gen = torch.Generator("cuda").manual_seed(n)
    dev, bf = "cuda", torch.bfloat16
    pr = _params(gen)
    slots_total = n + 5
    x = torch.randn(n, 3 * P, device=dev, generator=gen).to(bf)
    f = torch.randn(n, P, device=dev, generator=gen).to(bf)
    b = torch.randn(n, H, device=dev, generator=gen).to(bf)
    gate = torch.randn(n, P, device=dev, generator=gen).to(bf)
    conv = torch.randn(slots_total, 2, 3 * P, W - 1, device=dev, generator=gen).to(bf)
    rec = torch.randn(slots_total, 2, H, K, K, device=dev, generator=gen) * 0.1
    slots = torch.randperm(slots_total, device=dev, generator=gen)[:n]
    fresh = torch.rand(n, device=dev, generator=gen) < 0.3
    conv[slots[fresh], 1] = float("nan")  # a fresh slot's old contents must never be read
    rec[slots[fresh], 1] = float("nan")

    tails = conv[slots, 1].masked_fill(fresh[:, None, None], 0).double()
    st = rec[slots, 1].masked_fill(fresh[:, None, None, None], 0).double()
    y, new_tails = ref.short_conv_step(x.double(), pr["cw"].double(), tails)
    y = y.double()
    q, k, v = y.to(bf).double().view(n, 3, H, K).unbind(1)
    g = ref.kda_gate(f.view(n, H, K), pr["alog"], pr["dtb"], lower_bound).double()
    o, new_st = ref.kda_recurrent(l2_normalize(q).double(), l2_normalize(k).double(), v, g, torch.sigmoid(b.double()), st, K**-0.5)
    o_ref = gated_rms_norm(o, gate.view(n, H, K).double(), pr["onw"].double(), 1e-5).reshape(n, P)

    untouched = conv[:, 0].clone(), rec[:, 0].clone()
    out = kda_decode(x, f, b, gate, pr["cw"], conv[:, 1], rec[:, 1], pr["alog"], pr["dtb"], pr["onw"], slots,
                     fresh, K**-0.5, 1e-5, lower_bound, **OPTIONS.get(option, {}))
    torch.cuda.synchronize()
    assert rel_err(out, o_ref) < 1e-2
    assert rel_err(rec[slots, 1], new_st) < 1e-2  # q/k/v are rounded to bf16: an ulp flip moves the state ~1e-3
    assert torch.equal(conv[slots, 1].double(), new_tails.to(bf).double())
    assert torch.equal(conv[:, 0], untouched[0]) and torch.equal(rec[:, 0], untouched[1])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_prefill_varlen_matches_reference(lower_bound):
    from hyserve.ops.kda_prefill import causal_conv_varlen, chunk_kda_varlen

    gen = torch.Generator("cuda").manual_seed(1)
    dev, bf = "cuda", torch.bfloat16
    pr = _params(gen)
    lens = [2, 63, 64, 65, 300, 1000]
    n, t = len(lens), sum(lens)
    cu_cpu = torch.tensor([0] + lens).cumsum(0)
    cu = cu_cpu.to(dev)
    x = torch.randn(t, 3 * P, device=dev, generator=gen).to(bf)
    f = torch.randn(t, H, K, device=dev, generator=gen).to(bf)
    b = torch.randn(t, H, device=dev, generator=gen).to(bf)
    tails = torch.randn(n, 3 * P, W - 1, device=dev, generator=gen).to(bf)
    init = torch.randn(n, H, K, K, device=dev, generator=gen) * 0.1
    fresh = torch.tensor([True, False, True, False, False, True], device=dev)
    tails = tails.masked_fill(fresh[:, None, None], 0)
    init = init.masked_fill(fresh[:, None, None, None], 0)

    y, new_tails = causal_conv_varlen(x, pr["cw"], cu, tails)
    q, k, v = (z.contiguous() for z in y.view(t, 3, H, K).unbind(1))
    o, final = chunk_kda_varlen(q, k, v, f, b, pr["alog"], pr["dtb"], lower_bound, K**-0.5, init.clone(), cu, cu_cpu)
    for i in range(n):
        sl = slice(int(cu_cpu[i]), int(cu_cpu[i + 1]))
        yr, tr = ref.short_conv(x[sl].double(), pr["cw"].double(), tails[i].double())
        yr = yr.double()
        assert rel_err(y[sl], yr) < 1e-2
        assert torch.equal(new_tails[i], tr.to(bf))
        qr, kr, vr = yr.to(bf).double().view(-1, 3, H, K).unbind(1)
        g = ref.kda_gate(f[sl], pr["alog"], pr["dtb"], lower_bound).double()
        orf, sr = ref.kda_chunk(l2_normalize(qr).double(), l2_normalize(kr).double(), vr, g, torch.sigmoid(b[sl].double()),
                                init[i].double(), K**-0.5)
        assert rel_err(o[sl], orf) < 2e-2, i
        assert rel_err(final[i], sr) < 2e-2, i


def test_prefill_chunk_list_built_on_the_device_gives_the_same_outputs_without_a_sync():
    from hyserve.ops.kda_prefill import chunk_kda_varlen

    gen = torch.Generator("cuda").manual_seed(2)
    dev, bf = "cuda", torch.bfloat16
    pr = _params(gen)
    lens = [1, 64, 130, 700, 3]
    n, t = len(lens), sum(lens)
    cu_cpu = torch.tensor([0] + lens).cumsum(0)
    cu = cu_cpu.to(dev)
    q, k, v, f = (torch.randn(t, H, K, device=dev, generator=gen).to(bf) for _ in range(4))
    b = torch.randn(t, H, device=dev, generator=gen).to(bf)
    init = torch.randn(n, H, K, K, device=dev, generator=gen) * 0.1

    def run(device_indices: bool):
        return chunk_kda_varlen(q, k, v, f, b, pr["alog"], pr["dtb"], -5.0, K**-0.5, init.clone(), cu, cu_cpu,
                                device_indices=device_indices)

    host, device = run(False), run(True)  # the first calls autotune (which synchronizes)
    assert torch.equal(host[0], device[0]) and torch.equal(host[1], device[1])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = run(True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again[0], device[0])


@pytest.mark.parametrize("option", ["no-pdl", "pdl"])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("n", [1, 64])
@pytest.mark.parametrize("t", [2, 16])
def test_multi_token_decode_kernel_matches_reference(lower_bound, n, t, option):
    """T tokens per sequence in one launch against T single-token reference steps (spec §2.4, step 6)."""
    from hyserve.ops.kda_decode import kda_decode_multi

    gen = torch.Generator("cuda").manual_seed(1000 * t + n)
    dev, bf = "cuda", torch.bfloat16
    pr = _params(gen)
    slots_total = n + 5
    x = torch.randn(n * t, 3 * P, device=dev, generator=gen).to(bf)  # sequence-major rows
    f = torch.randn(n * t, P, device=dev, generator=gen).to(bf)
    b = torch.randn(n * t, H, device=dev, generator=gen).to(bf)
    gate = torch.randn(n * t, P, device=dev, generator=gen).to(bf)
    conv = torch.randn(slots_total, 2, 3 * P, W - 1, device=dev, generator=gen).to(bf)
    rec = torch.randn(slots_total, 2, H, K, K, device=dev, generator=gen) * 0.1
    slots = torch.randperm(slots_total, device=dev, generator=gen)[:n]
    fresh = torch.rand(n, device=dev, generator=gen) < 0.3
    if n == 1:
        fresh[0] = t == 4  # both kinds at batch 1 too
    conv[slots[fresh], 1] = float("nan")
    rec[slots[fresh], 1] = float("nan")

    tails = conv[slots, 1].masked_fill(fresh[:, None, None], 0).double()
    st = rec[slots, 1].masked_fill(fresh[:, None, None, None], 0).double()
    o_ref = torch.empty(n * t, P, dtype=torch.float64, device=dev)
    for j in range(t):
        r = torch.arange(n, device=dev) * t + j
        y, tails = ref.short_conv_step(x[r].double(), pr["cw"].double(), tails)
        q, k, v = y.to(bf).double().view(n, 3, H, K).unbind(1)
        g = ref.kda_gate(f[r].view(n, H, K), pr["alog"], pr["dtb"], lower_bound).double()
        o, st = ref.kda_recurrent(l2_normalize(q).double(), l2_normalize(k).double(), v, g, torch.sigmoid(b[r].double()),
                                  st, K**-0.5)
        o_ref[r] = gated_rms_norm(o, gate[r].view(n, H, K).double(), pr["onw"].double(), 1e-5).reshape(n, P).double()

    others = torch.ones(slots_total, dtype=torch.bool, device=dev)
    others[slots] = False
    untouched = conv[:, 0].clone(), rec[:, 0].clone(), conv[others, 1].clone(), rec[others, 1].clone()
    out = kda_decode_multi(x, f, b, gate, pr["cw"], conv[:, 1], rec[:, 1], pr["alog"], pr["dtb"], pr["onw"], slots,
                           fresh, K**-0.5, 1e-5, lower_bound, t, **OPTIONS.get(option, {}))
    torch.cuda.synchronize()
    assert out.shape == (n * t, P)
    assert rel_err(out, o_ref) < 1e-2
    assert rel_err(rec[slots, 1], st) < 1e-2
    assert torch.equal(conv[slots, 1].double(), tails.to(bf).double())
    assert torch.equal(conv[:, 0], untouched[0]) and torch.equal(rec[:, 0], untouched[1])
    assert torch.equal(conv[others, 1], untouched[2]) and torch.equal(rec[others, 1], untouched[3])


def _graph_case(n: int, t: int, seed: int):
    """Inputs of n sequences x t tokens (filled per replay by the test), pools with n + 5 slots, the slots
    and fresh flags, for the graph-replay tests."""
    gen = torch.Generator("cuda").manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16
    pr = _params(gen)
    slots_total = n + 5
    x, f, gate = (torch.empty(n * t, c, device=dev, dtype=bf) for c in (3 * P, P, P))
    b = torch.empty(n * t, H, device=dev, dtype=bf)
    conv = torch.randn(slots_total, 3 * P, W - 1, device=dev, generator=gen).to(bf)
    rec = torch.randn(slots_total, H, K, K, device=dev, generator=gen) * 0.1
    slots = torch.randperm(slots_total, device=dev, generator=gen)[:n]
    fresh = torch.zeros(n, dtype=torch.bool, device=dev)
    return gen, pr, x, f, gate, b, conv, rec, slots, fresh


@pytest.mark.parametrize("capture_allocates", [False, True], ids=["shared-counters", "counters-in-graph"])
@pytest.mark.parametrize(("n", "t"), [(3, 1), (64, 1), (64, 4), (300, 1)])
def test_fused_finish_under_graph_replay_equals_the_finish_launch(n, t, capture_allocates, monkeypatch):
    """Replays of one captured graph reuse the same arrival counters: each replay, over new inputs and the
    states the one before wrote, gives what the three-launch path gives eagerly, and leaves the counters
    zero for the next. counters-in-graph: no shared buffer is big enough at capture, so the launch gets
    counters zeroed inside the graph."""
    from hyserve.ops import kda_decode as dec

    gen, pr, x, f, gate, b, conv, rec, slots, fresh = _graph_case(n, t, 10 * n + t)

    def decode(conv_: torch.Tensor, rec_: torch.Tensor, fused: bool) -> torch.Tensor:
        return dec.kda_decode_multi(x, f, b, gate, pr["cw"], conv_, rec_, pr["alog"], pr["dtb"], pr["onw"], slots,
                                    fresh, K**-0.5, 1e-5, None, t, fused_finish=fused)

    for y in (x, f, b, gate):
        y.copy_(torch.randn(y.shape, device="cuda", generator=gen))
    side = torch.cuda.Stream()  # compiles and counter growth outside the capture, as torch.cuda.graph expects
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode(conv.clone(), rec.clone(), True)
    torch.cuda.current_stream().wait_stream(side)
    if capture_allocates:
        monkeypatch.setattr(arrival, "_BUFFERS", {})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode(conv, rec, True)
    shared = arrival._BUFFERS.get(x.device, [])
    assert not capture_allocates or not shared  # a capture must not cache counters only the graph zeroes
    monkeypatch.undo()

    conv_ref, rec_ref = conv.clone(), rec.clone()
    for step in range(3):
        for y in (x, f, b, gate):
            y.copy_(torch.randn(y.shape, device="cuda", generator=gen))
        fresh.copy_(torch.rand(n, device="cuda", generator=gen) < (0.3 if step == 1 else 0.0))
        want = decode(conv_ref, rec_ref, False)
        graph.replay()
        torch.cuda.synchronize()
        # the same raw rows; the norm's sum may reduce in another order (other warp counts): bf16 ulps at most
        assert rel_err(out, want) < 2e-3, step
        assert rel_err(rec, rec_ref) < 1e-6 and torch.equal(conv, conv_ref), step
        assert all(int(buf.count_nonzero()) == 0 for buf in arrival._BUFFERS.get(x.device, [])), step


@pytest.mark.parametrize(("n", "t"), [(3, 1), (64, 1), (64, 4), (300, 1)])
def test_pdl_under_graph_replay_equals_the_plain_eager_calls(n, t):
    """Replays of a graph of two back-to-back PDL calls (the second on the states the first wrote, as the
    layers of a step graph follow one another) equal the same calls made eagerly with plain launches, bit
    for bit (the same arithmetic; only the launch overlaps). Each replay runs on new inputs and on the
    states the one before wrote."""
    from hyserve.ops import kda_decode as dec

    gen, pr, x, f, gate, b, conv, rec, slots, fresh = _graph_case(n, t, 20 * n + t)
    kw = {"pdl": False}  # the eager reference: the plain launches

    def decode(conv_: torch.Tensor, rec_: torch.Tensor, **opts) -> list[torch.Tensor]:
        return [dec.kda_decode_multi(x, f, b, gate, pr["cw"], conv_, rec_, pr["alog"], pr["dtb"], pr["onw"], slots,
                                     fresh, K**-0.5, 1e-5, -5.0, t, **opts) for _ in range(2)]

    for y in (x, f, b, gate):
        y.copy_(torch.randn(y.shape, device="cuda", generator=gen))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode(conv.clone(), rec.clone(), pdl=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = decode(conv, rec, pdl=True)

    conv_ref, rec_ref = conv.clone(), rec.clone()
    for step in range(3):
        for y in (x, f, b, gate):
            y.copy_(torch.randn(y.shape, device="cuda", generator=gen))
        fresh.copy_(torch.rand(n, device="cuda", generator=gen) < (0.3 if step == 1 else 0.0))
        wants = decode(conv_ref, rec_ref, **kw)
        graph.replay()
        torch.cuda.synchronize()
        for out, want in zip(outs, wants, strict=True):
            assert torch.equal(out, want), step
        assert torch.equal(rec, rec_ref) and torch.equal(conv, conv_ref), step
        assert all(int(buf.count_nonzero()) == 0 for buf in arrival._BUFFERS.get(x.device, [])), step


def test_prefill_output_norm_kernel_matches_the_fp32_norm():
    """48B head shape, bf16 fla output and a gate slice of the merged projection, 1000 tokens."""
    from hyserve.ops.kda_out_norm import gated_rms_norm_rows

    gen = torch.Generator(device="cuda").manual_seed(3)
    o = torch.randn(1000, 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
    gate = torch.randn(1000, 5000, device="cuda", generator=gen).to(torch.bfloat16)[:, 100:4196]
    w = torch.rand(128, device="cuda", generator=gen) + 0.5
    want = gated_rms_norm(o, gate.reshape(1000, 32, 128), w, 1e-5).reshape(1000, 4096)
    got = gated_rms_norm_rows(o, gate, w, 1e-5, torch.bfloat16)
    assert ((got.float() - want).norm() / want.norm()).item() < 5e-3

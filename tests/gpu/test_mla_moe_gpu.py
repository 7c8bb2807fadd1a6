"""MLA decode / prefill and grouped-MoE GPU paths against the torch references (48B shapes)."""

from __future__ import annotations

import pytest
import torch

from hyserve.models.layers.activation import GLU
from hyserve.ops import mla_attention as ref
from hyserve.ops import moe as moe_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
H, DN, DR, DV, R, BS = 32, 128, 64, 128, 512, 64


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values in the fast result"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _pages(ctx: list[int], gen, layers: int = 2):
    blocks = [(c + BS - 1) // BS for c in ctx]
    nb = sum(blocks) + 3
    pages = torch.randn(nb, layers, BS, R + DR, device="cuda", generator=gen).to(torch.bfloat16)
    perm = torch.randperm(nb, device="cuda", generator=gen)
    bt = torch.full((len(ctx), max(blocks)), -1, dtype=torch.long, device="cuda")
    s = 0
    for i, nblk in enumerate(blocks):
        bt[i, :nblk] = perm[s : s + nblk]
        s += nblk
    return pages, bt


@pytest.mark.parametrize("ctx", [[1], [77, 1000, 5], [32768, 4000]])
def test_mla_decode_matches_reference(ctx):
    from hyserve.ops.mla_decode import mla_absorbed_decode_fast

    gen = torch.Generator("cuda").manual_seed(len(ctx))
    pages, bt = _pages(ctx, gen)
    n = len(ctx)
    kvb = (torch.randn(H * (DN + DV), R, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    qn = torch.randn(n, H, DN, device="cuda", generator=gen).to(torch.bfloat16)
    qr = torch.randn(n, H, DR, device="cuda", generator=gen).to(torch.bfloat16)
    ctx_t = torch.tensor(ctx, device="cuda")
    scale = (DN + DR) ** -0.5
    o_ref = ref.mla_absorbed_decode(qn, qr, pages, 1, bt, ctx_t, kvb, R, DV, scale)
    o = mla_absorbed_decode_fast(qn, qr, pages, 1, bt, ctx_t, max(ctx), kvb, R, DV, scale)
    assert rel_err(o, o_ref) < 1e-2


# The default (heads-major, 64-row tiles, 8 warps, 3 stages, L2 prefetch 2) and one of each other knob
# (heads64 = heads padded to 64, wgmma; bf16 split partials);
# gpu_kernels.py --only mla checks every swept config against an fp32 reference before timing it.
MLA_VARIANTS = [
    {},
    {"layout": "rows", "num_warps": 4, "num_stages": 2},
    {"prefetch": 0},
    {"pdl": True},
    {"block_n": 32},
    {"num_warps": 4},
    {"layout": "heads64", "block_n": 32, "num_stages": 4},
    {"layout": "heads64", "block_n": 64, "num_stages": 2},
    {"partial_dtype": torch.bfloat16},
    {"layout": "heads64", "block_n": 32, "num_stages": 4, "partial_dtype": torch.bfloat16},
    {"layout": "wgmma"},
    {"layout": "wgmma", "prefetch": 0},
]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _latent_reference(qf, pages, bt, ctx, scale):
    """o_lat [H, R] per sequence in fp32 from its gathered rows."""
    out = []
    for i, c in enumerate(ctx):
        rows = ref.gather_rows(pages, 1, bt[i], c).float()
        p = torch.softmax(qf[i].float() @ rows.t() * scale, -1)
        out.append(p @ rows[:, :R])
    return out


@pytest.mark.parametrize("kw", MLA_VARIANTS,
                         ids=lambda kw: "-".join(f"{k}{str(v).removeprefix('torch.')}" for k, v in kw.items()) or "default")
@pytest.mark.parametrize("ctx,max_context", [([32768, 4000], None), ([1, 77, 1000, 5], None), ([63, 130, 1], 131072)],
                         ids=["32K", "short", "graph-plan"])
def test_mla_decode_latent_variants(kw, ctx, max_context):
    """bf16 rows and queries at the 48B shape against fp32 attention over the same rows; the graph-plan
    case splits for max_model_len 128K, so most splits see no row."""
    from hyserve.ops.mla_decode import mla_decode_latent

    if kw.get("layout") == "wgmma" and not HOPPER:
        pytest.skip("the Gluon kernel is wgmma: Hopper only")
    gen = torch.Generator("cuda").manual_seed(len(ctx))
    pages, bt = _pages(ctx, gen)
    qf = torch.randn(len(ctx), H, R + DR, device="cuda", generator=gen).to(torch.bfloat16)
    scale = (DN + DR) ** -0.5
    ctx_t = torch.tensor(ctx, device="cuda")
    got = mla_decode_latent(qf, pages[:, 1], bt, ctx_t, max_context or max(ctx), scale, R, **kw)
    for i, want in enumerate(_latent_reference(qf, pages, bt, ctx, scale)):
        assert rel_err(got[i], want) < 1e-2, i


@pytest.mark.parametrize("layout", ["heads", "wgmma"])
@pytest.mark.parametrize("heads", [H, 8])
def test_mla_decode_gives_rows_past_the_context_no_weight_even_when_they_hold_nan(layout, heads):
    """A page's rows past the context may hold anything: they must not reach the result, NaN included
    (a zero weight times NaN is NaN). 8 heads: a head block mostly masked."""
    from hyserve.ops.mla_decode import mla_decode_latent

    if layout == "wgmma" and not HOPPER:
        pytest.skip("the Gluon kernel is wgmma: Hopper only")
    ctx = [1, 65, 200, 4095]
    gen = torch.Generator("cuda").manual_seed(9)
    pages, bt = _pages(ctx, gen)
    for i, c in enumerate(ctx):  # everything after the context in its last page
        last = bt[i, (c - 1) // BS]
        pages[last, :, (c - 1) % BS + 1 :] = float("nan")
    qf = torch.randn(len(ctx), heads, R + DR, device="cuda", generator=gen).to(torch.bfloat16)
    scale = (DN + DR) ** -0.5
    got = mla_decode_latent(qf, pages[:, 1], bt, torch.tensor(ctx, device="cuda"), 8192, scale, R, layout=layout)
    for i, want in enumerate(_latent_reference(qf, pages, bt, ctx, scale)):
        assert rel_err(got[i], want) < 1e-2, i


@pytest.mark.parametrize("layout", ["heads", "wgmma"])
@pytest.mark.parametrize("pdl", [False, True])
def test_mla_decode_replays_from_a_cuda_graph(pdl, layout):
    """Captured once for max_context 8192 (as the engine captures for max_model_len), replayed after the
    contexts and block tables changed in place: the same result as eager calls."""
    from hyserve.ops.mla_decode import mla_decode_latent

    if layout == "wgmma" and not HOPPER:
        pytest.skip("the Gluon kernel is wgmma: Hopper only")

    gen = torch.Generator("cuda").manual_seed(5)
    pages, bt = _pages([8192, 8192, 8192], gen)
    qf = torch.randn(3, H, R + DR, device="cuda", generator=gen).to(torch.bfloat16)
    ctx_t = torch.tensor([8192, 300, 1], device="cuda")
    scale = (DN + DR) ** -0.5

    def call():
        return mla_decode_latent(qf, pages[:, 1], bt, ctx_t, 8192, scale, R, pdl=pdl, layout=layout)

    call()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for lens in ([8192, 300, 1], [64, 8000, 4097]):
        ctx_t.copy_(torch.tensor(lens))
        bt.copy_(bt.flip(0))
        graph.replay()
        torch.testing.assert_close(out, call(), rtol=0, atol=0)


def test_mla_prefill_matches_reference():
    from hyserve.ops.mla_decode import mla_prefill_fast

    gen = torch.Generator("cuda").manual_seed(3)
    ql, cl = [300, 64, 2], [300, 1000, 70]
    pages, bt = _pages(cl, gen)
    kvb = (torch.randn(H * (DN + DV), R, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    qn = torch.randn(sum(ql), H, DN, device="cuda", generator=gen).to(torch.bfloat16)
    qr = torch.randn(sum(ql), H, DR, device="cuda", generator=gen).to(torch.bfloat16)
    scale = (DN + DR) ** -0.5
    o = mla_prefill_fast(qn, qr, pages, 1, bt, ql, cl, kvb, R, DV, scale)
    q0 = 0
    for i, (nq, nc) in enumerate(zip(ql, cl)):
        rows = ref.gather_rows(pages, 1, bt[i], nc)
        r = ref.mla_expanded(qn[q0 : q0 + nq], qr[q0 : q0 + nq], rows, kvb, R, DV, scale, nc - nq)
        assert rel_err(o[q0 : q0 + nq], r) < 1e-2, i
        q0 += nq


@pytest.mark.parametrize("t", [1, 8, 64, 1000, 2000, 5000])
def test_grouped_moe_matches_reference(t):
    from hyserve.ops.moe_gemv import experts_forward_gemv
    from hyserve.ops.moe_grouped import experts_forward_grouped
    from hyserve.ops.moe_triton import experts_forward_triton

    gen = torch.Generator("cuda").manual_seed(t)
    e, d, inter, k = 256, 2304, 1024, 8
    x = torch.randn(t, d, device="cuda", generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(e, 2 * inter, d, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(e, d, inter, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    gw = torch.randn(e, d, device="cuda", generator=gen) * 0.02
    ids, w = moe_ref.route(x, gw, None, k, renormalize=True, scaling=2.446)
    act = GLU("silu")
    y_ref = moe_ref.experts_forward(x.float(), ids, w, w13.float(), w2.float(), act)
    assert rel_err(experts_forward_grouped(x, ids, w, w13, w2, act), y_ref) < 1e-2
    assert rel_err(experts_forward_triton(x, ids, w, w13, w2, act), y_ref) < 1e-2
    if t <= 8:
        assert rel_err(experts_forward_gemv(x, ids, w, w13, w2, act), y_ref) < 1e-2


@pytest.mark.parametrize("t", [64, 2000], ids=["pairs in one block", "pairs read in blocks"])
def test_triton_grouped_moe_replays_from_a_cuda_graph(t):
    """Decode steps run in CUDA graphs: neither tile layout may read anything back to the host."""
    from hyserve.ops.moe_triton import experts_forward_triton

    gen = torch.Generator("cuda").manual_seed(t)
    e, d, inter, k = 64, 512, 256, 8
    x = torch.randn(t, d, device="cuda", generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(e, 2 * inter, d, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(e, d, inter, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    ids, w = moe_ref.route(x, torch.randn(e, d, device="cuda", generator=gen) * 0.05, None, k, renormalize=True,
                           scaling=1.0)
    act = GLU("silu")
    eager = experts_forward_triton(x, ids, w, w13, w2, act)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        experts_forward_triton(x, ids, w, w13, w2, act)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts_forward_triton(x, ids, w, w13, w2, act)
    graph.replay()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


@pytest.mark.parametrize("t", [2048, 8192])
@pytest.mark.parametrize("bm", [16, 128])
def test_the_layout_kernel_equals_the_torch_layout_at_prefill_sizes(t, bm):
    from hyserve.ops.moe_triton import expert_tiles, expert_tiles_triton

    gen = torch.Generator("cuda").manual_seed(t)
    ids = torch.rand(t, 256, device="cuda", generator=gen).topk(8, -1).indices
    pairs, tiles, used = expert_tiles_triton(ids, 256, bm)
    want_pairs, want_tiles, want_used = expert_tiles(ids, 256, bm)
    n = int(want_used)
    assert int(used) == n
    assert torch.equal(pairs[:n].long(), want_pairs[:n]) and torch.equal(tiles[: n // bm].long(), want_tiles[: n // bm])


@pytest.mark.parametrize("t", [1, 8])
def test_gemv_experts_carry_the_shared_expert(t):
    """48B shape: the shared expert as the last pair of the two GEMV launches, silu fused into the down
    kernel, against the reference routed experts plus the shared DenseMLP in fp32."""
    from hyserve.models.layers.moe import DenseMLP
    from hyserve.ops.moe_gemv import experts_forward_gemv, shared_fits

    gen = torch.Generator("cuda").manual_seed(t)
    e, d, inter, k = 256, 2304, 1024, 8
    x = torch.randn(t, d, device="cuda", generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(e, 2 * inter, d, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(e, d, inter, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    act = GLU("silu")
    shared = DenseMLP(d, inter, act).cuda()
    for p in shared.parameters():
        p.data = (torch.randn(p.shape, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    assert shared_fits(shared, w13, w2)
    ids, w = moe_ref.route(x, torch.randn(e, d, device="cuda", generator=gen) * 0.02, None, k, renormalize=True,
                           scaling=2.446)
    xf, (g, u, dn) = x.float(), (m.weight.float() for m in (shared.gate_proj, shared.up_proj, shared.down_proj))
    y_ref = moe_ref.experts_forward(xf, ids, w, w13.float(), w2.float(), act) + act(xf @ g.t(), xf @ u.t()) @ dn.t()
    with torch.no_grad():
        got = experts_forward_gemv(x, ids, w, w13, w2, act, shared=shared)
    assert rel_err(got, y_ref) < 1e-2


@pytest.mark.parametrize("tokens", [1, 64])
def test_fused_router_selects_as_the_reference(tokens):
    """48B router shape (256 experts, top 8, bias, renormalised, scaled): the same experts, ties included."""
    from hyserve.ops.router_topk import route_topk_fast

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 2304, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(256, 2304, device="cuda", generator=gen) * 0.02
    bias = torch.randn(256, device="cuda", generator=gen) * 0.01
    logits = x.float() @ w.t()
    logits[0, [3, *range(10, 20)]] = logits[0].max() + 1  # 11 experts tie at the top: ids 3, 10, ..., 16 win
    bias[[3, *range(10, 20)]] = bias.max().item()
    ids, wts = route_topk_fast(logits, bias, 8, True, 2.446)
    # the reference from the same logits: x = logits against an identity gate (exact in fp32)
    ref_ids, ref_w = moe_ref.route(logits, torch.eye(256, device="cuda"), bias, 8, renormalize=True, scaling=2.446)
    assert ids[0].tolist() == [3, 10, 11, 12, 13, 14, 15, 16]
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(wts, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 4])
def test_one_launch_router_selects_as_logits_then_selection(tokens):
    """48B router shape from bf16 activations, twice in a row: the same experts as the reference on the
    same fp32 logits, weights to fp32 rounding of the GEMV's sum order."""
    from hyserve.ops.router_topk import router_fused

    gen = torch.Generator(device="cuda").manual_seed(10 + tokens)
    x = torch.randn(tokens, 2304, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(256, 2304, device="cuda", generator=gen) * 0.02
    bias = torch.randn(256, device="cuda", generator=gen) * 0.01
    ref_ids, ref_w = moe_ref.route(x, w, bias, 8, renormalize=True, scaling=2.446)
    for _ in range(2):
        ids, wts = router_fused(x, w, bias, 8, True, 2.446)
        torch.cuda.synchronize()
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(wts, ref_w, rtol=1e-4, atol=1e-5)


def test_router_with_pdl_equals_the_plain_launches_in_a_graph_replay():
    """The logits and selection kernels as programmatic dependents, right after a kernel that writes x:
    the same ids and weights, bit for bit, as plain launches."""
    from hyserve.ops.router_topk import router_fused

    gen = torch.Generator(device="cuda").manual_seed(21)
    src = torch.randn(1, 2304, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(256, 2304, device="cuda", generator=gen) * 0.02
    bias = torch.randn(256, device="cuda", generator=gen) * 0.01
    x = torch.empty_like(src)
    x.copy_(src)
    plain = router_fused(x, w, bias, 8, True, 2.446, pdl=False)
    x.zero_()
    router_fused(x, w, bias, 8, True, 2.446, pdl=True)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(src, 1.0, out=x)  # a kernel (not a copy node) writes x just before the dependent launch
        got = router_fused(x, w, bias, 8, True, 2.446, pdl=True)
    x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


def test_cache_write_kernel_stores_the_layers_rows_in_bf16():
    """48B widths (latent 512, rope 64): every element as the torch norm, cat and store give it."""
    from hyserve.models.layers.norm import rms_norm
    from hyserve.ops.dispatch import reference_ops
    from hyserve.ops.mla_cache import write_cache_rows

    gen = torch.Generator(device="cuda").manual_seed(5)
    ckv = torch.randn(37, 576 + 4096, device="cuda", generator=gen).to(torch.bfloat16)[:, :576]
    weight = (torch.rand(512, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    pages = torch.randn(8, 2, 64, 576, device="cuda", generator=gen).to(torch.bfloat16)
    slots = torch.randperm(8 * 64, device="cuda", generator=gen)[:37]
    want = pages.clone()
    with reference_ops():
        rows = torch.cat([rms_norm(ckv[:, :512], weight, 1e-6), ckv[:, 512:]], -1)
    want[slots // 64, 1, slots % 64] = rows
    write_cache_rows(ckv, weight, 1e-6, pages, 1, slots)
    assert (pages.float() - want.float()).abs().max().item() <= 2 ** -7 * want.float().abs().max().item()


@pytest.mark.parametrize("n,k", [(2304, 4096), (12576, 2304), (6720, 2304), (163840, 2304)])
def test_single_token_gemv_matches_the_fp32_product(n, k):
    """The 48B attention output, KDA input, MLA input and lm_head shapes, in bf16, with each shape's tiles."""
    from hyserve.ops.dense_gemv import gemv

    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    assert rel_err(gemv(x, w), x.float() @ w.float().t()) < 1e-2


@pytest.mark.parametrize("t,split", [(5, 1), (8, 4), (16, 2)])
@pytest.mark.parametrize("n,k", [(2304, 4096), (12576, 2304)])
def test_tokens_gemv_matches_the_fp32_product(n, k, t, split):
    """A verify step's rows through `gemv_tokens` (tensor-core dots), in bf16, K split or not."""
    from hyserve.ops.dense_gemv import gemv_tokens

    gen = torch.Generator(device="cuda").manual_seed(n + t)
    x = torch.randn(t, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    assert rel_err(gemv_tokens(x, w, (32, 128, 4, 3, split)), x.float() @ w.float().t()) < 1e-2


def test_lm_head_gemv_into_the_fp32_logits_buffer_equals_its_bf16_result_converted():
    """compute_logits' path at one token: the GEMV stores straight into the fp32 buffer the values its bf16
    result would hold, bit for bit."""
    from hyserve.ops.dense_gemv import gemv

    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(1, 2304, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(163840, 2304, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    out = torch.full((1, 163840), float("nan"), device="cuda")
    gemv(x, w, out=out)
    assert torch.equal(out, gemv(x, w).float())


@pytest.mark.parametrize("split", [2, 4])
def test_split_k_gemv_matches_the_fp32_product_twice(split):
    """The attention output shape split over K: the last split of each row block sums the parts; a second
    call on the same counters must agree bit for bit (the sum runs in split order)."""
    from hyserve.ops.dense_gemv import gemv

    gen = torch.Generator(device="cuda").manual_seed(split)
    x = torch.randn(1, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(2304, 4096, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    first = gemv(x, w, (16, 256, 4, 3, split))
    assert rel_err(first, x.float() @ w.float().t()) < 1e-2
    assert torch.equal(gemv(x, w, (16, 256, 4, 3, split)), first)


@pytest.mark.parametrize("n,k", [(2304, 4096), (163840, 2304)], ids=["split, prefetched", "lm_head"])
def test_gemv_with_pdl_after_the_kernel_that_writes_x_equals_the_plain_launch(n, k):
    """Launched as a programmatic dependent (the attention output's weight asked into L2 before the wait),
    right after a kernel that writes x, eagerly and in a graph replay: bit for bit the plain launch."""
    from hyserve.ops.dense_gemv import gemv

    gen = torch.Generator(device="cuda").manual_seed(n + 1)
    src = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    x = src.clone()
    plain = gemv(x, w, pdl=False)
    x.zero_()
    torch.mul(src, 1.0, out=x)
    assert torch.equal(gemv(x, w, pdl=True), plain)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(src, 1.0, out=x)  # a kernel, not a copy node, right before the dependent launch
        got = gemv(x, w, pdl=True)
    x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, plain)


def test_one_token_dense_mlp_matches_the_fp32_mlp():
    """The 48B layer-0 MLP (9216 wide) on one token: gate | up as one GEMM, the SiLU-GLU read by the split
    down GEMV, as the 48B model's kernel plan on this GPU picks them."""
    from hyserve.models.config import parse_config
    from hyserve.models.layers.moe import DenseMLP
    from hyserve.models.presets import preset_config
    from hyserve.ops.device_spec import DeviceSpec
    from hyserve.ops.kernel_plan import plan_kernels

    plan = plan_kernels(parse_config(preset_config("kimi-linear-48b-a3b")), DeviceSpec.of("cuda"), torch.bfloat16)
    torch.manual_seed(7)
    mlp = DenseMLP(2304, 9216, GLU("silu")).cuda()
    for p in mlp.parameters():
        p.data.normal_(0, 0.02)
    mlp = mlp.to(torch.bfloat16)
    x = torch.randn(1, 2304, device="cuda").to(torch.bfloat16)
    g, u, d = (m.weight.float() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    with torch.no_grad():
        assert plan.dense_mlp_one_token(x, "silu", *mlp.parameters())
        got = mlp(x, plan)
    want = GLU("silu")(x.float() @ g.t(), x.float() @ u.t()) @ d.t()
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < 1e-2


@pytest.mark.parametrize("tokens", [1, 4])
def test_gemv_experts_with_pdl_equal_the_plain_launches_bit_for_bit(tokens):
    """The down and sum kernels launched as programmatic dependents (down weights prefetched before the
    wait) compute the same sums in the same order, eagerly and in a graph replay."""
    from hyserve.models.layers.moe import DenseMLP
    from hyserve.ops.moe_gemv import experts_forward_gemv

    gen = torch.Generator(device="cuda").manual_seed(40 + tokens)
    e, d, inter, k = 64, 2304, 1024, 8
    w13 = (torch.randn(e, 2 * inter, d, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(e, d, inter, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    shared = DenseMLP(d, inter, GLU("silu")).cuda().to(torch.bfloat16)
    x = torch.randn(tokens, d, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device="cuda", generator=gen)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, device="cuda", generator=gen)
    with torch.no_grad():
        plain = experts_forward_gemv(x, ids, w, w13, w2, GLU("silu"), shared=shared, pdl=False)
        assert torch.equal(experts_forward_gemv(x, ids, w, w13, w2, GLU("silu"), shared=shared, pdl=True), plain)
        experts_forward_gemv(x, ids, w, w13, w2, GLU("silu"), shared=shared, pdl=True)  # compiled before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = experts_forward_gemv(x, ids, w, w13, w2, GLU("silu"), shared=shared, pdl=True)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, plain)


"""Fused KDA decode as two Triton launches (docs/ARCHITECTURE.md §7; math: §4.2).

Each of N sequences brings the same number T of new tokens (T = 1: plain decode; T > 1: e.g. verifying
T-1 speculative draft tokens + 1), token rows sequence-major: sequence n owns rows n*T .. n*T+T-1.
1. The prep kernel, one program per (sequence, head), does everything that is per head rather than per
   state row: the short conv of q/k/v over the slot's tail, the decay gate, β and the q/k L2 norms, for
   each token in order, into a small fp32 scratch; then it shifts the head's conv tails (it is their only
   reader).
2. The state kernel, one program per (sequence, head, block of V rows), streams the fp32 [V, K] state: for
   each token the delta-rule update and the output of its rows, the state held in registers across the T
   steps and written back to the slot once. It has nothing else to do, so many small programs (fla's
   fused recurrent kernel uses one warp on 8 rows) keep enough state in flight to run near copy
   bandwidth; when it also recomputed the conv, every row block repeated it and the kernel sat at
   46% of copy at batch 64.
   The gated RMSNorm needs the head's whole output row, which no single program has: each program writes
   its raw fp32 rows to a scratch and counts itself in on a per-(sequence, head) arrival counter, and the
   program that arrives last normalises all T tokens of the head and sets the counter back to zero. On
   an H200 this saved 0.6 µs per call at batch 1 and nothing measurable at 64 or 256 against a third
   launch for the norm (the finish kernel, still selectable with `fused_finish=False`).
The state is the bulk of the bytes: read once and written once per sequence, whatever T.
`kda_steps` also runs the two launches in a verify mode for ops/kda_verify_triton.py: slots from a slot
table and a source column, a prep program per token with no tail shift, the state after each token
written to its own column.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyserve.ops.arrival import arrival_counters
from hyserve.ops.dispatch import use_pdl
from hyserve.ops.kernel_plan import KDA_FUSED_NORM_BELOW_PAIRS, KDA_STREAM_BELOW_PAIRS


@triton.jit
def _window_of(x_ptr, s_xn, row0, tail_ptr, s_cc, s_cw, c, p0, fresh, T: tl.constexpr, W: tl.constexpr,
               WP: tl.constexpr, WIDTH: tl.constexpr):
    """[C, WP] inputs of channels c at positions p0 .. p0+WIDTH-1 of the sequence [old tail (W-1), new tokens
    (T)]; positions before W-1 come from the slot's tail (zero when fresh), the rest from the token rows."""
    j = tl.arange(0, WP)
    p = p0 + j
    live = j < WIDTH
    tail = tl.load(tail_ptr + c[:, None] * s_cc + p[None, :] * s_cw, mask=(live & (p < W - 1))[None, :], other=0.0)
    tail = tl.where(fresh, 0.0, tail)  # where, not a product: a fresh slot may hold NaN
    tok = tl.minimum(tl.maximum(p - (W - 1), 0), T - 1)  # clamped so no lane forms an address outside x
    xv = tl.load(x_ptr + (row0 + tok)[None, :] * s_xn + c[:, None], mask=(live & (p >= W - 1))[None, :], other=0.0)
    return tl.where((p < W - 1)[None, :], tail.to(xv.dtype), xv)


@triton.jit
def _conv_out(x_ptr, s_xn, row0, t, w_ptr, tail_ptr, s_cc, s_cw, c, fresh, T: tl.constexpr, W: tl.constexpr,
              WP: tl.constexpr):
    """SiLU(conv) of channels c for new token t (the tail is only read here)."""
    win = _window_of(x_ptr, s_xn, row0, tail_ptr, s_cc, s_cw, c, t, fresh, T, W, WP, W).to(tl.float32)
    j = tl.arange(0, WP)
    wt = tl.load(w_ptr + c[:, None] * W + j[None, :], mask=j[None, :] < W, other=0.0)
    y = tl.sum(win * wt, axis=1)
    return (y * tl.sigmoid(y)).to(x_ptr.dtype.element_ty).to(tl.float32)  # leaves the conv in model dtype


@triton.jit
def _head_lanes(P, h, K: tl.constexpr):
    """Lanes [q | k | v | gate] of head h, K each: (lane, part 0..3, conv channel). The gate lanes alias
    channel 0 (their conv is unused)."""
    i = tl.arange(0, 4 * K)
    part = i // K
    return i, part, tl.where(part < 3, part * P + h * K + i % K, 0)


@triton.jit
def _decay_of(f, a, lower_bound, BOUNDED: tl.constexpr):
    """exp(g) of the gate for raw inputs f (fp32, dt_bias added): bounded lower_bound·σ(a·f), else
    -a·softplus(f)."""
    if BOUNDED:
        g = lower_bound * tl.sigmoid(a * f)
    else:
        g = -a * tl.where(f > 20.0, f, tl.log(1.0 + tl.exp(tl.minimum(f, 20.0))))
    return tl.exp(g)


@triton.jit
def _shift_tails(x_ptr, s_xn, row0, tail_ptr, s_cc, s_cw, c, live, fresh, T: tl.constexpr, W: tl.constexpr,
                 WP: tl.constexpr):
    """The conv-tail shift of channels c (where live), after every read of the old tail by this program."""
    j = tl.arange(0, WP)
    # the new tail is the last W-1 positions of [old tail, T new tokens], i.e. positions T .. T+W-2
    new = _window_of(x_ptr, s_xn, row0, tail_ptr, s_cc, s_cw, c, T, fresh, T, W, WP, W - 1)
    tl.debug_barrier()  # every load of the old tail before any store (other threads shift the same rows)
    tl.store(tail_ptr + c[:, None] * s_cc + j[None, :] * s_cw, new.to(tail_ptr.dtype.element_ty),
             mask=live[:, None] & (j[None, :] < W - 1))


@triton.jit
def _slot_of(slots_ptr, fresh_ptr, n, s_sn, VERIFY: tl.constexpr):
    """(state slot, fresh) of sequence n: slots[n] and fresh[n], or (VERIFY) slots_ptr a slot table with
    rows s_sn apart and fresh_ptr the column each sequence starts from (verify rows always continue)."""
    if VERIFY:
        slot = tl.load(slots_ptr + n * s_sn + tl.load(fresh_ptr + n)).to(tl.int64)
        fresh = n < 0
    else:
        slot = tl.load(slots_ptr + n).to(tl.int64)
        fresh = tl.load(fresh_ptr + n) != 0
    return slot, fresh


@triton.jit
def _kda_prep_kernel(
    x_ptr, s_xn, f_ptr, s_fn, b_ptr, s_bn,
    conv_w_ptr, conv_ptr, s_cs, s_cc, s_cw,
    a_log_ptr, dt_bias_ptr, slots_ptr, fresh_ptr, qkvg_ptr, beta_ptr,
    P, H, scale, lower_bound, s_sn,
    T: tl.constexpr, K: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BOUNDED: tl.constexpr,
    PDL: tl.constexpr, VERIFY: tl.constexpr,
):
    """Program (n, h) (VERIFY: (n, h, t), token t alone): for each token t, writes q̂ (normed, scaled), k̂ (normed), v and exp(gate) of head h
    as rows 0..3 of qkvg[n*T+t, h] (fp32), and σ(b) to beta; then the conv-tail shift of the head's q/k/v
    channels. PDL: lets the state kernel launch now (it waits for this grid before reading qkvg/beta).
    VERIFY (ops/kda_verify_triton.py): slots_ptr is a slot table with rows s_sn apart and fresh_ptr the
    column each sequence starts from; the tail is only read (the windows after each token are written
    to their own slots by the verify windows kernel after this one)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0)
    h = tl.program_id(1)
    slot, fresh = _slot_of(slots_ptr, fresh_ptr, n, s_sn, VERIFY)
    row0 = n * T
    tail_ptr = conv_ptr + slot * s_cs
    # the three conv parts in one window per token, and the output in the layout the state kernel reads
    i, part, c = _head_lanes(P, h, K)
    gl = tl.where(part == 3, i - 3 * K, 0)
    a = tl.exp(tl.load(a_log_ptr + h))
    dtb = tl.load(dt_bias_ptr + h * K + gl)
    if VERIFY:  # no tail shift after the tokens: one program per token (5x the programs of a 4-draft step)
        t_first = tl.program_id(2)
        t_end = t_first + 1
    else:
        t_first = 0
        t_end = T
    for t in range(t_first, t_end):
        y = _conv_out(x_ptr, s_xn, row0, t, conv_w_ptr, tail_ptr, s_cc, s_cw, c, fresh, T, W, WP)
        qn = tl.rsqrt(tl.sum(tl.where(part == 0, y * y, 0.0), axis=0) + 1e-6) * scale
        kn = tl.rsqrt(tl.sum(tl.where(part == 1, y * y, 0.0), axis=0) + 1e-6)
        y = y * tl.where(part == 0, qn, tl.where(part == 1, kn, 1.0))
        f = tl.load(f_ptr + (row0 + t) * s_fn + h * K + gl).to(tl.float32) + dtb
        y = tl.where(part == 3, _decay_of(f, a, lower_bound, BOUNDED), y)
        tl.store(qkvg_ptr + ((row0 + t) * H + h) * 4 * K + i, y)
        tl.store(beta_ptr + (row0 + t) * H + h, tl.sigmoid(tl.load(b_ptr + (row0 + t) * s_bn + h).to(tl.float32)))
    if not VERIFY:
        _shift_tails(x_ptr, s_xn, row0, tail_ptr, s_cc, s_cw, c, part < 3, fresh, T, W, WP)


@triton.jit
def _gated_norm_row(o, gate_ptr, s_gn, wn, out_ptr, s_on, r, h, eps, K: tl.constexpr):
    """Gated RMSNorm of head h's raw fp32 output o [K] of row r, stored to out."""
    offs = tl.arange(0, K)
    gate = tl.load(gate_ptr + r * s_gn + h * K + offs).to(tl.float32)
    o = o * tl.rsqrt(tl.sum(o * o, axis=0) / K + eps) * wn * tl.sigmoid(gate)
    tl.store(out_ptr + r * s_on + h * K + offs, o.to(out_ptr.dtype.element_ty))


@triton.jit
def _gated_norm_rows(
    gate_ptr, s_gn, onorm_ptr, o_ptr, out_ptr, s_on, row0, h, P, eps,
    T: tl.constexpr, K: tl.constexpr, CACHE: tl.constexpr,
):
    """Gated RMSNorm of head h's raw fp32 output in rows row0 .. row0+T-1 (one source for both paths, so
    they do the same arithmetic)."""
    offs = tl.arange(0, K)
    wn = tl.load(onorm_ptr + offs)
    for t in range(T):
        r = row0 + t
        o = tl.load(o_ptr + r * P + h * K + offs, cache_modifier=CACHE)
        _gated_norm_row(o, gate_ptr, s_gn, wn, out_ptr, s_on, r, h, eps, K)


@triton.jit
def _delta_step(m, q, k, v, decay, beta):
    """One token's gated delta-rule step on state rows m [rows, K] (v: those rows' values): the new rows
    and their output."""
    m = m * decay[None, :]  # decay the key columns
    pred = tl.sum(m * k[None, :], axis=1)
    m = m + (beta * (v - pred))[:, None] * k[None, :]
    return m, tl.sum(m * q[None, :], axis=1)


# Cache hints on the state's load (evict first) and store (streaming). None: on below
# KDA_STREAM_BELOW_PAIRS (sequence, head) pairs (ops/kernel_plan.py has the measurements), off from
# there; True/False force them (ablations).
STATE_STREAM: bool | None = None
# The state kernel's grid with the V blocks of a head as its fastest dimension: programs launched one
# after another read one head's state rows one after another (contiguous 4 KB pieces of its 64 KB), in
# place of the same rows of another sequence's state
GRID_VB_FIRST = True


@triton.jit
def _kda_state_kernel(
    qkvg_ptr, beta_ptr, rec_ptr, s_rs, s_rh, s_rv, s_rk, slots_ptr, fresh_ptr, o_ptr, P, H,
    gate_ptr, s_gn, onorm_ptr, out_ptr, s_on, arrivals_ptr, eps, s_sn,
    T: tl.constexpr, K: tl.constexpr, BV: tl.constexpr, FUSED: tl.constexpr, PDL: tl.constexpr,
    STREAM: tl.constexpr = False, VB_FIRST: tl.constexpr = False, VERIFY: tl.constexpr = False,
):
    """Program (n, h, vb): rows vb*BV.. of head h's state over the sequence's T tokens; with FUSED, the
    last of the head's programs to arrive also applies the gated RMSNorm to all T tokens of the head.
    PDL (launched as a programmatic dependent of the prep kernel, which may still be running): the state
    rows, slots and fresh flags are loaded first (the prep kernel writes none of them, and every kernel
    before it on the stream has finished), then the wait for the prep grid's stores; every read of
    qkvg/beta/arrival counters and every store of this kernel comes after the wait.
    VERIFY (ops/kda_verify_triton.py): slots_ptr is a slot table with rows s_sn apart and fresh_ptr the
    column each sequence starts from; the state after token t goes to the slot of column t (the source
    rows are read once, before any store: the source may be one of them)."""
    if PDL:  # the output projection may launch now: it waits for this grid before it reads the output
        tl.extra.cuda.gdc_launch_dependents()
    if VB_FIRST:
        vb = tl.program_id(0)
        n = tl.program_id(2)
    else:
        n = tl.program_id(0)
        vb = tl.program_id(2)
    h = tl.program_id(1)
    slot, fresh = _slot_of(slots_ptr, fresh_ptr, n, s_sn, VERIFY)
    offs = tl.arange(0, K)
    rows = vb * BV + tl.arange(0, BV)
    head_rows = rec_ptr + h * s_rh + rows[:, None] * s_rv + offs[None, :] * s_rk
    sp = head_rows + slot * s_rs
    if STREAM:  # the state is read and written once a step: first out of L2, streaming stores
        m = tl.where(fresh, 0.0, tl.load(sp, eviction_policy="evict_first"))
    else:
        m = tl.where(fresh, 0.0, tl.load(sp))
    if PDL:
        tl.extra.cuda.gdc_wait()
    for t in range(T):
        r = n * T + t
        vec = qkvg_ptr + (r * H + h) * 4 * K
        q = tl.load(vec + offs)
        k = tl.load(vec + K + offs)
        v = tl.load(vec + 2 * K + rows)
        decay = tl.load(vec + 3 * K + offs)
        beta = tl.load(beta_ptr + r * H + h)
        m, o = _delta_step(m, q, k, v, decay, beta)
        tl.store(o_ptr + r * P + h * K + rows, o)
        if VERIFY:  # T stores: the price of rollback by the next step's choice of column
            dst = tl.load(slots_ptr + n * s_sn + t).to(tl.int64)
            tl.store(head_rows + dst * s_rs, m, cache_modifier=".cs" if STREAM else "")
    if FUSED:
        # One thread performs the scalar atomic. The barrier puts every thread's output stores before it,
        # and its release (cumulative through the barrier) publishes them at GPU scope. The head's
        # increments form one read-modify-write chain, so the acquire of the arrival that reads the
        # count of all the others synchronises with every earlier release, and the result's broadcast
        # to the other threads (shared memory + barrier) carries that on to their reads below. The
        # barrier is explicit because older Triton versions (>= 3.2 is allowed) insert none for release
        # semantics (3.9 does: the PTX then has two in a row, which costs next to nothing). Only the output
        # rows need publishing: the state is stored after the arrival, so the release need not wait
        # for that write.
        tl.debug_barrier()
        arrivals = arrivals_ptr + n * H + h
        before = tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu")
        if not VERIFY:
            tl.store(sp, m, cache_modifier=".cs" if STREAM else "")
        if before == tl.num_programs(0 if VB_FIRST else 2) - 1:
            # every other program of the head has arrived; its rows are read from L2 (".cg"), as a line
            # of this SM's L1 could predate them
            tl.debug_barrier()
            _gated_norm_rows(gate_ptr, s_gn, onorm_ptr, o_ptr, out_ptr, s_on, n * T, h, P, eps, T, K, ".cg")
            # nobody else touches the counter in this launch, and the next launch on the stream (eager
            # or a graph replay) starts after this one ends: a plain store leaves it zero for that one
            tl.store(arrivals, 0)
    elif not VERIFY:
        tl.store(sp, m, cache_modifier=".cs" if STREAM else "")


@triton.jit
def _kda_finish_kernel(
    gate_ptr, s_gn, onorm_ptr, o_ptr, out_ptr, s_on, P, eps, T: tl.constexpr, K: tl.constexpr,
):
    """Program (n, h): gated RMSNorm of the head's output for each token."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    _gated_norm_rows(gate_ptr, s_gn, onorm_ptr, o_ptr, out_ptr, s_on, n * T, h, P, eps, T, K, "")


def kda_decode_multi(
    x: torch.Tensor, f: torch.Tensor, b: torch.Tensor, gate: torch.Tensor, conv_weight: torch.Tensor,
    conv_pool: torch.Tensor, rec_pool: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
    o_norm_weight: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, scale: float, eps: float,
    lower_bound: float | None, tokens_per_seq: int, num_warps: int | None = None, block_v: int | None = None,
    fused_finish: bool | None = None, pdl: bool | None = None,
) -> torch.Tensor:
    """T = tokens_per_seq new tokens for each of N sequences (rows sequence-major, N*T in all): T recurrent
    steps per sequence, as T calls of `kda_decode` would make them. Updates the slots in place (state and
    conv tail end as after the last token) and returns the normed output of every token [N*T, P].

    x [N*T, 3P] pre-conv q|k|v; f [N*T, P] raw gate input; b [N*T, H] β logits; gate [N*T, P] output-gate
    logits (each may be a column slice of a wider projection: only the last dim must be unit-stride);
    slots, fresh [N]; conv_pool [slots, 3P, W-1] and rec_pool [slots, H, V, K] are this layer's views.
    fused_finish: the output norm by the last state program of each head (True) or as a third launch
    (False); None: the kernel plan's rule (ops/kernel_plan.py: fused below 528 (sequence, head) pairs, where
    it measured faster on an H200, a third launch from there).
    pdl (default: on a CUDA GPU of compute capability 9+; ignored elsewhere): the state kernel is launched
    as a programmatic dependent of the prep kernel and loads its state rows while the prep kernel still
    runs (same results, bit for bit; 0.93x the time at batch 1, even at 64 and 256 on an H200). One
    program per (sequence, head) doing everything in one launch was 1.2x slower at batch 1 and 1.9x at 64
    (the whole [V, K] state in registers: 252 a thread at 8 warps, one program per SM).
    Calls on one device must not overlap in time (one stream, as the engine runs them): they share the
    arrival counters.
    """
    t, kd = tokens_per_seq, rec_pool.shape[-1]
    assert 1 <= t <= 16 and x.shape[0] % t == 0, "1 to 16 tokens per sequence, the same for every sequence"
    n = x.shape[0] // t
    for y in (x, f, b, gate):
        assert y.stride(-1) == 1 and y.shape[0] == n * t
    assert conv_weight.is_contiguous() and rec_pool.shape[-2] == kd and slots.shape[0] == fresh.shape[0] == n
    return kda_steps(x, f, b, gate, conv_weight, conv_pool, rec_pool, a_log, dt_bias, o_norm_weight, slots, fresh,
                     scale, eps, lower_bound, t, num_warps, block_v, fused_finish, pdl)


def kda_steps(
    x: torch.Tensor, f: torch.Tensor, b: torch.Tensor, gate: torch.Tensor, conv_weight: torch.Tensor,
    conv_pool: torch.Tensor, rec_pool: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
    o_norm_weight: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, scale: float, eps: float,
    lower_bound: float | None, t: int, num_warps: int | None, block_v: int | None, fused_finish: bool | None,
    pdl: bool | None, table_stride: int | None = None,
) -> torch.Tensor:
    """The launches of `kda_decode_multi` (inputs checked there). With table_stride: the verify contract
    (`kda_verify_multi`): slots is a slot table with rows that far apart and fresh each sequence's source
    column; the prep kernel runs a program per token and leaves the conv windows alone, the state kernel
    writes the state after each token to its column."""
    h, kd = rec_pool.shape[1], rec_pool.shape[-1]
    p, w, n = h * kd, conv_weight.shape[-1], x.shape[0] // t
    verify = table_stride is not None
    s_sn = table_stride if verify else 1
    out = torch.empty(n * t, p, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    wp = triton.next_power_of_2(w)
    lb, bounded = 0.0 if lower_bound is None else float(lower_bound), lower_bound is not None
    # measured on an H200 (graph replay, 32 heads x 128): batch 1 best with 8 rows on 4 warps, batch 64 with
    # 8 rows on 2 warps (82% of copy with the third launch), batch 256 with 32 rows on one warp (86%)
    few, many = n * h < KDA_FUSED_NORM_BELOW_PAIRS, n * h >= KDA_STREAM_BELOW_PAIRS
    bv_default, warps_default = (8, 4) if few else (32, 1) if many else (8, 2)
    bv = min(block_v or bv_default, kd)  # never more rows than V: rows past it are another head's
    num_warps = num_warps or warps_default
    if fused_finish is None:
        fused_finish = few
    stream = x.is_cuda and (not many if STATE_STREAM is None else STATE_STREAM)
    pdl = use_pdl(x, pdl)
    qkvg = torch.empty(n * t, h, 4, kd, dtype=torch.float32, device=x.device)
    beta = torch.empty(n * t, h, dtype=torch.float32, device=x.device)
    o_raw = torch.empty(n * t, p, dtype=torch.float32, device=x.device)
    # before the prep launch: growing the counters launches a fill, which must not come between the two
    # kernels (the state kernel's programmatic dependency is on the launch just before it)
    arrivals = arrival_counters(x.device, n * h) if fused_finish else o_raw  # unused without fused_finish
    _kda_prep_kernel[(n, h, t) if verify else (n, h)](
        x, x.stride(0), f, f.stride(0), b, b.stride(0), conv_weight, conv_pool, *conv_pool.stride(),
        a_log, dt_bias, slots, fresh, qkvg, beta, p, h, scale, lb, s_sn,
        T=t, K=kd, W=w, WP=wp, BOUNDED=bounded, PDL=pdl, VERIFY=verify, num_warps=4,
    )
    extra = {"launch_pdl": True} if pdl else {}
    vbs = triton.cdiv(kd, bv)
    vb_first = GRID_VB_FIRST and n < 65536  # (the grid's third dimension is at most 65535)
    _kda_state_kernel[(vbs, h, n) if vb_first else (n, h, vbs)](
        qkvg, beta, rec_pool, *rec_pool.stride(), slots, fresh, o_raw, p, h,
        gate, gate.stride(0), o_norm_weight, out, out.stride(0), arrivals, eps, s_sn,
        T=t, K=kd, BV=bv, FUSED=fused_finish, PDL=pdl, STREAM=stream, VB_FIRST=vb_first, VERIFY=verify,
        num_warps=num_warps,
        **extra,
    )
    if not fused_finish:
        _kda_finish_kernel[(n, h)](gate, gate.stride(0), o_norm_weight, o_raw, out, out.stride(0), p, eps, T=t, K=kd,
                                   num_warps=4)
    return out


def kda_decode(
    x: torch.Tensor, f: torch.Tensor, b: torch.Tensor, gate: torch.Tensor, conv_weight: torch.Tensor,
    conv_pool: torch.Tensor, rec_pool: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
    o_norm_weight: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, scale: float, eps: float,
    lower_bound: float | None, num_warps: int | None = None, block_v: int | None = None,
    fused_finish: bool | None = None, pdl: bool | None = None,
) -> torch.Tensor:
    """One token for each of N sequences; updates the slots in place, returns the normed output [N, P].

    x [N, 3P] pre-conv q|k|v; f [N, P] raw gate input; b [N, H] β logits; gate [N, P] output-gate
    logits (each may be a column slice of a wider projection: only the last dim must be unit-stride);
    conv_pool [slots, 3P, W-1] and rec_pool [slots, H, V, K] are this layer's views of the pools.
    pdl: see `kda_decode_multi`.
    """
    return kda_decode_multi(x, f, b, gate, conv_weight, conv_pool, rec_pool, a_log, dt_bias, o_norm_weight, slots,
                            fresh, scale, eps, lower_bound, 1, num_warps, block_v, fused_finish, pdl)

"""The training forward: B sequences laid end to end through the engine's own model forward.

Each sequence starts from a fresh KDA state and gets its own scratch pages, so one call is exactly the
prefill the server would run for each of them. Inside `training_kernels` three layers take batched,
differentiable paths with no per-sequence Python loop and no host synchronisation:
  - KDA (CUDA + fla-core): fla `chunk_kda` varlen over the whole step (`chunk_kda` has a backward; the
    serving fast path merges weights detached and writes states, so it cannot train);
  - MLA (any device, rows of equal length): one causal SDPA over [rows, heads, row_len, dim], which is
    flash attention on the GPU, instead of one call per sequence over the paged cache;
  - MoE: every expert on every token, weighted by the router's (mostly zero) weights: static shapes and
    no `.tolist()` of expert counts; at this model size the extra expert FLOPs are cheap.
Each is the same function as the layer's reference forward (tests/test_train.py checks it on the CPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from hyserve.models.batch import Batch, CacheTensors
from hyserve.models.kimi import KimiForCausalLM
from hyserve.models.layers.kda import KimiDeltaAttention
from hyserve.models.layers.mla import MLAttention
from hyserve.models.layers.moe import MoE
from hyserve.models.layers.norm import gated_rms_norm
from hyserve.ops.dispatch import fast_path, has_fla
from hyserve.train.rows import IGNORE, RowBatch

BLOCK_SIZE = 64


def pack(seqs: Sequence[Sequence[int]], device: torch.device, block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, Batch]:
    """Flattened ids and a Batch of whole sequences, each in consecutive blocks and its own state slot."""
    lens = [len(s) for s in seqs]
    tables, nxt = [], 0
    for n in lens:
        blocks = -(-n // block_size)
        tables.append(list(range(nxt, nxt + blocks)))
        nxt += blocks
    batch = Batch.build(lens, lens, tables, block_size, list(range(len(seqs))), [True] * len(seqs), device)
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)
    return ids, batch


def row_batch(rows: int, row_len: int, device: torch.device, block_size: int = BLOCK_SIZE) -> Batch:
    """The constant Batch of a fixed-shape step: `rows` fresh sequences of `row_len` tokens."""
    per = -(-row_len // block_size)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(rows)]
    return Batch.build([row_len] * rows, [row_len] * rows, tables, block_size, list(range(rows)), [True] * rows,
                       device)


def scratch_cache(model: KimiForCausalLM, batch: Batch, block_size: int = BLOCK_SIZE) -> CacheTensors:
    blocks = int(batch.block_tables.max()) + 1
    return model.make_cache(blocks, block_size, batch.num_seqs)


def kda_train_forward(layer: KimiDeltaAttention, x: torch.Tensor, batch: Batch, cache: CacheTensors) -> torch.Tensor:
    """KDA over fresh sequences with fla `chunk_kda` (autograd through every projection); the same
    function as the reference layer. Writes no state: training never decodes."""
    from fla.ops.kda import chunk_kda

    from hyserve.ops.kda_prefill import causal_conv_varlen

    t, h, k = x.shape[0], layer.num_heads, layer.head_dim
    qkv = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], -1)
    tails = qkv.new_zeros(batch.num_seqs, 3 * h * k, layer.conv_weight.shape[1] - 1)
    y, _ = causal_conv_varlen(qkv, layer.conv_weight, batch.cu_seqlens, tails)
    q, kk, v = (z.contiguous() for z in y.view(t, 3, h, k).unbind(1))
    f = layer.f_b_proj(layer.f_a_proj(x)).view(t, h, k)
    b = layer.b_proj(x)
    o, _ = chunk_kda(
        q[None], kk[None], v[None], f[None], b[None], scale=k**-0.5, initial_state=None,
        output_final_state=False, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, A_log=layer.A_log, dt_bias=layer.dt_bias,
        lower_bound=layer.lower_bound, safe_gate=layer.lower_bound is not None,
        cu_seqlens=batch.cu_seqlens, cu_seqlens_cpu=_cu_seqlens_host(batch),
    )
    out = gated_rms_norm(o[0], layer.output_gate(x).view(t, h, k), layer.o_norm_weight, layer.eps)
    return layer.o_proj(out.reshape(t, h * k).to(x.dtype))


def _cu_seqlens_host(batch: Batch) -> torch.Tensor:
    # from the host-side lengths: `batch.cu_seqlens.cpu()` would synchronise with the GPU in every layer
    return torch.tensor([0] + batch.query_lens, dtype=torch.long).cumsum(0)


def _uniform_rows(batch: Batch) -> int | None:
    """The row length when every sequence is a fresh row of the same length, else None."""
    n = batch.query_lens[0] if batch.query_lens else 0
    same = all(q == n for q in batch.query_lens) and batch.context_lens == batch.query_lens
    return n if same and n > 0 else None


def mla_train_forward(layer: MLAttention, x: torch.Tensor, batch: Batch, cache: CacheTensors) -> torch.Tensor:
    """MLA over equal-length fresh rows as one batched causal SDPA (expanded form, as the reference
    prefill computes it). Other batches take the layer's own forward."""
    row_len = _uniform_rows(batch)
    if row_len is None or layer.indexer is not None:
        return MLAttention.forward(layer, x, batch, cache)
    t, h, dn, dv, rank = x.shape[0], layer.num_heads, layer.dn, layer.dv, layer.rank
    q = layer.query(x)
    rows = layer.cache_rows(x)  # [T, rank + dr]: normed latent | shared rope key
    q_nope, q_rope, k_rope = q[..., :dn], q[..., dn:], rows[:, rank:]
    if layer.rotary is not None:
        cos, sin = layer.rotary.cos_sin(batch.positions)
        q_rope, k_rope = layer.rotary.apply(q_rope, cos, sin), layer.rotary.apply(k_rope, cos, sin)
    kv = layer.kv_b_proj(rows[:, :rank]).view(t, h, dn + dv)
    k = torch.cat([kv[..., :dn], k_rope[:, None, :].to(kv.dtype).expand(-1, h, -1)], -1)
    q = torch.cat([q_nope, q_rope], -1).to(k.dtype)
    v = F.pad(kv[..., dn:], (0, k.shape[-1] - dv))  # the flash kernel wants v as wide as q and k

    def heads_first(z: torch.Tensor) -> torch.Tensor:  # [T, H, d] -> [rows, H, row_len, d]
        return z.view(t // row_len, row_len, h, -1).transpose(1, 2)

    o = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), is_causal=True,
                                       scale=layer.scale)
    return layer.project_out(o.transpose(1, 2)[..., :dv].reshape(t, h, dv), x)


def dense_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act,
) -> torch.Tensor:
    """`moe.experts_forward` computed for every expert on every token, combined with the routing
    weights scattered into a dense [T, E] matrix (zero for experts not picked)."""
    inter = w13.shape[1] // 2
    h = torch.matmul(x.unsqueeze(0), w13.transpose(1, 2))  # [E, T, 2I]
    out = torch.bmm(act(h[..., :inter], h[..., inter:]), w2.transpose(1, 2))  # [E, T, D]
    gate = torch.zeros(x.shape[0], w13.shape[0], dtype=torch.float32, device=x.device)
    gate = gate.scatter(1, ids, weights.float())
    return torch.einsum("te,etd->td", gate.to(out.dtype), out).to(x.dtype)


def moe_train_forward(layer: MoE, x: torch.Tensor, summed: bool = True) -> torch.Tensor:
    """`MoE.forward` with `dense_experts` in place of the sparse expert dispatch (always summed: only the
    decode kernels hand back unsummed pairs)."""
    return MoE.forward(layer, x, experts_fn=dense_experts, summed=summed)  # the class method: patched per instance


def trim_autotuners(module_prefix: str, max_configs: int) -> int:
    """Keep the `max_configs` lightest configs (fewest pipeline stages, then warps nearest 4) of every
    Triton autotuner in the imported modules under `module_prefix`; returns how many were trimmed.
    Fewer stages means less shared memory, so the configs kept are the ones least likely to fail to
    launch, and keeping two lets the autotuner still time (and survive) a bad one."""
    import sys

    from triton.runtime.autotuner import Autotuner

    trimmed = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith(module_prefix) or module is None:
            continue
        for obj in list(vars(module).values()):
            while obj is not None and not isinstance(obj, Autotuner) and hasattr(obj, "fn"):
                obj = obj.fn  # @triton.heuristics wraps the autotuner
            if isinstance(obj, Autotuner) and len(obj.configs) > max_configs:
                obj.configs = sorted(obj.configs, key=lambda c: (c.num_stages, abs(c.num_warps - 4)))[:max_configs]
                trimmed += 1
    return trimmed


def limit_fla_autotune(max_configs: int) -> int:
    """`trim_autotuners` over fla-core. Its chunk_kda forward and backward compile and time every config
    of every kernel before the first step: about four minutes on an H200 for the embedded model, more
    than the training steps that fit in one device call (38 s with two configs each)."""
    import fla.ops.kda  # noqa: F401 - imports the kernels to trim

    return trim_autotuners("fla.", max_configs)


@contextlib.contextmanager
def training_kernels(model: KimiForCausalLM, enable: bool = True) -> Iterator[bool]:
    """Route MLA and MoE layers through their batched training paths while inside, and KDA layers
    through `kda_train_forward` where CUDA and fla-core are there and `enable` is set. Yields whether
    KDA took the fla path."""
    use_fla = enable and has_fla() and fast_path(model.lm_head.weight)
    routes = {MLAttention: mla_train_forward, MoE: moe_train_forward}
    if use_fla:
        routes[KimiDeltaAttention] = kda_train_forward
    patched = [m for m in model.modules() if type(m) in routes]
    for m in patched:
        m.forward = routes[type(m)].__get__(m)  # an instance attribute shadows the class method
    try:
        yield use_fla
    finally:
        for m in patched:
            m.__dict__.pop("forward", None)


def row_lm_loss(model: KimiForCausalLM, rb: RowBatch, batch: Batch, cache: CacheTensors) -> torch.Tensor:
    """Mean next-token loss of a fixed-shape step (`batch` from `row_batch`): static shapes end to end,
    no host synchronisation (the targets carry IGNORE where nothing is trained)."""
    dev = model.device
    hidden = model(rb.ids.to(dev, non_blocking=True), batch, cache)
    logits = model.lm_head(hidden).float()
    return F.cross_entropy(logits, rb.targets.to(dev, non_blocking=True), ignore_index=IGNORE)


def packed_hidden(model: KimiForCausalLM, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
    """Final hidden states [sum(len), D] of `seqs`, each run from an empty state."""
    ids, batch = pack(seqs, model.device)
    return model(ids, batch, scratch_cache(model, batch))


def masked_lm_loss(
    model: KimiForCausalLM, seqs: Sequence[Sequence[int]], masks: Sequence[Sequence[int]],
) -> tuple[torch.Tensor, int]:
    """Mean next-token loss over targets whose mask is 1, and the number of such targets.

    Token j of a sequence predicts token j+1; the target's own mask decides (assistant-only for chat).
    """
    hidden = packed_hidden(model, seqs)
    src, tgt, start = [], [], 0
    for s, m in zip(seqs, masks):
        for j in range(len(s) - 1):
            if m[j + 1]:
                src.append(start + j)
                tgt.append(s[j + 1])
        start += len(s)
    dev = hidden.device
    src_t = torch.tensor(src, dtype=torch.long, device=dev)
    tgt_t = torch.tensor(tgt, dtype=torch.long, device=dev)
    logits = model.lm_head(hidden[src_t]).float()
    return F.cross_entropy(logits, tgt_t), len(tgt)

"""The training forward: B sequences laid end to end through the engine's own model forward.

Each sequence starts from a fresh KDA state and gets its own scratch pages, so one call is exactly the
prefill the server would run for each of them. On CUDA with fla-core, KDA layers run a differentiable
varlen path (`chunk_kda` has a backward; the serving fast path merges weights detached and writes
states, so it cannot train); everything else runs the layers' normal code under autograd.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from hyserve.models.batch import Batch, CacheTensors
from hyserve.models.kimi import KimiForCausalLM
from hyserve.models.layers.kda import KimiDeltaAttention
from hyserve.models.layers.norm import gated_rms_norm
from hyserve.ops.dispatch import fast_path, has_fla

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
        cu_seqlens=batch.cu_seqlens, cu_seqlens_cpu=batch.cu_seqlens.cpu(),
    )
    out = gated_rms_norm(o[0], layer.output_gate(x).view(t, h, k), layer.o_norm_weight, layer.eps)
    return layer.o_proj(out.reshape(t, h * k).to(x.dtype))


@contextlib.contextmanager
def training_kernels(model: KimiForCausalLM, enable: bool = True) -> Iterator[bool]:
    """Route KDA layers through `kda_train_forward` while inside (CUDA + fla only). Yields whether it did."""
    layers = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    use = enable and has_fla() and fast_path(model.lm_head.weight)
    if use:
        for layer in layers:
            layer.forward = kda_train_forward.__get__(layer)  # instance attribute shadows the class method
    try:
        yield use
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


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

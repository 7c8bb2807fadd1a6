"""KDA prefill on the GPU: the short conv vectorised over a whole step, then fla-core `chunk_kda`
over every prefill sequence of the step in one varlen call (docs/ARCHITECTURE.md §7).

The conv is plain torch (it runs and is tested on the CPU too); `chunk_kda` needs CUDA and fla-core.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv_varlen(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, tails: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU over N sequences laid end to end, with no per-sequence loop.

    x [T, C] pre-conv inputs, weight [C, W], cu_seqlens [N+1] long, tails [N, C, W-1] earlier inputs
    (oldest first; zero them for fresh sequences). Returns (SiLU(conv) [T, C] in x's dtype, new tails
    [N, C, W-1] in x's dtype). Each sequence is written after its W-1 tail rows into one extended
    buffer, so every token's window is W consecutive rows of it.
    """
    t, c = x.shape
    w = weight.shape[-1]
    n = cu_seqlens.numel() - 1
    dev = x.device
    seq = torch.repeat_interleave(torch.arange(n, device=dev), cu_seqlens.diff(), output_size=t)
    tok_pos = torch.arange(t, device=dev) + (seq + 1) * (w - 1)  # each token's row in the buffer
    tail_pos = (cu_seqlens[:-1] + torch.arange(n, device=dev) * (w - 1))[:, None] + torch.arange(w - 1, device=dev)
    xx = x.new_empty(t + n * (w - 1), c)
    xx[tok_pos] = x
    xx[tail_pos.reshape(-1)] = tails.transpose(1, 2).reshape(-1, c).to(x.dtype)
    wf = weight.float()
    y = torch.zeros(t, c, dtype=torch.float32, device=dev)
    for j in range(w):  # W (= 4) gathers, not a loop over sequences
        y += xx[tok_pos - (w - 1) + j].float() * wf[:, j]
    end_pos = (cu_seqlens[1:] + torch.arange(n, device=dev) * (w - 1))[:, None] + torch.arange(w - 1, device=dev)
    new_tails = xx[end_pos.reshape(-1)].view(n, w - 1, c).transpose(1, 2).contiguous()
    return F.silu(y).to(x.dtype), new_tails


def chunk_kda_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
    a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None, scale: float,
    initial_state: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor,
    device_indices: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla `chunk_kda` with gate, beta sigmoid and q/k L2 norm inside the kernel, V-first fp32 states.

    q, k, v [T, H, K] (conv outputs, model dtype); f [T, H, K] raw gate input; b [T, H] beta logits;
    initial_state [N, H, V, K] fp32. Returns (o [T, H, V], final states [N, H, V, K] fp32).

    device_indices: fla's chunk list is built on the device (its graph mode, with N sequences as the
    static bound, so no padding): from `cu_seqlens_cpu` fla would upload the list with a blocking copy,
    which drains the stream once a step and throws away the host's lead over the GPU. The chunk list
    then holds N - 1 sentinel rows more, whose programs return at once; the outputs are the same.
    """
    from fla.ops.kda import chunk_kda

    o, final = chunk_kda(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), f.unsqueeze(0), b.unsqueeze(0),
        scale=scale, initial_state=initial_state, output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        A_log=a_log, dt_bias=dt_bias,
        # the bounded K3 gate b*sigmoid(exp(A)(f+dt)) is fla's lower_bound form, which needs safe_gate
        lower_bound=lower_bound, safe_gate=lower_bound is not None,
        state_v_first=True, cu_seqlens=cu_seqlens,
        **({"use_graph": True, "max_num_seqs": cu_seqlens.numel() - 1} if device_indices
           else {"cu_seqlens_cpu": cu_seqlens_cpu}),
    )
    return o.squeeze(0), final

"""The first call of a new attention shape against a repeat, per SDPA backend (cuDNN, FlashAttention-2), causal
(a fresh prompt) and unmasked (a split chunk's cached part): cuDNN builds an execution plan per shape.

    python benchmarks/sdpa_first_call.py          # CUDA; TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 to try shared plans
"""
import random
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

h, d = 32, 192
dev = "cuda"
rng = random.Random(0)


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
    for causal in (True, False):
        firsts, seconds = [], []
        for _ in range(6):
            nq = rng.randrange(300, 3000)
            nc = nq if causal else nq + rng.randrange(1000, 9000)
            q = torch.randn(1, h, nq, d, device=dev, dtype=torch.bfloat16)
            k = torch.randn(1, h, nc, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn(1, h, nc, d, device=dev, dtype=torch.bfloat16)
            with sdpa_kernel(backend):
                def f(q=q, k=k, v=v, causal=causal):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                firsts.append(timed(f))
                seconds.append(timed(f))
        print(f"{backend.name:<18} causal={causal}: first call ms " + ", ".join(f"{x:.1f}" for x in firsts)
              + " | repeat ms " + ", ".join(f"{x:.2f}" for x in seconds), flush=True)

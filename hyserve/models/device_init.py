"""Random weights drawn on the model's own device: the 48B preset initialises in seconds on a GPU
instead of minutes through the CPU generator. Same distributions as `loader.random_init` (different
values), for benchmarks and GPU tests that need a real shape but no particular weights."""

from __future__ import annotations

import torch

from hyserve.models.kimi import KimiForCausalLM


@torch.no_grad()
def random_init_on_device(model: KimiForCausalLM, seed: int = 0, std: float = 0.02) -> None:
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in model.named_parameters():
        d = p.data
        if name.endswith(("norm.weight", "o_norm_weight", "res.norm", "attn_res.norm")) or "layernorm" in name:
            d.fill_(1.0)
        elif name.endswith("norm.bias"):  # the indexer's k_norm LayerNorm
            d.zero_()
        elif name.endswith("A_log"):
            d.copy_(torch.log(torch.empty(d.shape, device=d.device).uniform_(1, 16, generator=gen)))
        elif name.endswith("dt_bias"):
            d.uniform_(-1.0, 1.0, generator=gen)
        elif name.endswith("conv_weight"):
            d.normal_(0.0, 0.3, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            d.normal_(0.0, 0.01, generator=gen)
        else:
            d.normal_(0.0, std, generator=gen)

"""DeepSeek V3.2 (`DeepseekV32ForCausalLM`, docs/ARCHITECTURE.md §4.7), assembled from the shared layers.

The decoder is the Kimi family's plain pre-norm stack with every layer MLA + DSA indexer (YaRN RoPE on
the rope slices, softmax scale with mscale^2), dense FFNs on the first layers and grouped-sigmoid MoE
after them, so the model class only adds what differs at load time:
  - FP8 block-quantised Linear weights (`weight_scale_inv`, 128x128 blocks) are dequantised;
  - the 64 interleaved rope rows of `q_b_proj` (per head) and `kv_a_proj_with_mqa` are permuted to
    [even | odd], turning MLA's interleaved rotation into the half-split one the indexer uses (§4.3);
  - the MTP layer past `num_hidden_layers` is skipped (the shared loader drops it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from hyserve.models.config import ModelConfig
from hyserve.models.kimi import KimiForCausalLM

_SCALE_SUFFIX = ".weight_scale_inv"


def dequant_fp8_blocks(w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W[i, j] = W8[i, j] * scale_inv[i // bo, j // bi] in fp32 (despite its name the scale multiplies)."""
    out, inp = w8.shape
    bo, bi = block
    if scale_inv.shape != (-(-out // bo), -(-inp // bi)):
        raise ValueError(f"weight_scale_inv {tuple(scale_inv.shape)} does not tile a {out}x{inp} weight in "
                         f"{bo}x{bi} blocks")
    s = scale_inv.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    return w8.float() * s


def interleaved_to_half_split(rope_dim: int) -> torch.Tensor:
    """Row order [0, 2, 4, ..., 1, 3, 5, ...]: pair (x[2i], x[2i+1]) becomes (x[i], x[i + d/2])."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def permute_rope_rows(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Apply the rope-row permutation (docs/ARCHITECTURE.md §4.3) to the rope rows of the two MLA projections that produce them."""
    dr, perm = cfg.qk_rope_head_dim, interleaved_to_half_split(cfg.qk_rope_head_dim)
    if name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        r = cfg.kv_lora_rank
        return torch.cat([t[:r], t[r:][perm]], 0)
    if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
        heads = t.view(cfg.num_attention_heads, cfg.qk_head_dim, -1)
        dn = cfg.qk_nope_head_dim
        heads = torch.cat([heads[:, :dn], heads[:, dn:][:, perm]], 1)
        assert heads.shape[1] == dn + dr
        return heads.reshape(t.shape)
    return t


class DeepseekV32ForCausalLM(KimiForCausalLM):
    """Same forward, cache and interface as the Kimi family; only checkpoint reading differs."""

    def transform_checkpoint(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        block = tuple(cfg.weight_block_size or (128, 128))
        weights: dict[str, torch.Tensor] = {}  # FP8 weights waiting for their scale (or the reverse)
        scales: dict[str, torch.Tensor] = {}
        mtp = re.compile(r"^model\.layers\.(\d+)\.")
        for name, t in tensors:
            m = mtp.match(name)
            if m and int(m.group(1)) >= cfg.num_hidden_layers:
                continue  # the MTP layer is not served
            if name.endswith(_SCALE_SUFFIX):
                base = name[: -len(_SCALE_SUFFIX)] + ".weight"
                if base in weights:
                    yield base, permute_rope_rows(base, dequant_fp8_blocks(weights.pop(base), t, block), cfg)
                else:
                    scales[base] = t
            elif t.dtype == torch.float8_e4m3fn:
                if name in scales:
                    yield name, permute_rope_rows(name, dequant_fp8_blocks(t, scales.pop(name), block), cfg)
                else:
                    weights[name] = t
            else:
                yield name, permute_rope_rows(name, t, cfg)
            del t  # a safetensors tensor keeps its whole shard mapped: let it go before the next shard opens
        if weights or scales:
            orphans = sorted(weights) + [n + " (scale only)" for n in sorted(scales)]
            raise ValueError(f"FP8 weights without weight_scale_inv or the reverse: {', '.join(orphans[:8])}")

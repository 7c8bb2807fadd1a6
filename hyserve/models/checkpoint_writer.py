"""HF-format checkpoint directories from a model: config.json, safetensors shards in the K3 checkpoint
spelling the loader reads back (per-expert w1/w2/w3, q/k/v conv1d, o_norm, AttnRes `*_norm` / `*_proj`
weights) and the shard index. Written shard by shard from views of the parameters, wherever they live,
so host memory holds one shard at a time: a 45 GB directory can be written from a model on a GPU."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator

import torch

from hyserve.models.kimi import KimiForCausalLM

# saved in fp32 whatever the checkpoint dtype (the loader keeps them in fp32 too)
FP32_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias", "gate.weight")
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def checkpoint_views(model: KimiForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, view of the parameter) in the order of the model's state dict; no copies."""
    p = model.config.kda_proj_dim
    for name, t in model.state_dict().items():
        t = t.detach()
        if name.endswith("block_sparse_moe.w13"):
            base, inter = name[: -len("w13")], t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{base}experts.{e}.w1.weight", t[e, :inter]
                yield f"{base}experts.{e}.w3.weight", t[e, inter:]
        elif name.endswith("block_sparse_moe.w2"):
            base = name[: -len("w2")]
            for e in range(t.shape[0]):
                yield f"{base}experts.{e}.w2.weight", t[e]
        elif name.endswith("self_attn.conv_weight"):
            base = name[: -len("conv_weight")]
            for j, part in enumerate("qkv"):
                yield f"{base}{part}_conv1d.weight", t[j * p : (j + 1) * p].unsqueeze(1)
        elif name.endswith("self_attn.o_norm_weight"):
            yield name.replace("o_norm_weight", "o_norm.weight"), t
        elif name.endswith(("res.proj", "res.norm")):
            yield name[: -len(".proj")] + "_" + name.rsplit(".", 1)[1] + ".weight", t
        else:
            yield name, t


def _plan_shards(views: list[tuple[str, torch.Tensor]], dtype: torch.dtype, shard_bytes: int) -> list[list]:
    """Greedy in order: a shard closes before the tensor that would take it past `shard_bytes`."""
    shards: list[list] = [[]]
    size = 0
    for name, t in views:
        n = t.numel() * (4 if name.endswith(FP32_SUFFIXES) else torch.finfo(dtype).bits // 8)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += n
    return shards


def write_checkpoint(model: KimiForCausalLM, raw_config: dict, out_dir: str, dtype: torch.dtype = torch.bfloat16,
                     shard_bytes: int = 5 << 30, tokenizer_dir: str | None = None,
                     progress: Callable[[str], None] | None = None) -> list[str]:
    """Write the directory; returns the shard paths. `progress` gets a line per shard written."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    shards = _plan_shards(list(checkpoint_views(model)), dtype, shard_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards):
        host = {k: v.to(torch.float32 if k.endswith(FP32_SUFFIXES) else dtype).to("cpu").contiguous() for k, v in shard}
        save_file(host, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(host, fname))
        total += sum(v.numel() * v.element_size() for v in host.values())
        del host
        if progress is not None:
            progress(f"wrote {fname} ({os.path.getsize(os.path.join(out_dir, fname)) / 1e9:.2f} GB)")
    if len(shards) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dict(raw_config, dtype=_DTYPE_NAMES[dtype]), f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json") if tokenizer_dir else ():
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
    return [os.path.join(out_dir, n) for n in names]

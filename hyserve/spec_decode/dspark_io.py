"""DSpark drafter checkpoints: a directory with config.json and model.safetensors (the drafter's own
weights only; the embedding and lm_head come from the target it was trained against)."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from hyserve.spec_decode.dspark import DSparkConfig, DSparkDrafter

MODEL_TYPE = "dspark"


def save_drafter(drafter: DSparkDrafter, out_dir: str, target: dict, dtype: torch.dtype = torch.bfloat16) -> None:
    """target: what the drafter was trained against (name, num_hidden_layers, hidden_size, vocab_size),
    checked when it is loaded."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["DSparkDrafter"], "model_type": MODEL_TYPE, **drafter.config.to_dict(),
              "target": target, "dtype": str(dtype).removeprefix("torch.")}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def target_info(model: nn.Module, name: str) -> dict:
    cfg = model.config
    return {"name": name, "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size}


def load_drafter(path: str, target: nn.Module, dtype: torch.dtype | None = None) -> DSparkDrafter:
    """The drafter in `path`, on the target's device, sharing its embedding and lm_head. Raises
    ValueError when the checkpoint is not a DSpark drafter or was trained for another shape."""
    from safetensors.torch import load_file

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"speculative model {path!r}: no config.json there")
    with open(cfg_path) as f:
        raw = json.load(f)
    if raw.get("model_type") != MODEL_TYPE:
        raise ValueError(f"speculative model {path!r} is not a DSpark drafter (model_type {raw.get('model_type')!r})")
    want = raw.get("target", {})
    have = {"num_hidden_layers": target.config.num_hidden_layers, "hidden_size": target.config.hidden_size,
            "vocab_size": target.config.vocab_size}
    bad = {k: (want.get(k), v) for k, v in have.items() if want.get(k) not in (None, v)}
    if bad:
        raise ValueError(f"speculative model {path!r} was trained for another target: " +
                         ", ".join(f"{k} {a} (target has {b})" for k, (a, b) in bad.items()))
    drafter = DSparkDrafter(DSparkConfig.from_dict(raw))
    drafter.load_state_dict(load_file(os.path.join(path, "model.safetensors")))
    dev = target.lm_head.weight.device
    drafter = drafter.to(dev, dtype or target.lm_head.weight.dtype).eval().requires_grad_(False)
    return drafter.share_target(target.model.embed_tokens, target.lm_head)

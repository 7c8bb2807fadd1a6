"""A checkpoint directory's safetensors shards, read one tensor at a time.

`safetensors` (the default) maps one shard at a time and hands out host tensors one by one: host memory
holds at most that shard's pages and the tensor on its way to the device. `fastsafetensors` (optional,
`pip install fastsafetensors`) reads a whole shard into device memory with parallel reads and hands out
device tensors; its staging buffer of one shard is freed before the next.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch

from hyserve.config import FASTSAFETENSORS_HINT
from hyserve.models.weight_assembler import CheckpointError


def safetensor_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    # other safetensors files (e.g. saved activations) may sit beside a model*.safetensors checkpoint
    files = [f for f in files if f.startswith("model")] or files
    if not files:
        raise CheckpointError(f"no .safetensors files in {path}")
    return [os.path.join(path, f) for f in files]


def iter_tensors(files: list[str], load_format: str = "safetensors", device: str | torch.device = "cpu",
                 slices: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every tensor of every file, shard by shard, with vLLM's progress bar
    on stderr when there is more than one shard. fastsafetensors tensors are on `device`, the others on
    the host (the loader copies each into its parameter). `slices`: safetensors hands out each tensor as
    a `get_slice` handle, valid until the next one, from which a rank reads only its part (fastsafetensors
    has read the shard already and hands out tensors)."""
    from tqdm import tqdm

    read = _fastsafetensors_file if load_format == "fastsafetensors" else _safetensors_file
    bar = tqdm(files, desc="Loading safetensors checkpoint shards", disable=len(files) <= 1, dynamic_ncols=True)
    for file in bar:
        yield from read(file, device, slices)


def _safetensors_file(file: str, device, slices: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        for key in f.keys():
            yield key, f.get_slice(key) if slices else f.get_tensor(key)


def _fastsafetensors_file(file: str, device, slices: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        from fastsafetensors import fastsafe_open
    except ImportError as e:
        raise CheckpointError(f"--load-format fastsafetensors needs the fastsafetensors package: "
                              f"{FASTSAFETENSORS_HINT}") from e
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    # nogds: plain parallel reads through a bounce buffer; GPUDirect Storage needs cuFile set up
    with fastsafe_open(file, device=str(dev), nogds=True) as f:
        for key in f.keys():
            yield key, f.get_tensor(key)
        if dev.type == "cuda":
            torch.cuda.synchronize()  # the copies out of the shard's buffer, before the buffer goes
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the shard's staging buffer: the cache planner sizes from free memory

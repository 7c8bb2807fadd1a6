"""Tensor, expert and decode-context parallelism on torch.distributed (docs/parallelism.md).

One process per rank; NCCL on GPUs, gloo on CPUs. The modules here hold the building blocks: process
groups with bounded timeouts (groups.py), the worker pool (launch.py), per-parameter shard specs the
loader reads slices with (sharding.py), the parallel layers (tp_layers.py, moe.py, ep.py), the sharded
model (model.py), and DCP attention and the DSA top-k merge (dcp.py, dsa_dcp.py).
"""

from hyserve.distributed.config import ParallelConfig, ParallelConfigError, check_model_splits

__all__ = ["ParallelConfig", "ParallelConfigError", "check_model_splits"]

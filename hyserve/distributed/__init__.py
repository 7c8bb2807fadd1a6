"""Tensor, expert and decode-context parallelism on torch.distributed (docs/parallelism.md).

One process per rank; NCCL on GPUs, gloo on CPUs. The building blocks: the layout (config.py), process
groups with bounded timeouts and their collectives (groups.py, comm.py), the worker pool (launch.py),
per-parameter shard specs the loader reads slices with (sharding.py), the step's shared state
(context.py), the parallel layers (tp_layers.py, moe.py, ep.py, dcp_mla.py), the rank model (model.py),
DCP attention and the DSA top-k merge (dcp.py, dsa_dcp.py), and per-rank cache capacity (capacity.py).
"""

from hyserve.distributed.config import ParallelConfig, ParallelConfigError, check_model_splits

__all__ = ["ParallelConfig", "ParallelConfigError", "check_model_splits"]

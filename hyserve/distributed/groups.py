"""Process-group setup for one rank: the TP group (all ranks), the EP group (the TP ranks when expert
parallelism is on) and the DCP groups (consecutive TP ranks), each with a bounded timeout."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hyserve import envs
from hyserve.distributed.comm import Group
from hyserve.distributed.config import ParallelConfig


def default_timeout_s() -> float:
    """How long a rank waits in a collective for its peers before the step fails with a CollectiveError:
    HYSERVE_DIST_TIMEOUT_S, 600 s by default (NCCL's own default too; a step's imbalance between ranks
    stays far below it)."""
    return envs.get().dist_timeout_s


@dataclass
class ParallelState:
    """What a rank knows about the layout; `tp`, `ep` and `dcp` are groups of one on a single process."""

    config: ParallelConfig
    rank: int
    tp: Group
    ep: Group
    dcp: Group
    device: torch.device


def _one(name: str, rank: int, timeout_s: float, device: torch.device) -> Group:
    return Group(name, [rank], 0, timeout_s, None, device)


def single_process_state(config: ParallelConfig | None = None, device: str | torch.device = "cpu") -> ParallelState:
    """The state of an unsplit run (every group of one, no torch.distributed)."""
    config = config or ParallelConfig()
    if config.world_size != 1:
        raise ValueError("single_process_state is for tensor_parallel_size 1")
    dev = torch.device(device)
    g = _one("tp", 0, default_timeout_s(), dev)
    return ParallelState(config, 0, g, g, g, dev)


def join(world_size: int, rank: int, store: dist.Store, *, device: str | torch.device = "cpu",
         backend: str | None = None, timeout_s: float | None = None) -> None:
    """Join the job's default process group as `rank` through `store` (the engine process hosts a TCPStore);
    `timeout_s` None: `default_timeout_s()`."""
    dev = torch.device(device)
    timeout_s = default_timeout_s() if timeout_s is None else timeout_s
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    kwargs = {"device_id": dev} if dev.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def make_state(config: ParallelConfig, rank: int, *, device: str | torch.device = "cpu",
               timeout_s: float | None = None) -> ParallelState:
    """The groups of `config` over the joined job. Every rank must call it with the same config, in the
    same order as its other calls: creating a subgroup is itself collective."""
    world, dev = config.world_size, torch.device(device)
    timeout_s = default_timeout_s() if timeout_s is None else timeout_s
    if world == 1:
        return single_process_state(config, dev)
    if dist.get_world_size() != world:
        raise ValueError(f"the layout needs {world} ranks; the job has {dist.get_world_size()}")
    ranks = list(range(world))
    tp = Group("tp", ranks, rank, timeout_s, dist.group.WORLD, dev)
    ep = Group("ep", ranks, rank, timeout_s, dist.group.WORLD, dev) if config.enable_expert_parallel \
        else _one("ep", rank, timeout_s, dev)
    w = config.decode_context_parallel_size
    if w == 1:
        dcp = _one("dcp", rank, timeout_s, dev)
    elif w == world:
        dcp = Group("dcp", ranks, rank, timeout_s, dist.group.WORLD, dev)
    else:
        timeout = datetime.timedelta(seconds=timeout_s)
        for start in range(0, world, w):  # every rank creates every subgroup, in the same order
            members = ranks[start : start + w]
            pg = dist.new_group(members, timeout=timeout)
            if rank in members:
                dcp = Group("dcp", members, members.index(rank), timeout_s, pg, dev)
    return ParallelState(config, rank, tp, ep, dcp, dev)


def init_parallel(
    config: ParallelConfig, rank: int, store: dist.Store, *, device: str | torch.device = "cpu",
    backend: str | None = None, timeout_s: float | None = None,
) -> ParallelState:
    """`join` then `make_state`: one rank's setup for one layout."""
    if config.world_size > 1:
        join(config.world_size, rank, store, device=device, backend=backend, timeout_s=timeout_s)
    return make_state(config, rank, device=device, timeout_s=timeout_s)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

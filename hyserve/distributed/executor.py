"""The engine side of a parallel engine (docs/parallelism.md, "Under the engine"). The scheduler, the cache
manager and the sampler stay in the engine process; `tensor_parallel_size` worker processes (one per
rank, launch.RankPool: gloo processes on the CPU, one GPU each with NCCL) hold the model's slices, their
caches and decode graphs (worker.py).

- `RankWorkers` stands in for the model: it answers what the engine asks of one (`config`, the whole
  model's; `device`, where the logits land for the sampler; `dtype`; `kernel_plan`; `make_cache`), plans
  the cache on the ranks (each from its own memory and shapes, all taking the smallest counts) and
  carries each step to them.
- `RankCacheHandle` is the cache manager's view of the ranks' caches: meta tensors of a rank's shapes
  (nothing allocated here) and the copies the prefix cache makes, queued for every rank to apply to its
  own tensors before its next forward.
- `RankRunner` is the ModelRunner whose device half is the ranks: the step inputs are built here once
  (`build_step_inputs`, one packed buffer) and sent to every rank; rank 0's logits come back.
- `RankGraphs` is the engine's view of the ranks' decode graphs: the ladder the inputs are laid out for.

A rank that raises, dies or stops answering fails the step with `EngineDeadError`: a process group that
lost a member cannot be repaired, so the engine stops (the server then fails its requests and exits).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
import weakref
from dataclasses import dataclass, field

import torch

from hyserve.config import EngineConfig
from hyserve.distributed import worker
from hyserve.distributed.config import ParallelConfig, ParallelConfigError, check_model_splits
from hyserve.distributed.groups import default_timeout_s
from hyserve.distributed.launch import RankFailedError, RankPool
from hyserve.engine.cuda_graphs import DecodeGraphs
from hyserve.engine.engine_core import EngineDeadError
from hyserve.engine.kv_cache import CachePlan
from hyserve.engine.model_runner import ModelRunner, StepLogits
from hyserve.engine.step_inputs import StepInputs, StepLayout
from hyserve.models.batch import CacheTensors
from hyserve.models.loader import read_model_config
from hyserve.ops.device_spec import DeviceSpec

log = logging.getLogger(__name__)

# once a rank failed, how long the others get to report their own error before the pool stops them: theirs
# are consequences (a collective with the failed rank), and the engine must not wait out the group timeout
FAILURE_GRACE_S = 3.0


def check_layout(cfg: EngineConfig, device: str) -> ParallelConfig:
    """The layout of `cfg` for its model, or ParallelConfigError (a ValueError) before any process starts:
    a dimension the model cannot split, or more ranks than visible GPUs."""
    parallel = cfg.parallel_config
    model_cfg = read_model_config(cfg.model, cfg.load_format)
    if model_cfg.is_deepseek_v32 and parallel.world_size > 1:
        raise ParallelConfigError("tensor parallelism is built for the Kimi models; DeepSeek V3.2 is not split yet")
    check_model_splits(model_cfg, parallel)
    if torch.device(device).type == "cuda":
        visible = torch.cuda.device_count()
        if parallel.world_size > visible:
            raise ParallelConfigError(f"tensor_parallel_size {parallel.world_size} needs {parallel.world_size} GPUs; "
                                      f"{visible} are visible")
    return parallel


class _KernelPlans:
    """`kernel_plan.table()` for the engine's start-up log: the ranks' plans (one table: every rank has
    the same shapes)."""

    def __init__(self, table: str, device: torch.device):
        self._table = table
        self.device = DeviceSpec.of(device)  # rank 0's device kind: what the step budget is sized for

    def table(self) -> str:
        return "every rank's " + self._table


# engines whose ranks a shared pool still holds, released at the pool's next call: a finalizer may run
# inside another call on the same pool (garbage collection happens anywhere), which must not be re-entered
_RELEASED: weakref.WeakKeyDictionary[RankPool, list[str]] = weakref.WeakKeyDictionary()


def _close(pool: RankPool, key: str, owned: bool) -> None:
    if owned:
        pool.close()
    else:
        _RELEASED.setdefault(pool, []).append(key)


class RankWorkers:
    def __init__(self, cfg: EngineConfig, device: str, pool: RankPool | None = None):
        """Start the ranks (or use `pool`, whose size must be the layout's: tests share one across
        engines) and load the model's slices on them."""
        self.parallel = check_layout(cfg, device)
        self.config = read_model_config(cfg.model, cfg.load_format)
        cuda = torch.device(device).type == "cuda"
        self.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if pool is not None and pool.world != self.parallel.world_size:
            raise ValueError(f"a pool of {pool.world} ranks cannot run tensor_parallel_size {self.parallel.world_size}")
        self.pool = pool or RankPool(self.parallel, device="cuda" if cuda else "cpu", grace_s=FAILURE_GRACE_S)
        self.key = uuid.uuid4().hex
        self._finalizer = weakref.finalize(self, _close, self.pool, self.key, pool is None)
        infos = self.run(worker.load, cfg)
        self.dtype: torch.dtype = infos[0]["dtype"]
        self.kernel_plan = _KernelPlans(infos[0]["kernel_plan"], self.device)
        for rank, info in enumerate(infos):
            log.info("rank %d: %s", rank, info["load"])

    def run(self, fn, *args, timeout_s: float | None = None) -> list:
        """fn(state, key, *args) on every rank (worker.py); a failed rank ends the engine."""
        try:
            for key in _RELEASED.pop(self.pool, []):
                self.pool.run(worker.release, key, layout=self.parallel)
            return self.pool.run(fn, self.key, *args, layout=self.parallel, timeout_s=timeout_s)
        except RankFailedError as e:
            raise EngineDeadError(f"a rank of the parallel engine failed, so the engine cannot go on: {e}") from e

    def plan_cache(self, cfg: EngineConfig, dtype: torch.dtype, max_model_len: int, scratch: bool) -> CachePlan:
        """Each rank plans from its own memory and shapes; all take the smallest counts. Under DCP the
        scheduler's block is `block_size` tokens of each of the W ranks."""
        plans = self.run(worker.plan, cfg, dtype, max_model_len, scratch)
        for _, capacity in plans:
            log.info("KV cache of %s", capacity)
        return plans[0][0]

    def make_cache(self, num_blocks: int, block_size: int, num_slots: int, dtype: torch.dtype) -> RankCacheHandle:
        """The ranks allocate their caches (as planned: these are the plan's counts); the handle to them."""
        shapes = self.run(worker.allocate, dtype)[0]
        meta = {name: torch.empty(shape, dtype=dt, device="meta").as_subclass(OnTheRanks)
                for name, (shape, dt) in shapes.items()}
        return RankCacheHandle(**meta)

    def close(self) -> None:
        self._finalizer()


_READABLE = {torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__, torch.Tensor.size,
             torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size, torch.Tensor.__repr__}


class OnTheRanks(torch.Tensor):
    """A cache tensor of a parallel engine as the engine process holds it (on the meta device): its shape
    and dtype can be read, and any operation on its data raises, because the data lives on the ranks. Code
    that writes the cache goes through `CacheTensors.copy_slots` / `copy_blocks`, which every rank applies;
    a write straight into a tensor would otherwise do nothing, silently."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func not in _READABLE:
            raise RuntimeError(f"{getattr(func, '__name__', func)} on a cache tensor of a parallel engine in the "
                               "engine process: the data lives on the ranks (use CacheTensors.copy_slots / copy_blocks)")
        return super().__torch_function__(func, types, args, kwargs)


@dataclass
class RankCacheHandle(CacheTensors):
    ops: list[tuple[str, list[int], list[int]]] = field(default_factory=list)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        self.ops.append(("copy_slots", list(src), list(dst)))

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.ops.append(("copy_blocks", list(src), list(dst)))

    def take_ops(self) -> list[tuple[str, list[int], list[int]]]:
        """The copies queued since the last step, in order; the ranks apply them before its forward."""
        ops, self.ops = self.ops, []
        return ops


class RankGraphs(DecodeGraphs):
    """The ladder of the ranks' decode graphs, with the sizes of their static buffers (what the step
    inputs of a graph step are laid out for); each rank builds and captures its own graphs."""

    def __init__(self, workers: RankWorkers, kv, max_model_len: int, sizes: list[int], max_prev_rows: int | None = None):
        self.model, self.kv, self.max_model_len = workers, kv, max_model_len
        self.sizes = sorted(sizes)
        self.max_blocks = -(-max_model_len // kv.block_size)
        p = max(self.sizes[-1], max_prev_rows or 0)
        self.max_prev = p + (p & 1)  # as DecodeGraphs computes it on every rank
        self.verify_sizes = {}  # verify steps of a parallel engine run eagerly
        self._layouts = {(s, 1): StepLayout(s, s, 0, self.max_blocks) for s in self.sizes}
        self.graphs = {}
        workers.run(worker.build_graphs, max_model_len, sizes, max_prev_rows)

    def capture(self) -> None:
        """Every rank captures; a size one of them could not capture runs eagerly on all of them."""
        captured = self.model.run(worker.capture)
        self.graphs = dict.fromkeys(sorted(set.intersection(*map(set, captured))))

    def run(self, inputs: StepInputs, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        raise RuntimeError("the ranks replay their own graphs (RankRunner.run)")


def _with_host_ids(inputs: StepInputs, prev: torch.Tensor, prev_len: int) -> StepInputs:
    """The inputs with the ids still in the previous step's device tensor (async scheduling) written into
    the ids row: the ranks never see that tensor. Sources below prev.numel() point into it; the others
    are prev_len + the token's index."""
    flat = inputs.flat.clone()
    v = inputs.layout.views(flat)
    held = v.id_sources < prev.numel()
    v.input_ids[held] = prev.cpu()[v.id_sources[held]]
    v.id_sources[held] = prev_len + torch.arange(len(v.id_sources))[held]
    return dataclasses.replace(inputs, flat=flat, pending=False)


class RankRunner(ModelRunner):
    def __init__(self, workers: RankWorkers, kv, graphs: RankGraphs | None = None):
        super().__init__(workers, kv, graphs)
        self._pin = False  # the inputs travel to the ranks pickled, not by a host-to-device copy
        p = workers.parallel
        # the reference deployment's TEP prefill: sequence parallelism for TP+EP steps of many tokens
        self._sequence_parallel = p.expert_parallel_size > 1 and p.decode_context_parallel_size == 1
        self._timeout_s = default_timeout_s() + 60.0  # past the group timeout: a rank that stops answering

    def run(self, inputs: StepInputs, prev: torch.Tensor | None, prompt_rows: dict[int, int], graph: bool) -> StepLogits:
        if prev is not None:
            inputs = _with_host_ids(inputs, prev, self.graphs.max_prev if graph else prev.numel())
        workers = self.model
        sp = self._sequence_parallel and not graph and inputs.layout.num_tokens >= workers.parallel.world_size
        msg = worker.StepMessage(inputs.flat.numpy(), inputs.layout, inputs.query_lens, inputs.context_lens,
                                 inputs.sample_rows, prompt_rows, graph, sp, self.kv.tensors.take_ops())
        logits, prompt = workers.run(worker.step, msg, timeout_s=self._timeout_s)[0]
        dev = self.device
        return StepLogits(inputs.sample_rows, torch.from_numpy(logits).to(dev),
                          {i: torch.from_numpy(p).to(dev) for i, p in prompt.items()})

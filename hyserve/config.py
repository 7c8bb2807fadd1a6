"""Engine configuration: one flat, frozen dataclass with vLLM's names where a counterpart exists
(docs/ARCHITECTURE.md §6). Each field's metadata carries its CLI flag and help, so `hyserve serve` and
`hyserve generate` derive their engine flags from here (entrypoints/engine_args.py).

A field left at None means "decide for me": `resolve_config` fills every such default once, at engine
start, from the device, the model and the env aliases, and the engine keeps only that resolved copy.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field

from hyserve import envs
from hyserve.spec_decode.config import SpeculativeConfig, check_for_engine

# The model `hyserve serve` / `generate` / `LLM()` run when none is named: the trained embedded checkpoint
# shipped in hyserve/assets (python -m hyserve.train), else the random k3-tiny preset while none is shipped.
# Presets stay available by name either way.
EMBEDDED_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "hyserve-tiny-k3")
EMBEDDED_MODEL_NAME = "hyserve-tiny-k3"  # what the server calls it unless --served-model-name says otherwise
DEFAULT_MODEL = EMBEDDED_MODEL_DIR if os.path.isfile(os.path.join(EMBEDDED_MODEL_DIR, "config.json")) else "k3-tiny"
GIB = 1 << 30
log = logging.getLogger(__name__)


LOAD_FORMATS = ("auto", "safetensors", "fastsafetensors", "dummy")
FASTSAFETENSORS_HINT = "pip install fastsafetensors (or hyserve[fastsafetensors])"


def _check_load_format(fmt: str) -> None:
    """Before any process starts or torch is imported: a bad name, or fastsafetensors not installed."""
    if fmt not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got '{fmt}'")
    if fmt == "fastsafetensors":
        import importlib.util

        if importlib.util.find_spec("fastsafetensors") is None:
            raise ValueError(f"load_format fastsafetensors needs the fastsafetensors package: {FASTSAFETENSORS_HINT}")


def _opt(default, help: str, hash: bool | None = None, **cli):
    """A field with its CLI help; `cli` may name the flag (`flag=`), the value that flag takes in field
    units (`scale=`: --kv-offloading-size is GiB of a byte count), the smallest value (`min=`), `choices=`,
    `metavar=` and a short alias (`alias="-tp"`). `hash=False` leaves an unhashable value out of the hash."""
    return field(default=default, hash=hash, metadata={"help": help, **cli})


@dataclass(frozen=True)
class EngineConfig:
    model: str = _opt(DEFAULT_MODEL, "model directory or preset")
    dtype: str = _opt("auto", "weights and activations: auto (the checkpoint's), float32, bfloat16 or float16")
    device: str | None = _opt(None, "cuda or cpu (default: cuda when available)")
    seed: int = _opt(0, "engine seed: random preset weights and torch's global generator")
    load_format: str = _opt("auto", "how weights are read: auto (safetensors for a directory, dummy for a preset), "
                                    "safetensors, fastsafetensors (optional package) or dummy (random weights "
                                    "at the config's shape)", choices=LOAD_FORMATS)
    tokenizer: str | None = _opt(None, "tokenizer directory (default: the model's, else its family's built-in one)")
    served_model_name: str | None = _opt(None, "the name clients use (default: MODEL)")
    # scheduler
    max_num_seqs: int = _opt(64, "most sequences in one step", min=1)
    max_num_batched_tokens: int | None = _opt(
        None, "token budget of one step (prefill chunks and decodes); default: from the step cost model "
              "(8192 for the 48B shape on an H200), 2048 on the CPU", min=1)
    long_prefill_token_threshold: int | None = _opt(
        None, "most tokens one prompt's chunk takes from a step while other requests run or wait; 0 = no cap "
              "(default: from the step cost model, 4096 for the 48B shape on an H200; none on the CPU)", min=0, metavar="N")
    max_model_len: int | None = _opt(None, "context limit (default: the model's)", min=1)
    scheduling_policy: str = _opt("fcfs", "priority: requests' `priority` field orders the waiting queue",
                                  choices=("fcfs", "priority"))
    # cache
    block_size: int = _opt(64, "tokens per KV cache page (a power of two)")
    num_gpu_blocks: int | None = _opt(None, "KV cache pages to allocate, instead of sizing the pool from memory",
                                      flag="--num-gpu-blocks-override", min=1, metavar="N")
    num_state_slots: int | None = _opt(None, "KDA state slots to allocate, instead of sizing them from memory",
                                       min=1, metavar="N")
    kv_cache_memory_bytes: int | None = _opt(None, "bytes of the cache pools (pages and state slots), instead of "
                                                   "--gpu-memory-utilization", min=1, metavar="BYTES")
    gpu_memory_utilization: float = _opt(0.9, "share of GPU memory for weights, activations and the cache")
    kv_cache_dtype: str = _opt("auto", "cache rows: auto (the model dtype), float32, bfloat16 or float16")
    # prefix caching (docs/ARCHITECTURE.md §5)
    enable_prefix_caching: bool = _opt(True, "share cached pages and KDA checkpoints between requests")
    prefix_cache_retention_interval: int | None = _opt(
        None, "also keep a prefix-cache checkpoint every N tokens; 0 = off "
              "(default: env HYSERVE_PREFIX_CACHE_RETENTION_INTERVAL, else 0)", min=0, metavar="N")
    prefix_cache_second_hit: bool = _opt(True, "keep the branch point of a prefix seen a second time")
    prefix_cache_end_of_generation: bool = _opt(True, "keep the state at the end of each generation")
    prefix_cache_last_full_page: bool = _opt(True, "keep the state at the prompt's last full page, where a later "
                                                   "prompt that shares its pages but not its tail resumes")
    num_checkpoint_slots: int | None = _opt(None, "state slots reserved for prefix-cache checkpoints "
                                                  "(default: --max-num-seqs sessions x "
                                                  "--prefix-cache-checkpoints-per-session, within half the memory "
                                                  "the running slots leave)", min=0, metavar="N")
    prefix_cache_checkpoints_per_session: int = _opt(
        8, "prefix-cache checkpoints the cache is sized to keep per live session (a turn takes up to four: "
           "branch point, last full page, prompt end, end of generation; the newest turn and the one before)",
        min=1, metavar="N")
    cpu_offload_bytes: int = _opt(0, "CPU tier of the prefix cache, in GiB; 0 = off", flag="--kv-offloading-size",
                                  scale=GIB, min=0, metavar="GIB")
    # execution
    enforce_eager: bool | None = _opt(None, "never capture CUDA graphs: decode steps run eagerly (default on "
                                            "CUDA: graphs for decode batches up to min(max-num-seqs, 512); env "
                                            "HYSERVE_CUDA_GRAPHS=0 is an alias)")
    # launch step k+1 before reading back step k's tokens; on CUDA it measured 1.2x at batch 1 and 1.26x
    # at batch 64 on an H200, and a CPU step gains nothing
    async_scheduling: bool | None = _opt(None, "launch each step before reading back the previous one's tokens, "
                                               "so host work overlaps the GPU (a request that stops computes one "
                                               "token more, which is dropped); default: on for CUDA devices")
    warmup: bool | None = _opt(None, "run the prefill and mixed-step shapes of the token-count ladder at start-up, "
                                     "so kernels are compiled and tuned before ready (default: on for CUDA "
                                     "devices)")
    # parallelism on torch.distributed, one process per rank (docs/parallelism.md)
    tensor_parallel_size: int = _opt(1, "ranks (one process and one GPU each) the model is split over; on the CPU "
                                        "the ranks are gloo processes", min=1, alias="-tp")
    enable_expert_parallel: bool = _opt(False, "split the routed experts over the ranks by expert instead of by width")
    decode_context_parallel_size: int = _opt(1, "split the MLA latent cache and DSA index keys by token over groups of "
                                                "this many TP ranks (block-size tokens of each rank's own per page)",
                                             min=1, alias="-dcp")
    cp_kv_cache_interleave_size: int = _opt(1, "consecutive tokens a DCP rank owns (a DSA indexer needs 1)", min=1)
    # speculative decoding (docs/speculative_decoding.md); a SpeculativeConfig once constructed
    speculative_config: str | dict | SpeculativeConfig | None = _opt(
        None, "speculative decoding as a JSON object with vLLM's keys, e.g. "
              "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'; "
              "methods ngram and dspark (a drafter directory as 'model'; eager, no prefix caching) "
              "(default: off)", hash=False, metavar="JSON")
    # the server's periodic stats line (hyserve/stats_logger.py)
    disable_log_stats: bool = _opt(False, "no periodic stats line in the server log")

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got '{self.scheduling_policy}'")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        _check_load_format(self.load_format)
        self.parallel_config  # noqa: B018 (validates the layout: ParallelConfigError, a ValueError)
        if self.tensor_parallel_size > 1 and self.cpu_offload_bytes:
            raise ValueError("--kv-offloading-size (the prefix cache's CPU tier) is not supported with "
                             "tensor_parallel_size > 1 yet")
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", check_for_engine(self.speculative_config, self))
        for f in dataclasses.fields(self):
            value, least = getattr(self, f.name), f.metadata.get("min")
            if least is not None and value is not None and value < least:
                raise ValueError(f"{f.name} must be at least {least}, got {value}")

    @property
    def parallel_config(self):
        """The layout of these fields (hyserve/distributed/config.py), which checks itself."""
        from hyserve.distributed.config import ParallelConfig

        return ParallelConfig(self.tensor_parallel_size, self.enable_expert_parallel,
                              self.decode_context_parallel_size, self.cp_kv_cache_interleave_size)

    def describe(self) -> str:
        """Every field as name=value, for the start-up log."""
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


# the step budget hyserve used before the cost model, and what the CPU keeps (planning/step_budget.py)
LEGACY_STEP_BUDGET = 2048


def _step_budget(cfg: EngineConfig, cuda: bool, dtype: str, model_config, device_name: str | None) -> tuple[int, int]:
    """(max_num_batched_tokens, long_prefill_token_threshold): the given ones, the rest from the step cost model."""
    budget, threshold = cfg.max_num_batched_tokens, cfg.long_prefill_token_threshold
    if model_config is None or (budget is not None and threshold is not None):
        return budget or LEGACY_STEP_BUDGET, threshold or 0
    from hyserve.planning.ceilings import ceilings_for
    from hyserve.planning.step_budget import choose_step_budget
    from hyserve.planning.step_cost import StepCostModel

    weight_bytes = 4 if dtype == "float32" else 2
    chosen = choose_step_budget(StepCostModel(model_config, weight_bytes), ceilings_for(device_name) if cuda else None,
                                cfg.max_num_seqs, budget, threshold)
    log.info("step budget: max_num_batched_tokens %d, long_prefill_token_threshold %d (%s)",
             chosen.max_num_batched_tokens, chosen.long_prefill_token_threshold, chosen.reason)
    return chosen.max_num_batched_tokens, chosen.long_prefill_token_threshold


def resolve_config(
    cfg: EngineConfig, device: str, dtype: str, max_position_embeddings: int | None = None,
    env: envs.Envs | None = None, model_config=None, device_name: str | None = None,
) -> EngineConfig:
    """The config with every "decide for me" default filled in, for a model loaded on `device` (e.g. "cpu",
    "cuda:0") in `dtype` ("bfloat16"): the env aliases (HYSERVE_CUDA_GRAPHS, the retention interval) where
    no field was given, CUDA graphs, async scheduling and the warm-up on CUDA only, the cache in the model
    dtype, the context limit capped by the model's, the step budget from the cost model of `model_config`
    (a ModelConfig) on the device named `device_name` (hyserve's earlier 2,048 tokens without them). The
    one place these defaults are decided; `cfg` is not changed."""
    env = env or envs.get()
    cuda = device.split(":")[0] == "cuda"
    eager = cfg.enforce_eager or not env.cuda_graphs or not cuda
    interval = cfg.prefix_cache_retention_interval
    if interval is None:
        interval = env.prefix_cache_retention_interval or 0
    limit = max_position_embeddings
    max_len = cfg.max_model_len if limit is None else min(cfg.max_model_len or limit, limit)
    budget, threshold = _step_budget(cfg, cuda, dtype, model_config, device_name)
    return dataclasses.replace(
        cfg, device=device, dtype=dtype, enforce_eager=eager, warmup=cuda if cfg.warmup is None else cfg.warmup,
        max_num_batched_tokens=budget, long_prefill_token_threshold=threshold,
        async_scheduling=cuda if cfg.async_scheduling is None else cfg.async_scheduling,
        prefix_cache_retention_interval=interval, max_model_len=max_len,
        kv_cache_dtype=dtype if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype,
    )


def log_startup(cfg: EngineConfig, kernel_plan=None) -> None:
    """The start-up log: the resolved config, the env switches that are set, the model's kernel plan."""
    log.info("engine config: %s", cfg.describe())
    log.info("env switches set: %s", envs.get().describe())
    if kernel_plan is not None:
        log.info("%s", kernel_plan.table())


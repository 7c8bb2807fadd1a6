"""Engine configuration: flat dataclasses with vLLM's names where a counterpart exists (DESIGN.md §8)."""

from __future__ import annotations

import os
from dataclasses import dataclass

# The model `hyserve serve` / `generate` / `LLM()` run when none is named: the trained embedded checkpoint
# shipped in hyserve/assets (python -m hyserve.train), else the random k3-tiny preset while none is shipped.
# Presets stay available by name either way.
EMBEDDED_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "hyserve-tiny-k3")
EMBEDDED_MODEL_NAME = "hyserve-tiny-k3"  # what the server calls it unless --served-model-name says otherwise
DEFAULT_MODEL = EMBEDDED_MODEL_DIR if os.path.isfile(os.path.join(EMBEDDED_MODEL_DIR, "config.json")) else "k3-tiny"


def _env_int(name: str, default: int | None) -> int | None:
    v = os.environ.get(name)
    return default if v in (None, "") else int(v)


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    device: str | None = None  # None: cuda when available, else cpu
    seed: int = 0
    # how weights are read (vLLM's names): auto = safetensors for a directory, dummy (random weights at
    # the config's shape) for a preset; fastsafetensors needs the optional fastsafetensors package
    load_format: str = "auto"
    tokenizer: str | None = None
    served_model_name: str | None = None
    # scheduler
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority"
    # cache
    block_size: int = 64
    num_gpu_blocks: int | None = None  # page count override (the CPU default sizing uses bytes)
    num_state_slots: int | None = None  # state slot count override
    kv_cache_memory_bytes: int | None = None  # pool budget override (both pools)
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    # prefix caching (DESIGN.md §5)
    enable_prefix_caching: bool = True
    prefix_cache_retention_interval: int | None = None
    prefix_cache_second_hit: bool = True
    prefix_cache_end_of_generation: bool = True
    num_checkpoint_slots: int | None = None
    cpu_offload_bytes: int = 0
    # execution
    enforce_eager: bool = False
    # launch step k+1 before reading back step k's tokens (vLLM's --async-scheduling); None: on for CUDA
    # devices (1.2x at batch 1, 1.26x at batch 64 on an H200), off elsewhere (a CPU step gains nothing)
    async_scheduling: bool | None = None
    # the server's periodic stats line (hyserve/stats_logger.py); off with --disable-log-stats
    disable_log_stats: bool = False

    def __post_init__(self) -> None:
        if self.prefix_cache_retention_interval is None:
            self.prefix_cache_retention_interval = _env_int("HYSERVE_PREFIX_CACHE_RETENTION_INTERVAL", 0)
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got '{self.scheduling_policy}'")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        _check_load_format(self.load_format)
        if self.prefix_cache_retention_interval < 0:
            raise ValueError("prefix_cache_retention_interval must be >= 0")


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

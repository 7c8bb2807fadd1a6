"""Every `HYSERVE_*` environment switch: the one module that reads the environment (docs/ARCHITECTURE.md §6).

The switches are read once, on first use, into a frozen `Envs`; whoever needs one reads that object. They
are switches for debugging and measuring, not configuration: each engine setting has an `EngineConfig`
field (and a CLI flag), and the switches that only stand in for a field or a flag are aliases, applied
where the config is resolved (`hyserve.config.resolve_config`) or the flag is read (`hyserve serve`'s
--responses-store-*). The engine logs the switches that are set when it starts.

One switch is read apart, at `import hyserve`, before anything else is: the cache root
(`cache_root`), since Triton and torch read the cache directories derived from it when they load.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_MAX_N_SEQUENCES = 16384
DEFAULT_RESPONSES_STORE_SIZE = 4096
DEFAULT_RESPONSES_STORE_MIB = 256


@dataclass(frozen=True)
class Switch:
    name: str
    default: str
    help: str


SWITCHES = (
    Switch("HYSERVE_REFERENCE_OPS", "0",
           "1: every layer runs its torch reference, on CUDA too (the kernel plan says 'reference' everywhere)"),
    Switch("HYSERVE_DSA_TRITON", "1",
           "0: the DSA indexer and sparse MLA keep their torch references on CUDA (to bisect a kernel)"),
    Switch("HYSERVE_DSA_EXACT_SCORES", "0",
           "1: the indexer's Triton kernel scores FP8 keys with an exact fp16 dot, not the FP8 tensor-core dot"),
    Switch("HYSERVE_CUDA_GRAPHS", "1", "0: an alias of --enforce-eager (no decode graphs)"),
    Switch("HYSERVE_PREFIX_CACHE_RETENTION_INTERVAL", "",
           "the default of --prefix-cache-retention-interval (a checkpoint every N tokens; 0 = off)"),
    Switch("HYSERVE_DIST_TIMEOUT_S", "600",
           "seconds a rank waits in a collective for its peers before the step fails (parallel layouts)"),
    Switch("HYSERVE_MAX_N_SEQUENCES", str(DEFAULT_MAX_N_SEQUENCES),
           "the most completions one request may ask for (n), as vLLM's VLLM_MAX_N_SEQUENCES: each is a "
           "sequence the engine builds up front (lower it on a slow CPU server, or a fuzzer's)"),
    Switch("HYSERVE_RESPONSES_STORE_SIZE", str(DEFAULT_RESPONSES_STORE_SIZE),
           "the default of --responses-store-size (responses kept for previous_response_id)"),
    Switch("HYSERVE_RESPONSES_STORE_MIB", str(DEFAULT_RESPONSES_STORE_MIB),
           "the default of --responses-store-mib (MiB of JSON those responses may take)"),
    Switch("HYSERVE_CACHE_ROOT", "",
           "where compiled kernels and autotuning results are kept between starts (default: "
           "$XDG_CACHE_HOME/hyserve, else ~/.cache/hyserve); see hyserve/compile_cache.py"),
)
_NAMES = {s.name for s in SWITCHES}


@dataclass(frozen=True)
class Envs:
    reference_ops: bool = False
    dsa_triton: bool = True
    dsa_exact_scores: bool = False
    cuda_graphs: bool = True
    prefix_cache_retention_interval: int | None = None  # None: not set
    dist_timeout_s: float = 600.0  # NCCL's own default too
    max_n_sequences: int = DEFAULT_MAX_N_SEQUENCES
    responses_store_size: int = DEFAULT_RESPONSES_STORE_SIZE
    responses_store_mib: float = DEFAULT_RESPONSES_STORE_MIB
    set_switches: tuple[tuple[str, str], ...] = ()  # (name, value) of every HYSERVE_* variable set

    def describe(self) -> str:
        """The set switches for the start-up log ("none" when no HYSERVE_* variable is set)."""
        return " ".join(f"{k}={v}" for k, v in self.set_switches) or "none"


def _flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    value = environ.get(name, "").strip()
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def _count(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "").strip()
    if value == "":
        return None
    if not value.isdigit():
        raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    return int(value)


def _at_least_one(environ: Mapping[str, str], name: str, default: int) -> int:
    value = _count(environ, name)
    if value is None:
        return default
    if value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {environ[name]!r}")
    return value


def _size(environ: Mapping[str, str], name: str, default: float) -> float:
    value = environ.get(name, "").strip()
    if value == "":
        return default
    try:
        size = float(value)
    except ValueError:
        size = float("nan")
    if not size > 0 or size == float("inf"):
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    return size


def cache_root(environ: Mapping[str, str]) -> str:
    """HYSERVE_CACHE_ROOT, else $XDG_CACHE_HOME/hyserve, else ~/.cache/hyserve. Any path will do, so this
    cannot fail (it runs at `import hyserve`)."""
    root = environ.get("HYSERVE_CACHE_ROOT", "").strip()
    if root:
        return os.path.expanduser(root)
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hyserve")


def read(environ: Mapping[str, str]) -> Envs:
    """Parse the switches of `environ`; ValueError names a switch with a value it cannot take. A
    HYSERVE_* name that is not a switch here is reported as set, so a misspelling shows in the log."""
    return Envs(
        reference_ops=_flag(environ, "HYSERVE_REFERENCE_OPS", False),
        dsa_triton=_flag(environ, "HYSERVE_DSA_TRITON", True),
        dsa_exact_scores=_flag(environ, "HYSERVE_DSA_EXACT_SCORES", False),
        cuda_graphs=_flag(environ, "HYSERVE_CUDA_GRAPHS", True),
        prefix_cache_retention_interval=_count(environ, "HYSERVE_PREFIX_CACHE_RETENTION_INTERVAL"),
        dist_timeout_s=_size(environ, "HYSERVE_DIST_TIMEOUT_S", 600.0),
        max_n_sequences=_at_least_one(environ, "HYSERVE_MAX_N_SEQUENCES", DEFAULT_MAX_N_SEQUENCES),
        responses_store_size=_at_least_one(environ, "HYSERVE_RESPONSES_STORE_SIZE", DEFAULT_RESPONSES_STORE_SIZE),
        responses_store_mib=_size(environ, "HYSERVE_RESPONSES_STORE_MIB", DEFAULT_RESPONSES_STORE_MIB),
        set_switches=tuple(sorted((k, v if k in _NAMES else f"{v} (not read by hyserve)")
                                  for k, v in environ.items() if k.startswith("HYSERVE_"))),
    )


@functools.cache
def get() -> Envs:
    """The process's switches, read from os.environ on the first call."""
    return read(os.environ)



def child_environ(**overrides: str) -> dict[str, str]:
    """The environment a child process started by hyserve (a benchmark's server) inherits: this process's,
    switches included, with `overrides`."""
    return {**os.environ, **overrides}

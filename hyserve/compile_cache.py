"""Compiled kernels and autotuning results kept between starts, so a restarted server does not compile
and tune again what the previous one did (the first request after a cold start waited 44 s for that).

Defaults under the hyserve cache root (`envs.cache_root`: $HYSERVE_CACHE_ROOT, else
$XDG_CACHE_HOME/hyserve, else ~/.cache/hyserve), each only where the user has not set it:
  - TRITON_CACHE_DIR=<root>/triton: Triton's compiled kernels, and its autotuning results;
  - TRITON_CACHE_AUTOTUNING=1: every `triton.autotune` writes its choice there (fla-core's autotuners do
    so already, FLA_CACHE_RESULTS=1 by default, also set here);
  - TORCHINDUCTOR_CACHE_DIR=<root>/inductor: torch.compile's cache, whose default is under /tmp.
Set when `hyserve` is imported, before Triton, fla-core or torch read them (Triton's autotuners read
theirs when their kernels are defined): this module writes those third-party variables into the process
environment (`_PROCESS_ENV`), and reads them only to leave a user's own settings alone.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from hyserve import envs

_PROCESS_ENV: MutableMapping[str, str] = os.environ


def configure_compile_caches(env: MutableMapping[str, str] = _PROCESS_ENV) -> dict[str, str]:
    """Fill in the defaults above that `env` lacks; returns what was set. Leaves everything alone where
    the cache root cannot be created (a read-only home): the libraries' own defaults apply then."""
    root = envs.cache_root(env)
    dirs = {"TRITON_CACHE_DIR": os.path.join(root, "triton"), "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor")}
    try:
        for key, path in dirs.items():
            if not env.get(key):
                os.makedirs(path, exist_ok=True)
    except OSError:
        return {}
    chosen = {**dirs, "TRITON_CACHE_AUTOTUNING": "1", "FLA_CACHE_RESULTS": "1"}
    added = {k: v for k, v in chosen.items() if not env.get(k)}
    env.update(added)
    return added


def describe(env: MutableMapping[str, str] = _PROCESS_ENV) -> str:
    """For the start-up log: where compiled kernels live and how many a previous start left there."""
    path = env.get("TRITON_CACHE_DIR")
    if not path:
        return "Triton cache: Triton's default directory"
    try:
        entries = len(os.listdir(path))
    except OSError:
        entries = 0
    return f"Triton cache: {path} ({entries} entries{' from earlier starts' if entries else ', empty'})"

"""Compiled kernels and autotuning results kept between starts, so a restarted server does not compile
and tune again what the previous one did (the first request after a cold start waited 44 s for that).

Defaults under the hyserve cache root ($HYSERVE_CACHE_ROOT, else $XDG_CACHE_HOME/hyserve, else
~/.cache/hyserve), each only where the user has not set it:
  - TRITON_CACHE_DIR=<root>/triton: Triton's compiled kernels, and its autotuning results;
  - TRITON_CACHE_AUTOTUNING=1: every `triton.autotune` writes its choice there (fla-core's autotuners do
    so already, FLA_CACHE_RESULTS=1 by default, also set here);
  - TORCHINDUCTOR_CACHE_DIR=<root>/inductor: torch.compile's cache, whose default is under /tmp.
Set when `hyserve` is imported, before Triton, fla-core or torch read them (Triton's autotuners read
theirs when their kernels are defined).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping


def cache_root(env: MutableMapping[str, str] = os.environ) -> str:
    if env.get("HYSERVE_CACHE_ROOT"):
        return os.path.expanduser(env["HYSERVE_CACHE_ROOT"])
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hyserve")


def configure_compile_caches(env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Fill in the defaults above that `env` lacks; returns what was set. Leaves everything alone where
    the cache root cannot be created (a read-only home): the libraries' own defaults apply then."""
    root = cache_root(env)
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


def describe(env: MutableMapping[str, str] = os.environ) -> str:
    """For the start-up log: where compiled kernels live and how many a previous start left there."""
    path = env.get("TRITON_CACHE_DIR")
    if not path:
        return "Triton cache: Triton's default directory"
    try:
        entries = len(os.listdir(path))
    except OSError:
        entries = 0
    return f"Triton cache: {path} ({entries} entries{' from earlier starts' if entries else ', empty'})"

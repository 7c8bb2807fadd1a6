"""Import a script under benchmarks/ as a module, for CPU dry-run tests of the benchmarks."""

from __future__ import annotations

import importlib.util
import sys
from contextlib import contextmanager
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module; its sibling imports (gpu_common, gpu_decode) resolve while it loads."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return mod


@contextmanager
def benchmark_on_path(name: str):
    """benchmarks/<name>.py as a module, with benchmarks/ on sys.path while it is used (its main() imports
    gpu_common and its other siblings when it runs)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield load_benchmark(name)
    finally:
        sys.path.remove(str(BENCHMARKS))

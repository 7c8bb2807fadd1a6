"""GPU tests share one device: an engine takes 90% of its memory for the cache pool, and a dropped engine
can linger in reference cycles until the collector runs, so a kernel test after an engine test would
run out of memory. Every GPU test starts from memory given back."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _give_gpu_memory_back():
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

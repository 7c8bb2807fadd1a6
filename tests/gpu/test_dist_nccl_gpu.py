"""The parallel layouts on NCCL, one GPU per rank (needs 2 or 4 GPUs; the CPU suite proves the same
layouts on gloo): the rank model's logits against one process's on the same GPU kind, with the GPU
kernels each rank's shapes select."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dist_util import logits_error  # noqa: E402

from hyserve.distributed import ParallelConfig  # noqa: E402
from hyserve.distributed.launch import RankPool  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")


@pytest.fixture(scope="module", params=[w for w in (2, 4) if w <= GPUS])
def pool(request):
    with RankPool(ParallelConfig(tensor_parallel_size=request.param), device="cuda", timeout_s=120) as p:
        yield p


@pytest.mark.parametrize("layout", ["tp", "tp_ep", "tp_ep_sp", "dcp"])
@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k3-tiny", "k3.1-tiny"])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_layout_logits_match_one_gpu(pool, preset, layout, dtype, tol):
    w = pool.world
    kw = dict(enable_expert_parallel="ep" in layout, decode_context_parallel_size=w if layout == "dcp" else 1)
    errors = pool.run(logits_error, preset, layout.endswith("sp"), dtype,
                      layout=ParallelConfig(tensor_parallel_size=w, **kw))
    assert max(errors) < tol, errors

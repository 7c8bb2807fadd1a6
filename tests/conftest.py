"""Fixtures for engine tests: tiny models load once per module; engines are rebuilt per test around them.

Every engine a test builds through `make_engine` / `make_llm` is checked after the test: no page and no
running state slot may still be held (pages pinned by prefix checkpoints excepted), so a leak in any
path (finish, abort, preemption, error) fails the test that caused it.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

# Triton decides when it is first imported whether its library functions run interpreted, and torch or
# transformers may import it while the modules below load. Without CUDA no compiled kernel can run, so
# switch the interpreter on first: tests/test_dsa_triton_interpret.py runs the Triton kernels on CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hyserve import LLM
from hyserve.config import EngineConfig
from hyserve.engine.llm_engine import LLMEngine
from hyserve.models.loader import load_model
from hyserve.tokenizer import load_tokenizer

# The tiny presets' matmuls are far too small to gain from intra-op threads, and OpenMP barriers on a
# busy 2-core CI box made engine tests 10-20x slower (measured: 0.6 s vs 28 s for one batch).
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _fewer_fla_autotune_configs():
    """HYSERVE_TEST_FLA_CONFIGS=N keeps N configs of each fla-core autotuner. fla compiles and times
    every config of every kernel for each new shape, about four of the GPU suite's eight minutes; the
    tests check values, not speed. Off by default: the full autotune is what users get."""
    n = int(os.environ.get("HYSERVE_TEST_FLA_CONFIGS", "0"))
    if n > 0 and torch.cuda.is_available():
        import importlib.util

        if importlib.util.find_spec("fla") is not None:
            from hyserve.train.packed import limit_fla_autotune

            limit_fla_autotune(n)
    yield


@pytest.fixture(autouse=True)
def _give_gpu_memory_back():
    """GPU tests share one device: an engine takes 90% of its memory for the cache pool, so every test
    starts from memory given back (a dropped engine's pool, tensors a failed test's traceback held).
    A tests/gpu/conftest.py would shadow this module for `from conftest import ...`."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def assert_pool_empty(engine: LLMEngine) -> None:
    """No request holds a page or a running slot; only prefix-cache checkpoints may pin pages."""
    assert not engine.has_unfinished_requests(), "requests still unfinished: drain or abort them"
    engine.kv.check_empty()


@pytest.fixture(scope="module")
def tiny_model():
    """`tiny_model(name)` -> (model, tokenizer); each preset loads once per test module."""
    loaded = {}

    def get(name: str = "k3-tiny"):
        if name not in loaded:
            model = load_model(name, dtype="float32", device="cpu", seed=0)
            loaded[name] = (model, load_tokenizer(None, model.config.tokenizer_family))
        return loaded[name]

    return get


@pytest.fixture
def make_engine(tiny_model):
    """`make_engine(model="k3-tiny", static_decode_buffers=False, **EngineConfig fields)`; block_size 16
    and a 32 MiB pool by default (static_decode_buffers=True runs decode steps through the CUDA graphs'
    static buffers, on the CPU without a capture)."""
    engines: list[LLMEngine] = []

    def make(model: str = "k3-tiny", static_decode_buffers: bool = False, **kwargs) -> LLMEngine:
        kwargs.setdefault("block_size", 16)
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("kv_cache_memory_bytes", 32 << 20)  # the 1 GiB CPU default is slow to build
        weights, tok = tiny_model(model)
        engine = LLMEngine(EngineConfig(model=model, **kwargs), model=weights, tokenizer=tok,
                           static_decode_buffers=static_decode_buffers)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert_pool_empty(engine)


@pytest.fixture
def make_llm(make_engine):
    """Like `make_engine`, wrapped in the offline `LLM` API."""

    def make(model: str = "k3-tiny", static_decode_buffers: bool = False, **kwargs) -> LLM:
        return LLM.from_engine(make_engine(model, static_decode_buffers, **kwargs))

    return make


@pytest.fixture
def drafter_dir(tmp_path, tiny_model):
    """A small untrained DSpark drafter for k3-tiny (block 4, one layer, target layers 0 and 2), saved to disk."""
    from hyserve.spec_decode.dspark_io import save_drafter, target_info
    from hyserve.train.dspark import DrafterTrainConfig, new_drafter

    target, _ = tiny_model("k3-tiny")
    d = new_drafter(target, DrafterTrainConfig(block_size=4, num_layers=1, layer_ids=[0, 2]), seed=1)
    with torch.no_grad():  # a Markov bias that is not zero, so drafts depend on the token before
        d.markov_out.weight.normal_(0, 0.5)
    save_drafter(d, str(tmp_path / "drafter"), target_info(target, "k3-tiny"), dtype=torch.float32)
    return str(tmp_path / "drafter")


# Files whose tests take the longest (a `--durations` run on a 2-core CI-size machine), collected first:
# with `make test`'s workers (pytest-xdist, a file per worker) they start at once instead of last.
SLOW_FILES = ("test_openapi_fuzz.py", "test_train.py", "test_soak.py", "test_trained_model.py", "test_gpu_issue24_bench.py",
              "test_dist_server.py", "test_structured_thinking.py", "test_prefix_cache.py", "test_bench_frontier.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order

"""The byte counts benchmarks/dsa_decode.py reports (spec/models.md §6.1 record sizes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "dsa_decode.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("dsa_decode_bench", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # importable without CUDA or triton: kernels load inside main()
    return mod


def test_dense_decode_reads_every_fp8_latent_row(bench):
    assert bench.dense_bytes(1, 32768) == 32768 * 576
    assert bench.dense_bytes(64, 131072) == 64 * 131072 * 576


def test_indexer_reads_each_132_byte_key_and_moves_one_sort_key_twice(bench):
    assert bench.indexer_bytes(1, 1000) == 1000 * (132 + 16)
    assert bench.indexer_bytes(16, 131072) == 16 * 131072 * 148


def test_sparse_mla_reads_only_the_selected_rows(bench):
    assert bench.sparse_bytes(1, 131072) == 2048 * 576
    assert bench.sparse_bytes(4, 1000) == 4 * 1000 * 576  # fewer tokens than top-k: all of them


def test_dsa_is_indexer_plus_sparse_and_wins_at_long_context(bench):
    n, ctx = 64, 131072
    assert bench.dsa_bytes(n, ctx) == bench.indexer_bytes(n, ctx) + bench.sparse_bytes(n, ctx)
    # at 128K the indexer's 148 B/token dominates, still about 3.7x fewer bytes than 576 B/token dense
    assert 3.6 < bench.dense_bytes(n, ctx) / bench.dsa_bytes(n, ctx) < 3.7

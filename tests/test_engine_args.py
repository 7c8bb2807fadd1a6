"""Cache flags of `hyserve serve` / `hyserve generate` map onto EngineConfig fields (no engine is built)."""

from __future__ import annotations

import argparse

import pytest

from hyserve.entrypoints.generate import add_generate_parser, engine_kwargs
from hyserve.entrypoints.openai.server import engine_config_from_args
from hyserve.entrypoints.serve import _add_arguments


def serve_config(*argv: str):
    p = argparse.ArgumentParser()
    _add_arguments(p)
    return engine_config_from_args(p.parse_args(["k3-tiny", *argv]))


def generate_kwargs(*argv: str) -> dict:
    p = argparse.ArgumentParser()
    add_generate_parser(p.add_subparsers())
    return engine_kwargs(p.parse_args(["generate", "k3-tiny", "--prompt", "x", *argv]))


def test_retention_interval_flag_sets_the_config_field(monkeypatch):
    monkeypatch.setenv("HYSERVE_PREFIX_CACHE_RETENTION_INTERVAL", "7")
    assert serve_config("--prefix-cache-retention-interval", "256").prefix_cache_retention_interval == 256


def test_retention_interval_env_var_is_the_default_without_the_flag(monkeypatch):
    monkeypatch.setenv("HYSERVE_PREFIX_CACHE_RETENTION_INTERVAL", "128")
    assert serve_config().prefix_cache_retention_interval == 128


def test_kv_offloading_size_is_gib_of_cpu_offload_bytes():
    assert serve_config("--kv-offloading-size", "1.5").cpu_offload_bytes == 3 * 2**29


def test_kv_offloading_is_off_by_default_and_at_zero():
    assert serve_config().cpu_offload_bytes == 0
    assert serve_config("--kv-offloading-size", "0").cpu_offload_bytes == 0


def test_negative_kv_offloading_size_is_rejected():
    with pytest.raises(ValueError, match="kv-offloading-size"):
        serve_config("--kv-offloading-size", "-1")


def test_num_gpu_blocks_override_sets_num_gpu_blocks():
    assert serve_config("--num-gpu-blocks-override", "40").num_gpu_blocks == 40
    assert serve_config().num_gpu_blocks is None


def test_num_checkpoint_slots_flag_sets_the_field():
    assert serve_config("--num-checkpoint-slots", "0").num_checkpoint_slots == 0
    assert serve_config().num_checkpoint_slots is None


def test_enforce_eager_flag_sets_the_field():
    assert serve_config("--enforce-eager").enforce_eager is True
    assert serve_config().enforce_eager is False


def test_generate_takes_the_same_cache_flags():
    kw = generate_kwargs("--prefix-cache-retention-interval", "64", "--kv-offloading-size", "2",
                         "--num-gpu-blocks-override", "32", "--num-checkpoint-slots", "3", "--enforce-eager")
    assert kw["prefix_cache_retention_interval"] == 64
    assert kw["cpu_offload_bytes"] == 2 * 2**30
    assert (kw["num_gpu_blocks"], kw["num_checkpoint_slots"], kw["enforce_eager"]) == (32, 3, True)


def test_generate_without_cache_flags_leaves_the_config_defaults():
    kw = generate_kwargs()
    assert not {"prefix_cache_retention_interval", "cpu_offload_bytes", "num_gpu_blocks"} & set(kw)


def test_startup_description_shows_the_effective_cache_values(monkeypatch):
    from hyserve.entrypoints.openai.server import describe_config

    monkeypatch.setenv("HYSERVE_PREFIX_CACHE_RETENTION_INTERVAL", "512")
    cfg = serve_config("--kv-offloading-size", "2", "--num-gpu-blocks-override", "40")
    text = describe_config(cfg, {"num_blocks": 40, "num_state_slots": 72, "num_checkpoint_slots": 8})
    for part in ("retention_interval=512", "kv_offloading=2 GiB", "num_gpu_blocks=40 (override)",
                 "num_checkpoint_slots=8", "enforce_eager=False"):
        assert part in text


def test_async_scheduling_is_left_to_the_device_unless_a_flag_says_otherwise():
    assert serve_config().async_scheduling is None  # the engine turns it on for CUDA devices
    assert serve_config("--no-async-scheduling").async_scheduling is False
    assert serve_config("--async-scheduling").async_scheduling is True
    assert generate_kwargs("--no-async-scheduling")["async_scheduling"] is False


def test_the_engine_resolves_the_async_default_from_its_device():
    from hyserve.config import EngineConfig
    from hyserve.engine.llm_engine import LLMEngine

    cfg = EngineConfig(model="k3-tiny", device="cpu", max_model_len=64, max_num_seqs=2)
    LLMEngine(cfg)
    assert cfg.async_scheduling is False  # nothing to overlap on the CPU

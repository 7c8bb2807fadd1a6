"""The engine flags of `hyserve serve` / `hyserve generate` are EngineConfig's fields, and the config is resolved
once, frozen (mostly no engine is built)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from hyserve import envs
from hyserve.config import EngineConfig, resolve_config
from hyserve.entrypoints.engine_args import engine_fields
from hyserve.entrypoints.generate import add_generate_parser, engine_kwargs
from hyserve.entrypoints.openai.responses_store import ResponseStore
from hyserve.entrypoints.openai.server import engine_config_from_args
from hyserve.entrypoints.serve import _add_arguments
from hyserve.spec_decode.config import SpeculativeConfig


def serve_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    _add_arguments(p)
    return p.parse_args(["k3-tiny", *argv])


def serve_config(*argv: str):
    return engine_config_from_args(serve_args(*argv))


def generate_kwargs(*argv: str) -> dict:
    p = argparse.ArgumentParser()
    add_generate_parser(p.add_subparsers())
    return engine_kwargs(p.parse_args(["generate", "k3-tiny", "--prompt", "x", *argv]))


def resolved(cfg, device: str = "cpu", **environ: str):
    return resolve_config(cfg, device, "float32", 4096, env=envs.read(environ))


def test_retention_interval_flag_sets_the_config_field():
    cfg = serve_config("--prefix-cache-retention-interval", "256")
    assert resolved(cfg, HYSERVE_PREFIX_CACHE_RETENTION_INTERVAL="7").prefix_cache_retention_interval == 256


def test_retention_interval_env_var_is_the_default_without_the_flag():
    assert serve_config().prefix_cache_retention_interval is None  # left to the engine
    assert resolved(serve_config(), HYSERVE_PREFIX_CACHE_RETENTION_INTERVAL="128").prefix_cache_retention_interval == 128
    assert resolved(serve_config()).prefix_cache_retention_interval == 0


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
    assert serve_config().enforce_eager is None  # resolved at engine start: graphs on CUDA only


def test_generate_takes_the_same_cache_flags():
    kw = generate_kwargs("--prefix-cache-retention-interval", "64", "--kv-offloading-size", "2",
                         "--num-gpu-blocks-override", "32", "--num-checkpoint-slots", "3", "--enforce-eager")
    assert kw["prefix_cache_retention_interval"] == 64
    assert kw["cpu_offload_bytes"] == 2 * 2**30
    assert (kw["num_gpu_blocks"], kw["num_checkpoint_slots"], kw["enforce_eager"]) == (32, 3, True)


def test_generate_without_cache_flags_leaves_the_config_defaults():
    kw = generate_kwargs()
    assert not {"prefix_cache_retention_interval", "cpu_offload_bytes", "num_gpu_blocks"} & set(kw)


def test_startup_description_shows_the_effective_cache_values():
    from hyserve.entrypoints.openai.server import describe_config

    cfg = serve_config("--kv-offloading-size", "2", "--num-gpu-blocks-override", "40")
    cfg = resolved(cfg, "cuda:0", HYSERVE_PREFIX_CACHE_RETENTION_INTERVAL="512")
    text = describe_config(cfg, {"num_blocks": 40, "num_state_slots": 72, "num_checkpoint_slots": 8})
    for part in ("retention_interval=512", "kv_offloading=2 GiB", "num_gpu_blocks=40 (override)",
                 "num_checkpoint_slots=8", "enforce_eager=False"):
        assert part in text


def test_async_scheduling_is_left_to_the_device_unless_a_flag_says_otherwise():
    assert serve_config().async_scheduling is None  # the engine turns it on for CUDA devices
    assert serve_config("--no-async-scheduling").async_scheduling is False
    assert serve_config("--async-scheduling").async_scheduling is True
    assert generate_kwargs("--no-async-scheduling")["async_scheduling"] is False


def test_the_engine_resolves_the_async_default_from_its_device_and_leaves_the_given_config_alone(caplog):
    from hyserve.engine.llm_engine import LLMEngine

    cfg = EngineConfig(model="k3-tiny", device="cpu", max_model_len=64, max_num_seqs=2)
    with caplog.at_level("INFO"):
        engine = LLMEngine(cfg)
    logged = caplog.text
    assert "engine config: model=k3-tiny dtype=float32 device=cpu" in logged and "env switches set:" in logged
    assert "kernel plan: KimiK3ForCausalLM in float32 on cpu" in logged
    assert engine.cfg.async_scheduling is False  # nothing to overlap on the CPU
    assert engine.cfg.enforce_eager is True  # nor graphs to capture
    assert cfg.async_scheduling is None and cfg.enforce_eager is None


def test_the_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        serve_config().async_scheduling = True


def test_cuda_defaults_resolve_to_graphs_and_async_scheduling_unless_a_field_or_alias_says_otherwise():
    on_cuda = resolved(serve_config(), "cuda:0")
    assert (on_cuda.enforce_eager, on_cuda.async_scheduling) == (False, True)
    assert resolved(serve_config(), "cuda:0", HYSERVE_CUDA_GRAPHS="0").enforce_eager is True
    assert resolved(serve_config("--enforce-eager"), "cuda:0").enforce_eager is True
    assert resolved(serve_config("--no-async-scheduling"), "cuda:0").async_scheduling is False


def test_resolution_fills_the_dtypes_device_and_context_limit():
    cfg = resolved(serve_config("--max-model-len", "100000", "--device", "cpu"))
    assert (cfg.dtype, cfg.kv_cache_dtype, cfg.device, cfg.max_model_len) == ("float32", "float32", "cpu", 4096)
    assert resolved(serve_config("--kv-cache-dtype", "bfloat16")).kv_cache_dtype == "bfloat16"


def test_a_bad_env_switch_value_is_an_error_naming_the_switch():
    with pytest.raises(ValueError, match="HYSERVE_CUDA_GRAPHS"):
        envs.read({"HYSERVE_CUDA_GRAPHS": "off"})
    with pytest.raises(ValueError, match="HYSERVE_PREFIX_CACHE_RETENTION_INTERVAL"):
        envs.read({"HYSERVE_PREFIX_CACHE_RETENTION_INTERVAL": "-3"})


@pytest.mark.parametrize(("name", "bad"), [
    ("HYSERVE_MAX_N_SEQUENCES", "0"), ("HYSERVE_MAX_N_SEQUENCES", "many"), ("HYSERVE_RESPONSES_STORE_SIZE", "-1"),
    ("HYSERVE_RESPONSES_STORE_MIB", "0"), ("HYSERVE_RESPONSES_STORE_MIB", "nan"),
])
def test_the_server_side_switches_are_validated_too(name, bad):
    with pytest.raises(ValueError, match=name):
        envs.read({name: bad})


def test_the_server_side_switches_have_defaults_and_take_values():
    assert (envs.read({}).max_n_sequences, envs.read({}).responses_store_size) == (16384, 4096)
    env = envs.read({"HYSERVE_MAX_N_SEQUENCES": "4", "HYSERVE_RESPONSES_STORE_MIB": "0.5"})
    assert env.max_n_sequences == 4 and env.responses_store_mib == 0.5
    assert env.describe() == "HYSERVE_MAX_N_SEQUENCES=4 HYSERVE_RESPONSES_STORE_MIB=0.5"


def test_the_cache_root_is_hyserve_cache_root_else_under_xdg_cache_home():
    assert envs.cache_root({"HYSERVE_CACHE_ROOT": "/r", "XDG_CACHE_HOME": "/x"}) == "/r"
    assert envs.cache_root({"XDG_CACHE_HOME": "/x"}) == "/x/hyserve"
    assert envs.read({"HYSERVE_CACHE_ROOT": "/r"}).describe() == "HYSERVE_CACHE_ROOT=/r"


def test_the_responses_store_flags_default_to_their_switches_and_refuse_nonsense():
    args = serve_args("--responses-store-size", "3")
    store = ResponseStore.for_server(args.responses_store_size, args.responses_store_mib)
    assert store.max_entries == 3 and store.max_bytes == envs.DEFAULT_RESPONSES_STORE_MIB << 20
    for bad in (("--responses-store-size", "0"), ("--responses-store-mib", "-2"), ("--responses-store-mib", "inf")):
        with pytest.raises(SystemExit):
            serve_args(*bad)


def test_the_set_switches_are_described_for_the_startup_log():
    env = envs.read({"HYSERVE_DSA_TRITON": "0", "HYSERVE_TYPO": "1", "PATH": "/bin"})
    assert env.describe() == "HYSERVE_DSA_TRITON=0 HYSERVE_TYPO=1 (not read by hyserve)"
    assert envs.read({}).describe() == "none"


# One sample value per EngineConfig field: each field has a serve flag, and the flag sets that field.
SAMPLES = {
    "dtype": ("bfloat16", "bfloat16"), "device": ("cpu", "cpu"), "seed": ("3", 3), "tokenizer": ("/t", "/t"),
    "served_model_name": ("m", "m"), "max_num_seqs": ("5", 5), "max_num_batched_tokens": ("99", 99),
    "max_model_len": ("77", 77), "scheduling_policy": ("priority", "priority"), "block_size": ("16", 16),
    "num_gpu_blocks": ("12", 12), "num_state_slots": ("6", 6), "kv_cache_memory_bytes": ("1024", 1024),
    "gpu_memory_utilization": ("0.5", 0.5), "kv_cache_dtype": ("bfloat16", "bfloat16"),
    "enable_prefix_caching": (None, False), "prefix_cache_retention_interval": ("32", 32),
    "prefix_cache_second_hit": (None, False), "prefix_cache_end_of_generation": (None, False),
    "num_checkpoint_slots": ("2", 2), "cpu_offload_bytes": ("0.5", 2**29), "enforce_eager": (None, False),
    "async_scheduling": (None, False), "load_format": ("dummy", "dummy"), "disable_log_stats": (None, False),
    "long_prefill_token_threshold": ("512", 512), "prefix_cache_checkpoints_per_session": ("3", 3),
    "warmup": (None, False), "prefix_cache_last_full_page": (None, False),
    "tensor_parallel_size": ("4", 4), "enable_expert_parallel": (None, False),
    "decode_context_parallel_size": ("1", 1), "cp_kv_cache_interleave_size": ("2", 2),
    "speculative_config": ('{"method": "ngram", "num_speculative_tokens": 2}', SpeculativeConfig("ngram", 2)),
}


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"])
def test_every_config_field_has_a_serve_flag_that_sets_it(field):
    flags = {f.name: flag for f, _, flag in engine_fields()}
    text, want = SAMPLES[field]
    argv = [flags[field], text] if text is not None else ["--no-" + flags[field][2:]]
    assert getattr(serve_config(*argv), field) == want


def test_boolean_fields_take_vllm_style_negations():
    assert serve_config("--no-enable-prefix-caching").enable_prefix_caching is False
    assert serve_config("--enable-prefix-caching").enable_prefix_caching is True
    assert serve_config("--no-enforce-eager").enforce_eager is False


def test_generate_takes_every_engine_flag_but_the_sampling_seed_and_the_served_name():
    p = argparse.ArgumentParser()
    sub = add_generate_parser(p.add_subparsers())
    dests = {a.dest for a in sub._actions}
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert fields - dests == {"served_model_name"}  # model is the positional; seed is the sampling seed
    assert generate_kwargs("--seed", "5") == {}


def test_parallel_flags_take_vllms_names_and_short_forms():
    cfg = serve_config("-tp", "4", "--enable-expert-parallel", "-dcp", "2", "--cp-kv-cache-interleave-size", "1")
    p = cfg.parallel_config
    assert (p.tensor_parallel_size, p.expert_parallel_size, p.decode_context_parallel_size) == (4, 4, 2)
    assert generate_kwargs("--tensor-parallel-size", "2", "--decode-context-parallel-size", "2") == {
        "tensor_parallel_size": 2, "decode_context_parallel_size": 2}


def test_a_layout_that_does_not_divide_is_refused_by_the_config():
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\) must be divisible by decode_context_parallel_size \(3\)"):
        serve_config("-tp", "4", "-dcp", "3")
    with pytest.raises(ValueError, match="tensor-parallel-size must be >= 1"):
        serve_config("-tp", "0")


def test_the_cpu_tier_is_refused_under_tensor_parallelism():
    with pytest.raises(ValueError, match="kv-offloading-size.*not supported with tensor_parallel_size > 1"):
        serve_config("-tp", "2", "--kv-offloading-size", "1")

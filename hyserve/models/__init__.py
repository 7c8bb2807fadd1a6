"""The Kimi model family: config parsing, layers, loading."""

from hyserve.models.config import ConfigError, ModelConfig, load_config, parse_config
from hyserve.models.deepseek_v32 import DeepseekV32ForCausalLM
from hyserve.models.kimi import KimiForCausalLM
from hyserve.models.loader import CheckpointError, load_model

__all__ = ["ConfigError", "CheckpointError", "DeepseekV32ForCausalLM", "KimiForCausalLM", "ModelConfig", "load_config", "load_model",
           "parse_config"]

"""One ModelConfig for every supported config.json format, plus the random-weight presets.

Formats (docs/ARCHITECTURE.md §4.7):
  (a) transformers 5.x `kimi_linear`: `layer_types`, `mlp_layer_types`, `linear_*` keys;
  (b) the original Kimi Linear remote code: `linear_attn_config` with 1-based layer lists;
  (c) Kimi K3: a `text_config` (or a flat `KimiK3ForCausalLM` config) with AttnRes, LatentMoE, SiTU-GLU,
      gated MLA with q-LoRA and the bounded KDA gate, switched on by key;
  (d) K3.1 = K3 + `index_n_heads` / `index_head_dim` / `index_topk`;
  (e) DeepSeek V3.2 (`DeepseekV32ForCausalLM`): every layer MLA + indexer, YaRN RoPE, grouped routing.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from hyserve.ops.dsa_indexer import KEY_FORMATS, key_record_bytes

KIMI_LINEAR = "KimiLinearForCausalLM"
KIMI_K3 = "KimiK3ForCausalLM"
DEEPSEEK_V32 = "DeepseekV32ForCausalLM"
_K3_NAMES = {"KimiK3ForCausalLM", "KimiK3ForConditionalGeneration"}


class ConfigError(ValueError):
    pass


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: list[str]  # per 0-based layer: "kda" | "mla"
    mlp_types: list[str]  # per 0-based layer: "dense" | "moe"
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"  # "silu" | "situ"
    situ_beta: float = 1.0
    situ_linear_beta: float | None = None
    # MLA
    num_attention_heads: int = 32
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_output_gate: bool = False
    # KDA
    kda_num_heads: int = 32
    kda_head_dim: int = 128
    conv_kernel_size: int = 4
    gate_lower_bound: float | None = None  # K3's bounded decay gate when set
    kda_full_rank_gate: bool = False  # K3: g_proj instead of g_a_proj/g_b_proj
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    latent_moe_dim: int | None = None  # K3 LatentMoE (`routed_expert_hidden_size`)
    latent_moe_norm: bool = False
    # Block AttnRes (K3)
    attn_res_block_size: int | None = None
    # DSA indexer (K3.1)
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None
    index_key_format: str = "fp8"  # "fp8" | "mxfp4" | "raw" (R0: unquantised keys, for exact tests)
    # RoPE (DeepSeek V3.2); None = NoPE (Kimi)
    rope_theta: float | None = None
    rope_scaling: dict | None = None  # YaRN: factor, original_max_position_embeddings, beta_*, mscale*
    weight_block_size: list[int] | None = None  # FP8 checkpoints: [rows, cols] per weight_scale_inv entry
    # tokens and limits
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    max_position_embeddings: int = 1 << 20
    dtype: str = "bfloat16"
    # checkpoint spelling: prefix of the decoder weights and of lm_head
    weight_prefix: str = "model."
    head_prefix: str = ""
    tokenizer_family: str = "k2"  # chat/tokenizer family: "k3" (XTML) or "k2" (ChatML-like)

    # ---- derived shapes -------------------------------------------------------------------------
    @property
    def is_k3(self) -> bool:
        return self.architecture == KIMI_K3

    @property
    def is_deepseek_v32(self) -> bool:
        return self.architecture == DEEPSEEK_V32

    @property
    def has_indexer(self) -> bool:
        return self.index_n_heads is not None

    @property
    def use_rope(self) -> bool:
        return self.rope_theta is not None

    @property
    def attn_softmax_scale(self) -> float:
        """MLA softmax scale: qk_head_dim^-1/2, times YaRN's mscale(factor, mscale_all_dim)^2 when set
        (0.1352338 for DeepSeek V3.2, docs/ARCHITECTURE.md §4.3)."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling or {}
        if rs.get("mscale_all_dim") and rs.get("rope_type", rs.get("type", "default")) != "default":
            factor = rs.get("factor") or self.max_position_embeddings / rs["original_max_position_embeddings"]
            m = 1.0 if factor <= 1 else 0.1 * rs["mscale_all_dim"] * math.log(factor) + 1.0
            scale *= m * m
        return scale

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "kda"]

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "mla"]

    @property
    def kda_proj_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def kv_row_width(self) -> int:
        """Values per token per MLA layer in the page: latent + unrotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes per cached token over all full-attention layers (MLA rows only)."""
        return len(self.mla_layers) * self.kv_row_width * dtype_bytes

    def index_key_bytes_per_layer(self, raw_dtype_bytes: int = 2) -> int:
        """One token's index-key record: FP8 D+4 (132 for D = 128), MXFP4 D/2 + D/32 (68), raw D * elem."""
        if not self.has_indexer:
            return 0
        return key_record_bytes(self.index_key_format, int(self.index_head_dim), raw_dtype_bytes)

    def index_key_bytes_per_token(self, raw_dtype_bytes: int = 2) -> int:
        """Index-key bytes per cached token over all MLA layers (each MLA layer has an indexer)."""
        return len(self.mla_layers) * self.index_key_bytes_per_layer(raw_dtype_bytes)

    def kda_state_bytes(self, conv_dtype_bytes: int = 2, tp: int = 1) -> tuple[int, int]:
        """(recurrent, conv) bytes of one sequence's KDA state over all KDA layers."""
        n, h, k = len(self.kda_layers), self.kda_num_heads // tp, self.kda_head_dim
        recurrent = n * h * k * k * 4
        conv = n * 3 * h * k * (self.conv_kernel_size - 1) * conv_dtype_bytes
        return recurrent, conv

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- parsing ---------------------------------------------------------------------------------------


def _need(cfg: dict, key: str, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"config.json ({where}) is missing required field '{key}'")
    return cfg[key]


def _as_list(v: Any) -> list[int]:
    if v is None:
        return []
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _layer_pattern(cfg: dict, n_layers: int) -> list[str]:
    if "layer_types" in cfg and cfg["layer_types"]:
        kinds = {"linear_attention": "kda", "full_attention": "mla", "kda": "kda", "mla": "mla"}
        try:
            types = [kinds[t] for t in cfg["layer_types"]]
        except KeyError as e:
            raise ConfigError(f"unknown entry {e} in layer_types") from None
    else:
        lac = cfg.get("linear_attn_config") or {}
        kda, full = lac.get("kda_layers"), lac.get("full_attn_layers")
        if kda is None or full is None:
            raise ConfigError(
                "config.json has neither 'layer_types' nor 'linear_attn_config.kda_layers' and "
                "'linear_attn_config.full_attn_layers': cannot tell KDA from MLA layers"
            )
        kda, full = set(kda), set(full)
        if kda & full:
            raise ConfigError(f"layers {sorted(kda & full)} are listed as both KDA and full attention")
        types = []
        for i in range(n_layers):  # the lists are 1-based
            if i + 1 in kda:
                types.append("kda")
            elif i + 1 in full:
                types.append("mla")
            else:
                raise ConfigError(f"layer {i + 1} (1-based) is in neither kda_layers nor full_attn_layers")
    if len(types) != n_layers:
        raise ConfigError(f"layer pattern has {len(types)} entries but num_hidden_layers is {n_layers}")
    return types


def _mlp_pattern(cfg: dict, n_layers: int) -> list[str]:
    if cfg.get("mlp_layer_types"):
        kinds = {"dense": "dense", "sparse": "moe", "moe": "moe"}
        types = [kinds[t] for t in cfg["mlp_layer_types"]]
        if len(types) != n_layers:
            raise ConfigError(f"mlp_layer_types has {len(types)} entries, expected {n_layers}")
        return types
    n_experts = cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts")))
    if not n_experts:
        return ["dense"] * n_layers
    first_dense = cfg.get("first_k_dense_replace", 0) or 0
    freq = cfg.get("moe_layer_freq", 1) or 1
    return ["moe" if i >= first_dense and (i - first_dense) % freq == 0 else "dense" for i in range(n_layers)]


def parse_config(raw: dict) -> ModelConfig:
    """Parse any supported config.json dict into a ModelConfig."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch is None:
        raise ConfigError("config.json has no 'architectures' entry")
    if arch in _K3_NAMES:
        text = raw.get("text_config") or raw
        is_k3, prefix, head_prefix = True, "", ""
        if "text_config" in raw:
            prefix, head_prefix = "language_model.", "language_model."
        return _parse_text(text, outer=raw, is_k3=is_k3, prefix=prefix, head_prefix=head_prefix)
    if arch == KIMI_LINEAR:
        return _parse_text(raw, outer=raw, is_k3=False, prefix="", head_prefix="")
    if arch == DEEPSEEK_V32:
        return _parse_deepseek_v32(raw)
    raise ConfigError(
        f"unsupported architecture '{arch}'; hyserve supports {KIMI_LINEAR}, "
        f"KimiK3ForCausalLM, KimiK3ForConditionalGeneration and {DEEPSEEK_V32}"
    )


def _rope_params(c: dict) -> tuple[float, dict | None]:
    """(theta, YaRN dict or None) from transformers-5 `rope_parameters` or the original
    `rope_theta` + `rope_scaling` spelling."""
    rp = dict(c.get("rope_parameters") or {})
    theta = float(rp.pop("rope_theta", None) or c.get("rope_theta") or 10000.0)
    scaling = rp or dict(c.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if not scaling or scaling.get("rope_type", "default") == "default":
        return theta, None
    if scaling["rope_type"] != "yarn":
        raise ConfigError(f"unsupported rope scaling '{scaling['rope_type']}' (DeepSeek V3.2 uses yarn)")
    if "original_max_position_embeddings" not in scaling:
        raise ConfigError("yarn rope scaling needs 'original_max_position_embeddings'")
    return theta, scaling


def _parse_deepseek_v32(c: dict) -> ModelConfig:
    """DeepSeek V3.2 (docs/ARCHITECTURE.md §4.7): every layer MLA + DSA indexer; dense FFN on the first
    `first_k_dense_replace` layers; sigmoid router with group-limited selection; YaRN RoPE."""
    where = "top level"
    n_layers = int(_need(c, "num_hidden_layers", where))
    theta, scaling = _rope_params(c)
    first_dense = int(c.get("first_k_dense_replace", 3) or 0)
    if c.get("mlp_layer_types"):
        mlp_types = _mlp_pattern(c, n_layers)
    else:
        mlp_types = ["dense" if i < first_dense else "moe" for i in range(n_layers)]
    eos = _as_list(c.get("eos_token_id"))
    mc = ModelConfig(
        architecture=DEEPSEEK_V32,
        vocab_size=int(_need(c, "vocab_size", where)),
        hidden_size=int(_need(c, "hidden_size", where)),
        num_hidden_layers=n_layers,
        layer_types=["mla"] * n_layers,
        mlp_types=mlp_types,
        intermediate_size=int(c.get("intermediate_size") or 0),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        hidden_act=c.get("hidden_act", "silu"),
        num_attention_heads=int(_need(c, "num_attention_heads", where)),
        q_lora_rank=int(_need(c, "q_lora_rank", where)),
        kv_lora_rank=int(_need(c, "kv_lora_rank", where)),
        qk_nope_head_dim=int(c.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(c.get("qk_rope_head_dim", 64)),
        v_head_dim=int(c.get("v_head_dim", 128)),
        num_experts=int(c.get("n_routed_experts") or c.get("num_local_experts") or 0),
        num_experts_per_tok=int(c.get("num_experts_per_tok") or 0),
        num_shared_experts=int(c.get("n_shared_experts") or 0),
        moe_intermediate_size=int(c.get("moe_intermediate_size") or 0),
        routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        moe_renormalize=bool(c.get("norm_topk_prob", True)),
        num_expert_group=int(c.get("n_group") or 1),
        topk_group=int(c.get("topk_group") or 1),
        # transformers' DeepseekV32Config defaults, which its save_pretrained always writes out
        index_n_heads=int(c.get("index_n_heads", 64)),
        index_head_dim=int(c.get("index_head_dim", 128)),
        index_topk=int(c.get("index_topk", 2048)),
        index_key_format=c.get("index_key_format", "fp8"),
        rope_theta=theta,
        rope_scaling=scaling,
        weight_block_size=(c.get("quantization_config") or {}).get("weight_block_size"),
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=[int(e) for e in eos],
        pad_token_id=c.get("pad_token_id"),
        max_position_embeddings=int(c.get("max_position_embeddings") or 163840),
        dtype=str(c.get("dtype") or c.get("torch_dtype") or "bfloat16"),
    )
    if c.get("tie_word_embeddings"):
        raise ConfigError("tied word embeddings are not supported for DeepSeek V3.2")
    if mc.qk_rope_head_dim > mc.index_head_dim:
        raise ConfigError("qk_rope_head_dim exceeds index_head_dim: the indexer rotates its first rope dims")
    _validate(mc)
    return mc


def _parse_text(c: dict, *, outer: dict, is_k3: bool, prefix: str, head_prefix: str) -> ModelConfig:
    where = "text_config" if c is not outer else "top level"
    n_layers = int(_need(c, "num_hidden_layers", where))
    lac = c.get("linear_attn_config") or {}
    k3_keys = ("attn_res_block_size", "routed_expert_hidden_size", "mla_use_output_gate")
    if not is_k3 and any(c.get(k) for k in k3_keys):
        is_k3 = True  # a K3 text_config read on its own
    eos = _as_list(c.get("eos_token_id", outer.get("eos_token_id")))
    mc = ModelConfig(
        architecture=KIMI_K3 if is_k3 else KIMI_LINEAR,
        vocab_size=int(_need(c, "vocab_size", where)),
        hidden_size=int(_need(c, "hidden_size", where)),
        num_hidden_layers=n_layers,
        layer_types=_layer_pattern(c, n_layers),
        mlp_types=_mlp_pattern(c, n_layers),
        intermediate_size=int(c.get("intermediate_size") or 0),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        hidden_act=c.get("hidden_act", "silu"),
        situ_beta=float(c.get("activation_situ_beta") or 1.0),
        situ_linear_beta=c.get("activation_situ_linear_beta"),
        num_attention_heads=int(_need(c, "num_attention_heads", where)),
        q_lora_rank=c.get("q_lora_rank"),
        kv_lora_rank=int(_need(c, "kv_lora_rank", where)),
        qk_nope_head_dim=int(c.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(c.get("qk_rope_head_dim", 64)),
        v_head_dim=int(c.get("v_head_dim", 128)),
        mla_output_gate=bool(c.get("mla_use_output_gate", False)),
        kda_num_heads=int(c.get("linear_num_heads") or lac.get("num_heads") or _need(lac, "num_heads", where)),
        kda_head_dim=int(c.get("linear_head_dim") or lac.get("head_dim") or _need(lac, "head_dim", where)),
        conv_kernel_size=int(c.get("linear_conv_kernel_dim") or lac.get("short_conv_kernel_size") or 4),
        gate_lower_bound=lac.get("gate_lower_bound", c.get("gate_lower_bound")),
        kda_full_rank_gate=bool(lac.get("use_full_rank_gate", c.get("use_full_rank_gate", False))),
        num_experts=int(c.get("num_experts") or c.get("num_local_experts") or 0),
        num_experts_per_tok=int(c.get("num_experts_per_token") or c.get("num_experts_per_tok") or 0),
        num_shared_experts=int(c.get("num_shared_experts") or c.get("n_shared_experts") or 0),
        moe_intermediate_size=int(c.get("moe_intermediate_size") or 0),
        routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        moe_renormalize=bool(c.get("moe_renormalize", c.get("norm_topk_prob", True))),
        num_expert_group=int(c.get("num_expert_group") or c.get("n_group") or 1),
        topk_group=int(c.get("topk_group") or 1),
        latent_moe_dim=c.get("routed_expert_hidden_size"),
        latent_moe_norm=bool(c.get("latent_moe_use_norm", False)),
        attn_res_block_size=c.get("attn_res_block_size"),
        index_n_heads=c.get("index_n_heads"),
        index_head_dim=c.get("index_head_dim"),
        index_topk=c.get("index_topk"),
        index_key_format=c.get("index_key_format", "fp8"),
        bos_token_id=c.get("bos_token_id", outer.get("bos_token_id")),
        eos_token_ids=[int(e) for e in eos],
        pad_token_id=c.get("pad_token_id", outer.get("pad_token_id")),
        max_position_embeddings=int(
            c.get("max_position_embeddings") or c.get("model_max_length") or (1 << 20)
        ),
        dtype=str(c.get("dtype") or c.get("torch_dtype") or outer.get("dtype") or "bfloat16"),
        weight_prefix=prefix + "model.",
        head_prefix=head_prefix,
        tokenizer_family="k3" if is_k3 else "k2",
    )
    _validate(mc)
    return mc


def _validate(mc: ModelConfig) -> None:
    if "moe" in mc.mlp_types:
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if not getattr(mc, key):
                raise ConfigError(f"MoE layers are configured but '{key}' is missing or zero")
        if mc.num_experts_per_tok > mc.num_experts:
            raise ConfigError("num_experts_per_tok exceeds num_experts")
    if "dense" in mc.mlp_types and not mc.intermediate_size:
        raise ConfigError("dense FFN layers are configured but 'intermediate_size' is missing")
    if mc.hidden_act not in ("silu", "situ"):
        raise ConfigError(f"unsupported hidden_act '{mc.hidden_act}' (expected silu or situ)")
    if mc.has_indexer:
        for key in ("index_head_dim", "index_topk"):
            if getattr(mc, key) is None:
                raise ConfigError(f"index_n_heads is set but '{key}' is missing")
        if mc.index_key_format not in KEY_FORMATS:
            raise ConfigError(f"index_key_format must be one of {KEY_FORMATS}, got '{mc.index_key_format}'")
        if not mc.q_lora_rank:
            raise ConfigError("a DSA indexer needs q_lora_rank (the index query reads the MLA query latent)")
        if mc.index_key_format == "mxfp4" and mc.index_head_dim % 32:
            raise ConfigError(f"MXFP4 index keys need index_head_dim divisible by 32, got {mc.index_head_dim}")
    if mc.kda_num_heads * mc.kda_head_dim == 0:
        raise ConfigError("KDA heads and head_dim must be positive")


def with_changes(mc: ModelConfig, **changes: Any) -> ModelConfig:
    """A re-validated copy of `mc` with some fields replaced (e.g. a cache-format override)."""
    out = replace(mc, **changes)
    _validate(out)
    return out


def load_config(path: str) -> tuple[ModelConfig, dict]:
    """Read `path/config.json` (or a config.json path). Returns (parsed, raw dict)."""
    file = path if path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.exists(file):
        raise ConfigError(f"no config.json at {file}")
    with open(file) as f:
        raw = json.load(f)
    return parse_config(raw), raw

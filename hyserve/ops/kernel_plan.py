"""Which kernel each layer runs, decided once per model and device (docs/ARCHITECTURE.md §7).

`plan_kernels(cfg, device, dtype)` reads the model's shapes, the device and the env switches and returns a
frozen `KernelPlan`. The model builds it at load (`model.kernel_plan`) and hands it to every layer's
forward; the layers ask it instead of testing shapes or thresholds of their own. What depends on the step
(how many tokens or token-expert pairs, how long a context, whether autograd records) the plan answers
through its methods, from the thresholds below. They were measured on an H200 (docs/gpu_fast_path_notes.md,
docs/BENCHMARKS.md); the ops keep their tile choices, and take the thresholds from here.

Without CUDA and Triton, with HYSERVE_REFERENCE_OPS=1, and inside `reference_ops()` every answer is
"reference": the torch references, which are the specification, run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hyserve import envs
from hyserve.ops.device_spec import DeviceSpec
from hyserve.ops.dispatch import pow2_dims, records_grad, references_forced

REFERENCE = "reference"
# the router as partial logits over weight tiles + the selection kernel up to this many tokens (1 token:
# 11.4 against 13.3 µs for cast + cuBLAS GEMV + selection; 4 tokens 12.8 against 19.9 µs), which covers a
# verify step of up to 7 drafts: each token's logits then sum in the order of its plain decode step
ROUTER_FUSED_MAX_TOKENS = 8
# routed experts as GEMV kernels reading only the selected experts' rows up to this many token-expert pairs
MOE_GEMV_MAX_PAIRS = 64
# up to this many pairs the GEMV's down kernel takes its one-token tile and launches as a programmatic
# dependent of the up kernel (1.03x at 1 token, 0.93x at 8)
MOE_GEMV_SMALL_PAIRS = 16
# the grouped GEMM switches from 16-pair tiles that stream the touched experts to 128-pair tensor-core
# tiles (with the SiLU-GLU in the up GEMM) from this many pairs per expert
MOE_TENSOR_CORE_PAIRS_PER_EXPERT = 32
# KDA decode: the output norm by the last state program of each head below this many (sequence, head)
# pairs, a third launch from there (batch 1: 6.9 against 7.0 µs; batch 64: 81.2 against 84.8 µs)
KDA_FUSED_NORM_BELOW_PAIRS = 4 * 132
# KDA decode: evict-first state loads and streaming stores below this many pairs (batch 64 85.6 against
# 87.0 µs; batch 256 344.5 against 333.2 µs)
KDA_STREAM_BELOW_PAIRS = 8192
# KDA verify: the state kernel unrolls a sequence's tokens (the last sampled one and its drafts) up to this
# many; a step with a longer verify row runs the layer's reference
KDA_VERIFY_MAX_TOKENS = 16
# MLA decode "auto": the Gluon wgmma split kernel where a split walks at least this many 64-row tiles, the
# Triton heads-as-M kernel for shorter splits (batch 8 x 32K: 100.0 against 114.8 µs; batch 1 x 32K, 4
# tiles a split: 35.0 against 31.9)
MLA_WGMMA_MIN_TILES = 8
# single-token projections: one GEMV program per block of 16 rows streams them once; split over K until
# there are about this many programs per SM, but keep at least this many column blocks of 256 per split
GEMV_PROGRAMS_PER_SM = 4
GEMV_MIN_BLOCKS_PER_SPLIT = 4

GemvConfig = tuple[int, int, int, int, int]  # (BLOCK_N rows, BLOCK_K, warps, stages, K splits)


def gemv_config(n: int, k: int, silu_glu: bool, sm_count: int) -> GemvConfig:
    """The GEMV tiles for a weight [n, k], by rule: 16-row blocks, 256-wide column blocks; K split when the
    row blocks alone leave SMs idle (the 48B attention output, 2,304 rows: 144 blocks, 4 splits; the
    lm_head's 10,240 blocks need none); 8 warps for rows of 2,048 values or more; one pipeline stage less
    when each column block reads two input vectors (SiLU(gate)·up). At the 48B shapes this gives the
    sweep's best tiles (benchmarks/gpu_kernels.py --only gemv)."""
    blocks = -(-n // 16)
    target = GEMV_PROGRAMS_PER_SM * sm_count
    split = 1 if blocks >= target else max(1, min(-(-target // blocks), k // (GEMV_MIN_BLOCKS_PER_SPLIT * 256)))
    return 16, 256, 8 if k >= 2048 else 4, 3 if silu_glu else 4, split


def dsa_fp8_dot(fmt: str, head_dim: int, on_cuda: bool, env: envs.Envs | None = None) -> bool:
    """The indexer's FP8 tensor-core dot (FP8 keys of 32+ dims on a GPU), unless HYSERVE_DSA_EXACT_SCORES=1
    asks for the exact fp16 dot (about 1.3x slower, scores in the same R1 band)."""
    return fmt == "fp8" and on_cuda and head_dim >= 32 and not (env or envs.get()).dsa_exact_scores


@dataclass(frozen=True)
class KernelPlan:
    """The kernels of one model on one device. The defaults are the reference plan."""

    device: DeviceSpec = DeviceSpec()
    dtype: str = "float32"  # the model's
    architecture: str = ""
    triton: bool = False  # Triton kernels at all
    kda_decode: str = REFERENCE  # "triton": prep + state kernels over the slots in place
    kda_prefill: str = REFERENCE  # "fla": chunk_kda over the step's prefill sequences
    kda_verify: str = REFERENCE  # "triton": kda_verify_multi over the verify rows, one call per row length
    mla: str = REFERENCE  # "merged": q|kv_a GEMM + fused row write; "triton": decode kernels, SDPA prefill
    mla_decode_layout: str = "heads"  # "auto": the Gluon wgmma kernel where it runs (mla_decode_latent)
    dsa_index: str = REFERENCE  # "triton": index scores + top-k (models with an indexer)
    dsa_topk: int = 0
    dsa_fp8_dot: bool = False
    dsa_sparse_mla: str = REFERENCE  # "triton"
    router: str = REFERENCE  # "triton": selection kernel (and partial-logit GEMV for few tokens)
    moe_gemv_shared: bool = False  # the shared expert rides in the decode GEMV's launches
    moe_grouped_mm: bool = False  # torch._grouped_mm can take the grouped GEMMs where autograd records
    layer_kinds: frozenset[str] = frozenset()  # "kda", "mla", "dsa", "moe", "dense": the table's rows
    gemv_weights: tuple[tuple[str, int, int, bool], ...] = ()  # (names, rows, cols, SiLU-GLU input): the table's
    training: bool = False  # the training forward (`for_training`)
    train_fla: bool = False  # its KDA layers through fla chunk_kda with autograd

    # ---- the answers that depend on the step ---------------------------------------------------------
    def kda_kernels(self, prefill: bool, verify_tokens: int = 0) -> bool:
        """Whether a KDA layer takes its GPU path for a step: its plain decodes take the decode kernel, its
        prefill chunks need fla, its verify rows (the longest `verify_tokens` long, 0 without) the verify
        kernel. The path serves a step whole: a step with a row no kernel takes runs the layer's reference."""
        return (self.kda_decode == "triton" and (not prefill or self.kda_prefill == "fla")
                and (not verify_tokens or (self.kda_verify == "triton" and verify_tokens <= KDA_VERIFY_MAX_TOKENS)))

    def kda_fused_norm(self, pairs: int) -> bool:
        return pairs < KDA_FUSED_NORM_BELOW_PAIRS

    def mla_path(self, cache_dtype: torch.dtype, dtype: torch.dtype) -> str:
        """"merged" | "triton" | "reference" for an MLA layer without an indexer (the merged row write
        stores the model dtype: a cache in another one takes the separate projections)."""
        return "triton" if self.mla == "merged" and cache_dtype != dtype else self.mla

    def dsa_index_kernel(self, max_context: int) -> str:
        """Up to top-k positions every causal position is selected: nothing to score."""
        return "triton" if self.dsa_index == "triton" and max_context > self.dsa_topk else REFERENCE

    def router_kernel(self, tokens: int, grad: bool) -> str:
        """"fused" (partial-logit GEMV + selection) | "select" (fp32 GEMM + selection) | "reference"."""
        if self.router != "triton" or grad:
            return REFERENCE
        return "fused" if tokens <= ROUTER_FUSED_MAX_TOKENS else "select"

    def moe_experts(self, pairs: int, dtype: torch.dtype, grad: bool) -> str:
        """"gemv" | "triton" (grouped GEMM) | "grouped_mm" | "reference" for `pairs` token-expert pairs; fp32
        activations keep the exact reference loop past the GEMV, autograd takes torch._grouped_mm."""
        if not self.triton:
            return REFERENCE
        if pairs <= MOE_GEMV_MAX_PAIRS:
            return "gemv"
        if not grad and dtype != torch.float32:
            return "triton"
        return "grouped_mm" if self.moe_grouped_mm and dtype == torch.bfloat16 else REFERENCE

    def dense_mlp_one_token(self, x: torch.Tensor, act_kind: str, *weights: torch.Tensor) -> bool:
        """A SiLU dense MLP on one token: gate | up as one GEMM, then the GEMV that reads SiLU(gate)·up."""
        return self.triton and x.dim() == 2 and x.shape[0] == 1 and act_kind == "silu" and not records_grad(x, *weights)

    def gemv_config(self, n: int, k: int, silu_glu: bool = False) -> GemvConfig:
        return gemv_config(n, k, silu_glu, self.device.sm_count)

    def linear_gemv(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> GemvConfig | None:
        """The GEMV tiles for `linear(x, weight)` of one token in a 16-bit dtype, else None (cuBLAS)."""
        if not (self.triton and x.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype
                and x.dtype in (torch.bfloat16, torch.float16) and not records_grad(x, weight)
                and (out is None or out.stride(-1) == 1)):
            return None
        return self.gemv_config(*weight.shape)

    def for_training(self, fla: bool = True) -> KernelPlan:
        """The plan of the training forward: batched, differentiable layer paths (fla chunk_kda where `fla`,
        CUDA and fla-core allow; one SDPA over equal rows; every expert on every token)."""
        return dataclasses.replace(self, training=True, train_fla=fla and self.triton and self.device.fla)

    def table(self) -> str:
        return plan_table(self)


def active(plan: KernelPlan | None) -> KernelPlan:
    """The plan a forward follows: the reference one without a plan or inside `reference_ops()`."""
    return REFERENCE_PLAN if plan is None or references_forced() else plan


REFERENCE_PLAN = KernelPlan()


def _gemv_weights(cfg) -> tuple[tuple[str, int, int, bool], ...]:
    """The single-token projections that `linear` or the one-token dense MLP take through the GEMV, one
    row per shape."""
    out: dict[tuple[int, int, bool], list[str]] = {}
    for name, n, k, silu, there in (
        ("lm_head", cfg.vocab_size, cfg.hidden_size, False, True),
        ("KDA o_proj", cfg.hidden_size, cfg.kda_proj_dim, False, bool(cfg.kda_layers)),
        ("MLA o_proj", cfg.hidden_size, cfg.num_attention_heads * cfg.v_head_dim, False, bool(cfg.mla_layers)),
        ("MLP down_proj", cfg.hidden_size, cfg.intermediate_size, True, "dense" in cfg.mlp_types and cfg.hidden_act == "silu"),
    ):
        if there:
            out.setdefault((n, k, silu), []).append(name)
    return tuple((" & ".join(names), n, k, silu) for (n, k, silu), names in out.items())


def _layer_kinds(cfg) -> frozenset[str]:
    kinds = set(cfg.layer_types) | set(cfg.mlp_types)
    return frozenset(kinds | ({"dsa"} if cfg.has_indexer else set()))


def plan_kernels(cfg, device: DeviceSpec, dtype: torch.dtype | str, env: envs.Envs | None = None) -> KernelPlan:
    """The plan of a model of config `cfg` (a ModelConfig) in `dtype` on `device`."""
    env = env or envs.get()
    dtype = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    triton = device.type == "cuda" and device.triton and not env.reference_ops
    base = KernelPlan(device, dtype, cfg.architecture, triton, layer_kinds=_layer_kinds(cfg),
                      gemv_weights=_gemv_weights(cfg))
    if not triton:
        return base
    # the kernels span a head or a latent row with one tl.arange: power-of-two widths only
    kda = pow2_dims(cfg.kda_head_dim)
    mla = pow2_dims(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    dsa = env.dsa_triton and cfg.has_indexer
    shared = cfg.moe_intermediate_size * cfg.num_shared_experts
    return dataclasses.replace(
        base,
        kda_decode="triton" if kda else REFERENCE,
        # fla's chunk kernels need tl.dot tiles of 16 or more
        kda_prefill="fla" if kda and device.fla and cfg.kda_head_dim >= 16 else REFERENCE,
        # the verify kernel is the decode kernel's prep and finish around a state kernel of the same shape
        kda_verify="triton" if kda else REFERENCE,
        mla=REFERENCE if not mla or cfg.has_indexer else "triton" if cfg.use_rope else "merged",
        mla_decode_layout="auto" if (device.capability[0] == 9 and device.gluon and cfg.kv_lora_rank % 64 == 0
                                     and cfg.qk_rope_head_dim % 16 == 0) else "heads",
        dsa_index="triton" if dsa and pow2_dims(cfg.index_head_dim) and cfg.index_key_format != "raw" else REFERENCE,
        dsa_topk=cfg.index_topk or 0,
        dsa_fp8_dot=bool(cfg.has_indexer) and dsa_fp8_dot(cfg.index_key_format, cfg.index_head_dim or 0, True, env),
        dsa_sparse_mla="triton" if dsa and mla else REFERENCE,
        router="triton" if cfg.num_expert_group == 1 or cfg.topk_group >= cfg.num_expert_group else REFERENCE,
        moe_gemv_shared=cfg.latent_moe_dim is None and shared == cfg.moe_intermediate_size > 0,
        moe_grouped_mm=(device.grouped_mm and device.capability >= (9, 0) and dtype == "bfloat16"
                        and (cfg.latent_moe_dim or cfg.hidden_size) % 8 == 0 and cfg.moe_intermediate_size % 8 == 0),
    )


def plan_table(plan: KernelPlan) -> str:
    """The plan as the start-up log prints it: one row per layer kind, with the token counts that switch."""
    head = f"kernel plan: {plan.architecture or 'model'} in {plan.dtype} on {plan.device.describe()}"
    if not plan.triton:
        return head + ": every layer runs its torch reference"
    ref, kinds, rows = REFERENCE, plan.layer_kinds, []
    if "kda" in kinds:
        rows += [("KDA decode", ref if plan.kda_decode == ref else "Triton prep + state kernels; the output norm "
                  f"in the state kernel below {KDA_FUSED_NORM_BELOW_PAIRS} (sequence, head) pairs, a third launch from there"),
                 ("KDA prefill", "fla chunk_kda over the step's prefill sequences, Triton conv and output norm"
                  if plan.kda_prefill != ref else ref + " (a step with a prefill runs the whole layer's)"),
                 ("KDA verify", ref + " (a step with verify rows runs the whole layer's)" if plan.kda_verify == ref
                  else "Triton kda_verify_multi, one call per verify row length (up to "
                  f"{KDA_VERIFY_MAX_TOKENS} tokens), the state after each token into its own slot")]
    if "dsa" in kinds:
        rows += [("DSA indexer", ref if plan.dsa_index == ref else f"Triton scores + top-k past {plan.dsa_topk} "
                  f"positions ({'FP8' if plan.dsa_fp8_dot else 'fp16'} dot); every position up to {plan.dsa_topk}"),
                 ("sparse MLA", ref if plan.dsa_sparse_mla == ref else "Triton split kernel over the selected rows")]
    elif "mla" in kinds:
        gluon = f"Gluon wgmma where a split walks >= {MLA_WGMMA_MIN_TILES} tiles, else "
        rows += [("MLA", {"merged": "q|kv_a as one GEMM, the row write as one kernel (a cache in the model dtype)",
                          "triton": "separate projections"}.get(plan.mla, ref)),
                 ("MLA decode", ref if plan.mla == ref else ("" if plan.mla_decode_layout != "auto" else gluon)
                  + "Triton split-K with heads as M"),
                 ("MLA prefill", ref if plan.mla == ref else "flash SDPA over the expanded rows")]
    if "moe" in kinds:
        rows.append(("router", ref if plan.router == ref else f"partial-logit GEMV + selection kernel up to "
                     f"{ROUTER_FUSED_MAX_TOKENS} tokens, fp32 GEMM + selection kernel beyond"))
        beyond = ("the torch loop (exact fp32)" if plan.dtype == "float32" else "Triton grouped GEMM (tensor-core "
                  f"tiles from {MOE_TENSOR_CORE_PAIRS_PER_EXPERT} pairs an expert)")
        rows.append(("MoE experts", f"GEMV up to {MOE_GEMV_MAX_PAIRS} token-expert pairs"
                     f"{' with the shared expert' if plan.moe_gemv_shared else ''} (PDL up to "
                     f"{MOE_GEMV_SMALL_PAIRS}); beyond, {beyond}"))
    rows += [(f"1-token {name}", f"{n}x{k}{' SiLU-GLU' if silu else ''}: GEMV tiles {plan.gemv_config(n, k, silu)}")
             for name, n, k, silu in plan.gemv_weights if silu or plan.dtype in ("bfloat16", "float16")]
    rows.append(("RMSNorm", "Triton (the reference while autograd records)"))
    width = max(len(name) for name, _ in rows)
    return "\n".join([head] + [f"  {name:<{width}}  {what}" for name, what in rows])

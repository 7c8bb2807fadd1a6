"""DSA index keys, index scores and top-k selection, torch reference (docs/ARCHITECTURE.md §4.4).

Key records (one per token and MLA layer, uint8):
  fp8   : D e4m3 bytes, then the fp32 scale (little endian)   -> D + 4 bytes   (132 for D = 128)
  mxfp4 : D/2 bytes of E2M1 code pairs, then D/32 E8M0 bytes -> D/2 + D/32     (68 for D = 128)
  raw   : the unquantised key in the model dtype (R0 only)   -> D * elem bytes (256 for bf16)

R0 scores use unquantised queries and keys; R1 quantises both (queries always to FP8 with the scale
folded into the head weight). Every quantiser here is the byte-exact contract GPU kernels are tested on.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
MX_GROUP = 32
_E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# Decision points between neighbouring E2M1 magnitudes and whether a tie rounds up: a tie goes to the
# code with mantissa bit 0, i.e. up exactly when the lower code is odd (0.75 -> 1, 1.75 -> 2, 3.5 -> 4).
_E2M1_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

KEY_FORMATS = ("fp8", "mxfp4", "raw")
# A long prefill scores [rows, context] per sequence: query rows are taken in chunks whose scores and
# sort temporaries stay under this many bytes (at 128K tokens all rows at once would need 64 GB+).
WORKSPACE_BYTES = 1 << 30


def key_record_bytes(fmt: str, head_dim: int, raw_elem_bytes: int = 2) -> int:
    """Bytes of one token's index key in the cache row."""
    if fmt == "fp8":
        return head_dim + 4
    if fmt == "mxfp4":
        if head_dim % MX_GROUP:
            raise ValueError(f"MXFP4 index keys need index_head_dim to be a multiple of {MX_GROUP}, got {head_dim}")
        return head_dim // 2 + head_dim // MX_GROUP
    if fmt == "raw":
        return head_dim * raw_elem_bytes
    raise ValueError(f"unknown index key format '{fmt}' (expected one of {KEY_FORMATS})")


# ---- scales -----------------------------------------------------------------------------------------


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0, fp32), computed exactly with frexp rather than log2."""
    m, e = torch.frexp(x.float())
    e = torch.where(m == 0.5, e - 1, e)  # x is already a power of two
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), e)


def fp8_scale(amax: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """max(amax, 1e-4) / 448 in fp32; DeepSeek V3.2's ue8m0 format rounds it up to a power of two."""
    s = torch.clamp_min(amax.float(), AMAX_FLOOR) / E4M3_MAX
    return pow2_ceil(s) if ue8m0 else s


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(clamp(x / scale, -448, 448)), round to nearest even; returned as the raw uint8 bytes.

    A division (not a multiply by the reciprocal) so kernels can reproduce the bytes exactly.
    """
    y = torch.clamp(x.float() / scale, -E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def from_e4m3(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float8_e4m3fn).float()


# ---- FP8 keys ---------------------------------------------------------------------------------------


def quantize_fp8_keys(k: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """k [N, D] -> records [N, D + 4] uint8: D e4m3 bytes, then the fp32 per-token scale."""
    kf = k.float()
    s = fp8_scale(kf.abs().amax(-1), ue8m0)
    codes = to_e4m3(kf, s[:, None])
    return torch.cat([codes, s.contiguous().view(torch.uint8).view(-1, 4)], -1)


def split_fp8_keys(rec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """records [..., D + 4] -> (e4m3 values as fp32 [..., D], scale [...])."""
    d = rec.shape[-1] - 4
    scale = rec[..., d:].contiguous().view(torch.float32).squeeze(-1)
    return from_e4m3(rec[..., :d]), scale


def dequantize_fp8_keys(rec: torch.Tensor) -> torch.Tensor:
    vals, scale = split_fp8_keys(rec)
    return vals * scale[..., None]


# ---- MXFP4 keys -------------------------------------------------------------------------------------


def _mx_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The smallest e with amax <= 6 * 2^e (= ceil(log2(amax / 6)) in exact arithmetic), int32."""
    a = amax.float()
    e = torch.ceil(torch.log2(a / 6.0)).to(torch.int32)
    # log2 may be off by one next to powers of two; fix it with exact comparisons against 6 * 2^e
    six = torch.full_like(a, 6.0)
    e = torch.where(a > torch.ldexp(six, e), e + 1, e)
    e = torch.where(a <= torch.ldexp(six, e - 1), e - 1, e)
    return e


def _e2m1_code(y: torch.Tensor) -> torch.Tensor:
    """|y| (already divided by the group scale) -> magnitude code 0..7, saturating at 6."""
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for bound, tie_up in _E2M1_BOUNDS:
        code += (y >= bound if tie_up else y > bound).to(torch.uint8)
    return code


def quantize_mxfp4_keys(k: torch.Tensor) -> torch.Tensor:
    """k [N, D] -> records [N, D/2 + D/32] uint8 (docs/ARCHITECTURE.md §4.4).

    Byte i of the codes holds element 2i in bits 0-3 and element 2i+1 in bits 4-7; bit 3 of a nibble is
    the sign (set for negative inputs, so a tiny negative value becomes -0). Then one E8M0 byte per group.
    """
    n, d = k.shape
    kf = k.float().view(n, d // MX_GROUP, MX_GROUP)
    amax = kf.abs().amax(-1)
    e_b = torch.clamp(_mx_exponent(amax.clamp_min(torch.finfo(torch.float32).tiny)) + 127, 1, 254)
    e_b = torch.where(amax == 0, torch.zeros_like(e_b), e_b)
    scale = torch.ldexp(torch.ones_like(amax), (e_b - 127).clamp_min(-126))[..., None]
    code = _e2m1_code(kf.abs() / scale) | (torch.signbit(kf).to(torch.uint8) << 3)
    code = torch.where((amax == 0)[..., None], torch.zeros_like(code), code).view(n, d)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return torch.cat([packed, e_b.to(torch.uint8)], -1)


def dequantize_mxfp4_keys(rec: torch.Tensor) -> torch.Tensor:
    """records [..., D/2 + D/32] -> fp32 [..., D], exact."""
    w = rec.shape[-1]
    d = w * 64 // 34  # w = D/2 + D/32 = 17 D / 32
    packed, e_b = rec[..., : d // 2], rec[..., d // 2 :]
    codes = torch.stack([packed & 0x0F, packed >> 4], -1).flatten(-2).long()
    mag = _E2M1_VALUES.to(rec.device)[codes & 7]
    vals = torch.where(codes & 8 > 0, -mag, mag)
    scale = torch.exp2(e_b.float() - 127.0).repeat_interleave(MX_GROUP, -1)
    return vals * scale


# ---- key records in the cache ------------------------------------------------------------------------
# A page of the `index_keys` pool, [block_size, record bytes] for one block and MLA layer, is stored split:
# the block_size value parts of its records first (e4m3 bytes, MXFP4 code pairs or raw keys), then their
# scale parts (the fp32 scale, the E8M0 bytes). A tile of consecutive tokens' values is then one contiguous
# 16-byte-aligned range that kernels read with vector loads; 132-byte records interleaved would be only
# word-aligned. The record (docs/ARCHITECTURE.md §4.4) is unchanged: gathering a token's two parts gives it back.


def key_scale_bytes(fmt: str, record_bytes: int) -> int:
    """Bytes of a record's scale part (the value part is the rest)."""
    if fmt == "fp8":
        return 4
    if fmt == "mxfp4":
        return record_bytes // 17  # D/2 + D/32 = 17 D/32 bytes, D/32 of them E8M0 scales
    if fmt == "raw":
        return 0
    raise ValueError(f"unknown index key format '{fmt}' (expected one of {KEY_FORMATS})")


def key_page_views(pool: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """pool [blocks, layers, block_size, record] uint8 -> (values [.., block_size, V], scales [.., block_size, S])
    views of the split pages."""
    nb, nl, bs, rec = pool.shape
    sb = key_scale_bytes(fmt, rec)
    flat = pool.view(nb, nl, bs * rec)
    v = rec - sb
    return flat[..., : bs * v].unflatten(-1, (bs, v)), flat[..., bs * v :].unflatten(-1, (bs, sb))


def write_key_records(pool: torch.Tensor, fmt: str, layer: int, slots: torch.Tensor, rec: torch.Tensor) -> None:
    """Store records [N, R] at the flat cache slots [N] (block * block_size + offset) of one layer."""
    if rec.shape[-1] != pool.shape[-1]:
        raise ValueError(f"index key records are {rec.shape[-1]} bytes but the cache rows hold {pool.shape[-1]}")
    vals, scales = key_page_views(pool, fmt)
    blk, off = slots // pool.shape[2], slots % pool.shape[2]
    v = vals.shape[-1]
    vals[blk, layer, off] = rec[:, :v]
    if scales.shape[-1]:
        scales[blk, layer, off] = rec[:, v:]


def gather_key_records(pool: torch.Tensor, fmt: str, layer: int, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The records [N, R] of one layer at (block, offset in the block) pairs."""
    vals, scales = key_page_views(pool, fmt)
    return torch.cat([vals[blocks, layer, offsets], scales[blocks, layer, offsets]], -1)



def encode_keys(k: torch.Tensor, fmt: str, ue8m0: bool = False) -> torch.Tensor:
    """k [N, D] (model dtype) -> uint8 records [N, key_record_bytes]."""
    if fmt == "fp8":
        return quantize_fp8_keys(k, ue8m0)
    if fmt == "mxfp4":
        return quantize_mxfp4_keys(k)
    if fmt == "raw":
        return k.contiguous().view(torch.uint8).view(k.shape[0], -1)
    raise ValueError(f"unknown index key format '{fmt}'")


# ---- Walsh-Hadamard (DeepSeek V3.2's FP8 path) ---------------------------------------------------------


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over the last dim (a power of two), fp32."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"Hadamard transform needs a power-of-two dim, got {d}")
    y = x.float().reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        y = torch.stack([y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]], 2)
        h *= 2
    return (y.reshape(x.shape) * d**-0.5)


# ---- queries and scores ------------------------------------------------------------------------------


def quantize_queries(
    q: torch.Tensor, w: torch.Tensor, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], w [T, H] fp32 (already times H^-1/2) -> (q8 as fp32 values, w' = w * D^-1/2 * s_q)."""
    s_q = fp8_scale(q.float().abs().amax(-1), ue8m0)
    q8 = from_e4m3(to_e4m3(q, s_q[..., None]))
    return q8, w.float() * q.shape[-1] ** -0.5 * s_q


def index_scores_r0(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """I[t, s] = sum_h w[t,h] * ReLU(D^-1/2 q[t,h] . k[s]); q [T, H, D], w [T, H], k [S, D] -> [T, S] fp32."""
    dots = torch.einsum("thd,sd->ths", q.float(), k.float()) * q.shape[-1] ** -0.5
    return torch.einsum("th,ths->ts", w.float(), torch.relu(dots))


def index_scores_q(
    q8: torch.Tensor, w_folded: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor | None
) -> torch.Tensor:
    """R1: I[t, s] = s_k[s] * sum_h w'[t,h] * ReLU(q8[t,h] . k[s]); k are e4m3 values (FP8, with k_scale)
    or exactly decoded MXFP4 keys (k_scale None)."""
    scores = torch.einsum("th,ths->ts", w_folded, torch.relu(torch.einsum("thd,sd->ths", q8, k.float())))
    return scores * k_scale[None, :] if k_scale is not None else scores


def topk_causal(scores: torch.Tensor, qpos: torch.Tensor, k: int) -> torch.Tensor:
    """Per query row t (absolute position qpos[t]) the top-min(k, t+1) positions s <= t.

    Order: score descending, then position ascending (docs/ARCHITECTURE.md §4.1; a stable descending sort keeps the
    lower position first among equal scores). scores [T, S] -> [T, min(k, S)] long, padded with -1.
    """
    s = scores.shape[-1]
    pos = torch.arange(s, device=scores.device)
    future = pos[None, :] > qpos[:, None]
    masked = scores.float().masked_fill(future, float("-inf"))
    idx = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, : min(k, s)]
    return torch.where(idx > qpos[:, None], torch.full_like(idx, -1), idx)

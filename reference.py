"""AITER-free reference for the DeepSeek-R1 MXFP4 MoE layer (GPU MODE "moe-mxfp4").

This file is the definition of what every path must compute (../shared/SPEC.md
sections 2-4): the MXFP4 formats, how the generator quantises weights, the
activation quantisation Qa that AITER's "a4w4" path applies, and the layer
itself. It runs on CPU, CUDA and ROCm and needs nothing beyond PyTorch.

Public entry points, as the official eval.py expects them:
    generate_input(dhidden, dexpert, nroutedexperts, nexpertspertoken,
                   nsharedexperts, bs, seed) -> the 12-tuple of SPEC section 1
    ref_kernel(data) -> [M, d_hidden] bf16
    check_implementation(data, output) -> (ok, message)
"""
import math
from typing import Tuple

import torch
import torch.nn.functional as F

from task import input_t, output_t

MXFP4_BLOCK = 32        # values per E8M0 scale, along the reduction axis
PAD_ALIGN = 256         # padded dims are multiples of this
RTOL = ATOL = 5e-2      # the official tolerance (AITER's rtol = atol)

# torch names these dtypes in recent releases; kernels read them as bytes.
FP4X2_DTYPE = getattr(torch, "float4_e2m1fn_x2", torch.uint8)
E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", torch.uint8)

# Magnitudes of the eight E2M1 codes; bit 3 of a code is the sign.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def pad_to(x: int, align: int) -> int:
    return (x + align - 1) // align * align


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The same storage viewed as uint8 (fp4x2 and e8m0 tensors carry bytes)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


# ---------------------------------------------------------------------------
# E2M1 and E8M0
# ---------------------------------------------------------------------------
def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (0..15, any integer dtype) to float32 values."""
    codes = codes.to(torch.int64)
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    magnitude = table[codes & 7]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 values (already divided by their block scale) to E2M1 codes.

    Round to nearest, ties to even code, saturating at +-6 (torchao's
    _f32_to_floatx_unpacked for E2M1). The sign bit is kept, so -0.0 gives
    code 8. NaN gives code 7 or 15 (E2M1 has no NaN); callers that must
    propagate NaN do so through the scale.
    """
    a = x.abs()
    # Midpoints between neighbouring magnitudes; '<=' where the lower
    # neighbour has the even code, '<' where the upper one has.
    code = torch.full_like(a, 7, dtype=torch.uint8)
    for threshold, c, inclusive in ((5.0, 6, True), (3.5, 5, False), (2.5, 4, True),
                                    (1.75, 3, False), (1.25, 2, True), (0.75, 1, False),
                                    (0.25, 0, True)):
        below = a <= threshold if inclusive else a < threshold
        code = torch.where(below, torch.tensor(c, dtype=torch.uint8, device=a.device), code)
    negative = torch.signbit(x)
    return code | (negative.to(torch.uint8) << 3)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes to [..., K/2] bytes, low nibble = even index."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes to [..., K] codes."""
    packed = as_bytes(packed)
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def e8m0_to_f32(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes to float32: 2^(s-127); s = 0 is 2^-127 (a denormal), s = 255 is NaN."""
    s = as_bytes(scale).to(torch.int32)
    bits = torch.where(s == 0, torch.tensor(0x00400000, dtype=torch.int32, device=s.device), s << 23)
    bits = torch.where(s == 255, torch.tensor(0x7FC00000, dtype=torch.int32, device=s.device), bits)
    return bits.view(torch.float32)


# ---------------------------------------------------------------------------
# Weight quantisation (SPEC section 3) and activation quantisation (section 4)
# ---------------------------------------------------------------------------
def weight_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 byte for a block whose largest magnitude is amax (float32).

    t = amax / 4; s = t's exponent field, plus one when t's mantissa rounds
    up (bit 22 set and bit 21, any lower bit, or a nonzero exponent set).
    """
    t = (amax.to(torch.float32) / 4.0).view(torch.int32)
    s = (t >> 23) & 0xFF
    round_up = ((t & (1 << 22)) != 0) & (((t & (1 << 21)) != 0) | ((t & ((1 << 21) - 1)) != 0) | (s > 0))
    s = torch.where(round_up & (s < 255), s + 1, s)
    return s.to(torch.uint8)


def quantize_weight_mxfp4(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[..., K] weights to ([..., K/2] packed fp4 bytes, [..., K/32] E8M0 bytes)."""
    blocks = w.to(torch.float32).unflatten(-1, (-1, MXFP4_BLOCK))
    s = weight_scale_exponent(blocks.abs().amax(dim=-1))
    codes = e2m1_encode(blocks / e8m0_to_f32(s).unsqueeze(-1))
    return pack_fp4(codes.flatten(-2)), s


def activation_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Qa's per-block exponent e (float32, NaN where amax is NaN).

    amax's bits plus 0x200000, masked to sign and exponent, then
    e = floor(log2(.)) - 2 clamped to [-127, 127] (AITER's "even" scaling).
    """
    bits = (amax.to(torch.float32).view(torch.int32) + 0x200000) & torch.tensor(
        0xFF800000 - (1 << 32), dtype=torch.int32, device=amax.device)
    rounded = bits.view(torch.float32)
    rounded = torch.where(torch.isnan(amax), amax.to(torch.float32), rounded)
    return (torch.floor(torch.log2(rounded)) - 2).clamp(-127, 127)


def quantize_activation(x: torch.Tensor, padded_width: int) -> torch.Tensor:
    """Qa: [..., K] values zero-padded to padded_width, quantised to MXFP4
    per block of 32 and returned dequantised as float32 (code * 2^e)."""
    x = x.to(torch.float32)
    x = F.pad(x, (0, padded_width - x.shape[-1]))
    blocks = x.unflatten(-1, (-1, MXFP4_BLOCK))
    e = activation_scale_exponent(blocks.abs().amax(dim=-1)).unsqueeze(-1)
    codes = e2m1_encode(blocks * torch.exp2(-e))
    return (e2m1_decode(codes) * torch.exp2(e)).flatten(-2)


def dequantize_weight(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., N, K/2] packed fp4 with [..., N, K/32] E8M0 scales to [..., N, K] float32."""
    values = e2m1_decode(unpack_fp4(packed)).unflatten(-1, (-1, MXFP4_BLOCK))
    return (values * e8m0_to_f32(scale).unsqueeze(-1)).flatten(-2)


# ---------------------------------------------------------------------------
# AITER's shuffled layouts (for its CK kernels)
# ---------------------------------------------------------------------------
def shuffle_weight(w: torch.Tensor) -> torch.Tensor:
    """AITER's shuffle_weight(w, layout=(16, 16)) on fp4x2 bytes."""
    n, kb = w.shape[-2], w.shape[-1]
    b = as_bytes(w)
    out = b.reshape(-1, n // 16, 16, kb // 32, 2, 16).permute(0, 1, 3, 4, 2, 5).contiguous()
    return out.view(w.shape).view(w.dtype)


def e8m0_shuffle(scale: torch.Tensor) -> torch.Tensor:
    """AITER's e8m0_shuffle on a 2-D [m, n] scale: zero-pad to [pad256(m), pad8(n)] and permute."""
    m, n = scale.shape
    mp, np_ = pad_to(m, 256), pad_to(n, 8)
    b = F.pad(as_bytes(scale), (0, np_ - n, 0, mp - m))
    out = b.view(mp // 32, 2, 16, np_ // 8, 2, 4).permute(0, 3, 5, 2, 4, 1).contiguous()
    return out.view(mp, np_).view(scale.dtype)


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------
def generate_input(dhidden: int, dexpert: int, nroutedexperts: int, nexpertspertoken: int,
                   nsharedexperts: int, bs: int, seed: int) -> input_t:
    """The official problem's inputs, drawn the way its generator draws them."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d_hidden, d_expert = dhidden, dexpert
    n_routed, n_shared, top_k = nroutedexperts, nsharedexperts, nexpertspertoken
    total_top_k = top_k + n_shared
    n_experts = n_routed + n_shared
    d_hidden_pad, d_expert_pad = pad_to(d_hidden, PAD_ALIGN), pad_to(d_expert, PAD_ALIGN)
    config = {
        "d_hidden": d_hidden, "d_expert": d_expert,
        "d_hidden_pad": d_hidden_pad, "d_expert_pad": d_expert_pad,
        "n_routed_experts": n_routed, "n_shared_experts": n_shared,
        "n_experts_per_token": top_k, "total_top_k": total_top_k, "bs": bs,
    }
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    hidden_states = torch.randn((bs, d_hidden), device=device, dtype=torch.bfloat16, generator=gen)
    router_weight = torch.randn((n_routed, d_hidden), device=device, dtype=torch.bfloat16,
                                generator=gen) / math.sqrt(d_hidden)
    scores = F.linear(hidden_states, router_weight).softmax(dim=-1)
    routed_weights, routed_ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    shared_ids = torch.arange(n_routed, n_experts, device=device, dtype=torch.int32).expand(bs, -1)
    topk_ids = torch.cat([routed_ids.to(torch.int32), shared_ids], dim=-1).contiguous()
    topk_weights = torch.cat([routed_weights.to(torch.float32),
                              torch.ones((bs, n_shared), device=device, dtype=torch.float32)], dim=-1)

    gate_up_bf16 = torch.randn((n_experts, 2 * d_expert_pad, d_hidden_pad), device=device,
                               dtype=torch.bfloat16, generator=gen) / math.sqrt(d_hidden)
    down_bf16 = torch.randn((n_experts, d_hidden_pad, d_expert_pad), device=device,
                            dtype=torch.bfloat16, generator=gen) / math.sqrt(d_expert)
    gate_up_weight, gate_up_scale = _quantize_by_expert(gate_up_bf16)
    del gate_up_bf16
    down_weight, down_scale = _quantize_by_expert(down_bf16)
    del down_bf16

    gate_up_weight_scale = gate_up_scale.reshape(-1, d_hidden_pad // MXFP4_BLOCK)
    down_weight_scale = down_scale.reshape(-1, d_expert_pad // MXFP4_BLOCK)
    return (
        hidden_states,
        gate_up_weight.view(FP4X2_DTYPE),
        down_weight.view(FP4X2_DTYPE),
        gate_up_weight_scale.view(E8M0_DTYPE),
        down_weight_scale.view(E8M0_DTYPE),
        shuffle_weight(gate_up_weight).view(FP4X2_DTYPE),
        shuffle_weight(down_weight).view(FP4X2_DTYPE),
        e8m0_shuffle(gate_up_weight_scale).view(E8M0_DTYPE),
        e8m0_shuffle(down_weight_scale).view(E8M0_DTYPE),
        topk_weights,
        topk_ids,
        config,
    )


def _quantize_by_expert(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """quantize_weight_mxfp4 one expert at a time, to bound the float32 temporaries."""
    packed = torch.empty(w.shape[:-1] + (w.shape[-1] // 2,), dtype=torch.uint8, device=w.device)
    scale = torch.empty(w.shape[:-1] + (w.shape[-1] // MXFP4_BLOCK,), dtype=torch.uint8, device=w.device)
    for e in range(w.shape[0]):
        packed[e], scale[e] = quantize_weight_mxfp4(w[e])
    return packed, scale


# ---------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------
def moe_a4w4_torch(data: input_t) -> output_t:
    """The a4w4 MoE of SPEC section 4 in PyTorch, one expert at a time.

    Reads the raw weights and scales (2-D or 3-D scale shapes). Dot products
    run in float64 and are rounded to float32, so the result is the exact
    a4w4 value up to that rounding, whatever the device's matmul precision.
    """
    (hidden_states, gate_up_weight, down_weight, gate_up_weight_scale, down_weight_scale,
     _, _, _, _, topk_weights, topk_ids, config) = data
    d_hidden, d_expert = config["d_hidden"], config["d_expert"]
    d_hidden_pad, d_expert_pad = config["d_hidden_pad"], config["d_expert_pad"]
    n_experts = gate_up_weight.shape[0]
    m = hidden_states.shape[0]
    device = hidden_states.device

    gate_up_scale = as_bytes(gate_up_weight_scale).reshape(n_experts, 2 * d_expert_pad, -1)
    down_scale = as_bytes(down_weight_scale).reshape(n_experts, d_hidden_pad, -1)
    xq = quantize_activation(hidden_states[:, :d_hidden], d_hidden_pad).to(torch.float64)
    out = torch.zeros((m, d_hidden), dtype=torch.float64, device=device)

    ids = topk_ids.to(torch.int64)
    for e in torch.unique(ids).tolist():
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        w_gate = dequantize_weight(gate_up_weight[e, :d_expert], gate_up_scale[e, :d_expert])
        w_up = dequantize_weight(gate_up_weight[e, d_expert_pad:d_expert_pad + d_expert],
                                 gate_up_scale[e, d_expert_pad:d_expert_pad + d_expert])
        w_down = dequantize_weight(down_weight[e, :d_hidden], down_scale[e, :d_hidden])
        x = xq[token]
        g = (x @ w_gate.to(torch.float64).T).to(torch.float32)
        u = (x @ w_up.to(torch.float64).T).to(torch.float32)
        h = (g / (1.0 + torch.exp(-g)) * u).to(torch.bfloat16)
        hq = quantize_activation(h, d_expert_pad).to(torch.float64)
        y = (hq @ w_down.to(torch.float64).T).to(torch.float32)
        weight = topk_weights[token, slot].to(torch.float32).unsqueeze(1)
        out.index_add_(0, token, (weight * y).to(torch.float64))
    return out.to(torch.float32).to(torch.bfloat16)


def ref_kernel(data: input_t) -> output_t:
    return moe_a4w4_torch(data)


# ---------------------------------------------------------------------------
# Checking
# ---------------------------------------------------------------------------
@torch.no_grad()
def compare_outputs(output: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL,
                    atol: float = ATOL, max_print: int = 5) -> Tuple[bool, str]:
    """The official elementwise rule |out - ref| <= atol + rtol*|ref|, with NaN
    and +-Inf mismatches counted, plus the relative L2 error in the message."""
    if not isinstance(output, torch.Tensor):
        return False, f"output is {type(output).__name__}, expected a tensor"
    if output.shape != expected.shape:
        return False, f"shape mismatch: got {tuple(output.shape)}, expected {tuple(expected.shape)}"
    if output.dtype != expected.dtype:
        return False, f"dtype mismatch: got {output.dtype}, expected {expected.dtype}"
    out = output.to(torch.float32).to(expected.device)
    ref = expected.to(torch.float32)
    diff = (out - ref).abs()
    bad = diff > atol + rtol * ref.abs()
    bad |= torch.isnan(out) ^ torch.isnan(ref)
    bad |= torch.isposinf(out) ^ torch.isposinf(ref)
    bad |= torch.isneginf(out) ^ torch.isneginf(ref)
    finite = torch.isfinite(out) & torch.isfinite(ref)
    ref_norm = ref[finite].norm().item()
    err_norm = (out - ref)[finite].norm().item()
    rel_l2 = err_norm / ref_norm if ref_norm > 0 else err_norm
    n_bad = int(bad.sum().item())
    summary = f"rel_l2={rel_l2:.3e} max_abs_err={diff[finite].max().item() if finite.any() else 0.0:.3e}"
    if n_bad == 0:
        return True, summary
    lines = [f"{n_bad} of {bad.numel()} elements outside rtol={rtol} atol={atol}; {summary}"]
    for index in torch.nonzero(bad)[:max_print].tolist():
        i = tuple(index)
        lines.append(f"  at {i}: got {out[i].item():.6g}, expected {ref[i].item():.6g}")
    return False, "\n".join(lines)


def check_implementation(data: input_t, output: output_t) -> Tuple[bool, str]:
    return compare_outputs(output, ref_kernel(data))

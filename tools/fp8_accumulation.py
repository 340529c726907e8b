"""How exact are e4m3 tensor-core sums over a long K, on folded MXFP4 operands?

The wide kernels could take e4m3 MMAs over all of K with no per-block
rescale if each operand carried its block scales inside its E4M3 bytes
(BENCHMARKS.md, twenty-first session, item 5). An E2M1 value v of a block
with exponent s, in a row whose largest block exponent is b, is stored as
v * 2^(s - b + 6) (exact in E4M3 while s - b >= -14: the window runs from
E4M3's smallest subnormal, 0.5 * 2^-8, to 6 * 2^6 = 384), and the row's
2^(b - 6) multiplies the sum once. Products are then exact, and only the
tensor core's accumulation can differ from an exact sum. Hopper keeps fewer
bits there than fp32 (cuBLAS's "fast accumulation" is the MMAs' own chain,
without promotion into fp32 registers).

This measures, for one wide tile of stage 1 (144 tokens, K = 7168, the gate
and up rows of 512 columns) and of stage 2 (K = 2048), drawn as the task's
generator draws its inputs:
  - the relative L2 and largest error of each sum against the exact one
    (float64 over the exact products), for fp32 (the bf16 kernels' class:
    summation order only), e4m3 with fast accumulation, and e4m3 with
    cuBLAS's promotion;
  - for stage 1, the fraction of Qa codes of h = bf16(silu(g) * u) that
    differ from the exact sums' (what reaches stage 2), and the relative L2
    of Qa(h) against the exact one.

    python tools/fp8_accumulation.py        (an sm_89+ GPU; about 10 s)
"""
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import reference  # noqa: E402

BLOCK = reference.MXFP4_BLOCK
# E4M3 holds v * 2^d exactly for every E2M1 magnitude v and -8 <= d <= 6.
FOLD_HEADROOM = 6
FOLD_WINDOW = 15


def fold(values: torch.Tensor, exponents: torch.Tensor):
    """MXFP4 rows (values: [R, K] E2M1 values as float32; exponents: [R, K/32]
    block exponents) folded to E4M3: (folded [R, K] float32 values, each
    exact in E4M3; base [R] exponents, the row's sum to be multiplied by
    2^base; unfoldable [R] count of nonzero blocks below the window, folded
    to 0)."""
    top = exponents.amax(dim=-1)
    base = top - FOLD_HEADROOM
    shift = exponents - base.unsqueeze(-1)
    blocks = values.unflatten(-1, (-1, BLOCK))
    inside = (shift >= FOLD_HEADROOM - FOLD_WINDOW + 1) | (blocks == 0).all(dim=-1)
    folded = blocks * torch.exp2(shift).unsqueeze(-1)
    folded = torch.where(inside.unsqueeze(-1), folded, torch.zeros_like(folded)).flatten(-2)
    return folded, base, (~inside).sum(dim=-1)


def weight_rows(rows: int, k: int, generator) -> tuple:
    """Weights drawn and quantised as the task's generator does: (E2M1 values, block exponents)."""
    w = torch.randn((rows, k), dtype=torch.bfloat16, generator=generator, device="cuda") / math.sqrt(k)
    packed, scale = reference.quantize_weight_mxfp4(w)
    values = reference.e2m1_decode(reference.unpack_fp4(packed))
    return values, scale.to(torch.float32) - 127.0


def activation_rows(x: torch.Tensor) -> tuple:
    """Qa of x ([T, K]): (E2M1 values, block exponents)."""
    blocks = x.to(torch.float32).unflatten(-1, (-1, BLOCK))
    e = reference.activation_scale_exponent(blocks.abs().amax(dim=-1))
    codes = reference.e2m1_encode(blocks * torch.exp2(-e).unsqueeze(-1))
    return reference.e2m1_decode(codes).flatten(-2), e


def sums(act, weight) -> dict:
    """act @ weight^T (each (values, exponents)) four ways, as float64 [T, R]."""
    act_exact = (act[0].unflatten(-1, (-1, BLOCK)) * torch.exp2(act[1]).unsqueeze(-1)).flatten(-2)
    weight_exact = (weight[0].unflatten(-1, (-1, BLOCK)) * torch.exp2(weight[1]).unsqueeze(-1)).flatten(-2)
    out = {"exact": act_exact.double() @ weight_exact.double().T}
    torch.backends.cuda.matmul.allow_tf32 = False
    out["fp32"] = (act_exact @ weight_exact.T).double()
    act_folded, act_base, act_lost = fold(*act)
    weight_folded, weight_base, weight_lost = fold(*weight)
    a8 = act_folded.to(torch.float8_e4m3fn)
    w8 = weight_folded.to(torch.float8_e4m3fn)
    assert torch.equal(a8.float(), act_folded) and torch.equal(w8.float(), weight_folded), "a fold is not exact"
    one = torch.ones((), device="cuda")
    scale = torch.exp2(act_base.double().unsqueeze(-1) + weight_base.double().unsqueeze(0))
    for name, fast in (("e4m3 fast", True), ("e4m3 promoted", False)):
        raw = torch._scaled_mm(a8, w8.T, scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast)
        out[name] = raw.double() * scale
    out["unfoldable blocks"] = int(act_lost.sum() + weight_lost.sum())
    return out


def errors(result: torch.Tensor, exact: torch.Tensor) -> str:
    rel_l2 = ((result - exact).norm() / exact.norm()).item()
    worst = ((result - exact).abs().max() / exact.abs().max()).item()
    return f"{rel_l2:10.2e} {worst:10.2e}"


def main():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("fp8_accumulation: needs an sm_89+ GPU (e4m3 tensor cores); none here")
        return
    generator = torch.Generator(device="cuda")
    generator.manual_seed(2026)
    tokens = 144
    print(f"{'sum':34s} {'rel L2':>10s} {'max/|max|':>10s}")
    for stage, k, rows in (("stage 1 (K 7168, 1024 rows)", 7168, 1024), ("stage 2 (K 2048, 1024 rows)", 2048, 1024)):
        x = torch.randn((tokens, k), dtype=torch.bfloat16, generator=generator, device="cuda")
        if stage.startswith("stage 2"):   # stage 2's inputs are SwiGLU outputs: heavier-tailed than normal
            x = (F.silu(x.float()) * torch.randn_like(x.float())).to(torch.bfloat16)
        result = sums(activation_rows(x), weight_rows(rows, k, generator))
        print(f"{stage}: unfoldable blocks {result['unfoldable blocks']}")
        for name in ("fp32", "e4m3 fast", "e4m3 promoted"):
            print(f"  {name:32s} {errors(result[name], result['exact'])}")
        if stage.startswith("stage 1"):
            def qa_of_h(s):
                g, u = s[:, :rows // 2].float(), s[:, rows // 2:].float()
                h = (g / (1.0 + torch.exp(-g)) * u).to(torch.bfloat16)
                return reference.quantize_activation(h, rows // 2)
            exact_hq = qa_of_h(result["exact"])
            for name in ("fp32", "e4m3 fast", "e4m3 promoted"):
                hq = qa_of_h(result[name])
                flipped = (hq != exact_hq).float().mean().item()
                rel = ((hq - exact_hq).norm() / exact_hq.norm()).item()
                print(f"  Qa(h) from {name:21s} {rel:10.2e} {flipped:10.2e} of codes differ")


if __name__ == "__main__":
    main()

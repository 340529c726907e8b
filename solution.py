"""DeepSeek-R1 MXFP4 mixture-of-experts layer (GPU MODE "moe-mxfp4"), one module.

custom_kernel(data) computes the a4w4 MoE of ../shared/SPEC.md section 4:
activations are quantised to MXFP4 (Qa) before each expert GEMM, weights are
MXFP4 with E8M0 block scales, and the result matches AITER's fused_moe up to
fp32 summation order.

On an NVIDIA GPU (sm_89 and newer; only sm_90a GPUs, the H100 and H200, have
run them in tests, and a warning says so on the others) it runs four
kernels (five when stage 1's K is split; the folded wide path below adds
four: the fold of the intermediate rows, and three that leave at once unless
its fallback is needed; the e4m3 configs' stage 2 on folded rows adds their
fold), built on first use with torch's load_inline and cached:

  route and    one kernel: its first CTA makes the per-expert token counts,
  quantise     offsets, the pairs sorted by expert (token and routing weight)
               and the tile table; the others, meanwhile, Qa of the hidden
               states (bf16 values, or E4M3 codes and block scales for the
               FP8 configs) and zeroing of the fp32 accumulator;
  stage 1      gate/up GEMM + SwiGLU + bf16 rounding + Qa of the intermediate
               (with few tiles: the GEMM over slices of K, then a kernel that
               sums the slices in a fixed order before SwiGLU and Qa);
  stage 2      down GEMM, weighted by topk_weights, added into the accumulator;
  convert      fp32 accumulator to the bf16 output.

On sm_90 every kernel after the first is launched with programmatic
dependent launch: its CTAs are placed while the kernel before it finishes,
and wait for it on the device (wait_for_previous_kernel).

The GEMMs read the raw weights, 16-byte runs of raw rows (one 32-value
scale block each) copied straight into shared memory, except stage 1's
folded form (e4m3 tiles of 8 to 32 tokens), where TMA loads its weights
from AITER's shuffled copy (input #5), whose 16-row groups hold a scale
block's 16 rows in 256 contiguous bytes, a stage's weights in runs of 2 KB
rather than of 128 bytes (shuffled_weight_offset).

Exactness. An E2M1 value times a power of two is exact in bf16, so the GEMMs
run bf16 MMAs (mma.sync; on sm_90 for 64-token tiles the warpgroup wgmma) on
operands that carry their block scales: the weights are
converted fp4 -> bf16 times their E8M0 scale in registers, and Qa writes its
dequantised activations as bf16. Every product is exact and the MMA sums the
whole K in fp32: the exact a4w4 value up to fp32 summation order. On sm_90,
tiles of 8 to 32 tokens instead run e4m3 warpgroup MMAs (E2M1 is exact in
E4M3, and the fp4 -> e4m3 conversion is cheaper than fp4 -> bf16): each
32-value block's exact sum is scaled by its two block scales in fp32, again
exact up to summation order. (The e4m3 mma.sync runs on sm_90 as F2FP
conversions plus fp16 HMMA; Hopper's fp8 tensor cores are reachable only
through wgmma.) With wide tiles (48, 64 or 144 tokens) and token rows of up to
8,192 values, stage 1 runs e4m3 warpgroup MMAs on folded operands: Qa writes
each token's values as E4M3 bytes against its row's largest block exponent,
the weights fold against each row's first block, and each sum is scaled once
by its row's and token's powers of two. That is exact wherever a row's blocks
fit E4M3's window; where one does not, the bf16 kernel computes stage 1
again. Over wide tiles stage 2 folds the same way, its intermediate rows folded
by a pass of their own after stage 1; whether all of them and all down-weight
rows fold is known before it starts (its adds are final), and if not the bf16
kernel does all of stage 2. The plain e4m3 tiles' stage 1 reads the same
folded activations: from 16 tokens on folded weights too, at 8 tokens with
each block's sum scaled by its weight scale alone (from
TOKEN_SCALED_MIN_PAIRS token-expert pairs; with fewer, per block on Qa's
codes and block scales); a CTA whose rows or
tokens do not fit runs its K again per block. With d_expert up to 256 their
stage 2 at 16 and 24 tokens folds too: a pass rewrites the intermediate
rows, and each stage chooses the folded or the per-block form before it
runs. Only the e4m3 tensor cores' accumulation keeps
fewer bits than fp32 (about 1e-6 relative, tools/fp8_accumulation.py).

On ROCm with AITER importable, AITER's fused_moe runs (as the official
submission template does; our kernels have not been verified on AMD). On CPU
tensors the PyTorch path of reference.py runs; on a GPU the kernels do not
take (ROCm without AITER, NVIDIA before sm_89), or if the build fails, it runs
after one warning that says why.

`python solution.py` is a self-benchmark (see the end of this file).
"""
import functools
import hashlib
import math
import os
import re
import sys
import tempfile
import time
import warnings
from typing import NamedTuple, Optional

import torch

from task import input_t, output_t

# ===========================================================================
# Kernel source: common helpers (formats, Qa, PTX wrappers)
# ===========================================================================
COMMON_SOURCE = r"""
#include <cuda_bf16.h>
#include <stdint.h>
#include <string.h>
#include <type_traits>

// The bit-level format helpers below also compile for the host, where a unit
// test checks them against reference.py without a GPU.
#define MOE_HD __host__ __device__ __forceinline__

namespace moe {

constexpr int kScaleBlock = 32;        // values per E8M0 scale
constexpr int kMaxExperts = 4096;      // routing keeps 3 ints per expert in shared memory
constexpr int kRows = 128;             // weight rows per GEMM CTA

// The first scale block of slice z of stage 1's k_blocks in `slices` slices
// that halve: of the K's S stages (stage_blocks each), slice z < slices - 1
// covers stages [S - (S >> z), S - (S >> (z + 1))), the last one the rest;
// k_blocks for z = slices. The grid runs slice 0's CTAs first, so the short
// slices come last and fill the last wave's gaps: with equal slices a last
// wave of a few CTAs left most SMs idle for a whole slice (272 CTAs on 264
// slots at bs=128 E=33). Every slice is non-empty while slices <=
// log2(S) + 1 (max_halving_slices).
MOE_HD int halving_slice_first_block(int z, int slices, int k_blocks, int stage_blocks) {
    const int stages = (k_blocks + stage_blocks - 1) / stage_blocks;
    const int first = (stages - (stages >> z)) * stage_blocks;
    return z >= slices || first > k_blocks ? k_blocks : first;
}
MOE_HD int max_halving_slices(int k_blocks, int stage_blocks) {
    int stages = (k_blocks + stage_blocks - 1) / stage_blocks, slices = 1;
    while (stages >>= 1) ++slices;
    return slices;
}

MOE_HD float bits_to_float(uint32_t bits) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(bits);
#else
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}
MOE_HD uint32_t float_to_bits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
#endif
}

// E2M1 code (sign in bit 3) of x, round to nearest, ties to even, saturating
// at 6 (NaN: 7): the same rule as reference.e2m1_encode. Branch-free, because
// a chain of seven comparisons compiled to divergent branches in every Qa
// (its lanes' values fall in different intervals). Below 1 the codes are
// the halves, 2a rounded to an integer (by the fma's own rounding against
// 2^23); from 1 up, a code is twice the binade plus the first mantissa bit,
// which the float's bits rounded at bit 22 (ties to even) give directly.
// It equals the comparison chain it replaced (a <= 0.25 ? 0 : a < 0.75 ? 1
// ...) on all 2^32 floats (an exhaustive host run: BENCHMARKS, thirty-second
// session, item 3).
MOE_HD uint32_t e2m1_code(float x) {
    const float a = fabsf(x);
    const uint32_t halves = float_to_bits(fmaf(a, 2.0f, 8388608.0f)) & 3u;
    const uint32_t bits = float_to_bits(a < 6.0f ? a : 6.0f);   // NaN too becomes 6
    const uint32_t binade_code = ((bits + 0x1FFFFFu + (bits >> 22 & 1u)) >> 22) - 252u;
    return (a < 1.0f ? halves : binade_code) | (float_to_bits(x) >> 28 & 8u);
}
MOE_HD float e2m1_value(uint32_t code) {
    const uint32_t c = code & 7u;
    const float magnitude = c < 4u ? 0.5f * (float)c : (float)(c & 1u ? 3u << ((c >> 1) - 2) : 2u << ((c >> 1) - 2));
    return code & 8u ? -magnitude : magnitude;
}
// e2m1_value(e2m1_code(x)) without the code: the same roundings (below 1,
// to a multiple of 0.5 through the fma; from 1, to one mantissa bit, ties
// to even), kept as a float and given x's sign. For the Qa of the bf16
// activations: the wide stage 1's unit epilogue, whose Qa loop it takes
// from 352 to 304 instructions per four blocks (SASS, 144 tokens), cost 84
// of d2048's 441-us stage 1 (H200).
MOE_HD float e2m1_round(float x) {
    const float a = fabsf(x);
    const float halves = (fmaf(a, 2.0f, 8388608.0f) - 8388608.0f) * 0.5f;
    const uint32_t bits = float_to_bits(a < 6.0f ? a : 6.0f);   // NaN too becomes 6
    const float binade = bits_to_float((bits + 0x1FFFFFu + (bits >> 22 & 1u)) & 0xFFC00000u);
    return bits_to_float(float_to_bits(a < 1.0f ? halves : binade) | (float_to_bits(x) & 0x80000000u));
}

// The GEMMs run bf16 MMAs on operands that carry their block scales: every
// E2M1 value times a power of two is exact in bf16, so the MMA's fp32
// accumulation over the whole K needs no per-block epilogue.
//
// Weights: pair J (0..3) of a word of eight fp4 codes, codes J and J+4, as the
// bf16 bit patterns of value * 2^-126 in the low and high halves (magnitude
// bits to bf16 bits 6..8, sign to bit 15; code 1, 0.5, becomes a subnormal).
// Multiplying by the block's weight_multiplier then gives value * scale.
// The pair's two codes (a nibble each, 16 bits apart) are multiplied by a
// constant with two bits set, which places copies of each at two shifts:
// its magnitude bits land at bits 6..8 (22..24) and its sign at bit 15 (31),
// the copies never overlap (so no carries), and a mask keeps those bits.
// Three integer operations per pair, the multiply on the FMA pipe (the
// conversion is the bf16 GEMMs' busiest work, on the ALU pipe), where a
// shift-and-mask form took four, all on the ALU.
template <int J>
MOE_HD uint32_t fp4_pair_to_bf16(uint32_t word) {
    const uint32_t codes = (J < 2 ? word : word >> 8) & (J % 2 == 0 ? 0x000F000Fu : 0x00F000F0u);
    return codes * (J % 2 == 0 ? 0x1040u : 0x0104u) & 0x81C081C0u;
}
// Both halves of a bf16x2 set to 2^(field - 127), field in [0, 254].
MOE_HD uint32_t bf16x2_pow2(uint32_t field) {
    return (field << 7) * 0x10001u;
}
// The multipliers that take fp4_pair_to_bf16's value * 2^-126 to
// value * 2^(s-127) for an E8M0 scale byte s: 2^(s-1) in one bf16 factor
// when s <= 128 (second factor 1), split in two above that. s = 255 (NaN)
// gives NaN.
MOE_HD uint32_t weight_multiplier_low(uint32_t s) {
    return bf16x2_pow2((s < 128u ? s : 128u) + 126u);
}
MOE_HD uint32_t weight_multiplier_high(uint32_t s) {
    return s == 255u ? 0x7FC07FC0u : bf16x2_pow2((s > 128u ? s : 128u) - 1u);
}
// A byte permute (prmt), also on the host. The caller keeps bit 3 of each
// of the selector's four low nibbles clear (prmt's sign-replicate mode);
// __byte_perm would clear them itself, an instruction more for a selector
// that is not a constant.
MOE_HD uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t selector) {
#ifdef __CUDA_ARCH__
    uint32_t out;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(x), "r"(y), "r"(selector));
    return out;
#else
    const uint64_t bytes = (uint64_t)y << 32 | x;
    uint32_t out = 0;
    for (int i = 0; i < 4; ++i) out |= (uint32_t)(bytes >> (8 * ((selector >> (4 * i)) & 7)) & 0xFFu) << (8 * i);
    return out;
#endif
}
// Byte k (0..3) of four scale bytes, all at most 128, as
// weight_multiplier_low: (s + 126) << 7 in both halves, one byte add for all
// four and a byte permute.
MOE_HD uint32_t weight_multiplier_of_byte(uint32_t four_scales, int k) {
    return byte_perm(four_scales + 0x7E7E7E7Eu, 0u, 0x4040u | (uint32_t)k * 0x101u) << 7;
}
// Bit 7 of byte k set when byte k of four_scales is above limit (128 <= limit
// < 255), other bits of a byte are noise: its low 7 bits plus 255 - limit carry
// into bit 7 (never beyond) exactly when they exceed limit - 128. Three
// instructions, so that a warp can vote on all of a stage's scales.
MOE_HD uint32_t scale_bytes_above(uint32_t four_scales, uint32_t limit) {
    return ((four_scales & 0x7F7F7F7Fu) + (255u - limit) * 0x01010101u) & four_scales;
}
// True if any of four packed scale bytes is above limit (128: the bf16 path
// needs the second factor; kFp8NarrowScale: the FP8 path's exponent split).
MOE_HD bool any_scale_above(uint32_t four_scales, uint32_t limit) {
    return (scale_bytes_above(four_scales, limit) & 0x80808080u) != 0u;
}

// Activations are stored as bf16 (Qa's values, exact), each 32-value block
// permuted so that the MMA's B fragments pair with the weight pairs above:
// physical value p of a block sits at act_position(p). Thread t of a quad
// holds weight word t (values 8t..8t+7); its k16 step s, half h, lane l take
// pair 2s+h, so value 8t + (2s+h) + 4l is logical k 16s + 8h + 2t + l.
MOE_HD int act_position(int p) {
    return ((p >> 1) & 1) << 4 | (p & 1) << 3 | (p >> 3) << 1 | ((p >> 2) & 1);
}

// FP8 configs (warpgroup e4m3 MMAs, sm_90a) take both operands unscaled: an
// E2M1 code placed in an E4M3 byte, sign to bit 7 and magnitude bits to
// bits 2..4, is exactly its value times 2^-6 (code 1, 0.5, becomes the E4M3
// subnormal 2^-7). Every product is then exact and carries 2^-12, and each
// 32-value block's fp32 sum is scaled by its two block scales afterwards
// (gemm_mainloop). E4M3 0x7F is NaN.
constexpr uint32_t kE4m3Nan = 0x7Fu;
// The largest weight scale byte for which the FP8 path's one-fma scaling is
// exact (gemm_mainloop's compute_blocks_fp8).
constexpr uint32_t kFp8NarrowScale = 242;
MOE_HD uint32_t e2m1_to_e4m3(uint32_t code) {
    return (code & 8u) << 4 | (code & 7u) << 2;
}
// e2m1_to_e4m3 of magnitudes 0-3 (lo) and 4-7 (hi) as byte tables for
// fp4_word_to_folded_e4m3 (below): the unscaled bytes in the folded
// fragments' order, for the narrow folded kernels' per-block pass.
constexpr uint32_t kE4m3CodesLo = 0x0C080400u, kE4m3CodesHi = 0x1C181410u;
// A word of eight fp4 codes (two per byte, low nibble first) as E4M3 bytes:
// its even values (the low nibbles) and its odd values, in byte order.
MOE_HD uint32_t fp4_even_to_e4m3(uint32_t word) {
    return (word << 2 & 0x1C1C1C1Cu) | (word << 4 & 0x80808080u);
}
MOE_HD uint32_t fp4_odd_to_e4m3(uint32_t word) {
    return (word >> 2 & 0x1C1C1C1Cu) | (word & 0x80808080u);
}
// E4M3 activations, each block permuted to pair with those weight bytes:
// thread t of a quad holds weight word t (values 8t..8t+7) and gives its
// even values as the k32 MMA's A register for k 4t..4t+3, its odd values
// for k 16+4t..16+4t+3. So physical value p sits at k = fp8_act_position(p).
MOE_HD int fp8_act_position(int p) {
    return (p & 1) << 4 | (p >> 3) << 2 | ((p >> 1) & 3);
}

// Folded E4M3 (the wide stage 1's e4m3 path): each operand carries its
// block scales in its bytes, so that the MMAs sum all of K with no per-block
// rescale. An E2M1 value v of a block with exponent s, in a row with base
// exponent b, is the E4M3 byte of v * 2^(s - b), and the row's sum is
// multiplied by 2^b once. E4M3 holds v * 2^d exactly for every E2M1 value
// and -8 <= d <= 6 (6 * 2^6 = 384 at the top, 0.5 * 2^-8 = 2^-9, its
// smallest subnormal, at the bottom); on the host side
// tools/fp8_accumulation.py measured the MMAs' sums of such bytes over K.
constexpr int kFoldMinShift = -8, kFoldMaxShift = 6;
MOE_HD uint32_t e2m1_to_e4m3_shifted(uint32_t code, int d) {
    const uint32_t c = code & 7u, sign = (code & 8u) << 4;
    if (c == 0) return sign;
    // v = (1 + frac / 2) * 2^((c >> 1) - 1) (code 1: 0.5, frac 0).
    const uint32_t frac = c >= 2 ? (c & 1u) : 0u;
    const int biased = (int)(c >> 1) - 1 + d + 7;
    if (biased >= 1) return sign | (uint32_t)biased << 3 | frac << 2;
    // Subnormal: (2 + frac) * 2^(biased + 1) units of 2^-9 (biased >= -2
    // here, and frac is 0 at -2: only code 1 gets that low).
    return sign | ((2u + frac) << (biased + 2)) >> 1;
}
// Where the wide stage 1's folded activations put a block's value p: its
// weight fragments (fp4_word_to_folded_e4m3) give word t's values 0-3 as k
// 4t..4t+3 and values 4-7 as k 16+4t..16+4t+3 of the k32 MMA.
MOE_HD int folded_act_position(int p) {
    return (p & 3) | (p >> 3) << 2 | ((p >> 2) & 1) << 4;
}
// The E4M3 bytes of E2M1 magnitudes 0-7 times 2^d (lo: codes 0-3, hi: 4-7)
// for -5 <= d <= 6, where every nonzero entry is a normal E4M3 and d adds to
// its exponent field: two adds per row and block.
constexpr int kFoldTableMinShift = -5;
// The largest first scale byte whose window (up to kFoldMaxShift above it)
// stops short of 255, E8M0's NaN: above it a block of 255 would fold as a
// finite shift.
constexpr int kFoldMaxFirstScale = 254 - kFoldMaxShift;
MOE_HD void folded_e4m3_table(int d, uint32_t& lo, uint32_t& hi) {
    lo = 0x3C383000u + (uint32_t)d * 0x08080800u;
    hi = 0x4C484440u + (uint32_t)d * 0x08080808u;
}
// The fold's window test of four scale bytes at once: bit 7 of byte i set
// where byte i lies outside [s, s + kFoldMaxShift - kFoldTableMinShift],
// s being each byte of window_starts (the window's start in all four), all
// taken mod 256: a bytewise subtraction without borrows, then a bytewise
// "above 11". As FoldedRows::fold_checked's test where s <= 255 - 11 (no
// window wraps).
MOE_HD uint32_t scale_bytes_outside_window(uint32_t four_scales, uint32_t window_starts) {
    constexpr uint32_t kHigh = 0x80808080u, kWidth = kFoldMaxShift - kFoldTableMinShift + 1;
    const uint32_t d = ((four_scales | kHigh) - (window_starts & ~kHigh)) ^ ((four_scales ^ ~window_starts) & kHigh);
    return (((d & ~kHigh) + (0x80u - kWidth) * 0x01010101u) | d) & kHigh;
}
// A word of eight fp4 codes (low nibble first) through that table: values
// 0-3 as the bytes of .x, values 4-7 of .y. A byte permute picks the
// magnitudes; a second one gathers the signs (bit 3 of each nibble): code
// 2i+1's is bit 7 of the word's byte i, code 2i's bit 7 of the word shifted
// left by 4 (9 operations a word where the old spread-and-shift took 13:
// the ALU pipe is the folded wide kernels' busiest).
MOE_HD uint2 fp4_word_to_folded_e4m3(uint32_t word, uint32_t lo, uint32_t hi) {
    const uint32_t magnitudes = word & 0x77777777u, shifted = word << 4;
    const uint32_t x = byte_perm(lo, hi, magnitudes) | (byte_perm(word, shifted, 0x1504u) & 0x80808080u);
    const uint32_t y = byte_perm(lo, hi, magnitudes >> 16) | (byte_perm(word, shifted, 0x3726u) & 0x80808080u);
    return make_uint2(x, y);
}
// fp4_word_to_folded_e4m3's bytes (values 0-3 in .x, 4-7 in .y) in the
// per-block pass's order: even values, then odd, as fp4_even_to_e4m3 and
// fp4_odd_to_e4m3 give the weights (fp8_act_position). The 8-token e4m3
// stage 1's folded activations take this order (ScalePath::kTokenScaled),
// so that its weights keep the per-block pass's cheaper conversion.
MOE_HD uint2 folded_to_per_block_order(uint2 bytes) {
    return make_uint2(byte_perm(bytes.x, bytes.y, 0x6420u), byte_perm(bytes.x, bytes.y, 0x7531u));
}
// Four E4M3 bytes of E2M1 codes (e2m1_to_e4m3: each value times 2^-6, no
// NaN byte) as the E4M3 bytes of the same values times 2^d, kFoldMinShift
// <= d <= kFoldMaxShift (fold_inter_codes_kernel): the magnitude codes
// (bits 2-4 of each byte) as a selector into folded_e4m3_table's table
// where d is in its range, byte by byte below it (subnormal bytes).
MOE_HD uint32_t e4m3_codes_shifted(uint32_t word, int d) {
    const uint32_t signs = word & 0x80808080u, codes = word >> 2 & 0x07070707u;
    if (d >= kFoldTableMinShift) {
        uint32_t lo, hi;
        folded_e4m3_table(d, lo, hi);
        // Byte 0 of codes | codes >> 4 holds codes 0 and 1 as nibbles, byte 2 codes 2 and 3.
        return byte_perm(lo, hi, byte_perm(codes | codes >> 4, 0u, 0x4420u)) | signs;
    }
    uint32_t out = signs;
    for (int i = 0; i < 4; ++i) out |= e2m1_to_e4m3_shifted(codes >> (8 * i) & 7u, d) << (8 * i);
    return out;
}
// The largest weight scale byte the token-scaled pass takes: each block's
// sum P (of weight codes times 2^-6 and folded activation bytes, |P| <=
// 32 * 6 * 2^-6 * 384 = 1152) is added as P * 2^(s - 121), and the 256
// blocks of a row of 8,192 values (the folded rows' longest) stay below
// 2^(s - 102), finite up to s = 229; bytes above 224 (255, NaN, among them)
// take the per-block pass.
constexpr uint32_t kTokenScaledNarrowScale = 224;

// Qa's block exponent e for a block whose largest magnitude is amax (not
// NaN): amax's bits plus 0x200000, masked to the exponent, e = log2 - 2,
// clamped to [-127, 127].
MOE_HD int qa_exponent(float amax) {
    const uint32_t rounded = (float_to_bits(amax) + 0x200000u) & 0xFF800000u;
    const int exponent_field = (int)(rounded >> 23);
    return exponent_field == 255 ? 127 : max(exponent_field - 129, -127);
}
// 2^e for e in [-127, 127], exactly, as a product of two normal powers of
// two: 2^-127 is subnormal and has no exponent field of its own.
MOE_HD float exact_pow2(int e) {
    return bits_to_float((uint32_t)(127 + (e >> 1)) << 23) * bits_to_float((uint32_t)(127 + (e - (e >> 1))) << 23);
}

// v * 2^-e for a block of exponent e, in two exact steps (see exact_pow2).
__device__ __forceinline__ float qa_unscaled(float v, int e) {
    const float inv_half = bits_to_float((uint32_t)(127 - (e >> 1)) << 23);
    const float inv_rest = bits_to_float((uint32_t)(127 - (e - (e >> 1))) << 23);
    return v * inv_half * inv_rest;
}
// Qa's E2M1 code of v in a block of exponent e.
__device__ __forceinline__ uint32_t qa_code(float v, int e) {
    return e2m1_code(qa_unscaled(v, e));
}
// Qa's dequantised value of v: code * 2^e, exact in bf16.
__device__ __forceinline__ float qa_value(float v, int e) {
    return e2m1_round(qa_unscaled(v, e)) * exact_pow2(e);
}

// The largest and smallest of a converged warp's 32 values: one redux.sync
// on sm_80+ instead of a chain of five dependent shuffles.
template <typename T>
__device__ __forceinline__ T warp_max(T v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(USE_ROCM)
    return __reduce_max_sync(0xFFFFFFFFu, v);
#else
    for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
    return v;
#endif
}
template <typename T>
__device__ __forceinline__ T warp_min(T v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(USE_ROCM)
    return __reduce_min_sync(0xFFFFFFFFu, v);
#else
    for (int offset = 16; offset > 0; offset >>= 1) v = min(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
    return v;
#endif
}

// Qa of N 32-value blocks, one value of each per lane (SPEC section 4), in
// the activation format of the GEMM that reads them: kFp8, the E4M3 codes
// at fp8_act_position in block i's 32 bytes of dst[i] and 2^e in
// *scale[i]; otherwise the dequantised bf16 values at act_position in its
// 64 bytes. Blocks count..N-1 are computed, not stored (count is
// warp-uniform). A block is all NaN if any value is NaN, so that NaN
// reaches the output instead of vanishing in the max. kRedux: each block's
// max is one warp_max of its magnitudes' bits (NaN as zero; an all-NaN
// block's scale then differs, its codes are NaN either way): with the fold
// kernels' warp_max, bs=128 E=33 0.993-0.998, d512 0.995-1.000 (H200;
// 656 -> 624 SASS instructions in d512's fix-up). Otherwise the blocks'
// shuffle chains interleave (four at a time took d2048's stage 1 from 471
// to 464 us when the wide kernel ran this form): the narrow stage 1's
// epilogue keeps them, since every integer form spilled its 24-token
// kernel at its 128-register cap.
template <bool kFp8, int N, bool kRedux>
__device__ __forceinline__ void quantize_blocks_warp(const float (&v)[N], int count, int lane,
                                                     uint8_t* const (&dst)[N], float* const (&scale)[N]) {
    float amax[N];
    if constexpr (kRedux) {
#pragma unroll
        for (int i = 0; i < N; ++i) amax[i] = bits_to_float(warp_max(isnan(v[i]) ? 0u : float_to_bits(fabsf(v[i]))));
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) amax[i] = fabsf(v[i]);
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1)
#pragma unroll
            for (int i = 0; i < N; ++i) amax[i] = fmaxf(amax[i], __shfl_xor_sync(0xffffffffu, amax[i], offset));
    }
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const bool has_nan = __any_sync(0xffffffffu, isnan(v[i]));
        if (i >= count) continue;
        const int e = qa_exponent(amax[i]);
        if (kFp8) {
            dst[i][fp8_act_position(lane)] = (uint8_t)(has_nan ? kE4m3Nan : e2m1_to_e4m3(qa_code(v[i], e)));
            if (lane == 0) *scale[i] = exact_pow2(e);
        } else {
            reinterpret_cast<__nv_bfloat16*>(dst[i])[act_position(lane)] =
                __float2bfloat16_rn(has_nan ? __int_as_float(0x7FC00000) : qa_value(v[i], e));
        }
    }
}

// Programmatic dependent launch (sm_90; elsewhere no-ops, and the host
// launches normally). The host launches each kernel after the first so that
// it may start while the kernel before it finishes (launch_after_previous):
// wait_for_previous_kernel then blocks until that kernel has completed and
// its writes are visible. Every such kernel waits before it reads or writes
// anything (but folded_fallback_kernel, which reads inputs and sets a flag
// no kernel before it reads), in every CTA, so a kernel's completion implies
// its predecessors'. let_next_kernel_launch lets the next kernel's CTAs be
// placed as soon as all of this kernel's CTAs have started.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(USE_ROCM)
#define MOE_HAS_DEPENDENT_LAUNCH 1
#endif
__device__ __forceinline__ void wait_for_previous_kernel() {
#ifdef MOE_HAS_DEPENDENT_LAUNCH
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// A word an earlier kernel wrote, read after wait_for_previous_kernel where
// the compiler might not keep a plain read there: a read through a const
// __restrict__ pointer may become an invariant load (ld.global.nc), which
// the wait's "memory" clobber does not hold back. ptxas put
// folded_fallback_kernel's read of *redo_tiles above its griddepcontrol.wait:
// it then saw the routing kernel's zero while stage 1 still ran, wrote no
// bf16 rows, and the redo read stale memory (H200, 2026-12-03). A volatile
// read stays below the wait; the build test checks every kernel's SASS for
// reads above it.
__device__ __forceinline__ int read_after_wait(const int* word) {
    return *reinterpret_cast<const volatile int*>(word);
}
__device__ __forceinline__ void let_next_kernel_launch() {
#ifdef MOE_HAS_DEPENDENT_LAUNCH
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ int2 warp_inclusive_scan(int2 v, int lane) {
    for (int d = 1; d < 32; d <<= 1) {
        const int x = __shfl_up_sync(0xffffffffu, v.x, d);
        const int y = __shfl_up_sync(0xffffffffu, v.y, d);
        if (lane >= d) { v.x += x; v.y += y; }
    }
    return v;
}

}  // namespace moe
"""

# ===========================================================================
# Kernel source: routing
# ===========================================================================
ROUTING_SOURCE = r"""
#include <algorithm>
#include <cmath>
namespace moe {

// The tiles of tile_tokens rows a call is expected to have (host code: the
// host sizes grids and K slices by it, and never waits for the routing),
// from a model of the routing: each shared expert (the last n_shared ids of
// every token) fills m / tile_tokens tiles rounded up, and a routed
// expert's pair count is taken as Poisson with the routed mean (normal
// beyond a mean of 30), ceil(n / T) having expectation sum over j >= 0 of
// P(n > jT). The host's older estimated_tiles overcounts experts with fewer
// than T pairs: 49 wide tiles for the ~38 at bs=512 E=33, where it chose
// one slice of stage 1's K and two were 9% faster (H200, 2026-12-01).
inline double expected_tiles(int m, int top_k, int n_experts, int n_shared, int tile_tokens) {
    if (n_shared < 0 || n_shared >= std::min(top_k, n_experts)) n_shared = 0;
    const int routed = n_experts - n_shared;
    const double mean = (double)m * (top_k - n_shared) / routed, sd = std::sqrt(mean);
    double per_expert = 0.0;
    if (mean <= 30.0) {
        double pmf = std::exp(-mean), cdf = 0.0;
        for (int n = 0; n <= (int)(mean + 12.0 * sd) + tile_tokens; ++n, pmf *= mean / n) {
            cdf += pmf;
            if (n % tile_tokens == 0) per_expert += std::max(0.0, 1.0 - cdf);   // P(X > n)
        }
    } else {   // P(X > jT) is 1 below 12 sd under the mean, 0 above 12 over it
        const int first = std::max(0, (int)((mean - 12.0 * sd) / tile_tokens));
        per_expert = first;
        for (int j = first; j * tile_tokens <= mean + 12.0 * sd; ++j)
            per_expert += 0.5 * std::erfc((j * tile_tokens + 0.5 - mean) / (sd * std::sqrt(2.0)));
    }
    return n_shared * (double)((m + tile_tokens - 1) / tile_tokens) + routed * per_expert;
}

// Exclusive scan of one int2 per thread over the whole CTA (every thread
// calls it): returns the sum of the lower threads' values, and total the
// CTA's. warp_totals: 32 int2 of shared memory, read until the caller's
// next barrier, so two scans need one between them.
__device__ __forceinline__ int2 block_exclusive_scan(int2 value, int2* warp_totals, int2& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int2 inclusive = warp_inclusive_scan(value, lane);
    if (lane == 31) warp_totals[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        const int nwarps = blockDim.x >> 5;
        int2 t = lane < nwarps ? warp_totals[lane] : make_int2(0, 0);
        warp_totals[lane] = warp_inclusive_scan(t, lane);
    }
    __syncthreads();
    int2 prefix = make_int2(inclusive.x - value.x, inclusive.y - value.y);
    if (warp > 0) { prefix.x += warp_totals[warp - 1].x; prefix.y += warp_totals[warp - 1].y; }
    total = warp_totals[(blockDim.x >> 5) - 1];
    return prefix;
}

// A GEMM tile: its expert, first sorted row and rows. The routing's table
// holds each as (expert | rows << kTileRowsShift, first row), so that a CTA
// has its whole tile from one entry: with the rows read from the expert's
// end offset instead, each narrow GEMM CTA began with three dependent loads
// (the tile count, the entry, expert_offsets[expert + 1]) before its first
// copy, and the wide kernels read that offset for every tile (bs=128 E=33
// 0.987, bs=512 E=257 0.989, bs=16 E=33 0.993 so; H200). The host checks
// that experts and tile widths fit their bits.
struct Tile {
    int expert, row_start, rows;
};
constexpr int kTileRowsShift = 20;
static_assert(kMaxExperts <= 1 << kTileRowsShift, "a tile entry's expert bits");
__device__ __forceinline__ int2 pack_tile(int expert, int row_start, int rows) {
    return make_int2(expert | rows << kTileRowsShift, row_start);
}
__device__ __forceinline__ Tile decode_tile(int2 entry) {
    return Tile{entry.x & ((1 << kTileRowsShift) - 1), entry.y, entry.x >> kTileRowsShift};
}
__device__ __forceinline__ Tile tile_at(const int2* tiles, int i) { return decode_tile(tiles[i]); }
// The CTA's tile (tile index `index`), false past the routing's tile count.
// The entry is read after the count's test, a second round trip. Four forms
// that read both in one round trip each took bs=128 E=257 1.0-1.3% longer
// (H200): volatile reads; ld.relaxed.gpu; .nc reads with the entry's sign
// tested beside the count; the same with the routing writing the entries
// past its count, so that no CTA read an unwritten line (stages 1 and 2
// both 1-3 us slower, cause unknown), for 0-0.9% at the bs=16 shapes.
__device__ __forceinline__ bool load_tile(Tile& tile, const int2* tiles, const int* num_tiles, int index) {
    if (index >= *num_tiles) return false;
    tile = tile_at(tiles, index);
    return true;
}
// The narrow GEMMs' grids take the tile as their slowest index (stage 1:
// column group, K slice, tile; stage 2: row group, tile), so that the CTAs
// past the routing's tile count, which leave at once, run after every CTA
// with work instead of between them, each holding a slot for its start and
// exit (H200: bs=128 E=257 0.984 of a call, the other narrow shapes 0.996;
// persistent CTAs dealing the units round-robin took 1.01-1.10, having
// given up the block scheduler's dynamic hand-out). Stage 1 with halving K
// slices (the bf16 kernels) keeps its slices slowest, as
// halving_slice_first_block needs: column group, tile, K slice. The grid's
// y and z hold at most kMaxGridTiles.
constexpr int kMaxGridTiles = 65535;

// Run by one CTA (the first of route_and_quantize_kernel, 1024 threads).
// Counts the (token, slot) pairs of each expert, writes expert_offsets[E+1],
// the pairs sorted by expert (as each pair's token and routing weight, so
// that a GEMM reads either with one load), and the tile table of tiles of
// tile_tokens rows that both GEMM stages walk (pack_tile's entries). Ids
// outside [0, E) are counted in bad_ids and skipped, so no kernel ever
// indexes out of bounds. Order within an expert is not fixed: every row of a
// GEMM tile is computed independently of the others.
__device__ void route_pairs(
        const int* __restrict__ topk_ids, const float* __restrict__ topk_weights, int num_pairs, int top_k,
        int n_experts, int tile_tokens, int* __restrict__ expert_offsets, int2* __restrict__ tiles,
        int* __restrict__ num_tiles, int* __restrict__ sorted_tokens, float* __restrict__ sorted_weights,
        int* __restrict__ bad_ids) {
    extern __shared__ int shared[];
    int* counts = shared;                   // [E]
    int* cursor = shared + n_experts;       // [E]
    int* tile_base = shared + 2 * n_experts;  // [E]
    __shared__ int2 warp_totals[32];
    __shared__ int bad;
    const int tid = threadIdx.x;

    // The pair loops load kPairsAhead pairs per thread before their shared
    // atomics: one at a time, each pair cost a global load's round trip
    // (2.6 us of the first kernel's 16 at bs=512 E=257, H200).
    constexpr int kPairsAhead = 8;
    for (int e = tid; e < n_experts; e += blockDim.x) counts[e] = 0;
    if (tid == 0) bad = 0;
    __syncthreads();
    for (int p0 = tid; p0 < num_pairs; p0 += kPairsAhead * blockDim.x) {
        int ids[kPairsAhead];
#pragma unroll
        for (int i = 0; i < kPairsAhead; ++i) {
            const int p = p0 + i * blockDim.x;
            ids[i] = p < num_pairs ? topk_ids[p] : 0;
        }
#pragma unroll
        for (int i = 0; i < kPairsAhead; ++i)
            if (p0 + i * blockDim.x < num_pairs) {
                if ((unsigned)ids[i] < (unsigned)n_experts) atomicAdd(&counts[ids[i]], 1);
                else atomicAdd(&bad, 1);
            }
    }
    __syncthreads();

    // Exclusive scan of (pairs, tiles) per expert: each thread sums a
    // contiguous run of experts, then a block scan of the run totals.
    const int per_thread = (n_experts + blockDim.x - 1) / blockDim.x;
    const int first = tid * per_thread, last = min(first + per_thread, n_experts);
    int2 run = make_int2(0, 0);
    for (int e = first; e < last; ++e) {
        run.x += counts[e];
        run.y += (counts[e] + tile_tokens - 1) / tile_tokens;
    }
    int2 total;
    int2 prefix = block_exclusive_scan(run, warp_totals, total);
    for (int e = first; e < last; ++e) {
        expert_offsets[e] = prefix.x;
        cursor[e] = prefix.x;
        tile_base[e] = prefix.y;
        prefix.x += counts[e];
        prefix.y += (counts[e] + tile_tokens - 1) / tile_tokens;
    }
    if (tid == blockDim.x - 1) {
        expert_offsets[n_experts] = total.x;
        *num_tiles = total.y;
        *bad_ids = bad;
    }
    __syncthreads();

    for (int e = tid; e < n_experts; e += blockDim.x) {
        const int n = (counts[e] + tile_tokens - 1) / tile_tokens;
        for (int j = 0; j < n; ++j) {
            const int offset = j * tile_tokens;
            tiles[tile_base[e] + j] = pack_tile(e, cursor[e] + offset, min(tile_tokens, counts[e] - offset));
        }
    }
    __syncthreads();
    for (int p0 = tid; p0 < num_pairs; p0 += kPairsAhead * blockDim.x) {
        int ids[kPairsAhead];
        float weights[kPairsAhead];
#pragma unroll
        for (int i = 0; i < kPairsAhead; ++i) {
            const int p = p0 + i * blockDim.x;
            ids[i] = p < num_pairs ? topk_ids[p] : -1;
            weights[i] = p < num_pairs ? topk_weights[p] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < kPairsAhead; ++i)
            if ((unsigned)ids[i] < (unsigned)n_experts) {   // also false past num_pairs
                const int row = atomicAdd(&cursor[ids[i]], 1);
                sorted_tokens[row] = (p0 + i * blockDim.x) / top_k;
                sorted_weights[row] = weights[i];
            }
    }
}

}  // namespace moe
"""


# ===========================================================================
# Kernel source: the expert GEMM main loop shared by stage 1 and stage 2
# ===========================================================================
class KernelConfig(NamedTuple):
    tile_tokens: int    # tokens per GEMM tile, a multiple of 8 (one MMA n-tile)
    warp_rows: int      # weight rows per warp: 16 or 32 (one or two m16 MMA tiles)
    warp_tokens: int    # tokens per warp, a multiple of 8 dividing tile_tokens
    stage_blocks: int   # scale blocks (32 K values) per cp.async pipeline stage
    stages: int         # pipeline depth
    wgmma: bool         # warpgroup MMAs (sm_90a; 16-row warps with all the tile's tokens)
    fp8: bool = False   # e4m3 warpgroup MMAs, block scales applied per block (8 to 32 tokens)
    stage2_warp_rows: int = 0   # stage 2's weight rows per warp, if not warp_rows (8-token e4m3: 32, two MMA tiles)
    wide_tile_tokens: int = 0   # one of WIDE_TILE_TOKENS: the warp-specialised wide kernels (e4m3 MMAs on folded
    #                             operands where Qa folds the rows, bf16 wgmma otherwise and for their redo)
    token_scaled: bool = True   # e4m3 tiles below FOLDED_STAGE1_MIN_TOKENS: stage 1 on activations folded
    #                             per token (else per block on Qa's codes; see TOKEN_SCALED_MIN_PAIRS)

    def __str__(self):
        return ("%d/%dx%d/%d/%d" % self[:5] + ("/fp8" if self.fp8 else "/wgmma" if self.wgmma else "")
                + (f"+{self.stage2_warp_rows}x{self.warp_tokens}" if self.stage2_warp_rows else "")
                + (f"+wide{self.wide_tile_tokens}" if self.wide_tile_tokens else "")
                + ("" if self.token_scaled or not self.fp8 or self.tile_tokens >= FOLDED_STAGE1_MIN_TOKENS
                   else "/codes"))


# Tokens per tile of the wide kernels (stage1_wide_kernel, stage2_wide_kernel):
# 48 for experts of 29 to 45 tokens, both stages over tiles of that width
# (at 128 tokens and 32 routed experts an expert has 32 +- 6 tokens,
# which 64-token tiles ran half empty; at 43.6 tokens 48 still measured 2%
# faster, at 48 tokens 6% slower); 64 from 46 to 96 (stage 1 only in its
# folded e4m3 form, for rows of up to 8,192 values; otherwise the config's own
# 64-token kernel); 144 (one CTA per SM), both stages, beyond, where at 512
# tokens and 32 routed experts an expert has 128 +- 11 tokens, which 144 cover
# in one tile for most experts.
WIDE_TILE_TOKENS = (48, 64, 144)


# Every GEMM configuration compiled into the kernels; choose_config picks one.
GEMM_CONFIGS = (KernelConfig(8, 16, 8, 8, 4, False), KernelConfig(16, 16, 16, 8, 3, False),
                KernelConfig(64, 16, 64, 4, 4, False), KernelConfig(64, 32, 64, 4, 4, False),
                KernelConfig(64, 16, 64, 4, 4, True),
                *(KernelConfig(64, 16, 64, 4, 4, True, False, 0, tokens) for tokens in WIDE_TILE_TOKENS),
                KernelConfig(8, 16, 8, 8, 4, True, True, 32), KernelConfig(16, 16, 16, 8, 3, True, True),
                KernelConfig(24, 16, 24, 8, 4, True, True), KernelConfig(32, 16, 32, 8, 3, True, True))
# Every e4m3 config's stage 1 has a folded form (stage1_kernel's kFolded),
# on activations Qa folds per token. From 16 tokens the weights fold too
# (one accumulating MMA per block); at 8 tokens that stage loop had as many
# instructions as the per-block one (517 against 521) and the call measured
# 4-5% slower (H200, 2026-12-02), so there each block's sum is scaled by its
# weight factor alone (ScalePath::kTokenScaled).
FOLDED_STAGE1_MIN_TOKENS = 16
# The token-scaled stage 1 pays per CTA (its tokens' scales copied and
# checked, the sums multiplied after K) for a shorter stage loop, which
# pays back only where stage 1 has many tiles: with 1,152 pairs (bs=128
# E=257) the call took 0.981-0.982 of the per-block one's, with 144 (bs=16,
# K in slices) 0.999-1.002 at E=257 and 1.007-1.012 at E=33 (H200,
# 2026-12-03, three A/B runs). choose_config takes it from this many pairs.
TOKEN_SCALED_MIN_PAIRS = 1024
# The 8-token e4m3 config with its stage 1 per block on Qa's codes (token_scaled
# off, as choose_config takes it below that many pairs): built with that
# config, so not an entry of GEMM_CONFIGS, but a form the tests and the sweep run.
PER_BLOCK_STAGE1_CONFIGS = tuple(c._replace(token_scaled=False) for c in GEMM_CONFIGS
                                 if c.fp8 and c.tile_tokens < FOLDED_STAGE1_MIN_TOKENS)
# The e4m3 configs whose stage 2 takes folded intermediate rows (a pass after
# stage 1 folds them: fold_inter_codes_kernel) where a row tile is one stage
# (d_expert up to 256): 16 and 24 tokens. Its bound at 8 tokens, 1.6-2.2 us
# of stage 2 (H200, 2026-12-03), is less than the pass costs the chain; at 32
# the kernel spilled (at its 128-register cap).
FOLDED_STAGE2_TOKENS = (16, 24)
# Of those, the widths whose folded-rows kernel runs its warpgroups over two
# 64-row MMA tiles each (128-thread CTAs, three per SM), as the 8-token
# config's stage 2 does: fewer instructions per weight. At 24 tokens it took
# bs=512 E=257's stage 2 from 120.9 to 108.7 us (the call 0.969; at two CTAs
# per SM, 1.018; H200, 2026-12-04). The plain kernel of that width keeps the
# config's warp rows: over two tiles at three CTAs it spilled. The kernels
# and the host take the folded kernel's MT from folded_stage2_mt.
FOLDED_STAGE2_TWO_TILE_TOKENS = (24,)
# The e4m3 configs whose stage 2 has a second kernel for a K of one stage
# (d_expert up to 256), at one CTA per SM more and a ring of fewer slots:
# where a row tile is one stage, two slots already keep the next row tile's
# stage loading, and the smaller ring lets the host give each CTA 8 row
# tiles. At 8 tokens it took bs=128 E=257's stage 2 from 80.1 to 75.6 us
# (the call 0.995, bs=16 E=257 0.994), while at d_expert 512 (two stages a
# row tile) the same 2-slot ring had cost bs=16 E=33 1.3% (H200, 2026-12-04).
# At 24 tokens (three CTAs of 256 threads per SM) it spilled.
ONE_STAGE_STAGE2_TOKENS = (8,)


def _config_macro(name: str, configs) -> str:
    """The configs' kernel template arguments as an X-macro, once each (a
    config with wide tiles shares them with the plain one)."""
    return f"#define {name}(X) " + " ".join(dict.fromkeys(
        f"X({c.tile_tokens // 8}, {c.warp_rows // 16}, {c.warp_tokens // 8}, {c.stage_blocks}, {c.stages}, "
        f"{'true' if c.wgmma else 'false'}, {'true' if c.fp8 else 'false'}, "
        f"{(c.stage2_warp_rows or c.warp_rows) // 16})" for c in configs)) + "\n"


GEMM_CONFIG_SOURCE = (_config_macro("MOE_GEMM_CONFIGS", GEMM_CONFIGS)
                      + _config_macro("MOE_FOLDED_STAGE1_CONFIGS", [c for c in GEMM_CONFIGS if c.fp8])
                      + _config_macro("MOE_FOLDED_STAGE2_CONFIGS", [c for c in GEMM_CONFIGS if c.fp8
                                                                    and c.tile_tokens in FOLDED_STAGE2_TOKENS])
                      + _config_macro("MOE_ONE_STAGE_STAGE2_CONFIGS", [c for c in GEMM_CONFIGS if c.fp8
                                                                       and c.tile_tokens in ONE_STAGE_STAGE2_TOKENS])
                      + f"constexpr int kFoldedStage1MinTokens = {FOLDED_STAGE1_MIN_TOKENS};\n"
                      + "constexpr bool folded_stage2_tokens(int tokens) { return "
                      + " || ".join(f"tokens == {n}" for n in FOLDED_STAGE2_TOKENS) + "; }\n"
                      + "constexpr bool one_stage_stage2_tokens(int tokens) { return "
                      + " || ".join(f"tokens == {n}" for n in ONE_STAGE_STAGE2_TOKENS) + "; }\n"
                      + "constexpr int folded_stage2_mt(int nt, int mt) { return ("
                      + " || ".join(f"8 * nt == {n}" for n in FOLDED_STAGE2_TWO_TILE_TOKENS) + ") ? 2 : mt; }\n")


def _wgmma_source(n: int, kind: str = "bf16") -> str:
    """A m64n{n} warpgroup MMA wrapper (n/2 accumulator registers, too many
    to write out by hand): d (+)= a.b, a from registers, b by descriptor (see
    wgmma_descriptor_low); accumulate 0 gives d = a.b, the first MMA of a wide
    row tile, so that no accumulator is zeroed between tiles. kind "bf16":
    wgmma_m64n{n}k16; "e4m3": wgmma_m64n{n}k32_e4m3 (no transpose operands
    for 8-bit types; the folded passes' (the narrow stage 1 at 16 to 32
    tokens, both wide stages), and tools/wgmma_chain.py's and
    timing_variants' wide_e4m3_mma)."""
    name, shape, operands = {"bf16": (f"wgmma_m64n{n}k16", f"m64n{n}k16.f32.bf16.bf16", "1, 1, 0"),
                             "e4m3": (f"wgmma_m64n{n}k32_e4m3", f"m64n{n}k32.f32.e4m3.e4m3", "1, 1")}[kind]
    regs = n // 2
    outputs = ", ".join(f"%{i}" for i in range(regs))
    constraints = ", ".join(f'"+f"(d[{i // 4}][{i % 4}])' for i in range(regs))
    return f"""
__device__ __forceinline__ void {name}(float (&d)[{n // 8}][4], const uint32_t (&a)[4],
                                                 uint32_t b_descriptor, uint32_t accumulate) {{
#ifdef MOE_HAS_WGMMA
    asm volatile("{{\\n.reg .pred accumulate;\\n.reg .b64 b;\\nsetp.ne.b32 accumulate, %{regs + 5}, 0;\\n"
                 "mov.b64 b, {{%{regs + 4}, %{regs + 6}}};\\n"
                 "wgmma.mma_async.sync.aligned.{shape} {{{outputs}}}, "
                 "{{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}, b, accumulate, {operands};\\n}}\\n"
                 : {constraints}
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b_descriptor), "r"(accumulate),
                   "r"(kWgmmaDescriptorHigh));
#else
    __trap();
#endif
}}
"""


GEMM_SOURCE = r"""
// Tensor maps for TMA copies (CUDA only: the bf16 warpgroup-MMA configs that
// use them are sm_90-only; elsewhere an opaque stand-in of the same size).
#if !defined(USE_ROCM)
#include <cuda.h>
#endif
namespace moe {
#if !defined(USE_ROCM)
using TensorMap = CUtensorMap;
#else
struct alignas(64) TensorMap { unsigned char bytes[128]; };
#define __grid_constant__
#endif

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define MOE_HAS_BF16_MMA 1
#endif

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
// The first kAlignment-aligned byte of dynamic shared memory (16-byte
// aligned), as an offset from the array itself: through an integer cast the
// compiler no longer knows the pointer is shared, and every access became a
// generic LD/ST with 64-bit address work (SASS, 2026-12-01).
template <uint32_t kAlignment>
__device__ __forceinline__ uint8_t* align_shared(uint8_t* smem) {
    return smem + ((kAlignment - (smem_addr(smem) & (kAlignment - 1))) & (kAlignment - 1));
}
// 16 bytes global -> shared, bypassing L1, of which the first src_bytes (16
// or 0) are read and the rest zero-filled.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
// 16 bytes global -> shared, or 16 zeros where copy is 0 (the ignore-src
// form: its predicate is one test of the caller's mask bit, where a
// src-size of 0 or 16 took a shift and a test per copy).
__device__ __forceinline__ void cp_async_16_or_zeros(void* dst, const void* src, uint32_t copy) {
    asm volatile("{\n.reg .pred zeros;\nsetp.eq.u32 zeros, %2, 0;\n"
                 "cp.async.cg.shared.global [%0], [%1], 16, zeros;\n}\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(copy));
}
// Bytes (4 or 8) global -> shared, of which the first valid_bytes are read
// and the rest zero-filled.
template <int Bytes>
__device__ __forceinline__ void cp_async_small(void* dst, const void* src, int valid_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "n"(Bytes), "r"(valid_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// Both bf16 halves of a times those of b: exact here (powers of two times
// E2M1 values, subnormals included), hence no rounding question.
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
    uint32_t d;
#ifdef MOE_HAS_BF16_MMA
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
#else
    __trap();
#endif
    return d;
}
// Half h (weight row g + 8h) of a 32-value block's bf16 A fragments for
// both k16 steps of an m16 tile: word holds the row's eight fp4 codes of
// the thread's k (word t of the block), four_scales the row's scale bytes of
// the stage, of which byte `byte` is the block's; wide: a scale above 128
// (both multipliers, see weight_multiplier_low).
__device__ __forceinline__ void bf16_fragment_half(uint32_t (&a)[2][4], int h, uint32_t word, uint32_t four_scales,
                                                   int byte, bool wide) {
    uint32_t low, high = 0;
    if (wide) {
        const uint32_t s = (four_scales >> (8 * byte)) & 0xFFu;
        low = weight_multiplier_low(s);
        high = weight_multiplier_high(s);
    } else {
        low = weight_multiplier_of_byte(four_scales, byte);
    }
    uint32_t p[4] = {fp4_pair_to_bf16<0>(word), fp4_pair_to_bf16<1>(word), fp4_pair_to_bf16<2>(word),
                     fp4_pair_to_bf16<3>(word)};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        p[j] = bf16x2_mul(p[j], low);
        if (wide) p[j] = bf16x2_mul(p[j], high);
    }
    // Step s: pair 2s at reg h (k 2t..2t+1), pair 2s+1 at reg 2+h (k 2t+8..).
    a[0][h] = p[0];
    a[0][2 + h] = p[1];
    a[1][h] = p[2];
    a[1][2 + h] = p[3];
}

// d += a(16x16) . b(16x8), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#ifdef MOE_HAS_BF16_MMA
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// Hopper warpgroup MMA (sm_90a only; other targets trap, and the host code
// refuses wgmma configs on them). A warpgroup (4 warps) computes
// d(64 x 64) += a(64 x 16) . b(16 x 64): a from registers, each warp's 16
// rows in mma_bf16's A layout; b (the tokens) read by the tensor cores from
// shared memory through a descriptor; d in mma_bf16's C layout per n8 tile.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOE_HAS_WGMMA 1
#endif
// Descriptor of a K-major operand in the 128-byte swizzle: rows of 128
// bytes (64 bf16 or 128 e4m3 values), 8-row atoms 1024 bytes apart,
// 1024-byte aligned. The MMA wrappers take its low half, the start address
// / 16 (14 bits: shared memory is under 256 KB) and a leading-byte offset of
// 1 (unused by this layout), and add the constant high half. So the slice an
// MMA reads, a constant byte offset c into a stage, is the stage's low half
// plus c / 16: one add per MMA, not the five of building it from an address.
__device__ __forceinline__ uint32_t wgmma_descriptor_low(const void* p) {
    return smem_addr(p) >> 4 | 1u << 16;
}
constexpr uint32_t kWgmmaDescriptorHigh = (1024 >> 4) | 1u << 30;   // atom stride; 128-byte swizzle
""" + "".join(_wgmma_source(n) for n in sorted({64, *WIDE_TILE_TOKENS})) \
    + "".join(_wgmma_source(n, "e4m3") for n in (16, 24, 32, *WIDE_TILE_TOKENS)) + r"""
// d(64 x 8*N8) = a(64 x 32) . b(32 x 8*N8), e4m3 in, fp32 out; d's previous
// contents are discarded (scale-d false): one scale block's fresh sum. a
// from registers in the k32 layout (thread t of a quad: k 4t..4t+3 of rows
// g, g+8, then k 16+4t.. of both), b as in wgmma_m64n64k16.
template <int N8>
__device__ __forceinline__ void wgmma_e4m3(float (&d)[N8][4], const uint32_t (&a)[4], uint32_t b_descriptor) {
    static_assert(N8 >= 1 && N8 <= 4, "8, 16, 24 or 32 tokens");
#ifdef MOE_HAS_WGMMA
    if constexpr (N8 == 1)
        asm volatile("{\n.reg .pred accumulate;\n.reg .b64 b;\nsetp.ne.b32 accumulate, %9, 0;\n"
                     "mov.b64 b, {%8, %10};\n"
                     "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, b, accumulate, 1, 1;\n}\n"
                     : "=f"(d[0][0]), "=f"(d[0][1]), "=f"(d[0][2]), "=f"(d[0][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b_descriptor), "r"(0),
                       "r"(kWgmmaDescriptorHigh));
    else if constexpr (N8 == 2)
        asm volatile("{\n.reg .pred accumulate;\n.reg .b64 b;\nsetp.ne.b32 accumulate, %13, 0;\n"
                     "mov.b64 b, {%12, %14};\n"
                     "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
                     "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, b, accumulate, 1, 1;\n}\n"
                     : "=f"(d[0][0]), "=f"(d[0][1]), "=f"(d[0][2]), "=f"(d[0][3]),
                       "=f"(d[1][0]), "=f"(d[1][1]), "=f"(d[1][2]), "=f"(d[1][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b_descriptor), "r"(0),
                       "r"(kWgmmaDescriptorHigh));
    else if constexpr (N8 == 3)
        asm volatile("{\n.reg .pred accumulate;\n.reg .b64 b;\nsetp.ne.b32 accumulate, %17, 0;\n"
                     "mov.b64 b, {%16, %18};\n"
                     "wgmma.mma_async.sync.aligned.m64n24k32.f32.e4m3.e4m3 "
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, "
                     "{%12, %13, %14, %15}, b, accumulate, 1, 1;\n}\n"
                     : "=f"(d[0][0]), "=f"(d[0][1]), "=f"(d[0][2]), "=f"(d[0][3]),
                       "=f"(d[1][0]), "=f"(d[1][1]), "=f"(d[1][2]), "=f"(d[1][3]),
                       "=f"(d[2][0]), "=f"(d[2][1]), "=f"(d[2][2]), "=f"(d[2][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b_descriptor), "r"(0),
                       "r"(kWgmmaDescriptorHigh));
    else
        asm volatile("{\n.reg .pred accumulate;\n.reg .b64 b;\nsetp.ne.b32 accumulate, %21, 0;\n"
                     "mov.b64 b, {%20, %22};\n"
                     "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
                     "{%16, %17, %18, %19}, b, accumulate, 1, 1;\n}\n"
                     : "=f"(d[0][0]), "=f"(d[0][1]), "=f"(d[0][2]), "=f"(d[0][3]),
                       "=f"(d[1][0]), "=f"(d[1][1]), "=f"(d[1][2]), "=f"(d[1][3]),
                       "=f"(d[2][0]), "=f"(d[2][1]), "=f"(d[2][2]), "=f"(d[2][3]),
                       "=f"(d[3][0]), "=f"(d[3][1]), "=f"(d[3][2]), "=f"(d[3][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b_descriptor), "r"(0),
                       "r"(kWgmmaDescriptorHigh));
#else
    __trap();
#endif
}
// The folded passes' MMA, m64nNk32 e4m3 (gemm_mainloop's kFolded at N = 16
// to 32 tokens, the wide kernels' folded forms at 48, 64 and 144): one of the
// generated wrappers above, d (+)= a.b. (At 8 tokens stage 1 does not fold
// its weights: wgmma_e4m3 above.)
template <int N>
__device__ __forceinline__ void wgmma_e4m3_mma(float (&d)[N / 8][4], const uint32_t (&a)[4], uint32_t b_descriptor,
                                               uint32_t accumulate) {
    static_assert(N == 16 || N == 24 || N == 32 || N == 48 || N == 64 || N == 144, "the generated e4m3 wrappers");
    if constexpr (N == 16) wgmma_m64n16k32_e4m3(d, a, b_descriptor, accumulate);
    else if constexpr (N == 24) wgmma_m64n24k32_e4m3(d, a, b_descriptor, accumulate);
    else if constexpr (N == 32) wgmma_m64n32k32_e4m3(d, a, b_descriptor, accumulate);
    else if constexpr (N == 48) wgmma_m64n48k32_e4m3(d, a, b_descriptor, accumulate);
    else if constexpr (N == 64) wgmma_m64n64k32_e4m3(d, a, b_descriptor, accumulate);
    else wgmma_m64n144k32_e4m3(d, a, b_descriptor, accumulate);
}
// Keeps the compiler from moving a read of an asynchronous MMA's result
// above the wgmma_wait that makes it valid (volatile asm stays in order).
__device__ __forceinline__ void pin_register(float& x) {
    asm volatile("" : "+f"(x));
}
// Orders this thread's register writes (A fragments, accumulators) before the
// warpgroup MMAs that follow.
__device__ __forceinline__ void wgmma_fence() {
#ifdef MOE_HAS_WGMMA
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef MOE_HAS_WGMMA
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most N committed groups of this warpgroup's MMAs are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef MOE_HAS_WGMMA
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
#endif
}
// Named barrier `id` (1..15; 0 is __syncthreads') of `threads` threads, a multiple of 32.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
// Shared memory written through the generic proxy (cp.async) and read next by
// the tensor cores (async proxy) needs this fence in each writing thread.
__device__ __forceinline__ void fence_async_shared() {
#ifdef MOE_HAS_WGMMA
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Shared-memory mbarriers (sm_90; the e4m3 configs' stage-1 pipeline).
// cp_async_arrive: an arrival once all of this thread's cp.asyncs issued so
// far have landed, counted in the barrier's expected arrivals (.noinc).
__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, int arrivals) {
#ifdef MOE_HAS_WGMMA
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_addr(barrier)), "r"(arrivals) : "memory");
#endif
}
__device__ __forceinline__ void fence_mbarrier_init() {
#ifdef MOE_HAS_WGMMA
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* barrier) {
#ifdef MOE_HAS_WGMMA
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" :: "r"(smem_addr(barrier)) : "memory");
#endif
}
// mbarrier_arrive where `arrive` holds, predicated rather than branched on.
__device__ __forceinline__ void mbarrier_arrive_if(uint64_t* barrier, bool arrive) {
#ifdef MOE_HAS_WGMMA
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n}\n"
                 :: "r"(smem_addr(barrier)), "r"((uint32_t)arrive) : "memory");
#endif
}
__device__ __forceinline__ void cp_async_arrive(uint64_t* barrier) {
#ifdef MOE_HAS_WGMMA
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(smem_addr(barrier)) : "memory");
#endif
}
// TMA (sm_90): this thread's arrival on the barrier, with `bytes` more for
// its phase to wait for; then tma_load_2d copies the box of `map` at
// byte x of row y (maps of bytes) to shared memory, the barrier counting its bytes.
// Box bytes past the tensor's edges are zero.
__device__ __forceinline__ void mbarrier_arrive_expecting(uint64_t* barrier, uint32_t bytes) {
#ifdef MOE_HAS_WGMMA
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(smem_addr(barrier)), "r"(bytes) : "memory");
#endif
}
// mbarrier_arrive_expecting's bytes without the arrival.
__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* barrier, uint32_t bytes) {
#ifdef MOE_HAS_WGMMA
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n"
                 :: "r"(smem_addr(barrier)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap* map, int x, int y, uint64_t* barrier) {
#ifdef MOE_HAS_WGMMA
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3}], [%4];\n"
                 :: "r"(smem_addr(dst)), "l"(map), "r"(x), "r"(y), "r"(smem_addr(barrier)) : "memory");
#else
    __trap();
#endif
}
// The box of a three-dimensional map (shuffled_weight_map) at (x, y, z).
__device__ __forceinline__ void tma_load_3d(void* dst, const TensorMap* map, int x, int y, int z, uint64_t* barrier) {
#ifdef MOE_HAS_WGMMA
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3, %4}], [%5];\n"
                 :: "r"(smem_addr(dst)), "l"(map), "r"(x), "r"(y), "r"(z), "r"(smem_addr(barrier)) : "memory");
#else
    __trap();
#endif
}
// tma_load_2d for the wide kernels' weights, with an L2 evict-first
// policy: their lines are the first to go when the L2 needs room. The call
// took 0.988 of its time at bs=128 E=33, 0.996 at d512 and 0.995 at d2048
// (stage 1's loads gave the first two, stage 2's the third; H200,
// 2026-12-04). The narrow kernels keep plain loads: there the policy gained
// nothing at 16 tokens and cost bs=128 E=257 2.4%, whose shared expert's 16
// tiles each read its weights again.
__device__ __forceinline__ void tma_load_weights_2d(void* dst, const TensorMap* map, int x, int y,
                                                    uint64_t* barrier) {
#ifdef MOE_HAS_WGMMA
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
                 "[%0], [%1, {%2, %3}], [%4], %5;\n"
                 :: "r"(smem_addr(dst)), "l"(map), "r"(x), "r"(y), "r"(smem_addr(barrier)), "l"(policy) : "memory");
#else
    __trap();
#endif
}
// The same for a box of a three-dimensional map (shuffled_weight_map).
__device__ __forceinline__ void tma_load_weights_3d(void* dst, const TensorMap* map, int x, int y, int z,
                                                    uint64_t* barrier) {
#ifdef MOE_HAS_WGMMA
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
                 "[%0], [%1, {%2, %3, %4}], [%5], %6;\n"
                 :: "r"(smem_addr(dst)), "l"(map), "r"(x), "r"(y), "r"(z), "r"(smem_addr(barrier)), "l"(policy)
                 : "memory");
#else
    __trap();
#endif
}
// Stage 1's K-slice partial sums (fp32 (gate, up) pairs), stored
// L2-evict-last: the weights streaming past then push them out (and their
// write-backs compete with the weights' reads) only after the L2's other
// lines, if at all before swiglu_quantize_kernel reads them: bs=128 E=257
// took 2.5-2.9 us less a call so (0.988-0.990, its 8-token stage 1
// shorter), bs=16 E=33 0.991-0.993 (H200, 2026-12-04).
__device__ __forceinline__ void store_partial(float2* dst, float2 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
    asm volatile("st.global.L2::cache_hint.v2.f32 [%0], {%1, %2}, %3;\n"
                 :: "l"(dst), "f"(v.x), "f"(v.y), "l"(policy) : "memory");
#else
    *dst = v;
#endif
}
// Until the barrier's phase of the given parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, int parity) {
#ifdef MOE_HAS_WGMMA
    asm volatile("{\n.reg .pred done;\nwait_%=:\n"
                 "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra wait_%=;\n}\n" :: "r"(smem_addr(barrier)), "r"(parity) : "memory");
#else
    __trap();
#endif
}

// The warpgroup-MMA stage layouts (GemmShape's and the wide kernels').
// Activations in the 128-byte-swizzled K-major layout: atoms of 8 tokens x
// 128 bytes (64 bf16 or 128 e4m3 values), chunk c of token i at chunk c ^
// (i % 8) of its row, so the tensor cores' reads (and the copies) spread
// over all banks; a stage's next 128 bytes of K kTokens rows later.
template <int kTokens>
__device__ __forceinline__ int swizzled_act_offset(int token, int chunk) {
    return (chunk >> 3) * (kTokens * 128) + (token >> 3) * 1024 + (token & 7) * 128
         + (((chunk & 7) ^ (token & 7)) << 4);
}
// Weight rows of SB 16-byte chunks, dense, chunk c of row r at chunk c ^
// swizzle(r): TMA's 128-byte (SB 8) or 64-byte (SB 4) swizzle, so that the
// eight 16-byte rows an ldmatrix phase reads fall in eight bank groups.
template <int SB>
__device__ __forceinline__ int swizzled_weight_offset(int row, int chunk) {
    static_assert(SB == 4 || SB == 8, "stages of 4 or 8 blocks");
    return row * (SB * 16) + ((chunk ^ (SB == 8 ? row & 7 : (row >> 1) & 3)) << 4);
}

// Weight rows as AITER's shuffled copy holds them (SPEC section 3), which
// stage 1's TMA boxes land unchanged: per 16 rows, each 16-byte chunk
// (scale block) of all 16 rows, then the next chunk. A stage then reads
// 16 x SB x 16 contiguous bytes per 16 rows, where the raw rows give runs
// of SB x 16 bytes d_hidden/2 apart: streamed by the copy engine alone,
// 4.0 against 3.5 TB/s (tools/dram_pattern.py, H200). An ldmatrix phase's
// eight rows of one chunk are 128 contiguous bytes: no bank conflicts.
template <int SB>
__device__ __forceinline__ int shuffled_weight_offset(int row, int chunk) {
    return (row >> 4) * (SB * 256) + (chunk << 8) + ((row & 15) << 4);
}

// A GEMM CTA: kRows weight rows x NT*8 tokens, its K streamed through a
// cp.async pipeline of STAGES stages of SB scale blocks each. Each warp
// computes MT m16 tiles of weight rows times WT n8 tiles of tokens: warps
// with one m-tile convert half the weights each, so twice as many of them
// share a stage's shared memory; warps with all the tile's tokens convert
// each weight once per CTA. WG: the MMAs are warpgroup MMAs (sm_90a), each
// warpgroup 64 rows x all the tile's tokens, the tokens read by the tensor
// cores straight from shared memory (no ldmatrix, no B fragments in
// registers): bf16 for 64 tokens, or (FP8) e4m3 for 8 to 32, with fp32
// activation block scales beside them in each stage.
template <int NT, int MT, int WT, int SB, int STAGES, bool WG, bool FP8>
struct GemmShape {
    static_assert((MT == 1 || MT == 2) && NT % WT == 0 && SB % 4 == 0, "GEMM tiling");
    static_assert(!WG || ((MT == 1 || FP8) && WT == NT && (FP8 ? NT <= 4 : NT == 8)),
                  "warpgroup MMAs are built for 16-row warps with 64 (bf16) or 8 to 32 (e4m3) tokens, "
                  "or (e4m3) 32-row warps: two 64-row MMA tiles per warpgroup");
    static_assert(!FP8 || WG, "e4m3 MMAs are warpgroup MMAs");
    static constexpr bool kWgmma = WG, kFp8 = FP8;
    // bf16 warpgroup MMAs may still read a stage after the warps leave it
    // (see gemm_mainloop's kAhead); e4m3 ones are waited for per stage.
    static constexpr bool kAsyncStages = WG && !FP8;
    // Stage 1's K slices halve (halving_slice_first_block) in the bf16
    // kernels; the e4m3 ones keep equal slices (launch_stage1 says why).
    static constexpr bool kHalvingSlices = !FP8;
    static constexpr int kTokens = NT * 8;
    static constexpr int kMTiles = MT, kWarpTiles = WT, kStageBlocks = SB, kStages = STAGES;
    static constexpr int kWarpRows = MT * 16;
    static constexpr int kRowWarps = kRows / kWarpRows;
    static constexpr int kWarps = kRowWarps * (NT / WT);
    static constexpr int kThreads = kWarps * 32;
    // A warp's m-tile mt starts at local weight row first_row(warp) + mt *
    // kMTileStride: a warp's m-tiles are consecutive, but with two per warp
    // of a warpgroup, warp w holds rows 16w..16w+15 of each of the
    // warpgroup's two 64-row MMA tiles.
    static constexpr bool kTwoWarpgroupTiles = WG && MT == 2;
    static constexpr int kMTileStride = kTwoWarpgroupTiles ? 64 : 16;
    static __device__ __forceinline__ int first_row(int warp) {
        return kTwoWarpgroupTiles ? (warp % kRowWarps) / 4 * 128 + warp % 4 * 16 : (warp % kRowWarps) * kWarpRows;
    }
    static __device__ __forceinline__ int first_token(int warp) { return (warp / kRowWarps) * WT * 8; }
    // A stage's weight rows, SB 16-byte chunks each, so that the eight
    // 16-byte rows an ldmatrix phase reads fall in eight different bank
    // groups: for warpgroup-MMA configs swizzled (swizzled_weight_offset, as
    // the TMA boxes land them); otherwise rows padded by 16 bytes.
    static_assert(!WG || SB == 4 || SB == 8, "warpgroup-MMA stages of 4 or 8 blocks");
    static constexpr int kWeightStride = WG ? SB * 16 : SB * 16 + 16;
    static __device__ __forceinline__ int weight_offset(int row, int chunk) {
        return WG ? swizzled_weight_offset<SB>(row, chunk) : row * kWeightStride + (chunk << 4);
    }
    static constexpr int kActValueBytes = FP8 ? 1 : 2;
    static constexpr int kActStride = SB * kScaleBlock * 2 + 16;
    static constexpr int kWeightBytes = kRows * kWeightStride;
    static constexpr int kWeightScaleBytes = kRows * SB;
    static constexpr int kActBytes = WG ? kTokens * SB * kScaleBlock * kActValueBytes : kTokens * kActStride;
    // FP8 activation scales, fp32: block-major ([block][token]) up to 24
    // tokens, so that a thread's two tokens of an MMA n-tile (2t, 2t+1) are
    // one 8-byte read, copied one scale per copy; token-major for 32 tokens,
    // copied 16 bytes (4 blocks) per copy (block-major, that config spilled
    // 8 bytes at its 128-register cap), and where one scale per copy would
    // take more copies than threads (24 tokens in 128-thread CTAs).
    static constexpr int kActScaleBytes = FP8 ? kTokens * SB * 4 : 0;
    static constexpr bool kActScalesBlockMajor = kTokens <= 24 && kTokens * SB <= kThreads;
    static constexpr int kActScaleCopyBlocks = kActScalesBlockMajor ? 1 : 4;
    // A stage: weights, their scales, activations (and FP8: their scales);
    // for warpgroup MMAs the activations first, in 1024-byte-aligned stages
    // (the swizzle below).
    static constexpr int kActOffset = WG ? 0 : kWeightBytes + kWeightScaleBytes;
    static constexpr int kWeightOffset = WG ? kActBytes : 0;
    static constexpr int kScaleOffset = kWeightOffset + kWeightBytes;
    static constexpr int kActScaleOffset = kScaleOffset + kWeightScaleBytes + (WG ? 0 : kActBytes);
    static constexpr int kStageAlignment = WG ? 1024 : 16;
    static constexpr int kStageBytes = (kWeightBytes + kWeightScaleBytes + kActBytes + kActScaleBytes
                                        + kStageAlignment - 1) / kStageAlignment * kStageAlignment;
    static constexpr int kAlignmentSlack = kStageAlignment - 16;   // dynamic shared memory is 16-byte aligned
    static constexpr int kWeightChunks = kRows * SB / kThreads;       // 16-byte copies per thread
    static constexpr int kActRowChunks = SB * kScaleBlock * kActValueBytes / 16;   // 16-byte chunks per token row
    static constexpr int kActCopies = kTokens * kActRowChunks;
    static constexpr int kActChunks = (kActCopies + kThreads - 1) / kThreads;
    static constexpr int kActScaleCopies = kActScaleBytes / (4 * kActScaleCopyBlocks);
    // Token and first block of activation-scale copy tid, and where a scale lands.
    static __device__ __forceinline__ int act_scale_copy_token(int tid) {
        return kActScalesBlockMajor ? tid % kTokens : tid / (SB / 4);
    }
    static __device__ __forceinline__ int act_scale_copy_block(int tid) {
        return kActScalesBlockMajor ? tid / kTokens : tid % (SB / 4) * 4;
    }
    static __host__ __device__ constexpr int act_scale_index(int token, int block) {
        return kActScalesBlockMajor ? block * kTokens + token : token * SB + block;
    }
    static_assert(kThreads >= kRows && kRows * SB % kThreads == 0
                  && (kActCopies % kThreads == 0 || kThreads % kActRowChunks == 0)
                  && kActScaleCopies <= kThreads, "copy split");
    // Activation copy j of thread tid: token, 16-byte chunk within the stage's
    // row, and where the chunk goes in shared memory. Consecutive threads copy
    // contiguous bytes of one token: 64 for bf16 WG (so that a warp's copies
    // land in distinct bank groups), the whole stage row otherwise. Where
    // kActCopies is no multiple of kThreads, the last round's copies past
    // kActCopies (tokens past kTokens) are skipped.
    static constexpr bool kFourPerToken = WG && !FP8;
    static_assert(!kFourPerToken || kThreads / 4 == kTokens, "bf16 WG: four threads per token");
    static __device__ __forceinline__ int act_copy_token(int tid, int j) {
        return kFourPerToken ? tid >> 2 : tid / kActRowChunks + j * (kThreads / kActRowChunks);
    }
    static __device__ __forceinline__ int act_copy_chunk(int tid, int j) {
        return kFourPerToken ? (tid & 3) + 4 * j : tid % kActRowChunks;
    }
    // Warpgroup MMAs read the tokens swizzled (swizzled_act_offset).
    static __device__ __forceinline__ int act_offset(int token, int chunk) {
        return WG ? swizzled_act_offset<kTokens>(token, chunk) : token * kActStride + chunk * 16;
    }
    // Stage 2's K (d_expert) is short: with one row tile per CTA its CTAs
    // run a stage or two each and hide memory latency only behind each
    // other. 8-token tiles are capped at 64 registers so that 1024 threads
    // fit per SM, 16-token tiles at 80 (768 threads; 64 would spill).
    // bf16 warpgroup-MMA CTAs are capped at 128 registers so that two fit
    // per SM; e4m3 ones at 170 (8 and 24 tokens in 128-thread CTAs of two
    // 64-row tiles per warpgroup: three CTAs; 128 for the 8-token one-stage
    // kernel's four) and 128 (16 to 32 tokens; 80 spills at 16).
    static constexpr int kStage1MinBlocks = WG ? 2 : 1;
    // Stage 1's folded form (stage1_kernel's kFolded) folds the weights too
    // (see FOLDED_STAGE1_MIN_TOKENS).
    static constexpr bool kFoldedStage1 = FP8 && kTokens >= kFoldedStage1MinTokens;
    // Stage 1 loads its weights by TMA, two boxes per stage (gemm_mainloop's
    // kWeightBoxes), in every warpgroup-MMA config; the folded e4m3 forms
    // from AITER's shuffled copy (kShuffledStage1). The 24- and 32-token
    // ones read the raw rows by cp.async until TMA from that copy took
    // bs=512 E=257's stage 1 from 195.0 to 188.8 us (the call 0.981; on the
    // raw rows TMA had measured 4% slower, 2026-12-01; H200, 2026-12-04; 32
    // tokens not timed). Stage 2 does in every warpgroup-MMA config, one box
    // per stage, and its activations too (kActTma) in the bf16 configs and
    // the 24-token e4m3 one: there it took bs=512 E=257's stage 2 from 124.9
    // to 120.9 us (the call 0.989), while the 8-token ones measured
    // 1.000-1.006 of the call so (H200, 2026-12-04; 16 and 32 tokens not
    // timed). The host builds the tensor maps these need.
    static constexpr int kStage1WeightBoxes = WG ? 2 : 0;
    static constexpr int kStage2WeightBoxes = WG ? 1 : 0;
    static constexpr bool kStage2ActTma = WG && (!FP8 || NT == 3);
    static constexpr int kStage2MinBlocks = WG && !FP8 ? 2 : NT == 1 ? (FP8 ? 3 : 4) : NT == 2 ? (FP8 ? 2 : 3)
                                          : FP8 ? (MT == 2 ? 3 : 2) : 1;
    // The second stage-2 kernel of ONE_STAGE_STAGE2_TOKENS, for a K of one
    // stage: one CTA per SM more (stage2_kernel's kOneStage, kStage2CtasPerSm).
    static constexpr bool kStage2OneStageKernel = FP8 && one_stage_stage2_tokens(kTokens);
    // Several row tiles per CTA (gemm_mainloop): not with bf16 warpgroup
    // MMAs, where zeroing the accumulators between a tile's MMAs and the
    // next tile's makes ptxas serialise every wgmma; their configs serve the
    // long-K shapes, where a CTA's K alone fills its pipeline. (e4m3 MMAs
    // write fresh per-block sums, not the accumulators.)
    static constexpr bool kRowTiles = !WG || FP8;
    // Pipeline slots of a CTA that streams row_tiles row tiles over k_blocks
    // scale blocks each through a ring of `ring` slots (gemm_mainloop's
    // kRing): as many stages as that, up to the ring (so that short-K CTAs
    // fit more per SM).
    static __host__ __device__ constexpr int pipeline_slots(int k_blocks, int row_tiles, int ring) {
        const int stages = (k_blocks + SB - 1) / SB * row_tiles;
        return stages < ring ? stages : ring;
    }
    // Shared memory of such a launch whose epilogue stages epilogue_bytes:
    // with one row tile the epilogue reuses the pipeline's memory; with more
    // it runs while the next tile's stages load, so it gets its own, after
    // the pipeline (see epilogue_buffer).
    static int shared_bytes(int k_blocks, int epilogue_bytes, int row_tiles, int ring) {
        const int pipeline = kStageBytes * pipeline_slots(k_blocks, row_tiles, ring) + kAlignmentSlack;
        return row_tiles > 1 ? pipeline + epilogue_bytes : (pipeline > epilogue_bytes ? pipeline : epilogue_bytes);
    }
    static __device__ __forceinline__ uint8_t* aligned_base(uint8_t* smem) {
        return align_shared<kStageAlignment>(smem);
    }
    static __device__ __forceinline__ uint8_t* epilogue_buffer(uint8_t* smem, int k_blocks, int row_tiles, int ring) {
        return row_tiles > 1 ? aligned_base(smem) + kStageBytes * pipeline_slots(k_blocks, row_tiles, ring) : smem;
    }
};

// acc[m-tile][n-tile][4] = W . A over k_blocks scale blocks, for this warp's
// MT*16 weight rows and WT*8 tokens, W and A dequantised exactly: bf16 MMAs
// on the weights converted fp4 -> bf16 times their block scale here and the
// activations as Qa's bf16 values; or (FP8) e4m3 MMAs on both unscaled,
// each block's sum times its two scales added into acc in fp32.
// The weight rows sit on the MMA's M side, so a handful of tokens fills it.
//   weight_row_of(r)  row, within the expert's `weight` and `weight_scale`, of
//                     the CTA's local weight row r (0..kRows-1);
//   act_row_of(i)     row of `act` holding the tile's token i, -1 past the
//                     tile's end: zero-filled, finite, discarded.
// Rows are k_padded values long: k_padded/2 weight bytes, k_padded/32 scales,
// k_padded activations (bf16, or FP8: e4m3 codes, with k_padded/32 fp32
// scales in act_scale).
// Row tiles: the CTA computes row_tiles tiles of kRows rows, tile i's rows
// being tile 0's plus i * row_tile_step, through one pipeline, so that the
// next tile's stages load while this one finishes (short-K CTAs otherwise
// wait for their only stages with nothing in flight). After each tile but
// the last, tile_done(acc, i) takes the accumulators, which then restart at
// zero; the last tile's are left in acc. Not in the bf16 warpgroup-MMA
// configs (S::kRowTiles: the mma.sync and e4m3 ones).
// kPath: how a stage picks the narrow or the wide weight-scale path (see
// ScalePath); returns, for kNarrowChecked, whether any weight scale needed
// the wide path, for kTokenScaled, whether any was above
// kTokenScaledNarrowScale, and for kFolded, whether a weight row left its
// fold window (the accumulators are then wrong, and K must run again with
// kWide), else false. kNarrowChecked, kTokenScaled, kFolded and kWide: one
// row tile (row_tiles 1).
// kVoteTokenScaled (stage 2 of the e4m3 configs over fold_inter_codes_kernel's
// rows; one stage per row tile): token_factor holds the tile's rows' 2^base
// (NaN for a row that did not fold). A stage whose weight scales are all at
// most kTokenScaledNarrowScale and whose rows all folded takes the
// token-scaled pass, and then multiplies its sums by the rows' 2^base (the
// row tile's only stage: its accumulators were zero); any other takes kWide
// on the rows' block scales (2^(base - 6) for a folded row).
// kFoldedBytes (e4m3 stage 1 from kFoldedStage1MinTokens tokens, on
// quantize_hidden_row_folded's bytes in folded order): the activations are
// in folded_act_position's order, so kWide converts the weights to that
// order too.
enum class ScalePath {
    kVote,            // every stage votes (a CTA barrier's OR) and takes the path its scales need
    kNarrowChecked,   // every stage narrow, no vote; each thread checks the scales it loads
    kWide,            // every stage wide
    kFolded,          // e4m3 on folded bytes: each block's MMA adds into acc, no per-block rescale
    kTokenScaled,     // e4m3, activations folded per token: each block's sum times its weight factor alone
    kVoteTokenScaled, // e4m3 stage 2 on folded rows: every stage votes between kTokenScaled and kWide
};
// A thread's two rows' fold (rows g and g + 8 of an m-tile of its warp;
// gemm_mainloop's kFolded, the wide kernels' folded forms): base, their
// scale bytes at the unit's first block; and, so that a block's table and
// window test start from its scale byte s with no subtraction,
// folded_e4m3_table(-base) and base + kFoldTableMinShift.
struct FoldedRows {
    uint32_t base[2], lo_at_zero[2], hi_at_zero[2], window_start[2];
    __device__ __forceinline__ void set(uint32_t first_scales_g, uint32_t first_scales_g8) {
        base[0] = first_scales_g & 0xFFu;
        base[1] = first_scales_g8 & 0xFFu;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            folded_e4m3_table(-(int)base[h], lo_at_zero[h], hi_at_zero[h]);
            window_start[h] = base[h] + (uint32_t)kFoldTableMinShift;   // mod 2^32, as the test below wants
        }
    }
    // Row g + 8h's block as folded E4M3 bytes (see fp4_word_to_folded_e4m3),
    // its scale byte being byte `block` (0-3) of four_scales, with no window
    // test (gemm_mainloop tests its rows' scale bytes apart).
    __device__ __forceinline__ uint2 fold(int h, uint32_t word, uint32_t four_scales, int block) const {
        // folded_e4m3_table(scale - base): linear in its shift.
        const uint32_t scale = byte_perm(four_scales, 0u, 0x4440u | block);
        return fp4_word_to_folded_e4m3(word, lo_at_zero[h] + scale * 0x08080800u, hi_at_zero[h] + scale * 0x08080808u);
    }
    // fold, with outside set when the block lies outside the fold's window
    // and its codes are not all zero (zero codes, as in K's zero-filled
    // tail, fold to zero at any shift).
    __device__ __forceinline__ uint2 fold_checked(int h, uint32_t word, uint32_t four_scales, int block,
                                                  bool& outside) const {
        const uint32_t scale = byte_perm(four_scales, 0u, 0x4440u | block);
        outside |= scale - window_start[h] > (uint32_t)(kFoldMaxShift - kFoldTableMinShift)
                   && (word & 0x77777777u) != 0u;
        return fold(h, word, four_scales, block);
    }
    // 2^(base - 127): row g + 8h's sums times it after K give their values.
    __device__ __forceinline__ float row_scale(int h) const { return exact_pow2((int)base[h] - 127); }
};

// Where a CTA's weight rows lie in a TMA map (see tensor_map): box i of a
// stage (kRows / boxes rows) from map row row + i * box_step, plus the row
// tile's offset; x0 the byte of K at the CTA's first scale block.
struct WeightBoxes {
    const TensorMap* map;
    int row, box_step, x0;
};
// The shared-memory row of local weight row r when a stage's weights are
// two TMA boxes of kRows / 2 rows (stage 1's gate rows, then its up rows):
// the local rows alternate 8 rows of box 0 and 8 of box 1.
__device__ __forceinline__ int gate_up_box_row(int r) {
    return ((r >> 3) & 1) * (kRows / 2) + (r >> 4) * 8 + (r & 7);
}
// kWeightBoxes > 0 (warpgroup-MMA configs): thread 0 loads each stage's
// weights with TMA, that many boxes (weights.map), instead of every thread's
// copies; with 2 boxes the local rows are gate_up_box_row's, while each box
// lands whole. kShuffledWeights: the map is a shuffled_weight_map and the
// stage's weights lie as shuffled_weight_offset says. kActTma (stage 2, a
// tile's activations consecutive rows of act): its activations too
// (act_map; a box's rows past the tile's are other tiles' rows, in token
// columns that no add reads). Weight scales, activation scales and stage
// 1's gathered activations stay cp.async. kRowTileLoop: the CTA may take
// several row tiles (stage 2 where S::kRowTiles); stage 1 takes one, and
// with the loop compiled in anyway ptxas kept its accumulator reset as a
// select of every accumulator in each stage (12 FSEL of the 24-token
// stage's 421).
template <typename S, int kRing, bool kMbarriers, ScalePath kPath, int kWeightBoxes, bool kShuffledWeights,
          bool kActTma, bool kFoldedBytes, bool kRowTileLoop, typename WeightRowOf, typename ActRowOf,
          typename TileDone>
__device__ __forceinline__ bool gemm_mainloop(
        float (&acc)[S::kMTiles][S::kWarpTiles][4], uint8_t* smem,
        const uint8_t* __restrict__ weight, const uint8_t* __restrict__ weight_scale, WeightRowOf weight_row_of,
        const uint8_t* __restrict__ act, const float* __restrict__ act_scale, ActRowOf act_row_of,
        WeightBoxes weights, const TensorMap* act_map, int k_padded, int k_blocks,
        int row_tiles, int row_tile_step, const float* token_factor, TileDone tile_done) {
    constexpr int MT = S::kMTiles, WT = S::kWarpTiles, SB = S::kStageBlocks;
    constexpr int kScaleCopy = SB < 8 ? SB : 8;   // scale rows are only 8-byte aligned
    constexpr uint32_t kNarrowLimit = S::kFp8 ? kFp8NarrowScale : 128u;   // scale bytes above it take kWide
    static_assert(!(kFoldedBytes || kPath == ScalePath::kFolded) || (S::kFp8 && kFoldedBytes),
                  "folded passes: e4m3 configs on folded bytes");
    static_assert((kPath != ScalePath::kTokenScaled && kPath != ScalePath::kVoteTokenScaled)
                  || (S::kFp8 && !kFoldedBytes), "the token-scaled pass: e4m3 configs on bytes in the per-block order");
    constexpr bool kVoting = kPath == ScalePath::kVote || kPath == ScalePath::kVoteTokenScaled;
    static_assert(kPath != ScalePath::kFolded || !kRowTileLoop, "kFolded's window test: one row tile");
    // The folded pass over 4 or more slots with a CTA barrier per stage (the
    // 24-token stage 1, which stage1_kernel keeps off mbarriers): a stage's
    // MMAs are left running, as the bf16 warpgroup MMAs' are (kAhead below),
    // instead of drained at its end (bs=512 E=257 0.986 of a call against
    // mbarriers over 3 slots, H100, 2026-12-05).
    constexpr bool kFoldedAsync = kPath == ScalePath::kFolded && !kMbarriers && kRing >= 4;
    // The passes that read the activations' block scales (the folded ones
    // apply the tokens' scales after K, in stage1_kernel).
    constexpr bool kActScales = kPath != ScalePath::kFolded && kPath != ScalePath::kTokenScaled;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int first_row = S::first_row(warp), first_tile = S::first_token(warp) / 8;
    const int tile_stages = (k_blocks + SB - 1) / SB;
    const int n_stages = tile_stages * row_tiles;
    smem = S::aligned_base(smem);
    const int scale_len = k_padded / kScaleBlock;
    static_assert(!kShuffledWeights || kWeightBoxes > 0, "shuffled weights: TMA boxes");
    auto weight_offset_of = [](int row, int chunk) {
        return kShuffledWeights ? shuffled_weight_offset<SB>(row, chunk) : S::weight_offset(row, chunk);
    };
    // Where copy j of this thread lands within a stage's weights and activations.
    auto weight_copy_offset = [&](int j) {
        return S::weight_offset(tid / SB + j * (S::kThreads / SB), tid % SB);
    };
    auto act_copy_offset = [&](int j) { return S::act_offset(S::act_copy_token(tid, j), S::act_copy_chunk(tid, j)); };

    // What this thread copies, fixed for the whole K: 16-byte chunk tid%SB of
    // weight rows tid/SB + j*kThreads/SB, the scales of weight row tid, and
    // its activation chunks (S::act_copy_token, S::act_copy_chunk). Sources
    // are kept as row starts and offset by the stage's first byte; a stage
    // costs one address add per copy and no validity test but in the tail.
    // Both stages' weight_row_of advance by a constant every kThreads/SB
    // local rows (a multiple of 16), so the weight rows are one pointer and
    // one stride, not a register pair each.
    static_assert(S::kThreads / SB % 16 == 0, "weight copy rows");
    const uint8_t* weight_src = weight + (size_t)weight_row_of(tid / SB) * (k_padded / 2) + (tid % SB) * 16;
    const int weight_src_stride = (weight_row_of(tid / SB + S::kThreads / SB) - weight_row_of(tid / SB))
                                * (k_padded / 2);
    const uint8_t* scale_src = weight_scale + (size_t)weight_row_of(tid % kRows) * scale_len;
    // Activation rows past the tile's end read nothing (zero-fill) from row 0.
    const uint8_t* act_src[S::kActChunks];
    int act_src_bytes[S::kActChunks];
    constexpr bool kEveryThreadCopiesActs = S::kActCopies % S::kThreads == 0;
#pragma unroll
    for (int j = 0; j < S::kActChunks; ++j) {
        const int token = S::act_copy_token(tid, j);
        const int row = kEveryThreadCopiesActs || token < S::kTokens ? act_row_of(token) : -1;
        act_src[j] = act + (size_t)(row >= 0 ? row : 0) * k_padded * S::kActValueBytes
                   + S::act_copy_chunk(tid, j) * 16;
        act_src_bytes[j] = row >= 0 ? 16 : 0;
    }
    // FP8: thread tid < kActScaleCopies copies kActScaleCopyBlocks activation
    // scales of one token (see kActScaleBytes).
    const int act_scale_token = S::act_scale_copy_token(tid), act_scale_block = S::act_scale_copy_block(tid);
    const int act_scale_row = tid < S::kActScaleCopies ? act_row_of(act_scale_token) : -1;
    // An element offset from act_scale, not a pointer: one register fewer for
    // the whole K (the 24- and 32-token configs sit at their register cap).
    // 32 bits hold any act_scale a GPU can: 2^32 scales are 2^37 activations.
    const uint32_t act_scale_src = (uint32_t)(act_scale_row >= 0 ? act_scale_row : 0) * scale_len
                                 + act_scale_block;
    const int act_scale_dst = S::kActScaleOffset + S::act_scale_index(act_scale_token, act_scale_block) * 4;

    auto zero_acc = [&] {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < WT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;
    };
    zero_acc();

    auto stage_base = [&](int slot) { return smem + slot * S::kStageBytes; };
    // Stages load in order; the next one starts at scale block first_block
    // of the row tile whose first weight row is tile_row rows down. Blocks
    // at or past k_blocks (the last stage's tail) are zero-filled: zero
    // weights, scales and activations add exact zeros, so every stage
    // computes the same branch-free code. kTail: the stage has such blocks,
    // and each copy tests its own (copy_stage is called with a constant
    // kTail, so the other stages' copies test nothing); copies of missing
    // blocks read nothing, from a valid address.
    // A stage's TMA bytes land on its slot's full barrier (the mbarrier
    // pipeline's, see below) or on tma_full[slot].
    constexpr bool kTma = kWeightBoxes > 0;
    static_assert(!kTma || S::kWgmma, "TMA stages: warpgroup-MMA configs");
    static_assert(!kActTma || kTma, "TMA activations: with TMA weights");
    static_assert(kWeightBoxes == 0 || kWeightBoxes == 1 || kWeightBoxes == 2, "weight boxes");
    __shared__ uint64_t full[kMbarriers ? kRing : 1], empty[kMbarriers ? kRing : 1];
    __shared__ uint64_t tma_full[kTma && !kMbarriers ? kRing : 1];
    auto stage_tma_barrier = [&](int slot) { return kMbarriers ? &full[slot] : &tma_full[slot]; };
    int first_block = 0, tile_row = 0;
    auto copy_stage = [&](const bool kTail, int slot, int blocks) {
        uint8_t* base = stage_base(slot);
        const size_t weight_offset = (size_t)tile_row * (k_padded / 2) + first_block * 16;
        const size_t scale_offset = (size_t)tile_row * scale_len + first_block;
        const bool weight_valid = !kTail || tid % SB < blocks;
        if constexpr (kTma) {
            // Whole boxes even in the tail: the maps read past the GEMM's K
            // as zero. (A K slice of stage 1 other than the last has whole
            // stages.) The mbarrier pipeline's full barrier counts every
            // thread's arrival already: its bytes come without one.
            if (tid == 0) {
                uint64_t* barrier = stage_tma_barrier(slot);
                const uint32_t bytes = S::kWeightBytes + (kActTma ? S::kActBytes : 0);
                if constexpr (kMbarriers)
                    mbarrier_expect_bytes(barrier, bytes);
                else
                    mbarrier_arrive_expecting(barrier, bytes);
#pragma unroll
                for (int i = 0; i < kWeightBoxes; ++i) {
                    uint8_t* box = base + S::kWeightOffset + i * (kRows / kWeightBoxes) * S::kWeightStride;
                    const int row = weights.row + i * weights.box_step + tile_row;
                    if constexpr (kShuffledWeights)
                        tma_load_3d(box, weights.map, 0, weights.x0 / 16 + first_block, row / 16, barrier);
                    else
                        tma_load_2d(box, weights.map, weights.x0 + first_block * 16, row, barrier);
                }
                if constexpr (kActTma)
#pragma unroll
                    for (int h = 0; h < SB * kScaleBlock * S::kActValueBytes / 128; ++h)
                        tma_load_2d(base + S::kActOffset + h * (S::kTokens * 128), act_map,
                                    first_block * kScaleBlock * S::kActValueBytes + h * 128, act_row_of(0), barrier);
            }
        } else {
#pragma unroll
            for (int j = 0; j < S::kWeightChunks; ++j)
                cp_async_16(base + S::kWeightOffset + weight_copy_offset(j),
                            weight_valid ? weight_src + j * weight_src_stride + weight_offset : weight,
                            weight_valid ? 16 : 0);
        }
        if (tid < kRows)
#pragma unroll
            for (int c = 0; c < SB; c += kScaleCopy) {
                const int valid_bytes = kTail ? max(0, min(kScaleCopy, blocks - c)) : kScaleCopy;
                cp_async_small<kScaleCopy>(base + S::kScaleOffset + tid * SB + c,
                                           valid_bytes > 0 ? scale_src + scale_offset + c : weight_scale,
                                           valid_bytes);
            }
        constexpr int kChunksPerBlock = kScaleBlock * S::kActValueBytes / 16;
        if constexpr (!kActTma) {
#pragma unroll
            for (int j = 0; j < S::kActChunks; ++j)
                if (kEveryThreadCopiesActs || tid + j * S::kThreads < S::kActCopies) {
                    const bool valid = !kTail || S::act_copy_chunk(tid, j) / kChunksPerBlock < blocks;
                    cp_async_16(base + S::kActOffset + act_copy_offset(j),
                                valid ? act_src[j] + first_block * (kScaleBlock * S::kActValueBytes) : act,
                                valid ? act_src_bytes[j] : 0);
                }
        }
        if (kActScales && S::kActScaleCopies > 0 && tid < S::kActScaleCopies) {
            constexpr int kCopyBlocks = S::kActScaleCopyBlocks;
            const int valid_blocks = kTail ? min(kCopyBlocks, max(0, blocks - act_scale_block))
                                           : kCopyBlocks;
            const bool valid = act_scale_row >= 0 && valid_blocks > 0;
            uint8_t* dst = base + act_scale_dst;
            const float* src = act_scale + (valid ? act_scale_src + first_block : 0);
            if constexpr (kCopyBlocks == 1)
                cp_async_small<4>(dst, src, valid ? 4 : 0);
            else
                cp_async_16(dst, src, valid ? 4 * valid_blocks : 0);
        }
    };
    auto load_stage = [&](int slot) {
        const int blocks = k_blocks - first_block;   // CTA-uniform; at least SB but in the tail
        if (blocks >= SB)
            copy_stage(false, slot, blocks);
        else
            copy_stage(true, slot, blocks);
        first_block += SB;
        if (first_block >= k_blocks) {
            first_block = 0;
            tile_row += row_tile_step;
        }
    };

    // Shared-memory fragments are loaded ahead of their use, so that their
    // latency hides behind other work: a stage's scale words and its first
    // block pair's weight words before the next stage's copies are issued
    // (load_stage_fragments), each later pair's words while the pair before
    // it is converted. (ldmatrix is asm volatile: it stays where it is written.)
    uint32_t scales[MT][2][SB / 4];
    // kNarrowChecked, kTokenScaled: set by any thread that loaded a scale
    // byte above its limit (shared memory, not a register live across K: the
    // 32-token stage 1 is at its register cap); kFolded: at the end, by any
    // thread whose row_outside (below) is set or one of whose rows' first
    // scale byte is above kFp8NarrowScale.
    __shared__ int saw_wide_scale;
    // kFolded: the threads test each stage's scale bytes, row by row,
    // against each row's window (row_window: its start in each byte, from
    // the row's first block), thread tid a share of local weight row tid %
    // kRows (kRowCheckWords of its SB / 4 scale words), ORing the bytes
    // found outside into row_outside: the test per converted word, in every
    // thread of the quad that shares the row, took 2.5 of each word's 15
    // instructions, and the NaN test of four scale words 12 a stage, in the
    // 24-token stage 1's 405 a stage. So a block of zero codes outside the
    // window, which would fold to zero at any shift, sends the CTA to the
    // per-block pass too, K's zero-filled tail aside.
    constexpr int kRowCheckWords = SB / 4 / (S::kThreads / kRows);   // (GemmShape: kThreads >= kRows)
    static_assert(kPath != ScalePath::kFolded || (S::kThreads % kRows == 0 && kRowCheckWords >= 1
                  && kRowCheckWords * (S::kThreads / kRows) == SB / 4), "kFolded's window test: each word once");
    uint32_t row_window = 0, row_outside = 0;
    constexpr bool kChecked = kPath == ScalePath::kNarrowChecked || kPath == ScalePath::kTokenScaled
                           || kPath == ScalePath::kFolded;
    if (kChecked && tid == 0) saw_wide_scale = 0;   // before the first stage's barrier
    // The shared-memory row of local weight row r (two TMA boxes: see kWeightBoxes).
    auto weight_smem_row = [](int r) {
        return kWeightBoxes == 2 ? gate_up_box_row(r) : r;
    };
    uint32_t w[MT][4];   // per m-tile: word t of rows g and g+8 of the current block pair
    auto load_weight_words = [&](uint32_t (&words)[MT][4], const uint8_t* w_s, int bp) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            ldmatrix_x4(words[mt], w_s + weight_offset_of(weight_smem_row(first_row + mt * S::kMTileStride
                                                                            + (lane & 15)), bp + (lane >> 4)));
    };
    auto load_stage_fragments = [&](int slot, int s) {
        const uint8_t* ws_s = stage_base(slot) + S::kScaleOffset;
        const int g = lane >> 2;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int i = 0; i < SB / 4; ++i)
                    scales[mt][h][i] = *reinterpret_cast<const uint32_t*>(
                        ws_s + (first_row + mt * S::kMTileStride + g + 8 * h) * SB + 4 * i);
        // The checked passes' scale test (the warps' rows g, g+8 cover all of
        // the CTA's): kNarrowChecked, any byte above kNarrowLimit;
        // kTokenScaled, above kTokenScaledNarrowScale.
        if constexpr (kPath == ScalePath::kNarrowChecked || kPath == ScalePath::kTokenScaled) {
            constexpr uint32_t kLimit = kPath == ScalePath::kTokenScaled ? kTokenScaledNarrowScale : kNarrowLimit;
            uint32_t above = 0;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int i = 0; i < SB / 4; ++i) above |= scale_bytes_above(scales[mt][h][i], kLimit);
            if ((above & 0x80808080u) != 0u) saw_wide_scale = 1;
        }
        // kFolded: this thread's share of row tid % kRows's window test. A
        // window that would start below 0 (a first scale byte under 5) is
        // not tested: the row goes to the per-block pass. Bytes past K's
        // last block (zero-filled) are tested as the window's start. (Stage
        // 1 has one row tile: stage s starts at block s * SB of the CTA's
        // slice.)
        if constexpr (kPath == ScalePath::kFolded) {
            const uint8_t* row_scales = ws_s + (tid % kRows) * SB;
            if (s == 0) {
                const int start = (int)row_scales[0] + kFoldTableMinShift;
                row_window = (uint32_t)start * 0x01010101u;
                if (start < 0) row_outside = 0x80u;
            }
            const int valid = k_blocks - s * SB;
#pragma unroll
            for (int j = 0; j < kRowCheckWords; ++j) {
                const int i = tid / kRows * kRowCheckWords + j;   // the row's scale word i
                uint32_t word = *reinterpret_cast<const uint32_t*>(row_scales + 4 * i);
                if (valid < SB) {   // the tail stage (CTA-uniform)
                    const int bytes = min(max(valid - 4 * i, 0), 4);
                    const uint32_t kept = bytes == 4 ? 0xFFFFFFFFu : (1u << (8 * bytes)) - 1u;
                    word = (word & kept) | (row_window & ~kept);
                }
                row_outside |= scale_bytes_outside_window(word, row_window);
            }
        }
        load_weight_words(w, stage_base(slot) + S::kWeightOffset, 0);
    };
    // A stage's SB blocks, with its scale bytes of rows g and g+8 of each
    // m-tile. kWide: some weight scale is above 128, so every block takes
    // both multipliers (see weight_multiplier_low). Called with a constant
    // kWide, so each call inlines its own straight-line code.
    auto compute_blocks = [&](const bool kWide, const uint8_t* w_s, const uint8_t* a_s) {
        const uint32_t act_descriptor = S::kWgmma ? wgmma_descriptor_low(a_s) : 0u;
#pragma unroll
        for (int bp = 0; bp < SB; bp += 2) {
            uint32_t next[MT][4];
            if (bp + 2 < SB) load_weight_words(next, w_s, bp + 2);
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const int block = bp + q;
                // A fragments of both k16 steps of the block: [m-tile][step][reg].
                uint32_t a[MT][2][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        bf16_fragment_half(a[mt], h, w[mt][2 * q + h], scales[mt][h][block / 4], block % 4, kWide);
                if constexpr (S::kAsyncStages) {   // bf16 warpgroup MMAs
                    // Both k16 steps of the block on the warpgroup, then wait
                    // only for the previous block's: converting the next block
                    // overlaps this one's MMAs.
                    wgmma_fence();
#pragma unroll
                    for (int s = 0; s < 2; ++s)
                        wgmma_m64n64k16(acc[0], a[0][s], act_descriptor + S::act_offset(0, block * 4 + 2 * s) / 16, 1u);
                    wgmma_commit();
                    wgmma_wait<1>();
                } else {
#pragma unroll
                    for (int nt = 0; nt < WT; ++nt) {
                        // The block's 32 k of this n-tile's 8 tokens: regs (0,1) step 0, (2,3) step 1.
                        uint32_t b[4];
                        ldmatrix_x4(b, a_s + ((first_tile + nt) * 8 + (lane & 7)) * S::kActStride
                                         + block * kScaleBlock * 2 + (lane >> 3) * 16);
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                            for (int s = 0; s < 2; ++s)
                                mma_bf16(acc[mt][nt], a[mt][s][0], a[mt][s][1], a[mt][s][2], a[mt][s][3],
                                         b[2 * s], b[2 * s + 1]);
                    }
                }
            }
            if (bp + 2 < SB)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) w[mt][i] = next[mt][i];
        }
    };

    // FP8: a stage's SB blocks as e4m3 warpgroup MMAs, each block's fresh
    // sum P (of products carrying 2^-12) added into acc as
    // P * 2^12 * weight scale * activation scale. Block b's MMAs run while
    // block b+1 converts; its sum is added after the next block's MMAs are
    // issued (more blocks in flight measured no faster, and cost stage 2
    // registers). Narrow (every weight scale byte of the stage at most
    // kFp8NarrowScale): P * 2^(s-115) is exact (a multiple of 2^(s-129)
    // below 2^(s-116)), so one fma with the activation scale rounds once.
    // kWide: the exponent sum c, split into two factors that cannot
    // overflow, the first applied exactly; scale byte 255 is NaN. (Generic
    // in wide, a std::bool_constant, so that only FP8 configs compile it.)
    // kTokenScaled (and kVoteTokenScaled's narrow stages): the activations are folded bytes, each
    // row's blocks against its own base (stage 1: quantize_hidden_row_folded
    // in the per-block order; stage 2: fold_inter_codes_kernel's rows), so
    // P * 2^(s - 121) alone, one fma with no activation factor: the rows'
    // 2^base multiply the sums afterwards (stage1_kernel after K,
    // compute_stage after a stage-2 row tile's only stage).
    auto compute_blocks_fp8 = [&](auto wide, const uint8_t* w_s, const uint8_t* a_s, const float* a_scale_s) {
        constexpr bool kWide = decltype(wide)::value;
        constexpr bool kTokenScaled = !kWide && (kPath == ScalePath::kTokenScaled
                                                 || kPath == ScalePath::kVoteTokenScaled);
        const int t = lane & 3;
        const uint32_t act_descriptor = wgmma_descriptor_low(a_s);
        float sums[2][MT][WT][4];   // block b's in sums[b % 2]
        auto add_block = [&](int block, float (&sum)[MT][WT][4]) {
            float act_factor[WT][2];   // tokens 2t and 2t+1 of each n-tile (none for kTokenScaled)
#pragma unroll
            for (int nt = 0; nt < (kTokenScaled ? 0 : WT); ++nt) {
                if constexpr (S::kActScalesBlockMajor) {
                    const float2 pair =
                        reinterpret_cast<const float2*>(a_scale_s)[S::act_scale_index(nt * 8 + 2 * t, block) / 2];
                    act_factor[nt][0] = pair.x;
                    act_factor[nt][1] = pair.y;
                } else {
#pragma unroll
                    for (int j = 0; j < 2; ++j)
                        act_factor[nt][j] = a_scale_s[S::act_scale_index(nt * 8 + 2 * t + j, block)];
                }
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float weight_factor[2];
                uint32_t weight_byte[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint32_t s4 = scales[mt][h][block / 4];
                    weight_byte[h] = (s4 >> (8 * (block % 4))) & 0xFFu;
                    // 2^(s - 115): exponent field s + 12 (kTokenScaled: 2^(s - 121), s + 6)
                    constexpr uint32_t kFieldOffset = kTokenScaled ? 0x06060606u : 0x0C0C0C0Cu;
                    if (!kWide)
                        weight_factor[h] = bits_to_float(byte_perm(s4 + kFieldOffset, 0u, 0x4044u | (block % 4) << 8)
                                                         << 7);
                }
#pragma unroll
                for (int nt = 0; nt < WT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        pin_register(sum[mt][nt][i]);
                        if (kTokenScaled) {
                            acc[mt][nt][i] = fmaf(sum[mt][nt][i], weight_factor[i >> 1], acc[mt][nt][i]);
                        } else if (!kWide) {
                            acc[mt][nt][i] = fmaf(sum[mt][nt][i] * weight_factor[i >> 1], act_factor[nt][i & 1],
                                                  acc[mt][nt][i]);
                        } else {
                            // act_factor = 2^(field - 127), 2^-127 having field 0 too.
                            const int c = (int)weight_byte[i >> 1] + (int)(float_to_bits(act_factor[nt][i & 1]) >> 23)
                                        - 242;
                            const int c1 = min(max(c, -126), 127), c2 = min(c - c1, 127);
                            const float f1 = weight_byte[i >> 1] == 255u ? __int_as_float(0x7FC00000)
                                                                         : bits_to_float((uint32_t)(c1 + 127) << 23);
                            acc[mt][nt][i] = fmaf(sum[mt][nt][i] * f1, bits_to_float((uint32_t)(c2 + 127) << 23),
                                                  acc[mt][nt][i]);
                        }
                    }
            }
        };
#pragma unroll
        for (int bp = 0; bp < SB; bp += 2) {
            uint32_t next[MT][4];
            if (bp + 2 < SB) load_weight_words(next, w_s, bp + 2);
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const int block = bp + q;
                // Every m-tile's A registers written before the fence: one
                // written after it makes ptxas add a warpgroup.arrive (C7519).
                uint32_t a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    if constexpr (kFoldedBytes) {
                        // Rows g and g+8: values 0-3 of both, then values 4-7 of both.
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const uint2 bytes = fp4_word_to_folded_e4m3(w[mt][2 * q + h], kE4m3CodesLo, kE4m3CodesHi);
                            a[mt][h] = bytes.x;
                            a[mt][2 + h] = bytes.y;
                        }
                    } else {
                        // Rows g and g+8: even values of both, then odd values of both.
                        a[mt][0] = fp4_even_to_e4m3(w[mt][2 * q]);
                        a[mt][1] = fp4_even_to_e4m3(w[mt][2 * q + 1]);
                        a[mt][2] = fp4_odd_to_e4m3(w[mt][2 * q]);
                        a[mt][3] = fp4_odd_to_e4m3(w[mt][2 * q + 1]);
                    }
                }
                wgmma_fence();
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    wgmma_e4m3<WT>(sums[q][mt], a[mt], act_descriptor + S::act_offset(0, 2 * block) / 16);
                wgmma_commit();
                if (block > 0) {
                    wgmma_wait<1>();
                    add_block(block - 1, sums[q ^ 1]);
                }
            }
            if (bp + 2 < SB)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) w[mt][i] = next[mt][i];
        }
        wgmma_wait<0>();
        add_block(SB - 1, sums[1]);
    };

    // kFolded: a stage's SB blocks as one e4m3 MMA each, adding into acc, on
    // weight bytes folded against each of the thread's rows' first block of
    // K (folded_rows, set at the first stage) and activation bytes folded
    // against their token's base (quantize_hidden_row_folded). After K the
    // sums are multiplied by 2^(base - 127) here and by the tokens' scales
    // in stage1_kernel. Block b + 1 converts while block b's MMAs run.
    FoldedRows folded_rows[MT];
    // (Generic, as compute_blocks_fp8, so that only kFolded configs compile it.)
    auto compute_blocks_folded = [&](auto first_stage, const uint8_t* w_s, const uint8_t* a_s) {
        const uint32_t act_descriptor = wgmma_descriptor_low(a_s);
        if (first_stage)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) folded_rows[mt].set(scales[mt][0][0], scales[mt][1][0]);
#pragma unroll
        for (int bp = 0; bp < SB; bp += 2) {
            uint32_t next[MT][4];
            if (bp + 2 < SB) load_weight_words(next, w_s, bp + 2);
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const int block = bp + q;
                uint32_t a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const uint2 bytes = folded_rows[mt].fold(h, w[mt][2 * q + h], scales[mt][h][block / 4],
                                                                 block % 4);
                        a[mt][h] = bytes.x;       // k 4t..4t+3 of row g + 8h
                        a[mt][2 + h] = bytes.y;   // k 16+4t..16+4t+3
                    }
                wgmma_fence();
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    wgmma_e4m3_mma<WT * 8>(acc[mt], a[mt], act_descriptor + S::act_offset(0, 2 * block) / 16, 1u);
                wgmma_commit();
                wgmma_wait<1>();   // the block before's A registers are free again
            }
            if (bp + 2 < SB)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) w[mt][i] = next[mt][i];
        }
        if constexpr (!kFoldedAsync)
            wgmma_wait<0>();   // the stage's slot is refilled once every thread has computed it
    };

    auto compute_stage = [&](int slot, bool wide, bool first_stage) {
        const uint8_t* w_s = stage_base(slot) + S::kWeightOffset;
        const uint8_t* a_s = stage_base(slot) + S::kActOffset;
        if constexpr (kPath == ScalePath::kFolded) {
            compute_blocks_folded(first_stage, w_s, a_s);
        } else if constexpr (kPath == ScalePath::kTokenScaled) {
            compute_blocks_fp8(std::false_type(), w_s, a_s, nullptr);
        } else if constexpr (kPath == ScalePath::kVoteTokenScaled) {
            const float* a_scale_s = reinterpret_cast<const float*>(stage_base(slot) + S::kActScaleOffset);
            if (wide) {
                compute_blocks_fp8(std::true_type(), w_s, a_s, a_scale_s);
            } else {
                compute_blocks_fp8(std::false_type(), w_s, a_s, a_scale_s);
                // The row tile's only stage: its sums into true units.
                const float* factor = token_factor + S::first_token(warp) + 2 * (lane & 3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < WT; ++nt)
#pragma unroll
                        for (int i = 0; i < 4; ++i) acc[mt][nt][i] *= factor[nt * 8 + (i & 1)];
            }
        } else if constexpr (S::kFp8) {
            const float* a_scale_s = reinterpret_cast<const float*>(stage_base(slot) + S::kActScaleOffset);
            if (wide)
                compute_blocks_fp8(std::true_type(), w_s, a_s, a_scale_s);
            else
                compute_blocks_fp8(std::false_type(), w_s, a_s, a_scale_s);
        } else {
            if (wide)
                compute_blocks(true, w_s, a_s);
            else
                compute_blocks(false, w_s, a_s);
        }
    };

    // A cp.async pipeline over a ring of kRing slots (stage 1: kStages;
    // stage 2: kStage2Ring), kAhead stages loading while one is computed.
    // With a CTA barrier per stage, the slot refilled after the barrier of
    // stage s is that of stage s + kAhead - kRing. mma.sync and e4m3
    // warpgroup MMAs finished with it before the barrier (kAhead = kRing -
    // 1: the previous stage). bf16 warpgroup MMAs are left running: they
    // refill the stage before the previous one (kAhead = kRing - 2), which
    // each warp's first wgmma_wait<1> of stage s - 1 has seen complete, so
    // the tensor cores never drain at a stage's end.
    // kMbarriers (e4m3 stage 1 of 4 or more stages): no CTA barrier. A
    // slot's "full" barrier completes when every thread's copies into it have
    // landed, its "empty" barrier when every thread has computed it; a thread
    // refills a slot after its empty barrier, so with kAhead = kRing - 2 warps
    // may drift a stage apart instead of meeting at every stage.
    // When K has fewer stages than kRing, the prologue loads all of them and
    // no slot beyond n_stages is touched, so shared_bytes() may allocate just
    // n_stages slots.
    static_assert(kRing <= S::kStages, "pipeline ring");
    static_assert(!kMbarriers || (S::kFp8 && kRing > 2), "mbarrier pipeline: e4m3 configs, 3 or more slots");
    constexpr int kAhead = S::kAsyncStages || kMbarriers || kFoldedAsync ? kRing - 2 : kRing - 1;
    static_assert(kAhead >= 1, "pipeline depth");
    if constexpr (kMbarriers || kTma) {
        if (tid == 0)
            for (int j = 0; j < kRing; ++j) {
                if constexpr (kMbarriers) {
                    mbarrier_init(&full[j], S::kThreads);
                    mbarrier_init(&empty[j], S::kThreads);
                } else {
                    mbarrier_init(&tma_full[j], 1);
                }
            }
        fence_mbarrier_init();
        __syncthreads();
    }
#pragma unroll 1   // unrolled, it pushed stage-2 kernels at their register caps into spills
    for (int s = 0; s < kAhead; ++s) {
        if constexpr (kMbarriers) {
            if (s < n_stages) {
                load_stage(s);
                cp_async_arrive(&full[s]);
            }
        } else {
            if (s < n_stages) load_stage(s);
            cp_async_commit();
        }
    }
    int tile = 0, stage_in_tile = 0;
    for (int s = 0; s < n_stages; ++s) {
        if constexpr (kMbarriers)
            mbarrier_wait(&full[s % kRing], (s / kRing) & 1);
        else
            cp_async_wait<kAhead - 1>();
        if constexpr (kTma && !kMbarriers) mbarrier_wait(&tma_full[s % kRing], (s / kRing) & 1);
        if constexpr (S::kWgmma && !kActTma) fence_async_shared();   // activations copied by cp.async
        // kVote: whether any of the stage's weight scales is above
        // kNarrowLimit: the slower exact path. (Otherwise the path is fixed,
        // and only the stage's barrier is left.) The whole CTA takes one
        // path (a warpgroup's MMAs must be the same instructions in all of its
        // warps): thread r < kRows copied row r's scales, so it may read them
        // before the barrier, which ORs the answers.
        static_assert(!kVoting || !kMbarriers, "the vote ORs over a CTA barrier");
        bool wide = kPath == ScalePath::kWide;
        if constexpr (!kVoting) {
            if constexpr (!kMbarriers) __syncthreads();
        } else {
            constexpr uint32_t kLimit = kPath == ScalePath::kVoteTokenScaled ? kTokenScaledNarrowScale : kNarrowLimit;
            if (tid < kRows)
#pragma unroll
                for (int i = 0; i < SB / 4; ++i) {
                    const uint32_t four_scales = *reinterpret_cast<const uint32_t*>(
                        stage_base(s % kRing) + S::kScaleOffset + tid * SB + 4 * i);
                    wide |= any_scale_above(four_scales, kLimit);
                }
            // kVoteTokenScaled: a row that did not fold (its factor came
            // with the first stage's copies), or a row tile of several
            // stages (its sums would need the factor per stage).
            if constexpr (kPath == ScalePath::kVoteTokenScaled)
                wide |= tile_stages > 1 || (tid < S::kTokens && act_row_of(tid) >= 0 && isnan(token_factor[tid]));
            // __any_sync of the CTA-wide answer: ptxas then knows the
            // branch on it is warp-uniform. Otherwise, with two m64 tiles
            // per warpgroup, it serialises every wgmma of the kernel
            // (ptxas C7520).
            wide = __any_sync(0xFFFFFFFFu, __syncthreads_or(wide));
        }
        load_stage_fragments(s % kRing, s);
        const int next = s + kAhead;
        if constexpr (kMbarriers) {
            if (next < n_stages) {
                if (next >= kRing) mbarrier_wait(&empty[next % kRing], (next / kRing - 1) & 1);
                load_stage(next % kRing);
                cp_async_arrive(&full[next % kRing]);
            }
        } else {
            if (next < n_stages) load_stage(next % kRing);
            cp_async_commit();
        }
        compute_stage(s % kRing, wide, s == 0);
        if constexpr (kMbarriers) mbarrier_arrive(&empty[s % kRing]);   // compute_blocks_fp8 waited for its MMAs
        if constexpr (kRowTileLoop)
            if (++stage_in_tile == tile_stages && s + 1 < n_stages) {   // a row tile done, and more to come
                tile_done(acc, tile++);
                zero_acc();
                stage_in_tile = 0;
            }
    }
    if constexpr (S::kWgmma) wgmma_wait<0>();   // the accumulators, and shared memory for the epilogue
    if constexpr (kPath == ScalePath::kFolded) {
        // A first scale byte above kFp8NarrowScale (a bound stricter than
        // kFoldMaxFirstScale, above which the window would reach 255, NaN):
        // K again per block.
        bool per_block = row_outside != 0u;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) per_block |= folded_rows[mt].base[h] > kFp8NarrowScale;
        if (per_block) saw_wide_scale = 1;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < WT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    pin_register(acc[mt][nt][i]);
                    acc[mt][nt][i] *= folded_rows[mt].row_scale(i >> 1);   // one per row, after CSE
                }
    }
    cp_async_wait<0>();
    __syncthreads();
    // __any_sync: warp-uniform to ptxas (see the vote above).
    return kChecked && __any_sync(0xFFFFFFFFu, saw_wide_scale != 0);
}

}  // namespace moe
"""

# ===========================================================================
# Kernel source: stage 1 (Qa of the hidden states; gate/up GEMM + SwiGLU + Qa)
# ===========================================================================
STAGE1_SOURCE = r"""
namespace moe {

// Qa's eight values of a token's hidden row from column k (zero past
// d_hidden, and everywhere if !active), as one 16-byte load where aligned,
// and their block's largest magnitude and NaN flag: the block's four
// threads are lanes 4j..4j+3 of one warp, all of which must call this.
__device__ __forceinline__ void load_hidden_eighth(const __nv_bfloat16* __restrict__ hidden, int d_hidden,
                                                   int token, int k, bool active, float (&v)[8], float& amax,
                                                   bool& has_nan) {
    const __nv_bfloat16* src = hidden + (size_t)token * d_hidden + k;
    if (active && k + 8 <= d_hidden && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
        const uint4 raw = *reinterpret_cast<const uint4*>(src);
        __nv_bfloat16 h[8];
        memcpy(h, &raw, sizeof raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __bfloat162float(h[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = active && k + i < d_hidden ? __bfloat162float(src[i]) : 0.0f;
    }
    amax = 0.0f;
    has_nan = false;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        amax = fmaxf(amax, fabsf(v[i]));
        has_nan |= isnan(v[i]);
    }
#pragma unroll
    for (int offset = 1; offset < 4; offset <<= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        has_nan |= __shfl_xor_sync(0xffffffffu, (int)has_nan, offset) != 0;
    }
}

// Qa's dequantised bf16 values of columns k..k+7 of a token (a quarter of a
// block of exponent e) into act's rows of d_hidden_pad values: values 8q+i
// and 8q+i+4 of the block (q = the quarter) are neighbours in act_position
// order, at 8i + 2q: one 4-byte store per pair.
__device__ __forceinline__ void store_qa_bf16(uint8_t* __restrict__ act, int d_hidden_pad, int token, int k,
                                              const float (&v)[8], int e, bool has_nan) {
    const int quad = (k / 8) & 3;
    __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(act) + (size_t)token * d_hidden_pad + (k - quad * 8);
    const float nan = __int_as_float(0x7FC00000);
#pragma unroll
    for (int i = 0; i < 4; ++i)
        *reinterpret_cast<__nv_bfloat162*>(dst + act_position(8 * quad + i)) =
            has_nan ? __floats2bfloat162_rn(nan, nan)
                    : __floats2bfloat162_rn(qa_value(v[i], e), qa_value(v[i + 4], e));
}

// Columns k..k+7 of a token's row of the fp32 accumulator that stage 2 adds
// into, zeroed by the first kernel's Qa thread that reads those columns.
__device__ __forceinline__ void zero_accumulator_eighth(float* __restrict__ accumulator, int d_hidden_pad, int token,
                                                        int k) {
    float4* zero = reinterpret_cast<float4*>(accumulator + (size_t)token * d_hidden_pad + k);
    zero[0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    zero[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// Qa of the hidden states into the GEMMs' activation format (bf16 values, or
// kFp8: E4M3 codes and fp32 block scales), and zeroing of the fp32
// accumulator that stage 2 adds into: columns k..k+7 of one token, by one
// thread. Four threads (lanes 4j..4j+3 of a warp) share a 32-value block,
// eight values each (one 16-byte load), so that whole sectors move.
template <bool kFp8>
__device__ __forceinline__ void quantize_hidden_columns(
        const __nv_bfloat16* __restrict__ hidden, int d_hidden, int d_hidden_pad,
        uint8_t* __restrict__ act, float* __restrict__ act_scale, float* __restrict__ accumulator,
        int token, int k) {
    const int quad = threadIdx.x & 3;
    if (k >= d_hidden_pad) return;   // whole blocks: d_hidden_pad is a multiple of 32
    float v[8], amax;
    bool has_nan;
    load_hidden_eighth(hidden, d_hidden, token, k, true, v, amax, has_nan);
    const int e = qa_exponent(amax);
    if (kFp8) {
        // The quad's even values are k 4q..4q+3 of fp8_act_position, its odd
        // ones k 16+4q..: one 4-byte store each.
        uint32_t even = 0, odd = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            even |= (has_nan ? kE4m3Nan : e2m1_to_e4m3(qa_code(v[2 * j], e))) << (8 * j);
            odd |= (has_nan ? kE4m3Nan : e2m1_to_e4m3(qa_code(v[2 * j + 1], e))) << (8 * j);
        }
        uint8_t* block = act + (size_t)token * d_hidden_pad + (k - quad * 8);
        *reinterpret_cast<uint32_t*>(block + 4 * quad) = even;
        *reinterpret_cast<uint32_t*>(block + 16 + 4 * quad) = odd;
        if (quad == 0) act_scale[(size_t)token * (d_hidden_pad / kScaleBlock) + k / kScaleBlock] = exact_pow2(e);
    } else {
        store_qa_bf16(act, d_hidden_pad, token, k, v, e, has_nan);
    }
    zero_accumulator_eighth(accumulator, d_hidden_pad, token, k);
}

// Qa of one token's whole row (one CTA: d_hidden_pad <= kPrepareColumns) for
// the wide stage 1's e4m3 path: the row's base b is its largest block
// exponent less 6 (so the largest block's bytes reach 384), each value goes
// to act as the E4M3 byte of its E2M1 code times 2^(e - b) at
// folded_act_position, and token_scale[token] = 2^b. A block more than 14
// binades below the row's largest has no exact bytes: its token's scale is
// NaN, which sends the call's stage 1 to the bf16 wide kernel (see
// launch_wide_stage1), which reads bf16 rows that folded_fallback_kernel
// writes only then.
// block_scale (the e4m3 plain stage 1's folded form; null for the wide
// one): each block's scale for stage1_kernel's per-block pass (kWide) over
// the same bytes: 2^(b - 6), as that pass reads E2M1 codes as E4M3 bytes
// of 2^-6 times their value. A token that does not fold (also: 2^(b - 6)
// not a normal float) gets those codes instead, at folded_act_position,
// with block scales 2^e. kPerBlockOrder (the 8-token e4m3 stage 1, whose
// weights keep the per-block conversion): the same bytes at
// fp8_act_position (folded_to_per_block_order).
template <bool kPerBlockOrder>
__device__ __forceinline__ void quantize_hidden_row_folded(
        const __nv_bfloat16* __restrict__ hidden, int d_hidden, int d_hidden_pad, uint8_t* __restrict__ act,
        float* __restrict__ token_scale, float* __restrict__ block_scale, float* __restrict__ accumulator,
        int token) {
    __shared__ int row_max, row_min;
    const int quad = threadIdx.x & 3, k = threadIdx.x * 8;
    const bool active = k < d_hidden_pad;   // whole quads: d_hidden_pad is a multiple of 32
    float v[8], amax;
    bool has_nan;
    load_hidden_eighth(hidden, d_hidden, token, k, active, v, amax, has_nan);
    const int e = qa_exponent(amax);
    // The row's largest and smallest exponents of its nonzero blocks: each
    // warp's first (a quad already agrees), then one shared atomic of each
    // per warp (one per block, 224 on one word at d_hidden 7168: the kernel
    // took 20.5 us at bs=512 E=257 so, 17.4 so, the unfolded Qa 13.6; H200,
    // 2026-12-02).
    const bool nonzero = active && amax > 0.0f;
    const int largest = warp_max(nonzero ? e : -128), smallest = warp_min(nonzero ? e : 128);
    if (threadIdx.x == 0) {
        row_max = -128;
        row_min = 128;
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) {
        atomicMax(&row_max, largest);
        atomicMin(&row_min, smallest);
    }
    __syncthreads();
    const int base = row_max - kFoldMaxShift, d = e - base;
    const bool unfoldable = row_min - base < kFoldMinShift
                         || (block_scale != nullptr && row_max > -128 && base - 6 < -126);
    if (threadIdx.x == 0) token_scale[token] = unfoldable ? __int_as_float(0x7FC00000) : exact_pow2(base);
    if (!active) return;
    const bool codes = block_scale != nullptr && unfoldable;
    if (block_scale != nullptr && quad == 0)
        block_scale[(size_t)token * (d_hidden_pad / kScaleBlock) + k / kScaleBlock] =
            exact_pow2(codes ? e : base - 6);
    // The eight codes as one word for fp4_word_to_folded_e4m3, whose bytes
    // .x (values 0-3) and .y (4-7) are this thread's k 4q..4q+3 and
    // 16+4q..16+4q+3; a block 12 to 14 binades below the row's largest
    // (subnormal bytes, beyond the table) value by value.
    uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) word |= qa_code(v[i], e) << (4 * i);
    uint2 bytes;
    if (codes) {
        bytes = fp4_word_to_folded_e4m3(word, kE4m3CodesLo, kE4m3CodesHi);
    } else if (d >= kFoldTableMinShift) {
        uint32_t lo, hi;
        folded_e4m3_table(d, lo, hi);
        bytes = fp4_word_to_folded_e4m3(word, lo, hi);
    } else {
        bytes = make_uint2(0u, 0u);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            bytes.x |= e2m1_to_e4m3_shifted(word >> (4 * i) & 15u, d) << (8 * i);
            bytes.y |= e2m1_to_e4m3_shifted(word >> (4 * i + 16) & 15u, d) << (8 * i);
        }
    }
    if constexpr (kPerBlockOrder) bytes = folded_to_per_block_order(bytes);
    const uint32_t low = has_nan ? kE4m3Nan * 0x01010101u : bytes.x;
    const uint32_t high = has_nan ? kE4m3Nan * 0x01010101u : bytes.y;
    uint8_t* block = act + (size_t)token * d_hidden_pad + (k - quad * 8);
    *reinterpret_cast<uint32_t*>(block + 4 * quad) = low;
    *reinterpret_cast<uint32_t*>(block + 16 + 4 * quad) = high;
    zero_accumulator_eighth(accumulator, d_hidden_pad, token, k);
}

// A call's first kernel. CTA (0, 0) routes (route_pairs, one CTA's work;
// first, so that it starts in the first wave); meanwhile CTA (1 + token, y)
// runs Qa of columns [8192y, 8192y+8192) of one token
// (quantize_hidden_columns), so that routing costs no launch of its own and
// little time. kFolded: Qa for the folded e4m3 stage 1s instead, a CTA per
// token (quantize_hidden_row_folded; act_scale is then the tokens' scales;
// block_scale, for the plain e4m3 stage 1's folded form, its block scales,
// else null; kFp8 with kFolded: the bytes in the per-block order, for the
// 8-token e4m3 stage 1's token-scaled form), and redo_tiles[0] (stage 1's
// redo tile count) and redo_tiles[1] (stage 2's redo flag) start at zero.
constexpr int kPrepareThreads = 1024;
constexpr int kPrepareColumns = kPrepareThreads * 8;
template <bool kFp8, bool kFolded>
__global__ void __launch_bounds__(kPrepareThreads) route_and_quantize_kernel(
        const int* __restrict__ topk_ids, const float* __restrict__ topk_weights, int num_pairs, int top_k,
        int n_experts, int tile_tokens, int* __restrict__ expert_offsets, int2* __restrict__ tiles,
        int* __restrict__ num_tiles, int* __restrict__ sorted_tokens, float* __restrict__ sorted_weights,
        int* __restrict__ bad_ids, const __nv_bfloat16* __restrict__ hidden, int d_hidden, int d_hidden_pad,
        uint8_t* __restrict__ act, float* __restrict__ act_scale, float* __restrict__ block_scale,
        float* __restrict__ accumulator, int* __restrict__ redo_tiles) {
    let_next_kernel_launch();   // a call's first kernel: launched normally, after whatever came before
    if constexpr (kFolded)   // stage 1's redo tile count, and stage 2's redo flag after it
        if (blockIdx.x == 0 && threadIdx.x == 0) redo_tiles[0] = redo_tiles[1] = 0;
    if (blockIdx.x == 0) {   // CTA-uniform: route_pairs' barriers see every thread
        if (blockIdx.y == 0)
            route_pairs(topk_ids, topk_weights, num_pairs, top_k, n_experts, tile_tokens, expert_offsets, tiles,
                        num_tiles, sorted_tokens, sorted_weights, bad_ids);
        return;
    }
    if constexpr (kFolded)
        quantize_hidden_row_folded<kFp8>(hidden, d_hidden, d_hidden_pad, act, act_scale, block_scale, accumulator,
                                         blockIdx.x - 1);
    else
        quantize_hidden_columns<kFp8>(hidden, d_hidden, d_hidden_pad, act, act_scale, accumulator, blockIdx.x - 1,
                                      blockIdx.y * kPrepareColumns + threadIdx.x * 8);
}

// The folded path's fallbacks, run by CTAs that sit beside the e4m3 wide
// stage 1's (launch_wide_stage1). First, while that kernel runs, whether
// every down-weight row folds for the e4m3 wide stage 2
// (wide_compute_stage_folded, against the row's first block): a row folds
// when its first k_blocks2 scale bytes all lie within kFoldTableMinShift..
// kFoldMaxShift of the first, none is 255, and the first is at least
// kFoldMinFirstScale. That is judged on the scales alone, so a row whose
// out-of-window blocks hold only zeros falls back too. Any row that does
// not fold sets *stage2_redo (zeroed by the routing kernel). Then, once
// stage 1's e4m3 kernel is done and only if it asked for its redo, the
// bf16 rows (Qa's values, as quantize_hidden_columns<false> stores them)
// that the redo reads: writing them in every call's Qa cost 6-7 us at
// bs=512 (BENCHMARKS, twenty-second session). Each warp takes 32
// consecutive eighths of rows, so a block's four eighths share a quad, as
// load_hidden_eighth requires.
constexpr int kFallbackThreads = 256;
// A stage-2 row's sums are multiplied by 2^(first scale - 127): at least
// 2^-95 keeps a sum of the smallest products (2^-18 each) a normal float.
constexpr int kFoldMinFirstScale = 32;
__global__ void __launch_bounds__(kFallbackThreads) folded_fallback_kernel(
        const __nv_bfloat16* __restrict__ hidden, int tokens, int d_hidden, int d_hidden_pad,
        const int* __restrict__ redo_tiles, uint8_t* __restrict__ act_bf16,
        const uint8_t* __restrict__ down_scale, int n_experts, int d_expert_pad, int k_blocks2,
        int* __restrict__ stage2_redo) {
    // The redo kernel's CTAs may be placed now: it waits for this kernel's end.
    let_next_kernel_launch();
    // The down scales are inputs, not any earlier kernel's output: checked
    // before the wait, in stage 1's shadow (for a folded stage 2 only: none
    // without stage2_redo). Rows of d_expert_pad / 32 bytes, a multiple of 8
    // (the host checks d_expert_pad % 256).
    const int scale_len = d_expert_pad / kScaleBlock;
    const long long weight_rows = stage2_redo != nullptr ? (long long)n_experts * d_hidden : 0;
    bool all_fold = true;
    for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < weight_rows;
         r += (long long)gridDim.x * blockDim.x) {
        const uint2* row = reinterpret_cast<const uint2*>(
            down_scale + ((size_t)(r / d_hidden) * d_hidden_pad + (size_t)(r % d_hidden)) * scale_len);
        const uint2 head = row[0];
        const int first = (int)(head.x & 0xFFu);
        all_fold &= first != 255 && first >= kFoldMinFirstScale;
        for (int word = 0; word < (k_blocks2 + 7) / 8; ++word) {
            const uint2 bytes = word == 0 ? head : row[word];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int scale = (int)(((j < 4 ? bytes.x : bytes.y) >> (8 * (j & 3))) & 0xFFu);
                const bool in_k = 8 * word + j < k_blocks2;
                all_fold &= !in_k || (scale != 255 && scale - first >= kFoldTableMinShift
                                      && scale - first <= kFoldMaxShift);
            }
        }
    }
    if (!all_fold) *stage2_redo = 1;
    wait_for_previous_kernel();
    if (read_after_wait(redo_tiles) == 0) return;
    const int eighths_per_row = d_hidden_pad / 8;   // a multiple of 4: whole blocks
    const long long eighths = (long long)tokens * eighths_per_row;
    const int lane = threadIdx.x & 31;
    for (long long warp_first = (long long)blockIdx.x * blockDim.x + threadIdx.x - lane; warp_first < eighths;
         warp_first += (long long)gridDim.x * blockDim.x) {
        const long long eighth = warp_first + lane;
        const bool active = eighth < eighths;
        const int token = active ? (int)(eighth / eighths_per_row) : 0;
        const int k = active ? (int)(eighth % eighths_per_row) * 8 : 0;
        float v[8], amax;
        bool has_nan;
        load_hidden_eighth(hidden, d_hidden, token, k, active, v, amax, has_nan);
        if (active) store_qa_bf16(act_bf16, d_hidden_pad, token, k, v, qa_exponent(amax), has_nan);
    }
}

constexpr int kStage1Columns = kRows / 2;  // intermediate columns per CTA
constexpr int kStage1HStride = kStage1Columns + 4;

// Qa of a stage-1 tile's SwiGLU values in shared memory (h: rows x
// kStage1HStride floats, two 32-column blocks a row, columns from col0)
// into inter as bf16 values, by kWarps warps: lane 4r + j of warp w
// takes row 8 (w / 2) + r (then kWarps * 4 rows further, ...) of block w & 1,
// the block's values j, j + 4, ..., j + 28, whose act_positions are
// 8j..8j+7: the block's max is two shuffles among four lanes, its output
// one 16-byte store a lane, and the reads of h conflict-free (bank 4r + j +
// 4m). The magnitudes' bit patterns compared as integers order them as
// floats do and put NaN above infinity, so the same max says whether the
// block has a NaN. Against the per-lane form below (the E4M3 one): 173 SASS
// instructions per eight blocks, not 257 per four, and two dependent
// shuffles, not five and a vote. The wide stage 1's consumers run Qa in
// line with their MMAs, so its instructions and chains are theirs: d2048's
// stage 1 took 423 us with that form, 398 with this one (H200).
template <int kWarps>
__device__ __forceinline__ void quantize_h_rows_bf16(const float* h, int rows, int warp, int lane, int row_start,
                                                     int col0, int d_expert_pad, uint8_t* __restrict__ inter) {
    static_assert(kWarps % 2 == 0, "a warp's rows all of one block");
    constexpr int kRowStep = kWarps / 2 * 8;
    const int j = lane & 3, block = warp & 1;
    const float* src = h + block * kScaleBlock + j;
    __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(inter) + (size_t)row_start * d_expert_pad + col0
                         + block * kScaleBlock + 8 * j;
    for (int first = (warp >> 1) * 8; first < rows; first += kRowStep) {
        const int row = first + (lane >> 2);
        // Rows past the tile's: h's last row, computed, not stored.
        const float* row_src = src + min(row, rows - 1) * kStage1HStride;
        float v[8];
        uint32_t amax_bits = 0;
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            v[m] = row_src[4 * m];
            amax_bits = max(amax_bits, float_to_bits(v[m]) & 0x7FFFFFFFu);
        }
#pragma unroll
        for (int offset = 1; offset < 4; offset <<= 1)
            amax_bits = max(amax_bits, __shfl_xor_sync(0xffffffffu, amax_bits, offset));
        const bool has_nan = amax_bits > 0x7F800000u;
        const int e = qa_exponent(bits_to_float(amax_bits));
        uint32_t words[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const __nv_bfloat162 pair = __floats2bfloat162_rn(qa_value(v[2 * q], e), qa_value(v[2 * q + 1], e));
            words[q] = has_nan ? 0x7FC07FC0u : *reinterpret_cast<const uint32_t*>(&pair);
        }
        if (row < rows)
            *reinterpret_cast<uint4*>(dst + (size_t)row * d_expert_pad) = make_uint4(words[0], words[1], words[2],
                                                                                      words[3]);
    }
}
// quantize_h_rows_bf16's Qa for the e4m3 configs: E4M3 codes into inter
// and their block scales into inter_scale. Warp w takes items w, w +
// kWarps, ... (item = row * 2 + block), kGroup at a time. With kWarps even those are all of block w & 1,
// rows w / 2 + kWarps / 2 * k, so each item's destination is the last
// one's plus a fixed step (recomputed per item from its row, a Qa loop of
// four blocks took 304 instructions, 257 this way: SASS of the wide stage
// 1, when it ran this form).
template <int kGroup, int kWarps>
__device__ __forceinline__ void quantize_h_rows_e4m3(const float* h, int rows, int warp, int lane, int row_start,
                                                     int col0, int d_expert_pad, uint8_t* __restrict__ inter,
                                                     float* __restrict__ inter_scale) {
    static_assert(kWarps % 2 == 0, "a warp's items all of one block");
    constexpr int kRowStep = kWarps / 2;
    const int block = warp & 1, first_row = warp >> 1;
    uint8_t* dst_row = inter + (size_t)(row_start + first_row) * d_expert_pad + col0 + block * kScaleBlock;
    float* scale_row = inter_scale + (size_t)(row_start + first_row) * (d_expert_pad / kScaleBlock)
                       + col0 / kScaleBlock + block;
    for (int row = first_row; row < rows; row += kGroup * kRowStep) {
        float v[kGroup];
        uint8_t* dst[kGroup];
        float* scale[kGroup];
#pragma unroll
        for (int i = 0; i < kGroup; ++i) {
            // Rows past the tile's: h's last row, computed, not stored.
            v[i] = h[min(row + i * kRowStep, rows - 1) * kStage1HStride + block * kScaleBlock + lane];
            dst[i] = dst_row + (size_t)(i * kRowStep) * d_expert_pad;
            scale[i] = scale_row + (size_t)(i * kRowStep) * (d_expert_pad / kScaleBlock);
        }
        quantize_blocks_warp<true, kGroup, false>(v, (rows - row + kRowStep - 1) / kRowStep, lane, dst, scale);
        dst_row += (size_t)(kGroup * kRowStep) * d_expert_pad;
        scale_row += (size_t)(kGroup * kRowStep) * (d_expert_pad / kScaleBlock);
    }
}

// SwiGLU of one intermediate value, rounded to bf16 as the reference does
// before its Qa.
__device__ __forceinline__ float swiglu_bf16(float gate, float up) {
    return __bfloat162float(__float2bfloat16_rn(gate / (1.0f + expf(-gate)) * up));
}

// CTA (column group x, K slice, tile), or (x, tile, K slice) where the
// slices halve: intermediate columns [64*x, 64*x+64) of the tile's rows
// over one of the grid's slices of K
// (halving_slice_first_block if S::kHalvingSlices, else split_blocks scale
// blocks each). Local weight rows 16c..16c+15 (one MMA m-tile) are the gate
// rows of columns 8c..8c+7 and then their up rows, so each thread's
// accumulators hold a gate value and its up value. With one slice the CTA
// finishes the columns (SwiGLU, Qa into inter); with several it stores its
// fp32 (gate, up) pairs to partial[slice][row][col] for swiglu_quantize_kernel.
// kFolded (e4m3 configs): act holds quantize_hidden_row_folded's bytes, with
// token_scale its tokens' scales and act_scale its block scales; from
// kFoldedStage1MinTokens tokens the weights fold too (ScalePath::kFolded),
// below only the activations (ScalePath::kTokenScaled, bytes in the
// per-block order).
template <int NT, int MT, int WT, int SB, int STAGES, bool WG, bool FP8, bool kFolded>
__global__ void __launch_bounds__(GemmShape<NT, MT, WT, SB, STAGES, WG, FP8>::kThreads,
                                  GemmShape<NT, MT, WT, SB, STAGES, WG, FP8>::kStage1MinBlocks) stage1_kernel(
        const uint8_t* __restrict__ gate_up_weight, const uint8_t* __restrict__ gate_up_scale,
        const uint8_t* __restrict__ act, const float* __restrict__ act_scale, const float* __restrict__ token_scale,
        const int* __restrict__ sorted_tokens, const int2* __restrict__ tiles, const int* __restrict__ num_tiles,
        int d_hidden, int d_hidden_pad, int d_expert, int d_expert_pad, int split_blocks,
        uint8_t* __restrict__ inter, float* __restrict__ inter_scale, float2* __restrict__ partial, int num_pairs,
        const __grid_constant__ TensorMap weight_map) {
    using S = GemmShape<NT, MT, WT, SB, STAGES, WG, FP8>;
    static_assert(!kFolded || S::kFp8, "a folded stage 1: e4m3 configs");
    constexpr bool kFoldedWeights = kFolded && S::kFoldedStage1;
    // The folded form's TMA boxes read the shuffled copy (weight_map is
    // gate_up_shuffled_map; shuffled_weight_offset): its 2 KB runs took the
    // 8-token stage 1 at bs=128 E=257, 1,152 pairs streaming at full
    // bandwidth, from 152.1 to 148.8 us (call 0.989-0.991). The per-block
    // form, below TOKEN_SCALED_MIN_PAIRS over K slices of few CTAs, keeps the
    // raw rows: there the runs cost 2.8 us of 58 (bs=16 E=257; H200,
    // 2026-12-04, two A/B runs).
    constexpr bool kShuffledStage1 = kFolded && S::kStage1WeightBoxes > 0;
    extern __shared__ __align__(16) uint8_t smem[];
    wait_for_previous_kernel();
    let_next_kernel_launch();
    Tile tile;
    if (!load_tile(tile, tiles, num_tiles, S::kHalvingSlices ? blockIdx.y : blockIdx.z)) return;
    // Opaque to ptxas: otherwise it kept what these derive from across K to
    // rederive them in the epilogue, a spill at the 24- and 32-token
    // kernels' register caps.
    asm volatile("" : "+r"(tile.rows), "+r"(tile.expert));
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int col0 = blockIdx.x * kStage1Columns;
    // (The e4m3 kernels' expressions as they were: the 24-token kernel, at
    // its 128-register cap, spilled with the same values written otherwise.)
    int first_block = blockIdx.y * split_blocks;
    int k_blocks = min(split_blocks, (d_hidden + kScaleBlock - 1) / kScaleBlock - first_block);
    if constexpr (S::kHalvingSlices) {
        const int all_blocks = (d_hidden + kScaleBlock - 1) / kScaleBlock;
        first_block = halving_slice_first_block(blockIdx.z, gridDim.z, all_blocks, SB);
        k_blocks = halving_slice_first_block(blockIdx.z + 1, gridDim.z, all_blocks, SB) - first_block;
    }
    const size_t expert_rows = 2 * (size_t)d_expert_pad;
    const uint8_t* weight = gate_up_weight + tile.expert * expert_rows * (d_hidden_pad / 2) + first_block * 16;
    const uint8_t* scale = gate_up_scale + tile.expert * expert_rows * (d_hidden_pad / kScaleBlock) + first_block;
    auto weight_row_of = [&](int r) {
        return ((r >> 3) & 1) * d_expert_pad + col0 + (r >> 4) * 8 + (r & 7);
    };
    auto token_of = [&](int i) { return i < tile.rows ? sorted_tokens[tile.row_start + i] : -1; };
    // kFolded: the tile's token scales for the epilogue, copied as the
    // first stage's cp.async group, which the mainloop waits for before it
    // returns (loaded into a register here, the scale's round trip held
    // every CTA's first copies: the 8-token stage 1 took 10% longer).
    __shared__ float tile_token_scale[kFolded ? S::kTokens : 1];
    if constexpr (kFolded)
        if (tid < S::kTokens) {
            const int token = token_of(tid);
            cp_async_small<4>(&tile_token_scale[tid], token >= 0 ? token_scale + token : token_scale,
                              token >= 0 ? 4 : 0);
        }

    // e4m3: K on the narrow path, checking the scales on the way instead of
    // voting per stage; in the rare CTA whose scales need the wide path, K
    // again (0.5-1.8% faster per call on the e4m3 shapes). bf16 keeps the
    // per-stage vote: the same change measured 2.3-2.6% slower at bs=512
    // E=33 (H200, 2026-12-01), with no instruction of it on that kernel's
    // hot path. kFolded: K on folded bytes (token-scaled: a weight scale
    // byte above kTokenScaledNarrowScale), and again per block (kWide) where
    // a row left its window or Qa could not fold a token (NaN scale).
    float acc[MT][WT][4];
    auto mainloop = [&](auto path) {
        // The TMA boxes (kStage1WeightBoxes): the gate rows of the CTA's
        // columns and then their up rows, d_expert_pad map rows later.
        const WeightBoxes boxes = {&weight_map, (int)(tile.expert * expert_rows) + col0, d_expert_pad,
                                   first_block * 16};
        // The slice's first activation byte, derived afresh in each pass
        // (opaque): kept from the first, it was spilled across K at the
        // 24-token kernels' 128-register cap.
        int act_offset = first_block * kScaleBlock * S::kActValueBytes;
        asm volatile("" : "+r"(act_offset));
        // The folded form's boxes come from the shuffled copy (kShuffledStage1).
        // Mbarriers for the e4m3 configs of 4 or more stages but the 24-token
        // one, whose ring runs the folded pass's CTA-barrier form (kFoldedAsync).
        return gemm_mainloop<S, S::kStages, S::kFp8 && S::kStages >= 4 && S::kTokens != 24, decltype(path)::value, S::kStage1WeightBoxes,
                             kShuffledStage1, false, kFoldedWeights, false>(
            acc, smem, weight, scale, weight_row_of, act + act_offset,
            act_scale + first_block, token_of, boxes, nullptr, d_hidden_pad, k_blocks, 1, 0, nullptr,
            [](float (&)[MT][WT][4], int) {});
    };
    constexpr ScalePath kFirstPass = kFoldedWeights ? ScalePath::kFolded
                                   : kFolded ? ScalePath::kTokenScaled
                                   : S::kFp8 ? ScalePath::kNarrowChecked : ScalePath::kVote;
    if (mainloop(std::integral_constant<ScalePath, kFirstPass>())
        || (kFolded && __syncthreads_or(tid < tile.rows && isnan(tile_token_scale[tid % S::kTokens])))) {
        mainloop(std::integral_constant<ScalePath, ScalePath::kWide>());
    } else if constexpr (kFolded) {
        const float* tokens = tile_token_scale + S::first_token(warp) + 2 * (lane & 3);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < WT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[mt][nt][i] *= tokens[nt * 8 + (i & 1)];
    }

    // Accumulators 0, 1: row g (gate), tokens 2t, 2t+1; 2, 3: row g+8 (up).
    const int g = lane >> 2, t = lane & 3;
    const int first_row = S::first_row(warp), first_token = S::first_token(warp);
    if ((S::kHalvingSlices ? gridDim.z : gridDim.y) > 1) {
        float2* out = partial + (size_t)(S::kHalvingSlices ? blockIdx.z : blockIdx.y) * num_pairs * d_expert_pad;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < WT; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int token = first_token + nt * 8 + 2 * t + j;
                    if (token < tile.rows)
                        store_partial(out + (size_t)(tile.row_start + token) * d_expert_pad + col0
                                          + (first_row / 16 + mt * (S::kMTileStride / 16)) * 8 + g,
                                      make_float2(acc[mt][nt][j], acc[mt][nt][2 + j]));
                }
        return;
    }
    // h = bf16(silu(gate) * up), zero in the padding columns, then Qa per
    // 32-column block, which spans several warps: go through shared memory.
    float* h = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < WT; ++nt)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int local_col = (first_row / 16 + mt * (S::kMTileStride / 16)) * 8 + g;
                const int token = first_token + nt * 8 + 2 * t + j;
                h[token * kStage1HStride + local_col] =
                    col0 + local_col < d_expert ? swiglu_bf16(acc[mt][nt][j], acc[mt][nt][2 + j]) : 0.0f;
            }
    __syncthreads();
    // Four blocks at a time where the registers allow: the unfolded e4m3
    // kernels of 24 and 32 tokens sit at their 128-register cap, and spilled
    // at two.
    constexpr int kQaGroup = kFoldedWeights ? 4 : 1;
    if constexpr (FP8)
        quantize_h_rows_e4m3<kQaGroup, S::kWarps>(h, tile.rows, warp, lane, tile.row_start, col0, d_expert_pad,
                                                  inter, inter_scale);
    else
        quantize_h_rows_bf16<S::kWarps>(h, tile.rows, warp, lane, tile.row_start, col0, d_expert_pad, inter);
}

// The end of a K-split stage 1: warp (kRows rows from kRows*blockIdx.x,
// block 8*blockIdx.y + warp) sums the slices' (gate, up) pairs of one
// 32-column block for each of its rows in slice order (so the result does
// not depend on timing), then SwiGLU and Qa as above. Each thread keeps
// eight loads in flight: kRows rows times 8/kRows slices, so that few slices
// give a warp more rows (one row per warp left 512 bytes in flight per warp
// at two slices, and the kernel ran at half the read bandwidth: 20.6 us at
// bs=512 E=33, H200) and many slices keep a row's slices in one round trip.
// The loads need not wait for the routed-pair count: row addresses are
// clamped to partial's last row and slice indices to the last slice, and
// what those clamped loads bring is not added.
// kDropLines, for partial sums too large to stay in the L2 (d512's 37.7 MB):
// each line is dropped once read (discard.global.L2), so the dead dirty
// lines are not written back while stage 2 streams its weights (d512's
// stage 2 1.5-3 us shorter, H200). The small shapes keep the plain form: the
// drops there cost their fix-up 1-2 us, even behind a runtime argument.
constexpr int kSwigluWarps = 8, kSwigluLoads = 8;
__device__ __forceinline__ void drop_l2_line(const void* line) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("discard.global.L2 [%0], 128;\n" :: "l"(line) : "memory");
#endif
}
template <bool kFp8, int kRows, bool kDropLines>
__global__ void __launch_bounds__(kSwigluWarps * 32) swiglu_quantize_kernel(
        const float2* __restrict__ partial, int splits, int num_pairs, const int* __restrict__ expert_offsets,
        int n_experts, int d_expert, int d_expert_pad, uint8_t* __restrict__ inter, float* __restrict__ inter_scale) {
    constexpr int kSlices = kSwigluLoads / kRows;
    wait_for_previous_kernel();
    let_next_kernel_launch();
    const int row0 = blockIdx.x * kRows, lane = threadIdx.x & 31;
    const int col = (blockIdx.y * kSwigluWarps + (threadIdx.x >> 5)) * kScaleBlock + lane;
    if (col - lane >= d_expert) return;   // warp-uniform
    // Offsets in 32 bits (the host checks that partial's values fit an int):
    // in 64 bits the eight loads' and the drops' addresses took about 200 of
    // a warp's 591 instructions at d512, where the kernel is issue-bound
    // (issue slots 64% busy, 2.9 IPC; H200 ncu); so d512 0.986, bs=16 and
    // bs=128 0.995-0.998 (H200).
    const int slice_stride = num_pairs * d_expert_pad;
    int rows[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) rows[r] = min(row0 + r, num_pairs - 1) * d_expert_pad + col;
    // Slice z's value of row r: one address for its load and its drop.
    auto value_at = [&](int r, int z) { return partial + (rows[r] + min(z, splits - 1) * slice_stride); };
    float2 sum[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) sum[r] = make_float2(0.0f, 0.0f);
    for (int z0 = 0; z0 < splits; z0 += kSlices) {
        float2 v[kSlices][kRows];
#pragma unroll
        for (int i = 0; i < kSlices; ++i)
#pragma unroll
            for (int r = 0; r < kRows; ++r)
                v[i][r] = kDropLines ? __ldcs(value_at(r, z0 + i)) : *value_at(r, z0 + i);
#pragma unroll
        for (int i = 0; i < kSlices; ++i)
#pragma unroll
            for (int r = 0; r < kRows; ++r)
                if (z0 + i < splits) {
                    sum[r].x += v[i][r].x;
                    sum[r].y += v[i][r].y;
                }
        if constexpr (kDropLines) {
            // Every lane has its values (the sums above used them); lanes 0
            // and 16 each drop one of the warp's two 128-byte lines.
            __syncwarp();
            if ((lane & 15) == 0) {
#pragma unroll
                for (int i = 0; i < kSlices; ++i)
#pragma unroll
                    for (int r = 0; r < kRows; ++r)
                        if (z0 + i < splits && row0 + r < num_pairs) drop_l2_line(value_at(r, z0 + i));
            }
        }
    }
    float v[kRows];
    uint8_t* dst[kRows];
    float* scale[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        const int block_start = (row0 + r) * d_expert_pad + col - lane;
        v[r] = col < d_expert ? swiglu_bf16(sum[r].x, sum[r].y) : 0.0f;
        dst[r] = inter + block_start * (kFp8 ? 1 : 2);
        scale[r] = inter_scale + block_start / kScaleBlock;
    }
    // Rows past the routed pairs' are computed, not stored.
    quantize_blocks_warp<kFp8, kRows, true>(v, expert_offsets[n_experts] - row0, lane, dst, scale);
}

}  // namespace moe
"""

# ===========================================================================
# Kernel source: stage 2 (down GEMM + weighted accumulation; bf16 output)
# ===========================================================================
STAGE2_SOURCE = r"""
namespace moe {

// Stage 2's folded rows for the e4m3 configs (stage2_kernel's kFoldedRows),
// in place, a warp per row of inter (E4M3 codes and fp32 block scales 2^e,
// as stage 1's Qa wrote them) of up to 8 blocks (d_expert up to 256: the
// host asks for no more; a longer row gets a NaN factor), lane l taking
// bytes 8l..8l+7 and its block's scale in one round trip. The row's largest
// exponent x over its nonzero blocks gives base b = x - kFoldMaxShift. Where
// every nonzero block lies at most -kFoldMinShift binades below b, none
// holds a NaN byte and 2^(b - 6) is a normal float, each value becomes the
// E4M3 byte of itself times 2^(e - b) (e4m3_codes_shifted), each block
// scale 2^(b - 6) (so that the per-block pass reads the same values: its
// bytes carry 2^-6) and inter_factor[row] = 2^b; otherwise the row stays as
// it was and its factor is NaN. Rows past the routed pairs' were never
// written: skipped. (Folding each tile's rows in the last of its stage-1
// CTAs instead, three dependent round trips a row, cost bs=512 E=257's
// stage 1 9.3 us for the 3.9 this kernel costs the chain: H200, 2026-12-03.)
constexpr int kFoldCodesThreads = 256, kFoldCodesMaxBlocks = 8;
__global__ void __launch_bounds__(kFoldCodesThreads) fold_inter_codes_kernel(
        uint8_t* __restrict__ inter, float* __restrict__ inter_scale, const int* __restrict__ expert_offsets,
        int n_experts, int d_expert_pad, int blocks, float* __restrict__ inter_factor) {
    wait_for_previous_kernel();
    let_next_kernel_launch();
    const int lane = threadIdx.x & 31, block = lane / 4, rows = expert_offsets[n_experts];
    const int warps = gridDim.x * (kFoldCodesThreads / 32), scale_len = d_expert_pad / kScaleBlock;
    const bool in_row = block < blocks;
    for (int row = blockIdx.x * (kFoldCodesThreads / 32) + (int)(threadIdx.x / 32); row < rows; row += warps) {
        uint2* word = reinterpret_cast<uint2*>(inter + (size_t)row * d_expert_pad + 8 * lane);
        float* scale = inter_scale + (size_t)row * scale_len + block;
        const uint2 bytes = in_row ? *word : make_uint2(0u, 0u);
        const uint32_t scale_bits = in_row ? float_to_bits(*scale) : 0u;
        // Block exponent e of a scale 2^e, e in [-127, 127] (2^-127 is subnormal).
        const int e = scale_bits >= 0x00800000u ? (int)(scale_bits >> 23) - 127 : -127;
        // A byte of magnitude 0x7F is E4M3's NaN (plus one carries into its
        // bit 7, no code byte's does); a block is nonzero if any of its quad's bytes is.
        const bool has_nan = __any_sync(0xFFFFFFFFu, ((((bytes.x & 0x7F7F7F7Fu) + 0x01010101u)
                                                       | ((bytes.y & 0x7F7F7F7Fu) + 0x01010101u)) & 0x80808080u) != 0u);
        const bool word_nonzero = ((bytes.x | bytes.y) & 0x7F7F7F7Fu) != 0u;
        bool nonzero = word_nonzero;
        nonzero |= __shfl_xor_sync(0xFFFFFFFFu, (int)nonzero, 1) != 0;
        nonzero |= __shfl_xor_sync(0xFFFFFFFFu, (int)nonzero, 2) != 0;
        const int largest = warp_max(nonzero ? e : -128), smallest = warp_min(nonzero ? e : 128);
        const int base = largest == -128 ? 0 : largest - kFoldMaxShift;   // an all-zero row folds at any base
        const bool folds = blocks <= kFoldCodesMaxBlocks && !has_nan
                        && (largest == -128 || smallest - base >= kFoldMinShift) && base - 6 >= -126;
        if (lane == 0) inter_factor[row] = folds ? exact_pow2(base) : __int_as_float(0x7FC00000);
        if (!folds || !in_row) continue;
        // A zero word stays (its block may be zero, with any exponent).
        if (word_nonzero)
            *word = make_uint2(e4m3_codes_shifted(bytes.x, e - base), e4m3_codes_shifted(bytes.y, e - base));
        if ((lane & 3) == 0) *scale = exact_pow2(base - 6);
    }
}

constexpr int kStage2YStride = kRows + 4;
template <typename S>
constexpr int kStage2EpilogueBytes = S::kTokens * kStage2YStride * (int)sizeof(float);

// Stage 2's pipeline ring. Its CTAs stream several row tiles of a short K
// (stage2_row_tiles), and are sized for kStage2MinBlocks per SM
// (one more for kOneStage): the ring has as
// many slots (2..kStages) as fit that many CTAs, each with its epilogue
// buffer, in an H100/H200 SM's 228 KB (1 KB of it reserved per CTA). bf16
// warpgroup MMAs keep kStages (one row tile, long K).
constexpr int kSharedBytesPerSm = 228 * 1024;
template <typename S, bool kOneStage>
constexpr int kStage2CtasPerSm = S::kStage2MinBlocks + (kOneStage ? 1 : 0);
template <typename S, bool kOneStage>
constexpr int kStage2Fit = (kSharedBytesPerSm / kStage2CtasPerSm<S, kOneStage> - 1024 - kStage2EpilogueBytes<S>
                            - S::kAlignmentSlack) / S::kStageBytes;
template <typename S, bool kOneStage = false>
constexpr int kStage2Ring = S::kAsyncStages || kStage2Fit<S, kOneStage> > S::kStages ? S::kStages
                          : kStage2Fit<S, kOneStage> < 2 ? 2 : kStage2Fit<S, kOneStage>;

__device__ __forceinline__ void atomic_add_float4(float* dst, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float4*>(dst), v);
#else
    atomicAdd(dst, v.x); atomicAdd(dst + 1, v.y); atomicAdd(dst + 2, v.z); atomicAdd(dst + 3, v.w);
#endif
}
// A tile's per-token lookups for add_weighted_rows, kSlots tokens per lane:
// slot s of lane l of warp w holds token w + warps * (l + 32 s)'s
// accumulator row and routing weight (a tile has at most 32 * kSlots *
// warps tokens). Loaded before the adds need them: looked up inside the
// adding loop, each token's two dependent loads were on that loop's path,
// about 40% of the 144-token wide stage 2's stall samples at d512 (ncu,
// thirty-third session).
template <int kSlots>
struct TokenLookup {
    int acc_row[kSlots];
    float weight[kSlots];
    // The warp's j-th token's (j warp-uniform), from the lane that holds it.
    __device__ __forceinline__ int acc_row_of(int j) const { return slot_of(acc_row, j); }
    __device__ __forceinline__ float weight_of(int j) const { return slot_of(weight, j); }
    template <typename T>
    static __device__ __forceinline__ T slot_of(const T (&slots)[kSlots], int j) {
        T value = __shfl_sync(0xFFFFFFFFu, slots[0], j);   // lane j % 32
#pragma unroll
        for (int s = 1; s < kSlots; ++s) {
            const T other = __shfl_sync(0xFFFFFFFFu, slots[s], j);
            if (j >= 32 * s) value = other;
        }
        return value;
    }
};
template <int kSlots>
__device__ __forceinline__ TokenLookup<kSlots> look_up_tokens(const Tile& tile, int warp, int warps, int lane,
                                                              const int* __restrict__ sorted_tokens,
                                                              const float* __restrict__ sorted_weights) {
    TokenLookup<kSlots> lookup;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
        const int token = warp + warps * (lane + 32 * s);
        lookup.acc_row[s] = 0;
        lookup.weight[s] = 0.0f;
        if (token < tile.rows) {
            lookup.acc_row[s] = sorted_tokens[tile.row_start + token];
            lookup.weight[s] = sorted_weights[tile.row_start + token];
        }
    }
    return lookup;
}
// A finished row tile in shared memory (y: the tile's tokens x kRows output
// columns from col0, kStage2YStride apart), each token's row times its
// routing weight, added into the accumulator row of its token: warp w takes
// tokens w, w + warps, ..., each lane four columns of each, kBatch tokens
// at a time.
template <int kBatch, int kSlots>
__device__ __forceinline__ void add_weighted_rows(const float* y, const Tile& tile, const TokenLookup<kSlots>& lookup,
                                                  int col0, int d_hidden, float* __restrict__ accumulator,
                                                  int d_hidden_pad, int warp, int warps, int lane) {
    static_assert(kRows == 32 * 4, "a lane per four columns of a row tile");
    const int col = col0 + lane * 4, tokens = (tile.rows - warp + warps - 1) / warps;
    const bool in_range = col < d_hidden;
    const float* src = y + lane * 4;
    // A batch's reads, then its adds: in one loop ptxas kept each token's
    // reads behind the previous token's atomic add. The adds' indices are
    // 32-bit (moe_forward checks the accumulator's size): 64-bit ones took
    // five more instructions per add.
#pragma unroll 1
    for (int j0 = 0; j0 < tokens; j0 += kBatch) {
        int acc_index[kBatch];   // of the token's row in the accumulator
        float weight[kBatch];
        float4 v[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            acc_index[u] = lookup.acc_row_of(j0 + u) * d_hidden_pad;
            weight[u] = lookup.weight_of(j0 + u);
            if (j0 + u < tokens)
                v[u] = *reinterpret_cast<const float4*>(src + (warp + warps * (j0 + u)) * kStage2YStride);
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
            if (in_range && j0 + u < tokens)
                atomic_add_float4(accumulator + (acc_index[u] + col), make_float4(weight[u] * v[u].x,
                                  weight[u] * v[u].y, weight[u] * v[u].z, weight[u] * v[u].w));
    }
}

// CTA (blockIdx.x, tile blockIdx.y): output columns [128*row_tiles*x, +128*row_tiles)
// of the tile's rows (fewer at d_hidden's end), 128 per row tile, scaled by
// each row's routing weight and added into the fp32 accumulator. Rows are
// transposed through shared memory so that each add covers four consecutive
// columns of one token.
// kFoldedRows (e4m3 configs, one stage per row tile): inter holds
// fold_inter_codes_kernel's rows and inter_factor their 2^base (NaN where a
// row did not fold), and each stage votes between the token-scaled pass and
// the per-block one (ScalePath::kVoteTokenScaled).
// kOneStage (GemmShape::kStage2OneStageKernel, K of one stage): built for
// one CTA per SM more (kStage2CtasPerSm), its ring as many slots as fit them.
template <int NT, int MT, int WT, int SB, int STAGES, bool WG, bool FP8, bool kFoldedRows, bool kOneStage>
__global__ void __launch_bounds__(GemmShape<NT, MT, WT, SB, STAGES, WG, FP8>::kThreads,
                                  kStage2CtasPerSm<GemmShape<NT, MT, WT, SB, STAGES, WG, FP8>, kOneStage>)
stage2_kernel(
        const uint8_t* __restrict__ down_weight, const uint8_t* __restrict__ down_scale,
        const uint8_t* __restrict__ inter, const float* __restrict__ inter_scale,
        const int* __restrict__ sorted_tokens, const float* __restrict__ sorted_weights,
        const int2* __restrict__ tiles, const int* __restrict__ num_tiles,
        int d_hidden, int d_hidden_pad, int d_expert, int d_expert_pad, int row_tiles, float* __restrict__ accumulator,
        const float* __restrict__ inter_factor,
        const __grid_constant__ TensorMap weight_map, const __grid_constant__ TensorMap inter_map) {
    using S = GemmShape<NT, MT, WT, SB, STAGES, WG, FP8>;
    static_assert(!kFoldedRows || FP8, "folded intermediate rows: e4m3 configs");
    extern __shared__ __align__(16) uint8_t smem[];
    wait_for_previous_kernel();
    let_next_kernel_launch();
    Tile tile;
    if (!load_tile(tile, tiles, num_tiles, blockIdx.y)) return;
    const int tid = threadIdx.x;
    const int row0 = blockIdx.x * row_tiles * kRows;
    const int cta_tiles = min(row_tiles, (d_hidden - row0 + kRows - 1) / kRows);   // at least 1 (the grid)
    const int k_blocks = (d_expert + kScaleBlock - 1) / kScaleBlock;
    const uint8_t* weight = down_weight + tile.expert * (size_t)d_hidden_pad * (d_expert_pad / 2);
    const uint8_t* scale = down_scale + tile.expert * (size_t)d_hidden_pad * (d_expert_pad / kScaleBlock);
    auto weight_row_of = [&](int r) { return row0 + r; };
    auto row_of = [&](int i) { return i < tile.rows ? tile.row_start + i : -1; };

    // y is written again only after the next stage's barrier, or the
    // pipeline's last one. (Values computed here rather than before the
    // mainloop: live across it, they made ptxas serialise the wgmmas.)
    auto add_tile = [&](float (&acc)[MT][WT][4], int row_tile) {
        float* y = reinterpret_cast<float*>(S::epilogue_buffer(smem, k_blocks, cta_tiles, kStage2Ring<S, kOneStage>));
        const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
        static_assert(S::kTokens <= S::kThreads, "look_up_tokens: a token per lane");
        const TokenLookup<1> lookup = look_up_tokens<1>(tile, warp, S::kThreads / 32, lane, sorted_tokens,
                                                        sorted_weights);
        const int first_row = S::first_row(warp), first_token = S::first_token(warp);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < WT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    y[(first_token + nt * 8 + 2 * t + (i & 1)) * kStage2YStride
                      + first_row + mt * S::kMTileStride + g + (i >> 1) * 8] = acc[mt][nt][i];
        __syncthreads();
        // Batches of up to 4 of a warp's tokens; none at 2 tokens a warp or
        // fewer (8-token tiles), where the batch's registers (137) cost the
        // 8-token e4m3 stage 2 its fourth CTA per SM: bs=16 2.6% slower.
        constexpr int kWarps = S::kThreads / 32, kPerWarp = (S::kTokens + kWarps - 1) / kWarps,
                      kBatch = kPerWarp <= 2 ? 1 : kPerWarp < 4 ? kPerWarp : 4;
        add_weighted_rows<kBatch>(y, tile, lookup, row0 + row_tile * kRows, d_hidden, accumulator, d_hidden_pad,
                                  warp, kWarps, lane);
    };

    // kFoldedRows: the tile's rows' factors, copied ahead of the first
    // stage's copies (in its cp.async group), which the first vote waits for.
    __shared__ float tile_factor[kFoldedRows ? S::kTokens : 1];
    if constexpr (kFoldedRows)
        if (tid < S::kTokens) {
            const int row = row_of(tid);
            cp_async_small<4>(&tile_factor[tid], row >= 0 ? inter_factor + row : inter_factor, row >= 0 ? 4 : 0);
        }
    float acc[MT][WT][4];
    const WeightBoxes boxes = {&weight_map, tile.expert * d_hidden_pad + row0, 0, 0};
    constexpr ScalePath kPath = kFoldedRows ? ScalePath::kVoteTokenScaled : ScalePath::kVote;
    gemm_mainloop<S, kStage2Ring<S, kOneStage>, false, kPath, S::kStage2WeightBoxes, false, S::kStage2ActTma, false,
                  S::kRowTiles>(
        acc, smem, weight, scale, weight_row_of, inter, inter_scale, row_of, boxes, &inter_map, d_expert_pad,
        k_blocks, cta_tiles, kRows, tile_factor, add_tile);
    add_tile(acc, cta_tiles - 1);
}

// fp32 accumulator to the bf16 output, CTA (token, y) four columns per
// thread; all NaN if routing saw a bad expert id, so that a bad call is loud
// without a host synchronisation.
constexpr int kConvertThreads = 256;
__global__ void __launch_bounds__(kConvertThreads) convert_output_kernel(
        const float* __restrict__ accumulator, int d_hidden_pad, __nv_bfloat16* __restrict__ out, int d_hidden,
        const int* __restrict__ bad_ids) {
    wait_for_previous_kernel();
    const int token = blockIdx.x, col = 4 * (blockIdx.y * kConvertThreads + threadIdx.x);
    if (col >= d_hidden) return;
    // Padded rows are whole multiples of 256 floats, so the float4 stays inside the row.
    float4 v = *reinterpret_cast<const float4*>(accumulator + (size_t)token * d_hidden_pad + col);
    if (*bad_ids != 0) {
        const float nan = __int_as_float(0x7FC00000);
        v = make_float4(nan, nan, nan, nan);
    }
    const __nv_bfloat162 low = __floats2bfloat162_rn(v.x, v.y), high = __floats2bfloat162_rn(v.z, v.w);
    __nv_bfloat16* dst = out + (size_t)token * d_hidden + col;
    if ((d_hidden & 3) == 0) {   // then dst is 8-byte aligned
        uint2 packed;
        memcpy(&packed.x, &low, 4);
        memcpy(&packed.y, &high, 4);
        *reinterpret_cast<uint2*>(dst) = packed;
    } else {
        const __nv_bfloat16 values[4] = {low.x, low.y, high.x, high.y};
        for (int i = 0; i < 4 && col + i < d_hidden; ++i) dst[i] = values[i];
    }
}

// Explicit instantiations, so that a plain nvcc compile of this source (the
// CI build check) produces and reports every kernel.
#define MOE_INSTANTIATE_STAGE1(NT, MT, WT, SB, STAGES, WG, FP8, FOLDED)                                     \
    template __global__ void stage1_kernel<NT, MT, WT, SB, STAGES, WG, FP8, FOLDED>(const uint8_t*,        \
        const uint8_t*, const uint8_t*, const float*, const float*, const int*, const int2*,               \
        const int*, int, int, int, int, int, uint8_t*, float*, float2*, int, const __grid_constant__ TensorMap);
#define MOE_INSTANTIATE_FOLDED(NT, MT, WT, SB, STAGES, WG, FP8, MT2) \
    MOE_INSTANTIATE_STAGE1(NT, MT, WT, SB, STAGES, WG, FP8, true)
#define MOE_INSTANTIATE_STAGE2(NT, MT, WT, SB, STAGES, WG, FP8, FOLDED, ONE_STAGE)                          \
    template __global__ void stage2_kernel<NT, MT, WT, SB, STAGES, WG, FP8, FOLDED, ONE_STAGE>(const uint8_t*, \
        const uint8_t*, const uint8_t*, const float*, const int*, const float*, const int2*,               \
        const int*, int, int, int, int, int, float*, const float*, const __grid_constant__ TensorMap,      \
        const __grid_constant__ TensorMap);
#define MOE_INSTANTIATE(NT, MT, WT, SB, STAGES, WG, FP8, MT2)                                               \
    MOE_INSTANTIATE_STAGE1(NT, MT, WT, SB, STAGES, WG, FP8, false)                                         \
    MOE_INSTANTIATE_STAGE2(NT, MT2, WT, SB, STAGES, WG, FP8, false, false)
#define MOE_INSTANTIATE_FOLDED_ROWS(NT, MT, WT, SB, STAGES, WG, FP8, MT2) \
    MOE_INSTANTIATE_STAGE2(NT, folded_stage2_mt(NT, MT2), WT, SB, STAGES, WG, FP8, true, false)
#define MOE_INSTANTIATE_ONE_STAGE(NT, MT, WT, SB, STAGES, WG, FP8, MT2) \
    MOE_INSTANTIATE_STAGE2(NT, MT2, WT, SB, STAGES, WG, FP8, false, true)
MOE_GEMM_CONFIGS(MOE_INSTANTIATE)
MOE_FOLDED_STAGE1_CONFIGS(MOE_INSTANTIATE_FOLDED)
MOE_FOLDED_STAGE2_CONFIGS(MOE_INSTANTIATE_FOLDED_ROWS)
MOE_ONE_STAGE_STAGE2_CONFIGS(MOE_INSTANTIATE_ONE_STAGE)
#undef MOE_INSTANTIATE
#undef MOE_INSTANTIATE_FOLDED
#undef MOE_INSTANTIATE_FOLDED_ROWS
#undef MOE_INSTANTIATE_ONE_STAGE
#undef MOE_INSTANTIATE_STAGE1
#undef MOE_INSTANTIATE_STAGE2
#define MOE_INSTANTIATE_ROUTE(FP8, FOLDED)                                                                 \
    template __global__ void route_and_quantize_kernel<FP8, FOLDED>(const int*, const float*, int, int, int, \
        int, int*, int2*, int*, int*, float*, int*, const __nv_bfloat16*, int, int, uint8_t*, float*, float*, \
        float*, int*);
#define MOE_INSTANTIATE_QA(FP8)                                                                            \
    MOE_INSTANTIATE_ROUTE(FP8, false)                                                                      \
    MOE_INSTANTIATE_SWIGLU(FP8, 1)                                                                         \
    MOE_INSTANTIATE_SWIGLU(FP8, 2)                                                                         \
    MOE_INSTANTIATE_SWIGLU(FP8, 4)
#define MOE_INSTANTIATE_SWIGLU(FP8, ROWS)                                                                  \
    MOE_INSTANTIATE_SWIGLU_FORM(FP8, ROWS, false)                                                          \
    MOE_INSTANTIATE_SWIGLU_FORM(FP8, ROWS, true)
#define MOE_INSTANTIATE_SWIGLU_FORM(FP8, ROWS, DROP)                                                       \
    template __global__ void swiglu_quantize_kernel<FP8, ROWS, DROP>(const float2*, int, int, const int*, int, \
                                                                     int, int, uint8_t*, float*);
MOE_INSTANTIATE_QA(false)
MOE_INSTANTIATE_QA(true)
MOE_INSTANTIATE_ROUTE(false, true)
MOE_INSTANTIATE_ROUTE(true, true)
#undef MOE_INSTANTIATE_QA
#undef MOE_INSTANTIATE_ROUTE
#undef MOE_INSTANTIATE_SWIGLU
#undef MOE_INSTANTIATE_SWIGLU_FORM

}  // namespace moe
"""

# ===========================================================================
# Kernel source: both stages over wide tiles (sm_90a, warp-specialised)
# ===========================================================================
STAGE2_WIDE_SOURCE = r"""
namespace moe {
// Stage 2 over wide tiles of kTokens tokens (the routing's tiles),
// for warpgroup-MMA calls with more than 28 tokens per expert: each
// converted weight then feeds kTokens tokens of MMA work. One CTA per SM
// at every width (WideTraits), so the
// pipeline must not stop at CTA barriers: warp 8 only loads (weights and
// activations by TMA, weight scales by cp.async) into a ring of slots, each
// with a full mbarrier (its bytes and 32 cp.async arrivals) and an empty one
// (each consumer thread's arrival once its warpgroup's MMAs that read the
// slot are complete); warps 0-7, two warpgroups of 64 rows, only convert and
// multiply, and epilogue warps add (WideStage2::epilogue_warps; in the bf16
// 144-token kernel, which has none, the consumers add). A CTA streams its
// even share of every (tile, row tile) pair, row tiles of 128 output
// columns, the next tile's stages loading while one is added into the
// accumulator.
// What differs between the tile widths (kCtasPerSm: stage 2's CTAs per SM;
// stage 1's are kCtasPerSm1, with a kRing1-slot ring, kRing1Folded for its
// folded form's stages of 8 blocks, and kProducerWarps1 loading warps). 144
// tokens (72 accumulators per thread): one CTA per SM in both stages; stage
// 1 in 3 slots of 53 KB folded (4 of 45 KB in bf16). 64 tokens: stage
// 2 at one CTA per SM with a 6-slot ring and epilogue warps (it ran at two
// CTAs per SM, to hide the latency one CTA's eight compute warps leave,
// until the adds moved to warps of their own); stage 1 (the
// folded e4m3 form only; bf16 as its fallback) at one CTA per SM, in 4 slots
// of 33 KB (6 of 25 KB in bf16). At bs=128 E=33 (H200, 2026-12-02) that
// stage 1, then in 6 slots of 4-block stages, took 0.978 of the call of the
// plain 64-token bf16 stage 1; with a 4-slot ring 0.997, and at
// two CTAs per SM (3 slots, 79 registers) 1.042. (The bf16 form at two CTAs
// per SM with two loading warps took 1.18x the plain kernel's stage 1,
// 2026-12-01: the bf16 64-token wide stage 1 runs only as the folded one's
// fallback.) 48 tokens: as 64.
template <int kTokens> struct WideTraits;
// The wide tile's MMA, m64nNk16 for N = kTokens.
template <int kTokens>
__device__ __forceinline__ void wgmma_wide(float (&d)[kTokens / 8][4], const uint32_t (&a)[4], uint32_t b_descriptor,
                                           uint32_t accumulate) {
    if constexpr (kTokens == 144) wgmma_m64n144k16(d, a, b_descriptor, accumulate);
    else if constexpr (kTokens == 48) wgmma_m64n48k16(d, a, b_descriptor, accumulate);
    else wgmma_m64n64k16(d, a, b_descriptor, accumulate);
}
// kRing1Folded: the folded stage 1's slots, of 8 blocks (WideStage1).
template <> struct WideTraits<144> {
    static constexpr int kCtasPerSm = 1, kCtasPerSm1 = 1, kRing1 = 4, kRing1Folded = 3, kProducerWarps1 = 4;
};
template <> struct WideTraits<64> {
    static constexpr int kCtasPerSm = 1, kCtasPerSm1 = 1, kRing1 = 6, kRing1Folded = 4, kProducerWarps1 = 4;
};
// 48 tokens: as 64.
template <> struct WideTraits<48> {
    static constexpr int kCtasPerSm = 1, kCtasPerSm1 = 1, kRing1 = 6, kRing1Folded = 4, kProducerWarps1 = 4;
};
// A wide tile's pipeline stage (both stages' wide kernels): kStageBlocks
// scale blocks of K (4, or 8 in the folded stage 1) for kRows weight rows
// and kTokens tokens, the activations' region sized for values of
// kActValueBytes (2: bf16; the folded stage 2's E4M3 bytes use half).
// kShuffledWeights: the weights lie as AITER's shuffled copy holds them
// (shuffled_weight_offset), else in swizzled rows.
template <int kTokens_, int kStageBlocks_ = 4, int kActValueBytes = 2, bool kShuffled = false>
struct WideLayout : WideTraits<kTokens_> {
    static constexpr int kTokens = kTokens_;
    static constexpr int kStageBlocks = kStageBlocks_, kConsumerWarps = 8;
    static constexpr bool kShuffledWeights = kShuffled;
    static constexpr int kActBytes = kTokens * kStageBlocks * kScaleBlock * kActValueBytes;
    static constexpr int kWeightBytes = kRows * kStageBlocks * 16;
    static constexpr int kScaleBytes = kRows * kStageBlocks;
    static constexpr int kActOffset = 0, kWeightOffset = kActBytes, kScaleOffset = kWeightOffset + kWeightBytes;
    static constexpr int kStageBytes = (kActBytes + kWeightBytes + kScaleBytes + 1023) / 1024 * 1024;
    static __device__ __forceinline__ int act_offset(int token, int chunk) {
        return swizzled_act_offset<kTokens>(token, chunk);
    }
    static __device__ __forceinline__ int weight_offset(int row, int chunk) {
        return kShuffled ? shuffled_weight_offset<kStageBlocks>(row, chunk)
                         : swizzled_weight_offset<kStageBlocks>(row, chunk);
    }
};
template <int kTokens>
struct WideStage2 : WideLayout<kTokens> {
    using L = WideLayout<kTokens>;
    static constexpr int kRing = kTokens == 144 ? 3 : 6;
    // Warps that add finished row tiles into the accumulator while the
    // consumers multiply the next: in every kernel but the bf16 144-token
    // one. In that kernel (a fallback) their
    // threads' share of the register file made ptxas serialise its MMAs
    // (C7512); there the consumers add.
    static constexpr __host__ __device__ int epilogue_warps(bool folded) {
        return kTokens == 144 && !folded ? 0 : 4;
    }
    static constexpr __host__ __device__ int threads(bool folded) {
        return (L::kConsumerWarps + 1 + epilogue_warps(folded)) * 32;
    }
    // Whether the folded kernel runs the bf16 body itself when a row did not
    // fold (both bodies want the same threads), or a second launch does.
    static constexpr bool kRedoesInKernel = threads(true) == threads(false);
    static constexpr int kEpilogueBytes = kTokens * kStage2YStride * (int)sizeof(float);
    // Dynamic shared memory is 16-byte aligned; the stages need 1024.
    static constexpr int kSharedBytes = kRing * L::kStageBytes + kEpilogueBytes + 1024 - 16;
    static_assert(kSharedBytes <= 227 * 1024 / L::kCtasPerSm - 1024, "the CTAs per SM");
};
// Stage 1's wide CTA: loading warps (the tile's tokens are gathered rows of
// act: 16-byte copies, 18 per thread per stage at 144 tokens and four
// warps). kFolded (E4M3 activations): stages of 8 blocks, in fewer slots,
// so that each stage's fixed work (the slot's waits and arrivals, a
// thread's copy addresses) is spread over twice the MMAs: the loaders'
// loop cost about 0.2% of stage 1 per instruction a stage (H200,
// 2026-12-03); and the weights from the shuffled copy, whose stage is 2 KB
// runs instead of 128-byte runs 3.5 KB apart. At bs=128 E=33 the wide
// stage 1 was its weight stream (40.8 us from L2 against 61.8 from HBM
// with neither fold nor MMAs; H100, 2026-12-05), and those runs streamed
// 4.0 against 3.5 TB/s (tools/dram_pattern.py, H200). The bf16 kernel (a
// fallback) keeps the raw rows.
template <int kTokens, bool kFolded = false>
struct WideStage1 : WideLayout<kTokens, kFolded ? 8 : 4, kFolded ? 1 : 2, kFolded> {
    using L = WideLayout<kTokens, kFolded ? 8 : 4, kFolded ? 1 : 2, kFolded>;
    static constexpr int kRing = kFolded ? L::kRing1Folded : L::kRing1, kProducerWarps = L::kProducerWarps1;
    static constexpr int kThreads = (L::kConsumerWarps + kProducerWarps) * 32;
    static constexpr int kEpilogueBytes = kTokens * kStage1HStride * (int)sizeof(float);
    static constexpr int kSharedBytes = kRing * L::kStageBytes + kEpilogueBytes + 1024 - 16;
    // The folded path's token scales of kRing units, after the epilogue's h.
    static constexpr int kFoldedExtraBytes = kRing * kTokens * (int)sizeof(float);
    static_assert(kSharedBytes + kFoldedExtraBytes <= 227 * 1024 / L::kCtasPerSm1 - 1024, "the CTAs per SM");
};

// A wide consumer lane's offsets into every stage, computed once per
// kernel (ptxas recomputed them in each stage, about 15 instructions): the
// weight words its ldmatrix reads for a stage's first pair of blocks (row
// first_row + (lane & 15) of the warp's 16, at shared-memory row
// smem_row(r); chunk lane >> 4), and the scale word of its row g.
struct WideLaneOffsets {
    uint32_t words, scales;
};
template <typename W, typename SmemRow>
__device__ __forceinline__ WideLaneOffsets wide_lane_offsets(int first_row, int lane, SmemRow smem_row) {
    WideLaneOffsets offsets{(uint32_t)(W::kWeightOffset + W::weight_offset(smem_row(first_row + (lane & 15)),
                                                                            lane >> 4)),
                            (uint32_t)(W::kScaleOffset + (first_row + (lane >> 2)) * W::kStageBlocks)};
    // Opaque from here on: otherwise the compiler moves the arithmetic back into each stage.
    asm volatile("" : "+r"(offsets.words), "+r"(offsets.scales));
    return offsets;
}

// What both forms of a wide consumer stage (wide_compute_stage,
// wide_compute_stage_folded) share. wide_stage_slot waits for stage s's
// slot, returns it, and gives the scale words of the warp's rows g and g+8
// (scales[h][i]: blocks 4i..4i+3). wide_stage_blocks then walks the
// stage's blocks in order: issue_block(block, words) converts the block's
// fp4 words of rows g and g+8 and issues its MMAs, while the next pair of
// blocks' words load ahead; after each block it commits, waits for the
// block before, and at block 0 releases the previous stage's slot (those
// MMAs are complete). W is the kernel's layout (a WideLayout).
template <typename W, int kRing>
__device__ __forceinline__ const uint8_t* wide_stage_slot(uint8_t* smem, uint64_t* full, int s,
                                                         const WideLaneOffsets& offsets,
                                                         uint32_t (&scales)[2][W::kStageBlocks / 4]) {
    mbarrier_wait(&full[s % kRing], (s / kRing) & 1);
    const uint8_t* base = smem + s % kRing * W::kStageBytes;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < W::kStageBlocks / 4; ++i)
            scales[h][i] = *reinterpret_cast<const uint32_t*>(base + offsets.scales + 8 * h * W::kStageBlocks + 4 * i);
    return base;
}
template <typename W, int kRing, typename IssueBlock>
__device__ __forceinline__ void wide_stage_blocks(const uint8_t* base, uint64_t* empty, int s,
                                                  const WideLaneOffsets& offsets, IssueBlock issue_block) {
    constexpr int SB = W::kStageBlocks;
    // Blocks bp, bp + 1 (bp even): chunk bp ^ (the first pair's), as the
    // swizzle XORs only a row's chunk bits (below SB * 16 bytes,
    // W::kWeightOffset a multiple of them); in the shuffled layout, bp
    // chunks of 256 bytes on.
    static_assert((SB == 4 || SB == 8) && W::kWeightOffset % (SB * 16) == 0,
                  "a pair's chunks one XOR from the first pair's");
    auto load_words = [&](uint32_t (&words)[4], int bp) {
        ldmatrix_x4(words, base + (W::kShuffledWeights ? offsets.words + (uint32_t)(bp << 8)
                                                       : offsets.words ^ (uint32_t)(bp << 4)));
    };
    uint32_t w[4];
    load_words(w, 0);
#pragma unroll
    for (int bp = 0; bp < SB; bp += 2) {
        uint32_t next[4];
        if (bp + 2 < SB) load_words(next, bp + 2);
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const uint32_t words[2] = {w[2 * q], w[2 * q + 1]};
            issue_block(bp + q, words);
            wgmma_commit();
            wgmma_wait<1>();
            // Every lane arrives, and the arrival is predicated, not branched
            // on: a branch here (on the lane, or on s > 0) made ptxas
            // serialise the MMAs (C7518, C7513).
            if (bp + q == 0) mbarrier_arrive_if(&empty[(s + kRing - 1) % kRing], s > 0);
        }
        if (bp + 2 < SB)
#pragma unroll
            for (int i = 0; i < 4; ++i) w[i] = next[i];
    }
}

// A consumer warp's stage s of a wide kernel: convert the warp's 16 weight
// rows block by block and issue its warpgroup's bf16 MMAs over the tile's
// tokens, adding into acc (first_of_tile: the first MMA starts it, scale-d
// 0, so no accumulator is zeroed between row tiles).
template <typename W, int kRing, int kTokens = W::kTokens>
__device__ __forceinline__ void wide_compute_stage(float (&acc)[kTokens / 8][4], uint8_t* smem, uint64_t* full,
                                                   uint64_t* empty, int s, bool first_of_tile, int first_row,
                                                   int lane, const WideLaneOffsets& offsets) {
    static_assert(W::kStageBlocks == 4, "the bf16 stages are 4 blocks");
    uint32_t scales[2][1];
    const uint8_t* base = wide_stage_slot<W, kRing>(smem, full, s, offsets, scales);
    // The path, voted over the warpgroup's 64 rows (lane: rows 2 lane, 2 lane
    // + 1): a warpgroup's MMAs must be the same instructions in all four of
    // its warps, and a warp's own 16 rows gave warps of one warpgroup
    // different paths (NaN on an H200, 2026-12-01).
    const uint2 group_scales = *reinterpret_cast<const uint2*>(
        base + W::kScaleOffset + ((first_row & ~63) + 2 * lane) * W::kStageBlocks);
    const bool wide = __any_sync(0xFFFFFFFFu, any_scale_above(group_scales.x, 128u)
                                                  || any_scale_above(group_scales.y, 128u));
    const uint32_t act_descriptor = wgmma_descriptor_low(base + W::kActOffset);
    // The stage's blocks, called with a constant path so that each path is
    // its own straight-line code (with the path a runtime value inside,
    // ptxas predicated both paths' conversions and issued both).
    auto compute = [&](const bool kWide) {
        wide_stage_blocks<W, kRing>(base, empty, s, offsets, [&](int block, const uint32_t (&words)[2]) {
            uint32_t a[2][4];
#pragma unroll
            for (int h = 0; h < 2; ++h) bf16_fragment_half(a, h, words[h], scales[h][0], block, kWide);
            wgmma_fence();
#pragma unroll
            for (int step = 0; step < 2; ++step)
                wgmma_wide<kTokens>(acc, a[step], act_descriptor + W::act_offset(0, block * 4 + 2 * step) / 16,
                                    !first_of_tile || block > 0 || step > 0);
        });
    };
    if (wide)
        compute(true);
    else
        compute(false);
}

// wide_compute_stage for folded activations (stage 1's from
// quantize_hidden_row_folded, stage 2's from fold_inter_rows_kernel): each
// block is one e4m3 k32 MMA, on weight bytes folded against rows.base
// (set from stage 0): a block of scale byte s gives v * 2^(s - base)
// (folded_e4m3_table, exact for -5 <= s - base <= 6). Bit h of
// out_of_window is set when this thread's codes of row g + 8h in a block
// outside that range are not all zero (their bytes are then wrong; zero
// codes, as in K's zero-filled tail, fold to zero at any shift).
template <typename W, int kRing, int kTokens = W::kTokens>
__device__ __forceinline__ void wide_compute_stage_folded(
        float (&acc)[kTokens / 8][4], uint8_t* smem, uint64_t* full, uint64_t* empty, int s, bool first_of_tile,
        const WideLaneOffsets& offsets, FoldedRows& rows, uint32_t& out_of_window) {
    uint32_t scales[2][W::kStageBlocks / 4];
    const uint8_t* base = wide_stage_slot<W, kRing>(smem, full, s, offsets, scales);
    if (first_of_tile) rows.set(scales[0][0], scales[1][0]);
    const uint32_t act_descriptor = wgmma_descriptor_low(base + W::kActOffset);
    // The stage's tests as predicates (a bit mask took a select and an OR per test).
    bool outside[2] = {false, false};
    wide_stage_blocks<W, kRing>(base, empty, s, offsets, [&](int block, const uint32_t (&words)[2]) {
        uint32_t a[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint2 bytes = rows.fold_checked(h, words[h], scales[h][block / 4], block % 4, outside[h]);
            a[h] = bytes.x;       // k 4t..4t+3 of row g + 8h
            a[2 + h] = bytes.y;   // k 16+4t..16+4t+3
        }
        wgmma_fence();
        // Block b's 32 bytes of each token: chunks 2b, 2b + 1 of the swizzled
        // rows (from block 4 on, in the second 128 bytes of K: act_offset).
        wgmma_e4m3_mma<kTokens>(acc, a, act_descriptor + W::act_offset(0, 2 * block) / 16,
                                !first_of_tile || block > 0);
    });
    out_of_window |= (uint32_t)outside[0] | (uint32_t)outside[1] << 1;
}

// Four floats times 2^-base as E4M3 bytes (v[0] in the low byte), through
// the hardware conversion (round to nearest, saturating). exact is cleared
// unless each byte times 2^base gives its value back: not for a value below
// E4M3's subnormals or above 448 at that base, nor NaN or infinity. Both
// products are exact where it matters: 2^-base and 2^base are normal (base
// in [-100, 119]), a byte times 2^base lies in [2^-109, 2^128), and a value
// whose scaled form rounds (an f32 subnormal) does not come back.
__device__ __forceinline__ uint32_t fold_four_e4m3(const float (&v)[4], float down, float up, bool& exact) {
#ifdef MOE_HAS_WGMMA
    uint32_t word = 0;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        uint16_t bytes;
        uint32_t halves;
        float back0, back1;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(bytes) : "f"(v[2 * half + 1] * down), "f"(v[2 * half] * down));
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(bytes));
        asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}"
            : "=f"(back0), "=f"(back1) : "r"(halves));
        exact &= back0 * up == v[2 * half] && back1 * up == v[2 * half + 1];
        word |= (uint32_t)bytes << (16 * half);
    }
    return word;
#else
    __trap();
    return 0;
#endif
}

// Stage 2's folded activations, from the bf16 rows of inter (Qa's values,
// at act_position in each block) once stage 1 has written them. A warp per
// row over the row's first `blocks` (those of d_expert; any later ones may
// be unwritten, and the TMA map reads them as zeros): the row's largest
// exponent x, then each value times 2^-base, base = x - 8, as an E4M3 byte
// at folded_act_position; and the row's routing weight times 2^base into
// folded_weights, which stage 2 multiplies its sums by instead of the
// weight. A row with a value no byte holds exactly (fold_four_e4m3), or
// whose largest is below 2^-92, sets *stage2_redo, and stage 2 runs in bf16
// instead.
//
// Lane l reads half l % 2 of each 16-byte chunk of block l / 2 (16 blocks a
// pass): chunk c holds values c, c + 4, .., c + 28 (act_position), so half
// p's four values j = 4p..4p+3 of the four chunks are the bytes c of four
// folded words, 2p and 2p + 1 at byte 8p, 2p + 4 and 2p + 5 at 16 + 8p.
// The first kFoldCachedPasses passes (d_expert up to 2048) stay in
// registers between the maximum and the conversion; longer rows are read
// again.
constexpr int kFoldInterThreads = 256, kFoldBlocksPerPass = 16, kFoldCachedPasses = 4;
__global__ void __launch_bounds__(kFoldInterThreads) fold_inter_rows_kernel(
        const uint8_t* __restrict__ inter, int num_pairs, int d_expert_pad, int blocks,
        const float* __restrict__ sorted_weights, uint8_t* __restrict__ folded, float* __restrict__ folded_weights,
        int* __restrict__ stage2_redo) {
    wait_for_previous_kernel();
    let_next_kernel_launch();
    const int lane = threadIdx.x & 31, half = lane & 1;
    const int passes = (blocks + kFoldBlocksPerPass - 1) / kFoldBlocksPerPass;
    const int warps = gridDim.x * (kFoldInterThreads / 32);
    for (int row = blockIdx.x * (kFoldInterThreads / 32) + threadIdx.x / 32; row < num_pairs; row += warps) {
        const uint8_t* values = inter + (size_t)row * d_expert_pad * 2;
        auto load = [&](int pass, uint2 (&halves)[4]) {
            const int block = pass * kFoldBlocksPerPass + lane / 2;
#pragma unroll
            for (int c = 0; c < 4; ++c)
                halves[c] = block < blocks ? *reinterpret_cast<const uint2*>(values + block * 64 + 16 * c + 8 * half)
                                           : make_uint2(0u, 0u);
        };
        // The largest magnitudes' bits of the low and the high bf16 of each
        // word (NaN and infinity give 255 and fail below).
        uint32_t largest_low = 0, largest_high = 0;
        auto take_largest = [&](const uint2 (&halves)[4]) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                largest_low = max(largest_low, max(halves[c].x & 0x7FFFu, halves[c].y & 0x7FFFu));
                largest_high = max(largest_high, max(halves[c].x & 0x7FFF0000u, halves[c].y & 0x7FFF0000u));
            }
        };
        uint2 cached[kFoldCachedPasses][4];
#pragma unroll
        for (int pass = 0; pass < kFoldCachedPasses; ++pass) {
            load(pass, cached[pass]);
            take_largest(cached[pass]);
        }
        for (int pass = kFoldCachedPasses; pass < passes; ++pass) {
            uint2 halves[4];
            load(pass, halves);
            take_largest(halves);
        }
        const uint32_t largest = warp_max(max(largest_low >> 7, largest_high >> 23));
        // An all-zero row folds at any base; one whose largest is below
        // 2^-92 (field 35) does not, so that its weight times 2^base stays
        // a normal float.
        const int base = largest == 0 ? 0 : (int)largest - 127 - 8;
        bool exact = largest == 0 || largest >= 35;
        const float down = exact_pow2(-base), up = exact_pow2(base);
        auto fold = [&](int pass, const uint2 (&halves)[4]) {
            const int block = pass * kFoldBlocksPerPass + lane / 2;
            if (block >= blocks) return;
            uint32_t words[4];   // j = 4 * half + i
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float v[4];
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const uint32_t word = i < 2 ? halves[c].x : halves[c].y;
                    v[c] = bits_to_float(i % 2 ? word & 0xFFFF0000u : word << 16);
                }
                words[i] = fold_four_e4m3(v, down, up, exact);
            }
            uint8_t* out = folded + (size_t)row * d_expert_pad + block * kScaleBlock;
            *reinterpret_cast<uint2*>(out + 8 * half) = make_uint2(words[0], words[2]);
            *reinterpret_cast<uint2*>(out + 16 + 8 * half) = make_uint2(words[1], words[3]);
        };
#pragma unroll
        for (int pass = 0; pass < kFoldCachedPasses; ++pass)
            if (pass < passes) fold(pass, cached[pass]);
        for (int pass = kFoldCachedPasses; pass < passes; ++pass) {
            uint2 halves[4];
            load(pass, halves);
            fold(pass, halves);
        }
        if (!__all_sync(0xFFFFFFFFu, exact) && lane == 0) *stage2_redo = 1;
        if (lane == 0) folded_weights[row] = sorted_weights[row] * up;
    }
}

// kFolded: the e4m3 form, on fold_inter_rows_kernel's bytes (inter_map
// over them, one 128-byte box per stage) and its folded_weights (passed as
// sorted_weights); the down-weight rows fold against their first block
// (wide_compute_stage_folded), and each sum is multiplied by its row's
// 2^(first scale - 127) before the epilogue. Whether everything folds was
// decided before it started (folded_fallback_kernel for the weights,
// fold_inter_rows_kernel for the activations): if not, the bf16 form does
// all of stage 2 (stage2_wide_kernel; no CTA may add partial sums first:
// the adds are atomic and final). The folded form also has epilogue warps
// (WideStage2::epilogue_warps): the consumers leave each row tile in y and
// go on to the next while those warps add it into the accumulator.
template <int kTokens, bool kFolded>
__device__ __forceinline__ void stage2_wide_body(
        const uint8_t* __restrict__ down_scale, const int* __restrict__ sorted_tokens,
        const float* __restrict__ sorted_weights,
        const int2* __restrict__ wide_tiles, const int* __restrict__ num_wide_tiles,
        int d_hidden, int d_hidden_pad, int d_expert, int d_expert_pad, float* __restrict__ accumulator,
        const TensorMap& weight_map, const TensorMap& inter_map) {
    using W = WideStage2<kTokens>;
    constexpr int SB = W::kStageBlocks, kRing = W::kRing;
    constexpr int kActBytes = kFolded ? W::kActBytes / 2 : W::kActBytes;   // one-byte activations
    extern __shared__ __align__(16) uint8_t smem_base[];
    __shared__ uint64_t full[kRing], empty[kRing];
    // The CTA's row tiles: its even share (gridDim.x CTAs, items/gridDim.x
    // each, rounded up or down) of the list of every (tile, row tile) pair
    // of the routing's actual tiles, tile-major, so that CTAs cross tile
    // boundaries and every one streams as many row tiles whatever the tile
    // count (a CTA per tile and group of row tiles left a last wave of a few
    // CTAs: 38 tiles x 7 groups = 266 CTAs on 132 SMs at bs=512 E=33).
    const int grid_rows = (d_hidden + kRows - 1) / kRows;
    const long long items = (long long)*num_wide_tiles * grid_rows;
    const int first_item = (int)(blockIdx.x * items / gridDim.x);
    const int cta_tiles = (int)((blockIdx.x + 1) * items / gridDim.x) - first_item;
    if (cta_tiles <= 0) return;
    // Row tile i's tile and first output row.
    auto tile_of = [&](int i) { return tile_at(wide_tiles, (first_item + i) / grid_rows); };
    auto row_of = [&](int i) { return (first_item + i) % grid_rows * kRows; };
    uint8_t* smem = align_shared<1024>(smem_base);   // the stages' swizzle
    float* y = reinterpret_cast<float*>(smem + kRing * W::kStageBytes);
    // The warp index through a shuffle: warp-uniform to ptxas, so that the
    // consumer warps' MMAs are not in a path it thinks divergent.
    const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xFFFFFFFFu, tid >> 5, 0);
    const int k_blocks = (d_expert + kScaleBlock - 1) / kScaleBlock;
    const int tile_stages = (k_blocks + SB - 1) / SB;
    const int n_stages = tile_stages * cta_tiles;
    // y's hand-over between the consumers and the epilogue warps: named
    // barriers, each completed by the consumers' and the epilogue warps'
    // threads together (one side arrives, the other waits). A barrier's
    // completion orders each arriving thread's earlier shared-memory
    // accesses before the waiting threads' later ones.
    constexpr int kEpilogueWarps = W::epilogue_warps(kFolded);
    constexpr int kYFull = 2, kYFree = 3, kYThreads = (W::kConsumerWarps + kEpilogueWarps) * 32;
    if (tid == 0)
        for (int j = 0; j < kRing; ++j) {
            mbarrier_init(&full[j], 1 + 32);   // the TMA thread's arrival and bytes, each lane's scale copies
            mbarrier_init(&empty[j], W::kConsumerWarps * 32);
        }
    fence_mbarrier_init();
    __syncthreads();

    if (warp == W::kConsumerWarps) {   // the loads
        const int scale_len = d_expert_pad / kScaleBlock;
        Tile tile{};
        int row = 0;
        for (int s = 0; s < n_stages; ++s) {
            const int slot = s % kRing, first_block = s % tile_stages * SB;
            if (first_block == 0) {   // the next row tile
                tile = tile_of(s / tile_stages);
                row = row_of(s / tile_stages);
            }
            const uint8_t* scale = down_scale + ((size_t)tile.expert * d_hidden_pad + row) * scale_len;
            if (s >= kRing) mbarrier_wait(&empty[slot], (s / kRing - 1) & 1);
            uint8_t* base = smem + slot * W::kStageBytes;
            if (lane == 0) {
                // Whole boxes: past the GEMM's K the maps read zeros, and
                // activation rows past the tile's end are other rows (or
                // zeros), computed and discarded.
                mbarrier_arrive_expecting(&full[slot], W::kWeightBytes + kActBytes);
                tma_load_weights_2d(base + W::kWeightOffset, &weight_map, first_block * 16,
                                    tile.expert * d_hidden_pad + row, &full[slot]);
                if constexpr (kFolded)
                    tma_load_2d(base + W::kActOffset, &inter_map, first_block * kScaleBlock, tile.row_start,
                                &full[slot]);
                else
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        tma_load_2d(base + W::kActOffset + h * (kTokens * 128), &inter_map,
                                    (first_block * kScaleBlock + h * 64) * 2, tile.row_start, &full[slot]);
            }
            // Rows lane + 32i: their four scale bytes, zero past k_blocks.
            const int valid_bytes = min(SB, k_blocks - first_block);
#pragma unroll
            for (int i = 0; i < kRows / 32; ++i) {
                const int r = lane + 32 * i;
                cp_async_small<4>(base + W::kScaleOffset + r * SB, scale + (size_t)r * scale_len + first_block,
                                  valid_bytes);
            }
            cp_async_arrive(&full[slot]);
        }
        return;
    }
    if constexpr (kEpilogueWarps > 0)
        if (warp > W::kConsumerWarps) {   // the adds, a row tile behind the consumers
            const int epilogue_warp = warp - W::kConsumerWarps - 1;
            constexpr int kSlots = (kTokens + 32 * kEpilogueWarps - 1) / (32 * kEpilogueWarps);
            for (int row_tile = 0; row_tile < cta_tiles; ++row_tile) {
                const Tile tile = tile_of(row_tile);
                const TokenLookup<kSlots> lookup = look_up_tokens<kSlots>(tile, epilogue_warp, kEpilogueWarps, lane,
                                                                          sorted_tokens, sorted_weights);
                named_barrier_sync(kYFull, kYThreads);
                add_weighted_rows<4>(y, tile, lookup, row_of(row_tile), d_hidden, accumulator, d_hidden_pad,
                                     epilogue_warp, kEpilogueWarps, lane);
                // The consumers wait for this only before their next row tile's y.
                if (row_tile + 1 < cta_tiles) named_barrier_arrive(kYFree, kYThreads);
            }
            return;
        }

    // Warp w: rows 16w..16w+15 (warpgroup w/4: rows 64(w/4)..+63).
    const int g = lane >> 2, t = lane & 3, first_row = warp * 16;
    const WideLaneOffsets lane_offsets = wide_lane_offsets<W>(first_row, lane, [](int r) { return r; });
    float acc[kTokens / 8][4];
#pragma unroll
    for (int nt = 0; nt < kTokens / 8; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.0f;
    // The epilogues' tiles, looked up a row tile ahead (before the row
    // tile's MMAs), so that the load is not on each row tile's critical path
    // (stage 2 at bs=512 E=33 d2048: 316 us against 320). Only where the
    // consumers add (no epilogue warps, which look their tiles up
    // themselves); elsewhere ptxas drops it.
    Tile tile = tile_of(0);
    // Row tiles, each its stages and then its epilogue (one loop over all
    // stages, with the epilogue inside, made ptxas wait for every stage's
    // last MMAs, C7517).
    for (int row_tile = 0, s = 0; row_tile < cta_tiles; ++row_tile) {
        const Tile next_tile = tile_of(min(row_tile + 1, cta_tiles - 1));
        static_assert(kTokens <= W::kConsumerWarps * 32, "look_up_tokens: a token per lane");
        TokenLookup<1> lookup{};
        if constexpr (kEpilogueWarps == 0)
            lookup = look_up_tokens<1>(tile, warp, W::kConsumerWarps, lane, sorted_tokens, sorted_weights);
        if constexpr (kFolded) {
            FoldedRows rows{};
            uint32_t out_of_window = 0;   // all rows fold (folded_fallback_kernel)
            for (int stage_in_tile = 0; stage_in_tile < tile_stages; ++stage_in_tile, ++s)
                wide_compute_stage_folded<W, kRing>(acc, smem, full, empty, s, stage_in_tile == 0, lane_offsets,
                                                    rows, out_of_window);
            wgmma_wait<0>();
            const float row_scale[2] = {rows.row_scale(0), rows.row_scale(1)};
#pragma unroll
            for (int nt = 0; nt < kTokens / 8; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[nt][i] *= row_scale[i >> 1];
        } else {
            for (int stage_in_tile = 0; stage_in_tile < tile_stages; ++stage_in_tile, ++s)
                wide_compute_stage<W, kRing>(acc, smem, full, empty, s, stage_in_tile == 0, first_row, lane,
                                             lane_offsets);
            wgmma_wait<0>();
        }
        // The row tile done: into y, and from there into the accumulator.
        if constexpr (kEpilogueWarps > 0)
            if (row_tile > 0) named_barrier_sync(kYFree, kYThreads);   // the previous row tile's adds read y
#pragma unroll
        for (int nt = 0; nt < kTokens / 8; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                y[(nt * 8 + 2 * t + (i & 1)) * kStage2YStride + first_row + g + (i >> 1) * 8] = acc[nt][i];
        if constexpr (kEpilogueWarps > 0) {
            named_barrier_arrive(kYFull, kYThreads);
        } else {
            named_barrier_sync(1, W::kConsumerWarps * 32);
            add_weighted_rows<4>(y, tile, lookup, row_of(row_tile), d_hidden, accumulator, d_hidden_pad, warp,
                                 W::kConsumerWarps, lane);
            tile = next_tile;
            named_barrier_sync(1, W::kConsumerWarps * 32);   // y is free again
        }
    }
}

// The kernel: the folded body, or the bf16 one over bf16_weights and
// bf16_inter_map where a row did not fold (*stage2_redo, decided before
// it started: every CTA takes the same body). Where the bf16 body wants
// other threads (144 tokens: no epilogue warps), the folded kernel instead
// sets *stage2_redo to the tile count and leaves, and the bf16 kernel
// launched next runs over *stage2_redo tiles (none otherwise).
template <int kTokens, bool kFolded>
__global__ void __launch_bounds__(WideStage2<kTokens>::threads(kFolded), WideTraits<kTokens>::kCtasPerSm)
stage2_wide_kernel(
        const uint8_t* __restrict__ down_scale, const int* __restrict__ sorted_tokens,
        const float* __restrict__ sorted_weights,
        const int2* __restrict__ wide_tiles, const int* __restrict__ num_wide_tiles,
        int d_hidden, int d_hidden_pad, int d_expert, int d_expert_pad, float* __restrict__ accumulator,
        int* __restrict__ stage2_redo,
        const __grid_constant__ TensorMap weight_map, const __grid_constant__ TensorMap inter_map,
        const float* __restrict__ bf16_weights, const __grid_constant__ TensorMap bf16_inter_map) {
    using W = WideStage2<kTokens>;
    wait_for_previous_kernel();
    let_next_kernel_launch();
    if constexpr (kFolded)
        if (*stage2_redo != 0) {   // CTA-uniform
            if constexpr (W::kRedoesInKernel)
                stage2_wide_body<kTokens, false>(down_scale, sorted_tokens, bf16_weights, wide_tiles, num_wide_tiles,
                                                 d_hidden, d_hidden_pad, d_expert, d_expert_pad, accumulator,
                                                 weight_map, bf16_inter_map);
            else if (blockIdx.x == 0 && threadIdx.x == 0)
                *stage2_redo = *num_wide_tiles;
            return;
        }
    stage2_wide_body<kTokens, kFolded>(down_scale, sorted_tokens, sorted_weights, wide_tiles, num_wide_tiles, d_hidden,
                                       d_hidden_pad, d_expert, d_expert_pad, accumulator, weight_map, inter_map);
}

// Stage 1 over wide tiles: work unit (wide tile, y, z) computes what
// stage1_kernel's CTA (tile, y, z) does (intermediate columns [64y,
// 64y+64), the z-th slice of K, SwiGLU and Qa or the slice's partial sums),
// warp-specialised as stage2_wide_kernel. The CTAs are persistent: CTA b
// takes units b, b + gridDim.x, ... (tile index fastest, then y, then z, the
// order a grid of a CTA per unit would run in), so that the loaders fill the
// next unit's stages while the consumers finish a unit's epilogue, and a
// unit's start (tile lookup, copy addresses, the first copies' round trip)
// is not on the consumers' path. Warps 8-11 load: the gate and up rows by
// TMA (two boxes, their rows interleaved 8 by 8: gate_up_box_row), the
// tile's tokens (rows of act through sorted_tokens) and the weight scales
// by cp.async. A loading thread marks a stage full
// once its copies have landed and it has fenced them for the tensor cores'
// reads (the async proxy), so it arrives a stage late, but marks a unit's
// last stage before it looks up the next unit.
// kFolded: act holds the folded E4M3 bytes of quantize_hidden_row_folded and
// token_scale its tokens' scales; the consumers take
// wide_compute_stage_folded, and the epilogue multiplies each sum by its
// row's and token's scales. A unit with a weight row or a token that does
// not fold sets *redo_tiles to the tile count, so that the bf16 kernel
// launched after folded_fallback_kernel (the same kernel without kFolded,
// over *redo_tiles tiles, none otherwise; it reads the bf16 rows that
// folded_fallback_kernel writes) computes all of stage 1 again, exactly.
template <int kTokens, bool kFolded>
__global__ void __launch_bounds__(WideStage1<kTokens>::kThreads, WideTraits<kTokens>::kCtasPerSm1) stage1_wide_kernel(
        const uint8_t* __restrict__ gate_up_scale, const uint8_t* __restrict__ act,
        const float* __restrict__ token_scale, const int* __restrict__ sorted_tokens,
        const int2* __restrict__ wide_tiles, const int* __restrict__ num_wide_tiles,
        int d_hidden, int d_hidden_pad, int d_expert, int d_expert_pad, int split_blocks, int columns,
        int slices, uint8_t* __restrict__ inter, float2* __restrict__ partial, int num_pairs,
        int* __restrict__ redo_tiles, const __grid_constant__ TensorMap weight_map) {
    using W = WideStage1<kTokens, kFolded>;
    constexpr int SB = W::kStageBlocks, kRing = W::kRing;
    constexpr int kActValueBytes = kFolded ? 1 : 2;
    extern __shared__ __align__(16) uint8_t smem_base[];
    __shared__ uint64_t full[kRing], empty[kRing];
    wait_for_previous_kernel();
    let_next_kernel_launch();
    const int num_tiles = *num_wide_tiles, units = num_tiles * columns * slices;
    if ((int)blockIdx.x >= units) return;
    uint8_t* smem = align_shared<1024>(smem_base);   // the stages' swizzle
    float* h = reinterpret_cast<float*>(smem + kRing * W::kStageBytes);
    // kFolded: the units' token scales, unit n's in slot n % kRing, after h
    // (kFoldedExtraBytes). A loader stores a unit's after issuing its first
    // stage, so after waiting for the slot of the stage kRing before it:
    // the consumers are then past unit n - kRing's epilogue whatever the
    // units' stage counts (K slices of one stage included), and slot
    // n % kRing is free. Its arrivals on that first stage come later.
    float* unit_token_scale = h + kTokens * kStage1HStride;
    const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xFFFFFFFFu, tid >> 5, 0);
    const int total_blocks = (d_hidden + kScaleBlock - 1) / kScaleBlock;
    const int expert_rows = 2 * d_expert_pad;
    // Unit u: its tile, first intermediate column, first K block and K blocks.
    struct Unit {
        Tile tile;
        int col0, first_block, k_blocks, n_stages;
    };
    auto unit_at = [&](int u) {
        Unit unit;
        unit.tile = tile_at(wide_tiles, u % num_tiles);
        unit.col0 = u / num_tiles % columns * kStage1Columns;
        unit.first_block = u / (num_tiles * columns) * split_blocks;
        unit.k_blocks = min(split_blocks, total_blocks - unit.first_block);
        unit.n_stages = (unit.k_blocks + SB - 1) / SB;
        return unit;
    };
    if (tid == 0)
        for (int j = 0; j < kRing; ++j) {
            mbarrier_init(&full[j], 1 + W::kProducerWarps * 32);   // the TMA thread's arrival and bytes, each loader's
            mbarrier_init(&empty[j], W::kConsumerWarps * 32);
        }
    fence_mbarrier_init();
    __syncthreads();

    if (warp >= W::kConsumerWarps) {   // the loads
        const int p = tid - W::kConsumerWarps * 32;
        constexpr int kChunks = SB * kScaleBlock * kActValueBytes / 16;     // a token's 16-byte chunks per stage
        constexpr int kTokensPerPass = W::kProducerWarps * 32 / kChunks;
        constexpr int kPasses = kTokens / kTokensPerPass;
        static_assert(kTokens % kTokensPerPass == 0, "token passes");
        static_assert(kTokensPerPass % 8 == 0 && kPasses <= 32, "a pass is whole swizzle atoms; a bit per pass");
        const int chunk = p % kChunks;
        // Pass j's destination: kTokensPerPass / 8 swizzle atoms (1024 bytes each) after pass j - 1's.
        const int act_dst = W::kActOffset + W::act_offset(p / kChunks, chunk);
        constexpr int kScaleRows = kRows / (W::kProducerWarps * 32);
        for (int u = blockIdx.x, s = 0, n = 0; u < units; u += gridDim.x, ++n) {
            const Unit unit = unit_at(u);
            // This thread's tokens p / kChunks + kTokensPerPass * j: where
            // its chunk of their act rows starts at the unit's first K block
            // (past the tile's end: act's first row, read as no bytes and
            // zero-filled), and a bit per valid token. Only a uniform K
            // offset is added per stage: recomputing each address from the
            // row index and the 64-bit compare per copy took about 15
            // instructions per 16-byte copy, the loading warps executing 125
            // M of the call's 319 M warp instructions at bs=512 E=33 d2048
            // (ncu, H200).
            // As 32-bit offsets from act (m * d_hidden_pad values fit:
            // moe_forward checks), which the 8-block stages' 18 passes
            // need to keep the kernel in 144 registers.
            uint32_t src[kPasses];
            uint32_t valid_tokens = 0;
#pragma unroll
            for (int j = 0; j < kPasses; ++j) {
                const int token = p / kChunks + kTokensPerPass * j;
                const bool valid = token < unit.tile.rows;
                src[j] = ((valid ? (uint32_t)sorted_tokens[unit.tile.row_start + token] * (uint32_t)d_hidden_pad
                                 : 0u) + (uint32_t)unit.first_block * kScaleBlock) * kActValueBytes + chunk * 16;
                valid_tokens |= (uint32_t)valid << j;
            }
            // kFolded: the scales of tokens p + kLoaders * i, stored into
            // unit_token_scale once the unit's first copies are issued (the
            // loads' round trip then delays no copy).
            constexpr int kLoaders = W::kProducerWarps * 32, kScaleTokens = (kTokens + kLoaders - 1) / kLoaders;
            float unit_scales[kFolded ? kScaleTokens : 1];
            if constexpr (kFolded)
#pragma unroll
                for (int i = 0; i < kScaleTokens; ++i) {
                    const int token = p + kLoaders * i;
                    unit_scales[i] = token < unit.tile.rows
                        ? token_scale[sorted_tokens[unit.tile.row_start + token]] : 0.0f;
                }
            // Local weight rows p, p + 32 * kProducerWarps, ...: their scales (stage1_kernel's weight_row_of).
            const uint8_t* scale_src[kScaleRows];
#pragma unroll
            for (int i = 0; i < kScaleRows; ++i) {
                const int r = p + i * W::kProducerWarps * 32;
                scale_src[i] = gate_up_scale
                    + ((size_t)unit.tile.expert * expert_rows + ((r >> 3) & 1) * d_expert_pad + unit.col0
                       + (r >> 4) * 8 + (r & 7)) * (d_hidden_pad / kScaleBlock) + unit.first_block;
            }
            for (int stage = 0; stage < unit.n_stages; ++stage, ++s) {
                const int slot = s % kRing, block0 = stage * SB, valid_blocks = unit.k_blocks - block0;
                if (s >= kRing) mbarrier_wait(&empty[slot], (s / kRing - 1) & 1);
                uint8_t* base = smem + slot * W::kStageBytes;
                if (p == 0) {
                    // Whole boxes: past the GEMM's K the map reads zeros.
                    mbarrier_arrive_expecting(&full[slot], W::kWeightBytes);
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        const int row = unit.tile.expert * expert_rows + unit.col0 + i * d_expert_pad;
                        uint8_t* box = base + W::kWeightOffset + i * (kRows / 2) * (SB * 16);
                        if constexpr (W::kShuffledWeights)   // 16-row groups (col0, d_expert_pad: multiples of 16)
                            tma_load_weights_3d(box, &weight_map, 0, unit.first_block + block0, row / 16,
                                                &full[slot]);
                        else
                            tma_load_weights_2d(box, &weight_map, (unit.first_block + block0) * 16, row,
                                                &full[slot]);
                    }
                }
                const uint32_t copied = chunk / (kChunks / SB) < valid_blocks ? valid_tokens : 0u;
                const size_t k_offset = (size_t)block0 * (kScaleBlock * kActValueBytes);
#pragma unroll
                for (int j = 0; j < kPasses; ++j)
                    cp_async_16_or_zeros(base + act_dst + j * (kTokensPerPass / 8 * 1024), act + src[j] + k_offset,
                                         copied & 1u << j);
#pragma unroll
                for (int i = 0; i < kScaleRows; ++i)
                    cp_async_small<SB>(base + W::kScaleOffset + (p + i * W::kProducerWarps * 32) * SB,
                                       scale_src[i] + block0, min(SB, valid_blocks));
                cp_async_commit();
                if constexpr (kFolded)
                    if (stage == 0)   // before this thread's arrival on the unit's first stage
#pragma unroll
                        for (int i = 0; i < kScaleTokens; ++i) {
                            if (p + kLoaders * i < kTokens)
                                unit_token_scale[n % kRing * kTokens + p + kLoaders * i] = unit_scales[i];
                            if (isnan(unit_scales[i])) *redo_tiles = num_tiles;   // Qa could not fold the token
                        }
                if (stage > 0) {   // the previous stage's copies have landed: fence them, mark that stage full
                    cp_async_wait<1>();
                    fence_async_shared();
                    mbarrier_arrive(&full[(s - 1) % kRing]);
                }
            }
            cp_async_wait<0>();
            fence_async_shared();
            mbarrier_arrive(&full[(s - 1) % kRing]);
        }
        return;
    }

    // Warp w: local rows 16w..16w+15, the gate rows of intermediate columns
    // 8w..8w+7 (g) and their up rows (g+8).
    const int g = lane >> 2, t = lane & 3, first_row = warp * 16, local_col = warp * 8 + g;
    // The weight map's two boxes: gate and up rows.
    const WideLaneOffsets lane_offsets = wide_lane_offsets<W>(first_row, lane, gate_up_box_row);
    float acc[kTokens / 8][4];   // each unit's first MMA overwrites it (scale-d 0); zeroed for ptxas
#pragma unroll
    for (int nt = 0; nt < kTokens / 8; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.0f;
    for (int u = blockIdx.x, s = 0, n = 0; u < units; u += gridDim.x, ++n) {
        const Unit unit = unit_at(u);
        if constexpr (kFolded) {
            FoldedRows rows{};
            uint32_t out_of_window = 0;
            for (int stage = 0; stage < unit.n_stages; ++stage, ++s)
                wide_compute_stage_folded<W, kRing>(acc, smem, full, empty, s, stage == 0, lane_offsets, rows,
                                                    out_of_window);
            wgmma_wait<0>();
            // The sums times their rows' and tokens' scales (NaN for a row
            // that met a block outside its fold, or a token Qa could not fold).
            // A quad's four threads hold K quarters of the same two rows. A
            // first scale byte above kFoldMaxFirstScale (255 included) folds
            // nothing: the bf16 kernel gives those rows' values, NaN where
            // a block's scale is 255.
            out_of_window |= (uint32_t)(rows.base[0] > (uint32_t)kFoldMaxFirstScale)
                             | (uint32_t)(rows.base[1] > (uint32_t)kFoldMaxFirstScale) << 1;
            out_of_window |= __shfl_xor_sync(0xFFFFFFFFu, out_of_window, 1);
            out_of_window |= __shfl_xor_sync(0xFFFFFFFFu, out_of_window, 2);
            if (out_of_window) *redo_tiles = num_tiles;
            const float nan = __int_as_float(0x7FC00000);
            const float gate_scale = out_of_window & 1u ? nan : rows.row_scale(0);
            const float up_scale = out_of_window & 2u ? nan : rows.row_scale(1);
            const float* tokens = unit_token_scale + n % kRing * kTokens;
#pragma unroll
            for (int nt = 0; nt < kTokens / 8; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const float token = tokens[nt * 8 + 2 * t + j];
                    acc[nt][j] = acc[nt][j] * gate_scale * token;
                    acc[nt][2 + j] = acc[nt][2 + j] * up_scale * token;
                }
        } else {
            for (int stage = 0; stage < unit.n_stages; ++stage, ++s)
                wide_compute_stage<W, kRing>(acc, smem, full, empty, s, stage == 0, first_row, lane,
                                             lane_offsets);
            wgmma_wait<0>();
        }
        if (slices > 1) {
            float2* out = partial + (size_t)(unit.first_block / split_blocks) * num_pairs * d_expert_pad;
#pragma unroll
            for (int nt = 0; nt < kTokens / 8; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int token = nt * 8 + 2 * t + j;
                    if (token < unit.tile.rows)
                        store_partial(out + (size_t)(unit.tile.row_start + token) * d_expert_pad + unit.col0
                                          + local_col,
                                      make_float2(acc[nt][j], acc[nt][2 + j]));
                }
            continue;
        }
        // SwiGLU, then Qa per 32-column block through shared memory (as stage1_kernel).
#pragma unroll
        for (int nt = 0; nt < kTokens / 8; ++nt)
#pragma unroll
            for (int j = 0; j < 2; ++j)
                h[(nt * 8 + 2 * t + j) * kStage1HStride + local_col] =
                    unit.col0 + local_col < d_expert ? swiglu_bf16(acc[nt][j], acc[nt][2 + j]) : 0.0f;
        named_barrier_sync(1, W::kConsumerWarps * 32);
        quantize_h_rows_bf16<W::kConsumerWarps>(h, unit.tile.rows, warp, lane, unit.tile.row_start, unit.col0,
                                                d_expert_pad, inter);
        named_barrier_sync(1, W::kConsumerWarps * 32);   // h is free again
    }
}

// Explicit instantiations, as for the GEMM configs: both stages of each
// width, bf16 and folded.
#define MOE_INSTANTIATE_WIDE_STAGE1(N, FOLDED)                                                                  \
    template __global__ void stage1_wide_kernel<N, FOLDED>(const uint8_t*, const uint8_t*, const float*,         \
        const int*, const int2*, const int*, int, int, int, int, int, int, int, uint8_t*, float2*,               \
        int, int*, const __grid_constant__ TensorMap);
MOE_INSTANTIATE_WIDE_STAGE1(48, false)
MOE_INSTANTIATE_WIDE_STAGE1(48, true)
MOE_INSTANTIATE_WIDE_STAGE1(64, false)
MOE_INSTANTIATE_WIDE_STAGE1(64, true)
MOE_INSTANTIATE_WIDE_STAGE1(144, false)
MOE_INSTANTIATE_WIDE_STAGE1(144, true)
#undef MOE_INSTANTIATE_WIDE_STAGE1
#define MOE_INSTANTIATE_WIDE_STAGE2(N, FOLDED)                                                                 \
    template __global__ void stage2_wide_kernel<N, FOLDED>(const uint8_t*, const int*, const float*,             \
        const int2*, const int*, int, int, int, int, float*, int*, const __grid_constant__ TensorMap,          \
        const __grid_constant__ TensorMap, const float*, const __grid_constant__ TensorMap);
MOE_INSTANTIATE_WIDE_STAGE2(48, false)
MOE_INSTANTIATE_WIDE_STAGE2(48, true)
MOE_INSTANTIATE_WIDE_STAGE2(64, false)
MOE_INSTANTIATE_WIDE_STAGE2(64, true)
MOE_INSTANTIATE_WIDE_STAGE2(144, false)
MOE_INSTANTIATE_WIDE_STAGE2(144, true)
#undef MOE_INSTANTIATE_WIDE_STAGE2

}  // namespace moe
"""

# Everything that runs on the device, with no torch headers: CI compiles this
# alone with nvcc for sm_90a to catch build breaks without a GPU.
KERNEL_SOURCE = (COMMON_SOURCE + ROUTING_SOURCE + GEMM_CONFIG_SOURCE + GEMM_SOURCE + STAGE1_SOURCE
                 + STAGE2_SOURCE + STAGE2_WIDE_SOURCE)

# ===========================================================================
# Host bindings
# ===========================================================================
HOST_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#if !defined(USE_ROCM)
#include <cudaTypedefs.h>
#endif
#include <climits>
#include <cmath>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

namespace moe {

#define MOE_CUDA_CHECK(expr) do { cudaError_t err_ = (expr); \
    TORCH_CHECK(err_ == cudaSuccess, "moe_mxfp4: ", #expr, ": ", cudaGetErrorString(err_)); } while (0)

// Raise a kernel's dynamic shared-memory limit to the most any launch of it
// uses, once per kernel and device (a lower limit set later would break the
// launches that need more); all_shared_carveout: and ask for the SM's
// whole carveout as shared memory.
template <typename Kernel>
void allow_shared_memory(Kernel kernel, int max_bytes, bool all_shared_carveout = false) {
    static std::mutex mutex;
    static std::set<std::pair<const void*, int>> done;
    int device = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&device));
    const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), device);
    std::lock_guard<std::mutex> lock(mutex);
    if (done.count(key)) return;
    MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_bytes));
    if (all_shared_carveout)   // 100: percent of the unified L1
        MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    done.insert(key);
}

// CTAs of a kernel that fit on one SM (at least 1), asked of the runtime once
// per kernel, shared memory size and device: it is host work on every call's path.
template <typename Kernel>
int ctas_per_sm(Kernel kernel, int threads, int smem) {
    static std::mutex mutex;
    static std::map<std::tuple<const void*, int, int>, int> known;
    int device = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&device));
    const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), smem, device);
    std::lock_guard<std::mutex> lock(mutex);
    const auto found = known.find(key);
    if (found != known.end()) return found->second;
    int per_sm = 0;
    MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    return known[key] = std::max(per_sm, 1);
}

// Launches every kernel of a call after its first (see
// wait_for_previous_kernel): on sm_90 and later, with programmatic dependent launch, so
// that its CTAs are placed while the kernel before it finishes instead of
// after; elsewhere as a plain launch.
template <typename... Params, typename... Args>
void launch_after_previous(void (*kernel)(Params...), dim3 grid, dim3 block, int smem, cudaStream_t stream,
                           Args... args) {
#if !defined(USE_ROCM)
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cudaLaunchAttribute overlap;
    overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    overlap.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &overlap;
    config.numAttrs = at::cuda::getCurrentDeviceProperties()->major >= 9 ? 1 : 0;
    MOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...));
#else
    kernel<<<grid, block, smem, stream>>>(args...);
    MOE_CUDA_CHECK(cudaGetLastError());
#endif
}

#if !defined(USE_ROCM)
// A tensor map of bytes (rank dims, dims[0] contiguous, strides the byte
// strides of the others), through the driver's cuTensorMapEncodeTiled,
// looked up once.
TensorMap encode_byte_map(cuuint32_t rank, const void* base, const cuuint64_t* dims, const cuuint64_t* strides,
                          const cuuint32_t* box, CUtensorMapSwizzle swizzle) {
    static const auto encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found;
        MOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                        &found));
        TORCH_CHECK(found == cudaDriverEntryPointSuccess && fn, "moe_mxfp4: the driver has no cuTensorMapEncodeTiled");
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }();
    const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
    TensorMap map{};
    const CUresult result = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, rank, const_cast<void*>(base), dims, strides,
                                   box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    TORCH_CHECK(result == CUDA_SUCCESS, "moe_mxfp4: cuTensorMapEncodeTiled failed (", (int)result, ")");
    return map;
}
#endif

// A tensor map through which the warpgroup-MMA GEMMs load a stage with TMA
// (gemm_mainloop's kWeightBoxes, kActTma): rows of `bytes` bytes,
// row_bytes apart (what lies past `bytes`, and past the last row, reads as
// zero), in boxes of box_bytes x box_rows rows in the swizzle of the GEMM's
// shared-memory layout (box_bytes 128: 128-byte swizzle,
// GemmShape::act_offset and weight_offset with 8-block stages; 64:
// 64-byte, weight_offset with 4).
TensorMap tensor_map(const void* base, int64_t rows, int bytes, int row_bytes, int box_bytes, int box_rows) {
#if !defined(USE_ROCM)
    TORCH_CHECK(box_bytes == 64 || box_bytes == 128, "moe_mxfp4: TMA boxes of 64 or 128 bytes");
    const cuuint64_t dims[2] = {(cuuint64_t)bytes, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)row_bytes};
    const cuuint32_t box[2] = {(cuuint32_t)box_bytes, (cuuint32_t)box_rows};
    return encode_byte_map(2, base, dims, strides, box,
                           box_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B);
#else
    return TensorMap{};
#endif
}

// A tensor map over AITER's shuffled weight copy (shuffled_weight_offset):
// `groups` groups of 16 rows, group_bytes apart, each `blocks` chunks of
// 16 rows x 16 bytes (one scale block of each row; what lies past `blocks`
// reads as zero), in boxes of box_blocks chunks of box_groups groups,
// unswizzled (a chunk's 256 bytes are its 16 rows in turn).
TensorMap shuffled_weight_map(const void* base, int64_t groups, int blocks, int64_t group_bytes, int box_blocks,
                              int box_groups) {
#if !defined(USE_ROCM)
    const cuuint64_t dims[3] = {256, (cuuint64_t)blocks, (cuuint64_t)groups};
    const cuuint64_t strides[2] = {256, (cuuint64_t)group_bytes};
    const cuuint32_t box[3] = {256, (cuuint32_t)box_blocks, (cuuint32_t)box_groups};
    return encode_byte_map(3, base, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_NONE);
#else
    return TensorMap{};
#endif
}

__nv_bfloat16* bf16_ptr(const torch::Tensor& t) {
    return reinterpret_cast<__nv_bfloat16*>(t.data_ptr<at::BFloat16>());
}
// Activations in the GEMMs' format (bf16 values, or FP8: E4M3 codes with
// fp32 block scales in `scale`, undefined for bf16) as raw bytes.
// folded: the folded stage 1s' E4M3 bytes (quantize_hidden_row_folded) with
// a scale per row in `token_scale`; FP8 (the plain folded stage 1) keeps
// `scale` for the block scales its per-block pass reads, bf16 (the wide
// one) gets room for the rows as bf16 values, which its redo reads
// (folded_fallback_kernel).
struct Activations {
    torch::Tensor values, scale, token_scale, fallback;
    Activations(int rows, int k_padded, bool fp8, bool folded, const torch::TensorOptions& options)
        : values(torch::empty({rows, k_padded * (fp8 || folded ? 1 : 2)}, options.dtype(torch::kUInt8))),
          scale(fp8 ? torch::empty({rows, k_padded / kScaleBlock}, options.dtype(torch::kFloat32)) : torch::Tensor()),
          token_scale(folded ? torch::empty({rows}, options.dtype(torch::kFloat32)) : torch::Tensor()),
          fallback(folded && !fp8 ? torch::empty({rows, k_padded * 2}, options.dtype(torch::kUInt8))
                                  : torch::Tensor()) {}
    uint8_t* bytes() const { return values.data_ptr<uint8_t>(); }
    uint8_t* fallback_bytes() const { return fallback.data_ptr<uint8_t>(); }
    float* scales() const { return scale.defined() ? scale.data_ptr<float>() : nullptr; }
    float* token_scales() const { return token_scale.defined() ? token_scale.data_ptr<float>() : nullptr; }
};

// The GEMM tiles a call will have, estimated as pairs / tile_tokens plus
// half the active experts: the host does not know the routing, and must not
// wait for it. The narrow configs' K slices and row tiles were tuned on this
// estimate; the wide kernels take expected_tiles (routing source), which
// models the routing.
int estimated_tiles(int num_pairs, int n_experts, int tile_tokens) {
    return num_pairs / tile_tokens + std::min(n_experts, num_pairs) / 2 + 1;
}
int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// Slices of K for stage 1. Each tile's CTAs stream their whole K, so when
// there are few tiles (few tokens) a partial last wave of CTAs leaves SMs
// idle. Slices multiply the CTAs; each costs a write and a read of fp32
// partial sums, so take the fewest slices whose CTAs fill their last wave to
// at least 85% (at most one slice per four stages of K; the best fill there
// if none reaches 85%). That counts equal slices; the bf16 plain stage 1's
// halve (halving_stage1_slices).
int splits_to_fill(long long slots, long long ctas, int k_stages) {
    int best = 1;
    double best_fill = 0.0;
    for (int splits = 1; splits <= std::max(1, k_stages / 4); ++splits) {
        const long long slices = (long long)ctas * splits, waves = (slices + slots - 1) / slots;
        const double fill = (double)slices / (double)(waves * slots);
        if (fill >= 0.85) return splits;
        if (fill > best_fill) { best = splits; best_fill = fill; }
    }
    return best;
}
template <typename S, typename Kernel>
int stage1_splits(Kernel kernel, int smem, int cta_columns, int tiles, int k_blocks) {
    return splits_to_fill((long long)ctas_per_sm(kernel, S::kThreads, smem) * sm_count(), (long long)tiles * cta_columns,
                          (k_blocks + S::kStageBlocks - 1) / S::kStageBlocks);
}
// Slices of K for the wide stage 1, whose persistent CTAs take every
// slots-th unit (tile, column group, slice): the busiest CTA streams
// ceil(units / slots) units, each of its slice's blocks plus a start
// (its first stages' latency, its epilogue) worth kWideUnitStartBlocks,
// and each slice past the first costs the fix-up about kWideSliceBlocks.
// Fitted to the sweeps of 1-8 slices (H200, 2026-12-03): 2 slices best at
// bs=128 E=33 and d512, 1 at d2048; the wave-fill rule above took 3 at
// bs=128 E=33 (2 slices fill 0.848 of a last wave), 3.5% slower there.
constexpr int kWideUnitStartBlocks = 16, kWideSliceBlocks = 8;
// Blocks per slice when stage 1's K is cut into `splits` slices of whole
// stages: rounding up to whole stages may leave fewer, fuller slices.
int whole_stage_slice_blocks(int k_blocks, int splits, int stage_blocks) {
    return ((k_blocks + splits - 1) / splits + stage_blocks - 1) / stage_blocks * stage_blocks;
}
int wide_stage1_splits(long long slots, long long unit_columns, int k_blocks, int stage_blocks) {
    int best = 1;
    long long best_cost = -1;
    for (int splits = 1; splits <= std::max(1, k_blocks / stage_blocks / 4); ++splits) {
        // The slices stage1_slices makes: whole stages, maybe fewer of them.
        const int blocks = whole_stage_slice_blocks(k_blocks, splits, stage_blocks);
        const int slices = (k_blocks + blocks - 1) / blocks;
        if (slices != splits) continue;
        const long long busiest = (unit_columns * slices + slots - 1) / slots;
        const long long cost = busiest * (blocks + kWideUnitStartBlocks) + (long long)(slices - 1) * kWideSliceBlocks;
        if (best_cost < 0 || cost < best_cost) { best = splits; best_cost = cost; }
    }
    return best;
}

// Row tiles per stage-2 CTA. A CTA over several row tiles keeps the next
// tile's stages loading while it finishes one, which short-K CTAs (a stage
// or two each) cannot do alone, and pays its start (the tile lookup, the
// copy addresses) once; but its pipeline slots must not cost CTAs per SM
// (H200 sweep, 2026-11-30: 4 or 8 row tiles over 4 slots, which halved the
// CTAs per SM, were slower than 1; kStage2Ring now sizes the ring to keep
// them). So take the most row tiles (up to 8) that fit as many CTAs per SM
// as one row tile does and leave at least two waves of CTAs. (The caller
// keeps one for bf16 warpgroup-MMA configs: see GemmShape::kRowTiles.)
// shared_bytes_of(row_tiles): a CTA's shared memory.
template <typename Kernel, typename SharedBytes>
int stage2_row_tiles(Kernel kernel, int threads, SharedBytes shared_bytes_of, int tiles, int grid_rows) {
    const int per_sm = ctas_per_sm(kernel, threads, shared_bytes_of(1));
    const long long slots = (long long)per_sm * sm_count();
    for (int row_tiles = 8; row_tiles > 1; row_tiles /= 2)
        if (ctas_per_sm(kernel, threads, shared_bytes_of(row_tiles)) == per_sm
            && (long long)tiles * ((grid_rows + row_tiles - 1) / row_tiles) >= 2 * slots)
            return row_tiles;
    return 1;
}

// What every GEMM launch of a call reads: its tensors, the routing's
// results and the sizes. Requested K slices or row tiles of 0: the launch
// functions choose them.
struct MoeCall {
    cudaStream_t stream;
    int num_pairs, n_experts, d_hidden, d_hidden_pad, d_expert, d_expert_pad, requested_splits, requested_row_tiles;
    const torch::Tensor &gate_up_weight, &gate_up_weight_shuffled, &gate_up_scale, &down_weight, &down_scale;
    const Activations &act, &inter;
    const int* sorted_tokens;
    const float* sorted_weights;
    const int* expert_offsets;
    torch::Tensor& accumulator;
    const __nv_bfloat16* hidden;   // the call's hidden states, for the folded stage 1's fallback rows
    int tokens;
    // The folded path's (launch_wide_stage1, launch_wide_stage2; null otherwise): stage 2's redo flag,
    // then tile count, and its activations' folded bytes and scaled routing weights.
    int* stage2_redo;
    uint8_t* inter_folded;
    float* folded_weights;
    // The e4m3 stage 2's folded rows' factors (fold_inter_codes_kernel; null when its rows stay per block).
    float* inter_factor;
    int k_blocks1() const { return (d_hidden + kScaleBlock - 1) / kScaleBlock; }
    int k_blocks2() const { return (d_expert + kScaleBlock - 1) / kScaleBlock; }
    int columns1() const { return (d_expert + kStage1Columns - 1) / kStage1Columns; }
    int grid_rows() const { return (d_hidden + kRows - 1) / kRows; }
};
// One of the routing's tile tables: the tiles, their count (on the device),
// the grid's bound and the host's estimate of the count.
struct TileTable {
    const int2* tiles;
    const int* count;
    int max_tiles, estimate;
};

// Stage 1's K in slices of whole stages: the largest slice's scale blocks,
// and the fp32 partial sums the slices write (undefined for one slice).
struct Stage1Slices {
    int blocks;
    torch::Tensor partial;
    Stage1Slices(const MoeCall& c, int blocks, int count) : blocks(blocks) {
        if (count <= 1) return;
        // swiglu_quantize_kernel forms ints for offsets of the (gate, up)
        // pairs, and of inter's bf16 bytes up to three rows past the last
        // (its 4-row warps' rows beyond num_pairs: computed, not stored).
        TORCH_CHECK(std::max((long long)count * c.num_pairs, 2LL * (c.num_pairs + 3)) * c.d_expert_pad <= INT_MAX,
                    "moe_mxfp4: stage 1's partial sums outgrow 32-bit offsets (", count, " slices of ",
                    c.num_pairs, " rows)");
        partial = torch::empty({count, c.num_pairs, c.d_expert_pad, 2}, c.accumulator.options());
    }
    int count() const { return partial.defined() ? (int)partial.size(0) : 1; }
    float2* partial_ptr() const {
        return partial.defined() ? reinterpret_cast<float2*>(partial.data_ptr<float>()) : nullptr;
    }
};
Stage1Slices stage1_slices(const MoeCall& c, int splits, int stage_blocks) {
    const int k_blocks = c.k_blocks1(), blocks = whole_stage_slice_blocks(k_blocks, splits, stage_blocks);
    return Stage1Slices(c, blocks, (k_blocks + blocks - 1) / blocks);
}
// The plain stage 1's slices (stage1_kernel): as many as asked that halve
// (halving_slice_first_block), at most max_halving_slices.
Stage1Slices halving_stage1_slices(const MoeCall& c, int splits, int stage_blocks) {
    const int k_blocks = c.k_blocks1(), n = std::min(splits, max_halving_slices(k_blocks, stage_blocks));
    return Stage1Slices(c, halving_slice_first_block(1, n, k_blocks, stage_blocks), n);
}
// After a sliced stage 1: the slices' sum through SwiGLU, quantised into inter.
template <bool FP8>
void launch_swiglu_quantize(const MoeCall& c, const Stage1Slices& slices) {
    if (!slices.partial.defined()) return;
    const int splits = slices.count();
    const long long column_blocks = c.d_expert_pad / (kSwigluWarps * kScaleBlock);
    auto launch = [&](auto kernel, int rows_per_warp) {
        launch_after_previous(kernel,
            dim3((c.num_pairs + rows_per_warp - 1) / rows_per_warp, (unsigned)column_blocks),
            kSwigluWarps * 32, 0, c.stream, slices.partial_ptr(), splits, c.num_pairs, c.expert_offsets,
            c.n_experts, c.d_expert, c.d_expert_pad, c.inter.bytes(), c.inter.scales());
    };
    // Rows per warp: as many as leave each row's slices one pass of loads,
    // while the CTAs still fill every SM's eight CTA slots. With fewer CTAs
    // a warp's rows run their SwiGLU and Qa one after another on a short
    // critical path: 4 rows per warp took 1 us more at bs=16 E=257 (H200).
    auto fills = [&](int rows_per_warp) {
        return (c.num_pairs + rows_per_warp - 1) / rows_per_warp * column_blocks >= 8LL * sm_count();
    };
    auto launch_form = [&](auto drop_lines) {
        constexpr bool kDrop = decltype(drop_lines)::value;
        if (splits <= kSwigluLoads / 4 && fills(4)) launch(swiglu_quantize_kernel<FP8, 4, kDrop>, 4);
        else if (splits <= kSwigluLoads / 2 && fills(2)) launch(swiglu_quantize_kernel<FP8, 2, kDrop>, 2);
        else launch(swiglu_quantize_kernel<FP8, 1, kDrop>, 1);
    };
    // The drop form where the partial sums would fill more than half the L2.
    if (slices.partial.nbytes() > (size_t)at::cuda::getCurrentDeviceProperties()->l2CacheSize / 2)
        launch_form(std::true_type{});
    else
        launch_form(std::false_type{});
}
// Every expert's gate and up rows, in boxes of half a CTA's rows: the bf16
// wide stage 1's, and the plain (per-block) stage1_kernel's, on the raw rows.
TensorMap gate_up_map(const MoeCall& c, int stage_blocks) {
    return tensor_map(c.gate_up_weight.data_ptr<uint8_t>(), c.gate_up_weight.size(0) * c.gate_up_weight.size(1),
                      c.k_blocks1() * 16, c.d_hidden_pad / 2, stage_blocks * 16, kRows / 2);
}
// The folded stage1_kernel's (kShuffledStage1) and the folded wide stage 1's: the shuffled copy, boxes of 64 rows.
TensorMap gate_up_shuffled_map(const MoeCall& c, int stage_blocks) {
    return shuffled_weight_map(c.gate_up_weight_shuffled.data_ptr<uint8_t>(),
                               c.gate_up_weight.size(0) * c.gate_up_weight.size(1) / 16, c.k_blocks1(),
                               16 * (int64_t)(c.d_hidden_pad / 2), stage_blocks, kRows / 2 / 16);
}
// Stage 2's TMA maps: the down weights as one row per output column of
// every expert, and the intermediate activations in boxes of a tile's rows.
TensorMap down_map(const MoeCall& c, int stage_blocks) {
    return tensor_map(c.down_weight.data_ptr<uint8_t>(), c.down_weight.size(0) * (int64_t)c.d_hidden_pad,
                      c.k_blocks2() * 16, c.d_expert_pad / 2, stage_blocks * 16, kRows);
}
TensorMap inter_map(const MoeCall& c, int tile_tokens) {
    const int row_bytes = (int)c.inter.values.size(1), value_bytes = row_bytes / c.d_expert_pad;   // bf16 or e4m3
    return tensor_map(c.inter.bytes(), c.num_pairs, c.k_blocks2() * kScaleBlock * value_bytes, row_bytes, 128,
                      tile_tokens);
}

template <int NT, int MT, int WT, int SB, int STAGES, bool WG, bool FP8>
void launch_stage1(const MoeCall& c, const TileTable& t) {
    using S = GemmShape<NT, MT, WT, SB, STAGES, WG, FP8>;
    TORCH_CHECK(!WG || at::cuda::getCurrentDeviceProperties()->major == 9,
                "moe_mxfp4: warpgroup-MMA configs run on sm_90 GPUs only");
    // With folded activations (c.act has token scales): the folded form.
    const bool folded = FP8 && c.act.token_scale.defined();
    auto stage1 = stage1_kernel<NT, MT, WT, SB, STAGES, WG, FP8, false>;
    if constexpr (FP8)
        if (folded) stage1 = stage1_kernel<NT, MT, WT, SB, STAGES, WG, FP8, true>;
    auto shared_bytes = [](int k_blocks) {
        return S::shared_bytes(k_blocks, S::kTokens * kStage1HStride * (int)sizeof(float), 1, S::kStages);
    };
    allow_shared_memory(stage1, shared_bytes(SB * STAGES));   // the most of any launch: K fills every slot
    const int k_blocks = c.k_blocks1();
    // Halving slices took the bf16 64-token stage 1 at bs=128 E=33 from 90.3
    // to 87.3 us (five slices; 0.977 of the call). The 8-token e4m3 stage 1
    // at bs=16 E=33 (five slices) measured 0.996, inside the noise, so the
    // e4m3 kernels keep equal slices and their code (H200, 2026-12-02).
    const int splits = c.requested_splits > 0 ? c.requested_splits
        : stage1_splits<S>(stage1, shared_bytes(k_blocks), c.columns1(), t.estimate, k_blocks);
    const Stage1Slices slices = S::kHalvingSlices ? halving_stage1_slices(c, splits, SB) : stage1_slices(c, splits, SB);
    launch_after_previous(stage1, S::kHalvingSlices ? dim3(c.columns1(), t.max_tiles, slices.count())
                                                    : dim3(c.columns1(), slices.count(), t.max_tiles),
        S::kThreads, shared_bytes(std::min(slices.blocks, k_blocks)), c.stream,
        c.gate_up_weight.data_ptr<uint8_t>(), c.gate_up_scale.data_ptr<uint8_t>(), c.act.bytes(), c.act.scales(),
        c.act.token_scales(), c.sorted_tokens, t.tiles, t.count, c.d_hidden, c.d_hidden_pad,
        c.d_expert, c.d_expert_pad, slices.blocks, c.inter.bytes(), c.inter.scales(), slices.partial_ptr(), c.num_pairs,
        // The folded form reads the shuffled copy (stage1_kernel's kShuffledStage1).
        S::kStage1WeightBoxes == 0 ? TensorMap{} : folded ? gate_up_shuffled_map(c, SB) : gate_up_map(c, SB));
    launch_swiglu_quantize<FP8>(c, slices);
}

// MT: stage 2's 16-row MMA tiles per warp (the config's stage2_warp_rows /
// 16; two tiles per warpgroup for the folded-rows kernel of
// FOLDED_STAGE2_TWO_TILE_TOKENS).
template <int NT, int MT, int WT, int SB, int STAGES, bool WG, bool FP8>
void launch_stage2(const MoeCall& c, const TileTable& t) {
    constexpr int kFoldedMT = folded_stage2_mt(NT, MT);
    // kernel: a stage2_kernel of shape S whose ring is kStage2Ring<S, one_stage::value>.
    auto launch = [&](auto kernel, auto shape, auto one_stage) {
        using S = decltype(shape);
        auto shared_bytes = [](int k_blocks, int row_tiles) {
            return S::shared_bytes(k_blocks, kStage2EpilogueBytes<S>, row_tiles,
                                   kStage2Ring<S, decltype(one_stage)::value>);
        };
        allow_shared_memory(kernel, shared_bytes(SB * STAGES, S::kRowTiles ? 2 : 1));
        const int k_blocks = c.k_blocks2(), grid_rows = c.grid_rows();
        const int row_tiles = !S::kRowTiles ? 1 : std::min(grid_rows, c.requested_row_tiles > 0
            ? c.requested_row_tiles
            : stage2_row_tiles(kernel, S::kThreads, [&](int per_cta) { return shared_bytes(k_blocks, per_cta); },
                               t.estimate, grid_rows));
        launch_after_previous(kernel, dim3((grid_rows + row_tiles - 1) / row_tiles, t.max_tiles), S::kThreads,
            shared_bytes(k_blocks, row_tiles), c.stream,
            c.down_weight.data_ptr<uint8_t>(), c.down_scale.data_ptr<uint8_t>(), c.inter.bytes(), c.inter.scales(),
            c.sorted_tokens, c.sorted_weights, t.tiles, t.count, c.d_hidden, c.d_hidden_pad,
            c.d_expert, c.d_expert_pad, row_tiles, c.accumulator.data_ptr<float>(), c.inter_factor,
            S::kStage2WeightBoxes > 0 ? down_map(c, SB) : TensorMap{},
            S::kStage2ActTma ? inter_map(c, S::kTokens) : TensorMap{});
    };
    // With folded rows (c.inter_factor): the pass that folds them, then the kernel that votes for them.
    if constexpr (FP8 && folded_stage2_tokens(8 * NT))
        if (c.inter_factor != nullptr) {
            launch_after_previous(fold_inter_codes_kernel,
                dim3(std::min((c.num_pairs + kFoldCodesThreads / 32 - 1) / (kFoldCodesThreads / 32), 8 * sm_count())),
                kFoldCodesThreads, 0, c.stream, c.inter.bytes(), c.inter.scales(), c.expert_offsets, c.n_experts,
                c.d_expert_pad, c.k_blocks2(), c.inter_factor);
            launch(stage2_kernel<NT, kFoldedMT, WT, SB, STAGES, WG, FP8, true, false>,
                   GemmShape<NT, kFoldedMT, WT, SB, STAGES, WG, FP8>(), std::false_type());
            return;
        }
    using S = GemmShape<NT, MT, WT, SB, STAGES, WG, FP8>;
    if constexpr (S::kStage2OneStageKernel)
        if (c.k_blocks2() <= SB) {
            launch(stage2_kernel<NT, MT, WT, SB, STAGES, WG, FP8, false, true>, S(), std::true_type());
            return;
        }
    launch(stage2_kernel<NT, MT, WT, SB, STAGES, WG, FP8, false, false>, S(), std::false_type());
}

// The wide kernels (bf16 warpgroup MMAs; e4m3 for both stages' folded forms), with
// stage 1's K slices and stage 2's row tiles per CTA sized for the CTAs per
// SM the kernels get and the tile count the routing is expected to give.
// folded (c.act holds quantize_hidden_row_folded's bytes): the e4m3 kernel,
// then the bf16 rows and the bf16 kernel over *redo_tiles tiles on them
// (none unless a unit did not fold: the CTAs of both then leave at once),
// all before the one fix-up of K slices.
template <int kTokens>
void launch_wide_stage1(const MoeCall& c, const TileTable& t, bool folded, int* redo_tiles) {
    using W = WideStage1<kTokens>;
    using F = WideStage1<kTokens, true>;   // the folded kernel's 8-block stages
    TORCH_CHECK(at::cuda::getCurrentDeviceProperties()->major == 9,
                "moe_mxfp4: warpgroup-MMA configs run on sm_90 GPUs only");
    const auto stage1 = stage1_wide_kernel<kTokens, false>;
    const auto stage1_folded = stage1_wide_kernel<kTokens, true>;
    constexpr int kFoldedSharedBytes = F::kSharedBytes + F::kFoldedExtraBytes;
    static_assert(F::kThreads == W::kThreads && F::kStageBlocks % W::kStageBlocks == 0, "one grid, one slicing");
    allow_shared_memory(stage1, W::kSharedBytes);
    // The SM's whole carveout as shared memory, so that folded_fallback_kernel's
    // CTA fits beside the e4m3 one: otherwise the driver sets an SM to the least
    // that kernel's CTA needs (132 KB for the 130.5 KB of 48-token tiles, then
    // no room for the fallback's 1 KB reserve), and the fallback, placed only
    // as stage 1's CTAs left, ended 5 us after them at bs=128 E=33 (H200,
    // 2026-12-03). Not for every kernel: that cost the plain e4m3 stage 1s
    // 4-6% of their time (their L1).
    allow_shared_memory(stage1_folded, kFoldedSharedBytes, true);
    const int k_blocks = c.k_blocks1();
    // The slices of the kernel that runs first, in its whole stages (folded:
    // the bf16 redo writes the same partial sums over them).
    auto slices_of = [&](auto layout, auto kernel, int shared_bytes) {
        using S = decltype(layout);
        return stage1_slices(c, c.requested_splits > 0 ? c.requested_splits
            : wide_stage1_splits((long long)ctas_per_sm(kernel, S::kThreads, shared_bytes) * sm_count(),
                                 (long long)t.estimate * c.columns1(), k_blocks, S::kStageBlocks), S::kStageBlocks);
    };
    const Stage1Slices slices = folded ? slices_of(F{}, stage1_folded, kFoldedSharedBytes)
                                       : slices_of(W{}, stage1, W::kSharedBytes);
    const int n_slices = slices.count();
    // Persistent CTAs: every CTA slot, or fewer if the most units the routing can give are fewer.
    const long long units = (long long)t.max_tiles * c.columns1() * n_slices;
    const long long slots = (long long)ctas_per_sm(stage1, W::kThreads, W::kSharedBytes) * sm_count();
    const dim3 grid((unsigned)std::max(1LL, std::min(units, slots)));
    auto launch = [&](auto kernel, int shared_bytes, const TensorMap& weight_map, const uint8_t* act,
                      const float* token_scale, const int* num_tiles) {
        launch_after_previous(kernel, grid, W::kThreads, shared_bytes, c.stream,
            c.gate_up_scale.data_ptr<uint8_t>(), act, token_scale, c.sorted_tokens, t.tiles,
            num_tiles, c.d_hidden, c.d_hidden_pad, c.d_expert, c.d_expert_pad, slices.blocks, c.columns1(),
            n_slices, c.inter.bytes(), slices.partial_ptr(), c.num_pairs, redo_tiles, weight_map);
    };
    if (folded) {
        TORCH_CHECK(ctas_per_sm(stage1_folded, W::kThreads, kFoldedSharedBytes) * sm_count() == slots,
                    "moe_mxfp4: the folded wide stage 1 must fit the bf16 one's CTAs");
        launch(stage1_folded, kFoldedSharedBytes, gate_up_shuffled_map(c, F::kStageBlocks), c.act.bytes(),
               c.act.token_scales(), t.count);
        // One CTA per SM: each fits beside an e4m3 CTA, to wait there for the flag.
        launch_after_previous(folded_fallback_kernel, dim3(sm_count()), kFallbackThreads, 0, c.stream,
                              c.hidden, c.tokens, c.d_hidden, c.d_hidden_pad, redo_tiles, c.act.fallback_bytes(),
                              c.down_scale.data_ptr<uint8_t>(), c.n_experts, c.d_expert_pad, c.k_blocks2(),
                              c.stage2_redo);
        launch(stage1, W::kSharedBytes, gate_up_map(c, W::kStageBlocks), c.act.fallback_bytes(), nullptr, redo_tiles);
    } else {
        launch(stage1, W::kSharedBytes, gate_up_map(c, W::kStageBlocks), c.act.bytes(), nullptr, t.count);
    }
    launch_swiglu_quantize<false>(c, slices);
}

// The grid: where the kernel fits one CTA per SM (every width on the H200),
// one CTA per SM, so that one wave streams every (tile, row tile) pair (the
// grid of a CTA per tile and group of 8 row tiles was 266 CTAs on 132 SMs
// at bs=512 E=33, two waves and a tail of two: its stage 2 took 368 us
// against this one's 316 at d2048); where more fit (no width now; the
// 64-token kernel before its epilogue warps), CTAs of about stage2_row_tiles' row tiles at
// the tile count the host expects, as that grid had. Requested row tiles
// size the grid the second way. Any grid covers every pair the routing
// gives. (H200.) At bs=128 E=33 this kernel's stage 2 took 55 us against
// the tile-per-CTA kernel's 52 whatever the grid (one wave of even shares,
// this grid, and CTAs of the old grid's own work units launched tile-major
// all measured alike), with the first lookup before the barriers' setup,
// and slower (58) with the pairs listed row-tile-major; 51 since its adds
// take their token lookups from before the MMAs (add_weighted_rows).
// folded: fold_inter_rows_kernel, then the e4m3 kernel over its bytes,
// which runs the bf16 form itself if a row did not fold, except at 144
// tokens: there the bf16 kernel follows, over *c.stage2_redo tiles (none
// unless a row did not fold: its CTAs then leave at once). A launch in the
// chain that usually does nothing cost bs=128 E=33 about a microsecond
// (H200: the three such links 4.7 us, 2026-12-05).
template <int kTokens>
void launch_wide_stage2(const MoeCall& c, const TileTable& t, bool folded) {
    using W = WideStage2<kTokens>;
    TORCH_CHECK(at::cuda::getCurrentDeviceProperties()->major == 9,
                "moe_mxfp4: warpgroup-MMA configs run on sm_90 GPUs only");
    const auto stage2 = stage2_wide_kernel<kTokens, false>;
    allow_shared_memory(stage2, W::kSharedBytes);
    long long ctas = sm_count();
    if (ctas_per_sm(stage2, W::threads(false), W::kSharedBytes) > 1 || c.requested_row_tiles > 0) {
        const int grid_rows = c.grid_rows();
        const int row_tiles = c.requested_row_tiles > 0 ? c.requested_row_tiles
            : stage2_row_tiles(stage2, W::threads(false), [](int) { return W::kSharedBytes; }, t.estimate,
                               grid_rows);
        ctas = ((long long)std::max(t.estimate, 1) * grid_rows + row_tiles - 1) / row_tiles;
    }
    const TensorMap bf16_acts = inter_map(c, kTokens);
    auto launch = [&](auto kernel, int threads, const float* weights, const int* num_tiles, const TensorMap& acts) {
        launch_after_previous(kernel, dim3((unsigned)ctas), threads, W::kSharedBytes, c.stream,
            c.down_scale.data_ptr<uint8_t>(), c.sorted_tokens, weights, t.tiles, num_tiles,
            c.d_hidden, c.d_hidden_pad, c.d_expert, c.d_expert_pad, c.accumulator.data_ptr<float>(), c.stage2_redo,
            down_map(c, W::kStageBlocks), acts, c.sorted_weights, bf16_acts);
    };
    if (folded) {
        const auto stage2_folded = stage2_wide_kernel<kTokens, true>;
        allow_shared_memory(stage2_folded, W::kSharedBytes);
        TORCH_CHECK(ctas_per_sm(stage2_folded, W::threads(true), W::kSharedBytes) == 1,
                    "moe_mxfp4: the folded wide stage 2 must fit one CTA per SM");
        launch_after_previous(fold_inter_rows_kernel, dim3((unsigned)std::max(1, (c.num_pairs + 7) / 8)),
                              kFoldInterThreads, 0, c.stream, c.inter.bytes(), c.num_pairs, c.d_expert_pad,
                              c.k_blocks2(), c.sorted_weights, c.inter_folded, c.folded_weights, c.stage2_redo);
        launch(stage2_folded, W::threads(true), c.folded_weights, t.count,
               tensor_map(c.inter_folded, c.num_pairs, c.k_blocks2() * kScaleBlock, c.d_expert_pad, 128, kTokens));
        if constexpr (!W::kRedoesInKernel)
            launch(stage2, W::threads(false), c.sorted_weights, c.stage2_redo, bf16_acts);
        return;
    }
    launch(stage2, W::threads(false), c.sorted_weights, t.count, bf16_acts);
}

}  // namespace moe

// Inputs are byte views (uint8) of the raw fp4x2 weights and e8m0 scales,
// already validated by the Python dispatcher. Returns the [M, d_hidden] bf16
// output, all NaN if any expert id lies outside [0, E): bad routing is never
// silently wrong, and no host synchronisation is needed to say so.
// n_shared_experts: how many of each token's ids (the last) are shared
// experts, for the expected tile count only (0 if unknown); token_scaled:
// the 8-token e4m3 config's stage 1 on activations folded per token (the
// config's field; see TOKEN_SCALED_MIN_PAIRS); stage1_splits:
// slices of stage 1's K, or 0 to choose (see stage1_splits);
// stage2_row_tiles: row tiles per stage-2 CTA, or 0 to choose (see stage2_row_tiles).
torch::Tensor moe_forward(
        torch::Tensor hidden_states, torch::Tensor gate_up_weight, torch::Tensor down_weight,
        torch::Tensor gate_up_scale, torch::Tensor down_scale, torch::Tensor gate_up_weight_shuffled,
        torch::Tensor topk_weights,
        torch::Tensor topk_ids, int64_t d_hidden, int64_t d_expert, int64_t n_shared_experts, int64_t tile_tokens,
        int64_t warp_rows, int64_t warp_tokens, int64_t stage_blocks, int64_t stages, bool wgmma, bool fp8,
        int64_t stage2_warp_rows, int64_t wide_tile_tokens, bool token_scaled,
        int64_t stage1_splits, int64_t stage2_row_tiles) {
    using namespace moe;
    const int64_t warp_rows2 = stage2_warp_rows > 0 ? stage2_warp_rows : warp_rows;
#define MOE_IS(NT, MT, WT, SB, STAGES, WG, FP8, MT2) (tile_tokens == 8 * NT && warp_rows == 16 * MT && \
    warp_tokens == 8 * WT && stage_blocks == SB && stages == STAGES && wgmma == WG && fp8 == FP8 &&  \
    warp_rows2 == 16 * MT2)
    bool known = false;
#define MOE_KNOWN(NT, MT, WT, SB, STAGES, WG, FP8, MT2) known |= MOE_IS(NT, MT, WT, SB, STAGES, WG, FP8, MT2);
    MOE_GEMM_CONFIGS(MOE_KNOWN)
#undef MOE_KNOWN
    TORCH_CHECK(known, "moe_mxfp4: no kernels built for tile_tokens=", tile_tokens, ", warp_rows=", warp_rows,
                ", warp_tokens=", warp_tokens, ", stage_blocks=", stage_blocks, ", stages=", stages,
                ", wgmma=", wgmma, ", fp8=", fp8, ", stage2_warp_rows=", stage2_warp_rows);
    TORCH_CHECK(wide_tile_tokens == 0 || ((wide_tile_tokens == 48 || wide_tile_tokens == 64 || wide_tile_tokens == 144)
                                          && wgmma && !fp8 && stage_blocks == 4 && tile_tokens == 64),
                "moe_mxfp4: wide tiles of ", wide_tile_tokens, " tokens: only 48, 64 or 144, with the bf16 "
                "warpgroup-MMA config of 64-token tiles and 4-block stages");
    // The routing's one table of tiles: of the wide width where both stages
    // run the wide kernels (48 and 144 tokens), else of the config's
    // tile_tokens (64-token wide tiles are the config's own).
    const int table_tokens = wide_tile_tokens == 48 || wide_tile_tokens == 144 ? (int)wide_tile_tokens
                                                                                : (int)tile_tokens;
    for (const auto& [name, tensor] : {std::make_pair("gate_up_weight", &gate_up_weight),
                                       std::make_pair("gate_up_weight_shuffled", &gate_up_weight_shuffled),
                                       std::make_pair("down_weight", &down_weight),
                                       std::make_pair("gate_up_scale", &gate_up_scale),
                                       std::make_pair("down_scale", &down_scale)})
        TORCH_CHECK(reinterpret_cast<uintptr_t>(tensor->data_ptr()) % 16 == 0, "moe_mxfp4: ", name,
                    " must start on a 16-byte boundary (its 16-byte copies and TMA boxes need it)");
    // Stage 1's folded form reads the shuffled copy (shuffled_weight_offset).
    TORCH_CHECK(gate_up_weight_shuffled.sizes() == gate_up_weight.sizes(), "moe_mxfp4: gate_up_weight_shuffled ",
                gate_up_weight_shuffled.sizes(), " must have gate_up_weight's shape ", gate_up_weight.sizes());
    const c10::cuda::CUDAGuard guard(hidden_states.device());
    const int m = hidden_states.size(0), top_k = topk_ids.size(1), n_experts = gate_up_weight.size(0);
    const int d_hidden_pad = down_weight.size(1), d_expert_pad = down_weight.size(2) * 2;
    const int num_pairs = m * top_k;
    // Stage 2 adds into the accumulator at 32-bit offsets (add_weighted_rows).
    TORCH_CHECK((int64_t)m * d_hidden_pad <= INT32_MAX, "moe_mxfp4: at most ", INT32_MAX / d_hidden_pad,
                " tokens per call at d_hidden ", d_hidden, ", got ", m);
    const auto int_opts = hidden_states.options().dtype(torch::kInt32);
    const auto float_opts = hidden_states.options().dtype(torch::kFloat32);
    auto out = torch::empty({m, d_hidden}, hidden_states.options());
    if (m == 0) return out;

    cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    // Tiles: at most one partial tile per expert that has any pair.
    const int max_tiles = num_pairs / table_tokens + std::min(n_experts, num_pairs) + 1;
    // One allocation for the routing results; the int2 tiles go first to stay 8-byte aligned.
    auto routing = torch::empty({2 * max_tiles + 1 + (n_experts + 1) + 2 * num_pairs + 3}, int_opts);
    int2* tiles = reinterpret_cast<int2*>(routing.data_ptr<int>());
    int* num_tiles = reinterpret_cast<int*>(tiles + max_tiles);
    int* expert_offsets = num_tiles + 1;
    int* sorted_tokens = expert_offsets + n_experts + 1;
    float* sorted_weights = reinterpret_cast<float*>(sorted_tokens + num_pairs);
    int* bad_ids = sorted_tokens + 2 * num_pairs;
    int* redo_tiles = bad_ids + 1;   // the folded wide stage 1's fallback (launch_wide_stage1)
    int* stage2_redo = redo_tiles + 1;   // the folded wide stage 2's (launch_wide_stage2)
    // Wide tiles and the e4m3 configs' plain tiles from kFoldedStage1MinTokens
    // tokens, or below it with token_scaled (then in the per-block order),
    // take folded E4M3 activations (both stage 1s' folded forms) where one Qa
    // CTA holds a token's whole row; the wide stage 2 folds its own
    // (fold_inter_rows_kernel), the plain ones run on the codes and block
    // scales stage 1 writes, or on those rows folded (folded_rows below).
    const bool folded = (wide_tile_tokens > 0 || (fp8 && (tile_tokens >= kFoldedStage1MinTokens || token_scaled)))
                        && d_hidden_pad <= kPrepareColumns;
    const bool per_block_order = folded && fp8 && tile_tokens < kFoldedStage1MinTokens;
    const bool folded_stage2 = folded && wide_tile_tokens > 0;
    const Activations act(m, d_hidden_pad, fp8, folded, hidden_states.options());
    const Activations inter(num_pairs, d_expert_pad, fp8, false, hidden_states.options());
    const auto inter_folded = folded_stage2 ? torch::empty({num_pairs, d_expert_pad}, int_opts.dtype(torch::kUInt8))
                                     : torch::Tensor();
    const auto folded_weights = folded_stage2 ? torch::empty({num_pairs}, float_opts) : torch::Tensor();
    // The e4m3 configs' stage 2 on folded rows where a row tile is one stage (their stages are 8 blocks).
    const bool folded_rows = fp8 && wide_tile_tokens == 0 && folded_stage2_tokens((int)tile_tokens)
                             && (d_expert + kScaleBlock - 1) / kScaleBlock <= kFoldCodesMaxBlocks;
    const auto inter_factor = folded_rows ? torch::empty({num_pairs}, float_opts) : torch::Tensor();
    auto accumulator = torch::empty({m, d_hidden_pad}, float_opts);

    // What the host expects of the routing, to size grids and K slices.
    const int tiles_estimate = estimated_tiles(num_pairs, n_experts, table_tokens);
    const int wide_tiles_estimate = wide_tile_tokens > 0
        ? (int)std::lround(expected_tiles(m, top_k, n_experts, (int)n_shared_experts, (int)wide_tile_tokens)) : 0;

    const int route_smem = 3 * n_experts * (int)sizeof(int);
    TORCH_CHECK(n_experts <= kMaxExperts, "moe_mxfp4: at most ", kMaxExperts, " experts, got ", n_experts);
    TORCH_CHECK(table_tokens < 1 << (31 - kTileRowsShift), "moe_mxfp4: tiles of ", table_tokens,
                " rows do not fit a tile entry's row bits");
    // Stage 1 in the narrow kernels (launch_stage1): every config without
    // wide tiles, and the 64-token one where Qa does not fold; stage 2 is
    // narrow only without wide tiles. The narrow launchers give the tile a
    // grid dimension of its own: refused here, before any kernel is queued.
    const bool narrow_stage1 = wide_tile_tokens == 0 || (wide_tile_tokens == 64 && !folded);
    TORCH_CHECK(!narrow_stage1 || max_tiles <= kMaxGridTiles, "moe_mxfp4: ", max_tiles, " tiles outgrow the grid's ",
                kMaxGridTiles, " (fewer tokens per call, or a wider tile)");
    const auto route_and_quantize = per_block_order ? route_and_quantize_kernel<true, true>
                                  : folded ? route_and_quantize_kernel<false, true>
                                  : fp8    ? route_and_quantize_kernel<true, false>
                                           : route_and_quantize_kernel<false, false>;
    allow_shared_memory(route_and_quantize, 3 * kMaxExperts * (int)sizeof(int));
    route_and_quantize<<<dim3(m + 1, (d_hidden_pad + kPrepareColumns - 1) / kPrepareColumns), kPrepareThreads,
                         route_smem, stream>>>(
        topk_ids.data_ptr<int>(), topk_weights.data_ptr<float>(), num_pairs, top_k, n_experts, table_tokens,
        expert_offsets, tiles, num_tiles, sorted_tokens, sorted_weights, bad_ids, bf16_ptr(hidden_states),
        (int)d_hidden, d_hidden_pad, act.bytes(), folded ? act.token_scales() : act.scales(),
        folded && fp8 ? act.scales() : nullptr, accumulator.data_ptr<float>(), redo_tiles);
    MOE_CUDA_CHECK(cudaGetLastError());

    const MoeCall call{stream, num_pairs, n_experts, (int)d_hidden, d_hidden_pad, (int)d_expert, d_expert_pad,
                       (int)stage1_splits, (int)stage2_row_tiles, gate_up_weight, gate_up_weight_shuffled,
                       gate_up_scale, down_weight,
                       down_scale, act, inter, sorted_tokens, sorted_weights, expert_offsets, accumulator,
                       bf16_ptr(hidden_states), m, folded_stage2 ? stage2_redo : nullptr,
                       folded_stage2 ? inter_folded.data_ptr<uint8_t>() : nullptr,
                       folded_stage2 ? folded_weights.data_ptr<float>() : nullptr,
                       folded_rows ? inter_factor.data_ptr<float>() : nullptr};
    const TileTable narrow{tiles, num_tiles, max_tiles, tiles_estimate};
    const TileTable wide{tiles, num_tiles, max_tiles, wide_tiles_estimate};
    // 64-token wide tiles: the folded wide stage 1 where Qa folds the
    // activations, else the config's own 64-token kernel, over the same
    // tiles (see WideTraits); stage 2 in the wide kernel. 48 and 144: both
    // stages in the wide kernels.
#define MOE_LAUNCH_STAGE1(NT, MT, WT, SB, STAGES, WG, FP8, MT2) \
    if (MOE_IS(NT, MT, WT, SB, STAGES, WG, FP8, MT2)) launch_stage1<NT, MT, WT, SB, STAGES, WG, FP8>(call, narrow);
#define MOE_LAUNCH_STAGE2(NT, MT, WT, SB, STAGES, WG, FP8, MT2) \
    if (MOE_IS(NT, MT, WT, SB, STAGES, WG, FP8, MT2)) launch_stage2<NT, MT2, WT, SB, STAGES, WG, FP8>(call, narrow);
    if (wide_tile_tokens == 144) {
        launch_wide_stage1<144>(call, wide, folded, redo_tiles);
        launch_wide_stage2<144>(call, wide, folded);
    } else if (wide_tile_tokens == 48) {
        launch_wide_stage1<48>(call, wide, folded, redo_tiles);
        launch_wide_stage2<48>(call, wide, folded);
    } else {
        if (narrow_stage1) { MOE_GEMM_CONFIGS(MOE_LAUNCH_STAGE1) }
        else launch_wide_stage1<64>(call, wide, true, redo_tiles);
        if (wide_tile_tokens == 64) launch_wide_stage2<64>(call, wide, folded);
        else { MOE_GEMM_CONFIGS(MOE_LAUNCH_STAGE2) }
    }
#undef MOE_LAUNCH_STAGE1
#undef MOE_LAUNCH_STAGE2
#undef MOE_IS

    launch_after_previous(convert_output_kernel,
        dim3(m, (d_hidden + 4 * kConvertThreads - 1) / (4 * kConvertThreads)), kConvertThreads, 0, stream,
        accumulator.data_ptr<float>(), d_hidden_pad, bf16_ptr(out), (int)d_hidden, bad_ids);
    return out;
}
"""

HOST_DECLARATION = """
torch::Tensor moe_forward(
    torch::Tensor hidden_states, torch::Tensor gate_up_weight, torch::Tensor down_weight,
    torch::Tensor gate_up_scale, torch::Tensor down_scale, torch::Tensor gate_up_weight_shuffled,
    torch::Tensor topk_weights,
    torch::Tensor topk_ids, int64_t d_hidden, int64_t d_expert, int64_t n_shared_experts, int64_t tile_tokens,
    int64_t warp_rows, int64_t warp_tokens, int64_t stage_blocks, int64_t stages, bool wgmma, bool fp8,
    int64_t stage2_warp_rows, int64_t wide_tile_tokens, bool token_scaled,
    int64_t stage1_splits, int64_t stage2_row_tiles);
"""

# ===========================================================================
# Build: load_inline into a cache keyed by everything that changes the binary
# ===========================================================================
CACHE_DIR_ENV = "MOE_MXFP4_CACHE_DIR"   # overrides the kernel cache directory
NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo"]
# Link the shared libstdc++, the one torch uses. On the H200 machine the
# compiler torch builds with (/opt/gcc) put a private copy of libstdc++'s
# exception runtime into every extension (nm: __cxa_* defined, no libstdc++
# in NEEDED), and a TORCH_CHECK thrown inside moe_forward then ended the
# process with a segmentation fault instead of a RuntimeError (2026-12-03).
LINK_FLAGS = ["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else []
MAX_EXPERTS = int(re.search(r"kMaxExperts = (\d+);", COMMON_SOURCE).group(1))
# Stage 2 indexes its fp32 accumulator (tokens x d_hidden_pad) in 32 bits.
MAX_ACCUMULATOR_ELEMENTS = 2 ** 31 - 1


def _cuda_arch(capability) -> Optional[str]:
    """TORCH_CUDA_ARCH_LIST entry for a compute capability, or None before sm_89. (The kernels
    need only sm_80's bf16 mma.sync; the CPU tests build them for sm_89 and sm_100 too, but only
    sm_90 GPUs have run them: _cuda_backend warns on the others.)"""
    major, minor = capability
    if (major, minor) < (8, 9):
        return None
    return "9.0a" if major == 9 else f"{major}.{minor}"


def _cache_root() -> str:
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return configured
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moe_mxfp4")


def _writable_dir(path: str) -> str:
    """path, created if needed, or a per-user temporary directory if path cannot be written."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, delete=True)
        probe.close()
        return path
    except OSError:
        user = os.getuid() if hasattr(os, "getuid") else "user"
        fallback = os.path.join(tempfile.gettempdir(), f"moe_mxfp4-{user}", os.path.basename(path))
        os.makedirs(fallback, exist_ok=True)
        print(f"moe_mxfp4: cache directory {path} is not writable; using {fallback}", file=sys.stderr)
        return fallback


def _load_extension(name: str, arch: str, build_dir: str, declaration: Optional[str] = None,
                    source: Optional[str] = None, function: str = "moe_forward"):
    """torch's load_inline for our source (or, for the tools'
    microbenchmarks, another source with its function's declaration): builds
    with ninja unless build_dir already holds an up-to-date library (torch's
    file lock makes concurrent builders wait for one build), then imports it."""
    from torch.utils.cpp_extension import load_inline

    previous_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    try:
        # Copies of the flag lists: load_inline appends torch's own link
        # flags to the list it is given, which changed _build_location's key
        # for the process's next build, so that a process that built twice
        # (ab_bench's smoke run: _backend, then custom_kernel on cuda:0)
        # built everything again in a second directory (75 s per version).
        return load_inline(name=name, cpp_sources=declaration or HOST_DECLARATION,
                           cuda_sources=source or KERNEL_SOURCE + HOST_SOURCE, functions=[function],
                           extra_cuda_cflags=list(NVCC_FLAGS), extra_ldflags=list(LINK_FLAGS),
                           build_directory=build_dir, verbose=False)
    finally:
        if previous_arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = previous_arch


def _build_location(arch: str):
    """(build directory, module name) for `arch`, keyed by everything that changes the binary."""
    key = hashlib.sha256("\0".join([KERNEL_SOURCE, HOST_SOURCE, HOST_DECLARATION, " ".join(NVCC_FLAGS + LINK_FLAGS),
                                    arch, torch.__version__, str(torch.version.cuda)]).encode()).hexdigest()[:16]
    return _writable_dir(os.path.join(_cache_root(), key)), f"moe_mxfp4_{key}"


def _build_kernels(arch: str):
    """Compile (or load from the cache) the extension for `arch`."""
    build_dir, name = _build_location(arch)
    libraries = lambda: [f for f in os.listdir(build_dir) if f.startswith(name) and f.endswith(".so")]  # noqa: E731
    already_built = bool(libraries())
    if not already_built:
        print(f"moe_mxfp4: building CUDA kernels for sm_{arch.replace('.', '')} in {build_dir} "
              "(first use only, about a minute)...", file=sys.stderr, flush=True)
    start = time.time()
    try:
        module = _load_extension(name, arch, build_dir)
    except (ImportError, OSError) as error:
        if not already_built:
            raise
        # The cached library no longer loads (truncated, corrupted): remove it
        # so that ninja links it again, once.
        print(f"moe_mxfp4: the cached library in {build_dir} does not load ({error}); rebuilding it",
              file=sys.stderr, flush=True)
        for library in libraries():
            os.remove(os.path.join(build_dir, library))
        module = _load_extension(name, arch, build_dir)
        already_built = False
    if not already_built:
        print(f"moe_mxfp4: built in {time.time() - start:.1f} s", file=sys.stderr, flush=True)
    return module


# ===========================================================================
# Dispatch
# ===========================================================================
def choose_config(m: int, top_k: int, n_experts: int, d_expert: int, wgmma: bool = False) -> KernelConfig:
    """GEMM configuration for a call, from the sweep of tools/profile_kernels.py
    (BENCHMARKS.md); wgmma: the GPU has Hopper's warpgroup MMAs (sm_90).
    Tiles hold one expert's tokens, so a tile is best while most experts'
    tokens fit in one tile and few of its columns stay empty: an expert
    spilling into a second tile has its weights read and converted again,
    while wide tiles waste MMA work. So 8-token tiles up to 8 tokens per
    expert, 16 up to 16 (20 without wgmma), on sm_90 24 up to 24 (best at
    17.5-22.4, 16-token tiles at 13.4), 32 up to 28 (best at 26.2, 64-token
    tiles at 35). Those narrow tiles take e4m3 warpgroup MMAs
    on sm_90, whose fp4 -> e4m3 conversion costs under half the integer work
    of fp4 -> bf16; with 8-token tiles, stage 2's warpgroups each cover two
    64-row MMA tiles (fewer instructions per weight: its stage 2 is
    issue-bound, while its stage 1 was slower so). Beyond them 64-token tiles
    win: each warp converts its weights once for all 64 tokens, and on sm_90
    warpgroup MMAs read the tokens from shared memory without ldmatrix. On
    sm_90 stage 2 runs in the warp-specialised wide kernel (loading warps,
    two compute warpgroups, no CTA barrier per stage), and so does stage 1
    where Qa can fold the activations into E4M3 bytes (e4m3 MMAs; see
    WideTraits; otherwise the config's own 64-token stage 1); with more
    than 96 tokens per expert both stages run over
    144-token tiles, converting each weight once for that many tokens, and
    up to 45 over 48-token tiles (bs=128 E=33: 32 +- 6 tokens per routed
    expert, which 64-token tiles ran half empty)."""
    tokens_per_expert = m * top_k / max(n_experts, 1)
    if tokens_per_expert <= 8:
        return (KernelConfig(8, 16, 8, 8, 4, True, True, 32, token_scaled=m * top_k >= TOKEN_SCALED_MIN_PAIRS)
                if wgmma else KernelConfig(8, 16, 8, 8, 4, False))
    if wgmma and 16 < tokens_per_expert <= 24:
        return KernelConfig(24, 16, 24, 8, 4, True, True)
    if wgmma and 24 < tokens_per_expert <= 28:
        return KernelConfig(32, 16, 32, 8, 3, True, True)
    if tokens_per_expert <= 20:
        return KernelConfig(16, 16, 16, 8, 3, wgmma, wgmma)
    if wgmma:
        return KernelConfig(64, 16, 64, 4, 4, True, False, 0,
                            144 if tokens_per_expert > 96 else 64 if tokens_per_expert > 45 else 48)
    return KernelConfig(64, 16, 64, 4, 4, False) if d_expert <= 512 else KernelConfig(64, 32, 64, 4, 4, False)


@functools.lru_cache(maxsize=None)
def _has_wgmma(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


_backend_cache = {}


def _warn_fallback(reason: str):
    warnings.warn(f"moe_mxfp4: {reason}; using the PyTorch a4w4 path (correct, slow).", RuntimeWarning,
                  stacklevel=3)


def _backend(device: torch.device):
    """('cuda', module) | ('aiter', fused_moe) | ('torch', None) for a device, decided once per device."""
    key = (device.type, device.index)
    if key in _backend_cache:
        return _backend_cache[key]
    backend = ("torch", None)
    if device.type == "cuda" and torch.version.hip:
        try:
            from aiter.fused_moe import fused_moe
            backend = ("aiter", fused_moe)
        except ImportError:
            _warn_fallback("ROCm without AITER (this project's kernels are not verified on AMD)")
    elif device.type == "cuda":
        backend = _cuda_backend(torch.cuda.get_device_capability(device))
    _backend_cache[key] = backend
    return backend


def _cuda_backend(capability):
    arch = _cuda_arch(capability)
    if arch is None:
        _warn_fallback(f"compute capability {capability[0]}.{capability[1]} is older than the kernels are "
                       "built for (8.9+)")
        return ("torch", None)
    try:
        module = _build_kernels(arch)
    except Exception as error:  # a missing compiler or a compile error: say so, keep working
        _warn_fallback(f"building the CUDA kernels failed ({type(error).__name__}: {error})")
        return ("torch", None)
    if capability[0] != 9:
        # They build there (CPU tests), but no test has run them on such a GPU.
        warnings.warn(f"moe_mxfp4: the CUDA kernels have been tested on sm_90 GPUs (H100, H200) only; on compute "
                      f"capability {capability[0]}.{capability[1]} they run untested (check them against "
                      "reference.py before relying on them).", RuntimeWarning, stacklevel=3)
    return ("cuda", module)


def validate_inputs(data: input_t) -> None:
    """Raise ValueError/TypeError naming the argument for any malformed input.
    Shapes, dtypes and devices only: nothing here synchronises with the GPU."""
    if not isinstance(data, (tuple, list)) or len(data) != 12:
        raise TypeError(f"data: expected the 12-tuple of task.input_t, got {type(data).__name__}"
                        + (f" of length {len(data)}" if isinstance(data, (tuple, list)) else ""))
    (hidden_states, gate_up_weight, down_weight, gate_up_scale, down_scale,
     gate_up_weight_shuffled, _, _, _, topk_weights, topk_ids, config) = data
    if not isinstance(config, dict):
        raise TypeError(f"config: expected a dict, got {type(config).__name__}")
    for key in ("d_hidden", "d_expert", "d_hidden_pad", "d_expert_pad"):
        if key not in config:
            raise ValueError(f"config: missing key {key!r}")
    d_hidden, d_expert = config["d_hidden"], config["d_expert"]
    d_hidden_pad, d_expert_pad = config["d_hidden_pad"], config["d_expert_pad"]
    for key, value in (("d_hidden_pad", d_hidden_pad), ("d_expert_pad", d_expert_pad)):
        if value <= 0 or value % 256:
            raise ValueError(f"config[{key!r}]: expected a positive multiple of 256, got {value}")
    if not 0 < d_hidden <= d_hidden_pad or not 0 < d_expert <= d_expert_pad:
        raise ValueError(f"config: need 0 < d_hidden <= d_hidden_pad and 0 < d_expert <= d_expert_pad, got "
                         f"{d_hidden}, {d_hidden_pad}, {d_expert}, {d_expert_pad}")

    named = {"hidden_states": hidden_states, "gate_up_weight": gate_up_weight, "down_weight": down_weight,
             "gate_up_weight_scale": gate_up_scale, "down_weight_scale": down_scale,
             "gate_up_weight_shuffled": gate_up_weight_shuffled, "topk_weights": topk_weights, "topk_ids": topk_ids}
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    device = hidden_states.device
    for name, tensor in named.items():
        if tensor.device != device:
            raise ValueError(f"{name}: on {tensor.device}, but hidden_states is on {device}")
    byte_types = (torch.uint8, getattr(torch, "float4_e2m1fn_x2", torch.uint8), getattr(torch, "float8_e8m0fnu", torch.uint8))
    expected_dtypes = {"hidden_states": (torch.bfloat16,), "gate_up_weight": byte_types, "down_weight": byte_types,
                       "gate_up_weight_scale": byte_types, "down_weight_scale": byte_types,
                       "gate_up_weight_shuffled": byte_types,
                       "topk_weights": (torch.float32,), "topk_ids": (torch.int32,)}
    for name, dtypes in expected_dtypes.items():
        if named[name].dtype not in dtypes:
            raise TypeError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {named[name].dtype}")

    if hidden_states.dim() != 2 or hidden_states.shape[1] != d_hidden:
        raise ValueError(f"hidden_states: expected [M, {d_hidden}], got {list(hidden_states.shape)}")
    m = hidden_states.shape[0]
    if gate_up_weight.dim() != 3 or gate_up_weight.shape[1:] != (2 * d_expert_pad, d_hidden_pad // 2):
        raise ValueError(f"gate_up_weight: expected [E, {2 * d_expert_pad}, {d_hidden_pad // 2}], "
                         f"got {list(gate_up_weight.shape)}")
    n_experts = gate_up_weight.shape[0]
    if not 0 < n_experts <= MAX_EXPERTS:
        raise ValueError(f"gate_up_weight: expected 1..{MAX_EXPERTS} experts, got {n_experts}")
    if gate_up_weight_shuffled.shape != gate_up_weight.shape:
        raise ValueError(f"gate_up_weight_shuffled: expected gate_up_weight's shape {list(gate_up_weight.shape)}, "
                         f"got {list(gate_up_weight_shuffled.shape)}")
    if list(down_weight.shape) != [n_experts, d_hidden_pad, d_expert_pad // 2]:
        raise ValueError(f"down_weight: expected {[n_experts, d_hidden_pad, d_expert_pad // 2]}, "
                         f"got {list(down_weight.shape)}")
    for name, tensor, rows, cols in (("gate_up_weight_scale", gate_up_scale, 2 * d_expert_pad, d_hidden_pad // 32),
                                     ("down_weight_scale", down_scale, d_hidden_pad, d_expert_pad // 32)):
        if tuple(tensor.shape) not in ((n_experts * rows, cols), (n_experts, rows, cols)):
            raise ValueError(f"{name}: expected [{n_experts * rows}, {cols}] or [{n_experts}, {rows}, {cols}], "
                             f"got {list(tensor.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != m or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids: expected [{m}, top_k], got {list(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights: expected {list(topk_ids.shape)} like topk_ids, got {list(topk_weights.shape)}")
    # Keys the dispatcher does not need must still agree with the tensors.
    for key, actual, what in (("total_top_k", topk_ids.shape[1], "topk_ids has {} columns"),
                              ("bs", m, "hidden_states has {} rows")):
        if key in config and config[key] != actual:
            raise ValueError(f"config[{key!r}]: {config[key]}, but {what.format(actual)}")
    if "n_routed_experts" in config and "n_shared_experts" in config and \
            config["n_routed_experts"] + config["n_shared_experts"] != n_experts:
        raise ValueError(f"config: n_routed_experts + n_shared_experts = "
                         f"{config['n_routed_experts'] + config['n_shared_experts']}, but the weights hold "
                         f"{n_experts} experts")


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """tensor, or a copy in a fresh (aligned) allocation if it does not start on a 16-byte boundary."""
    return tensor if tensor.data_ptr() % 16 == 0 else tensor.clone()


def _chosen_config(data: input_t) -> KernelConfig:
    """choose_config's pick for an input, on the GPU its tensors are on."""
    hidden_states, gate_up_weight, topk_ids, config = data[0], data[1], data[10], data[11]
    return choose_config(hidden_states.shape[0], topk_ids.shape[1], gate_up_weight.shape[0], config["d_expert"],
                         _has_wgmma(hidden_states.device.index))


def _moe_forward_args(data: input_t, kernel_config: Optional[KernelConfig] = None, stage1_splits: int = 0,
                      stage2_row_tiles: int = 0) -> tuple:
    """moe_forward's arguments for an input (see _run_kernels)."""
    (hidden_states, gate_up_weight, down_weight, gate_up_scale, down_scale,
     gate_up_weight_shuffled, _, _, _, topk_weights, topk_ids, config) = data
    # Checked here as well as in moe_forward, so that a call too large for
    # the kernels' 32-bit accumulator offsets is a ValueError, like every
    # other mistake a caller can make, before anything is allocated.
    most_tokens = MAX_ACCUMULATOR_ELEMENTS // down_weight.shape[1]
    if hidden_states.shape[0] > most_tokens:
        raise ValueError(f"hidden_states: the CUDA kernels take at most {most_tokens} tokens per call at "
                         f"d_hidden_pad {down_weight.shape[1]}, got {hidden_states.shape[0]}; split the call")
    if kernel_config is None:
        kernel_config = _chosen_config(data)
    # The kernels read weights and scales in 16-byte copies and TMA boxes,
    # which need 16-byte aligned addresses: a view that starts elsewhere (a
    # slice, a storage offset) is copied, at the cost of a copy per call.
    as_bytes = lambda t: _aligned(t.contiguous().view(torch.uint8))  # noqa: E731
    return (hidden_states.contiguous(), as_bytes(gate_up_weight), as_bytes(down_weight), as_bytes(gate_up_scale),
            as_bytes(down_scale), as_bytes(gate_up_weight_shuffled), topk_weights.contiguous(), topk_ids.contiguous(),
            config["d_hidden"], config["d_expert"], config.get("n_shared_experts", 0), *kernel_config, stage1_splits,
            stage2_row_tiles)


def _run_kernels(module, data: input_t, kernel_config: Optional[KernelConfig] = None,
                 stage1_splits: int = 0, stage2_row_tiles: int = 0) -> output_t:
    """The CUDA kernels; kernel_config, stage1_splits (slices of stage 1's K)
    and stage2_row_tiles (row tiles per stage-2 CTA) override the choices, for
    tests and sweeps (0: the host code chooses)."""
    return module.moe_forward(*_moe_forward_args(data, kernel_config, stage1_splits, stage2_row_tiles))


def _run_aiter(fused_moe, data: input_t) -> output_t:
    from aiter import ActivationType, QuantType
    (hidden_states, _, _, _, _, gate_up_shuffled, down_shuffled, gate_up_scale_shuffled,
     down_scale_shuffled, topk_weights, topk_ids, config) = data
    return fused_moe(hidden_states, gate_up_shuffled, down_shuffled, topk_weights, topk_ids,
                     expert_mask=None, activation=ActivationType.Silu, quant_type=QuantType.per_1x32,
                     doweight_stage1=False, w1_scale=gate_up_scale_shuffled, w2_scale=down_scale_shuffled,
                     a1_scale=None, a2_scale=None,
                     hidden_pad=config["d_hidden_pad"] - config["d_hidden"],
                     intermediate_pad=config["d_expert_pad"] - config["d_expert"])


def _run_torch(data: input_t) -> output_t:
    # The a4w4 math lives once, in this project's reference.py (beside this file).
    from reference import moe_a4w4_torch
    topk_ids, n_experts = data[10], data[1].shape[0]
    if topk_ids.device.type == "cpu" and topk_ids.numel() and not (
            0 <= int(topk_ids.min()) and int(topk_ids.max()) < n_experts):
        raise ValueError(f"topk_ids: expert ids must lie in [0, {n_experts}), got "
                         f"[{int(topk_ids.min())}, {int(topk_ids.max())}]")
    return moe_a4w4_torch(data)


def custom_kernel(data: input_t) -> output_t:
    """The MoE layer's output for task.input_t. Inputs #5-#8 must be the
    shuffled copies of #1-#4 that the task makes (SPEC section 3): on sm_90
    stage 1's folded form reads #5 in place of #1, and checking that they
    agree would cost a read of both per call."""
    validate_inputs(data)
    hidden_states = data[0]
    if hidden_states.shape[0] == 0:
        return torch.empty((0, data[11]["d_hidden"]), dtype=torch.bfloat16, device=hidden_states.device)
    kind, impl = _backend(hidden_states.device)
    if kind == "cuda":
        return _run_kernels(impl, data)
    if kind == "aiter":
        return _run_aiter(impl, data)
    return _run_torch(data)


# A torch.library op around custom_kernel, so that torch.compile can trace a
# model that calls it: the fake implementation gives the output's shape
# without running anything. The config dict travels as its four sizes and
# the shared experts' count (which only the host's tile estimate reads: with
# it the op chooses as custom_kernel does).
@torch.library.custom_op("moe_mxfp4::moe", mutates_args=())
def moe_op(hidden_states: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
           gate_up_weight_scale: torch.Tensor, down_weight_scale: torch.Tensor,
           gate_up_weight_shuffled: torch.Tensor, down_weight_shuffled: torch.Tensor,
           gate_up_weight_scale_shuffled: torch.Tensor, down_weight_scale_shuffled: torch.Tensor,
           topk_weights: torch.Tensor, topk_ids: torch.Tensor,
           d_hidden: int, d_expert: int, d_hidden_pad: int, d_expert_pad: int,
           n_shared_experts: int = 0) -> torch.Tensor:
    config = {"d_hidden": d_hidden, "d_expert": d_expert, "d_hidden_pad": d_hidden_pad, "d_expert_pad": d_expert_pad,
              "n_shared_experts": n_shared_experts}
    return custom_kernel((hidden_states, gate_up_weight, down_weight, gate_up_weight_scale, down_weight_scale,
                          gate_up_weight_shuffled, down_weight_shuffled, gate_up_weight_scale_shuffled,
                          down_weight_scale_shuffled, topk_weights, topk_ids, config))


@moe_op.register_fake
def _moe_op_shape(hidden_states, *tensors_and_sizes):
    d_hidden = tensors_and_sizes[10]
    return hidden_states.new_empty((hidden_states.shape[0], d_hidden))


def moe_op_args(data: input_t) -> tuple:
    """custom_kernel's input tuple as moe_op's arguments."""
    config = data[11]
    return tuple(data[:11]) + (config["d_hidden"], config["d_expert"], config["d_hidden_pad"], config["d_expert_pad"],
                               config.get("n_shared_experts", 0))


# ===========================================================================
# Self-benchmark: python solution.py
# ===========================================================================
# The official benchmark shapes (SPEC section 6) with AITER's MI355X times.
BENCHMARK_SHAPES = [  # (bs, routed experts, d_expert, seed, AITER MI355X us)
    (16, 256, 256, 9371, 152.7), (128, 256, 256, 2291, 239.0), (512, 256, 256, 81934, 336.5),
    (16, 32, 512, 2291, 106.2), (128, 32, 512, 81934, 141.1), (512, 32, 512, 81934, 225.0),
    (512, 32, 2048, 81934, 380.4)]
D_HIDDEN, TOP_K, N_SHARED = 7168, 8, 1
# H200 ceilings measured for SPEC section 7: HBM read bandwidth and the bf16
# and fp8 MMA rates.
READ_BYTES_PER_S, BF16_MMA_FLOPS_PER_S, FP8_MMA_FLOPS_PER_S = 4.45e12, 791e12, 1469e12


def runs_e4m3_mmas(config: KernelConfig) -> bool:
    """Whether a config multiplies on e4m3 tensor cores, exactly (SPEC
    section 4: E2M1 values and their folded bytes are exact in E4M3): the
    fp8 configs, and the wide ones where Qa folds the activations (any
    activations of normal spread, the benchmark inputs among them; others
    run the bf16 redo)."""
    return config.fp8 or config.wide_tile_tokens > 0


def floor_us(data, e4m3: bool = False) -> float:
    """SPEC section 7's floor for this input: the active experts' weight and
    scale bytes over the read bandwidth, or the FLOPs over the MMA rate the
    kernels use (fp8 where they run e4m3 MMAs, the issue's rule; else bf16),
    whichever is larger. The active experts are this input's (SPEC's table
    counts the expected number: 102 against the bs=16 E=257 input's 96)."""
    config = data[11]
    active = torch.unique(data[10]).numel()
    weight_bytes = active * 3 * config["d_expert_pad"] * config["d_hidden_pad"] * 17 / 32
    flops = 2 * data[10].numel() * 3 * config["d_expert"] * config["d_hidden"]
    mma_flops_per_s = FP8_MMA_FLOPS_PER_S if e4m3 else BF16_MMA_FLOPS_PER_S
    return max(weight_bytes / READ_BYTES_PER_S, flops / mma_flops_per_s) * 1e6


def main() -> int:
    import reference
    if not torch.cuda.is_available():
        print("No GPU here: running the PyTorch a4w4 path on a small shape on the CPU instead.")
        data = reference.generate_input(512, 256, 8, 2, 1, 8, 1)
        start = time.perf_counter()
        ok, message = reference.check_implementation(data, custom_kernel(data))
        print(f"cpu  d_hidden=512 d_expert=256 E=9 bs=8: {'pass' if ok else 'FAIL'} ({message}), "
              f"{(time.perf_counter() - start) * 1e3:.0f} ms wall")
        return 0 if ok else 1

    import eval as harness  # the timing rules of eval.py: L2 flushed, launch hidden, events
    kind, _ = _backend(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: backend {kind}", flush=True)
    timer = harness.cuda_timer()
    rows, all_ok = [], True
    for i, (bs, routed, d_expert, seed, aiter_us) in enumerate(BENCHMARK_SHAPES):
        label = f"bs={bs} E={routed + N_SHARED} d_expert={d_expert}"
        print(f"[{i + 1}/{len(BENCHMARK_SHAPES)}] {label}: generating, checking, timing...", file=sys.stderr, flush=True)
        data = reference.generate_input(D_HIDDEN, d_expert, routed, TOP_K, N_SHARED, bs, seed)
        ok, message = reference.check_implementation(data, custom_kernel(data))
        all_ok &= ok
        timer.hide_host_cost(harness.host_call_ns(custom_kernel, data))
        times = sorted(timer.time_call(custom_kernel, data)[1] / 1e3 for _ in range(30))
        host_us = min(harness.host_call_ns(custom_kernel, data) for _ in range(10)) / 1e3
        us = times[len(times) // 2]
        floor = floor_us(data, kind == "cuda" and runs_e4m3_mmas(_chosen_config(data)))
        rows.append((label, "pass" if ok else "FAIL", us, floor, 100 * floor / us, aiter_us, host_us,
                     message.split()[0]))
        del data
    geomean = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs))
    print(f"\n{'shape':<30} {'check':<5} {'us':>8} {'floor':>7} {'%floor':>7} {'AITER':>7} {'host us':>8}  error")
    for label, status, us, floor, pct, aiter_us, host_us, err in rows:
        print(f"{label:<30} {status:<5} {us:8.1f} {floor:7.1f} {pct:6.1f}% {aiter_us:7.1f} {host_us:8.1f}  {err}")
    print(f"{'geomean':<30} {'':<5} {geomean([r[2] for r in rows]):8.1f} {geomean([r[3] for r in rows]):7.1f} "
          f"{'':>7} {geomean([r[5] for r in rows]):7.1f}")
    print("us: median of 30 event-timed calls after an L2 flush; floor: SPEC section 7, at the fp8 MMA rate "
          "where the shape's kernels run e4m3 MMAs, else bf16 (floor_us); AITER: MI355X; "
          "host us: one call's host cost")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())

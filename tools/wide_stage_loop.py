"""How fast the folded wide stage 1's consumer loop runs when fed in
different ways, apart from the rest of the kernel: the question behind its
unit-stage (4 scale blocks), about 1,090 cycles at 64 tokens even with no
fp4 conversion (thirtieth session), against 256 cycles of tensor work,
while the consumers' MMA chain alone runs at the tensor cores' bound
(tools/wgmma_chain.py, thirty-sixth session).

One CTA per SM: the kernels' eight consumer warps (two warpgroups of 64
weight rows) run solution.py's own consumer stage, wide_compute_stage_folded
(the full-barrier wait, the scale words, ldmatrix of the fp4 words, the
fold, the e4m3 MMAs, the empty arrival), over units of 56 stages (K = 7168)
with a wait for the MMAs after each unit, as stage1_wide_kernel does, and
no epilogue. The ring's slots are fed one of five ways,

  static     one loading thread only marks each slot full (the slots hold
             fixed weights, scales and activations): the consumers alone
  no_fold    the same, the consumers' MMAs on the raw fp4 words (no fold)
  weights    the weights by TMA, two 64-row boxes a stage, streamed from a
             484 MB buffer (d2048's gate/up weights), as stage1_wide_kernel
  both       the weights, and the activations by TMA too (one 128-byte box
             of all the tile's tokens, from 512 tokens' rows)
  gathers    the weights by TMA and the rest as stage1_wide_kernel loads
             it: four loading warps, 16-byte cp.async copies of the tokens'
             rows and a scale word per weight row, a copy group a stage,
             the previous stage marked full once its group has landed
             (slower here than in the kernel: 2,115 cycles a stage at 144
             tokens against the kernel's ~1,550, and the kernel did not
             speed up when its loaders stopped waiting for their copies;
             BENCHMARKS, thirty-eighth session)

and, for the other design (ss_loop_kernel), four warps of their own fold
the fp4 weights into e4m3 bytes in the slot and the consumers' MMAs take
both operands from shared memory (no register operand, no fold on their
path; the folded weights in the kernels' activation order, not scaled by
their rows' scales, no window test):

  ss_static  the slots only marked full
  ss_both    the weights and activations by TMA (as both)

Prints cycles per stage (clock64, each warpgroup's median over the CTAs)
against the tensor cores' bound (4 x N cycles a stage for two warpgroups
at N tokens), the rate at which the stages consume weight bytes (read
from memory only by the weights, both, gathers and ss_both feeds), and
whether every consumer's sums came out right (every weight and activation
folds to 1.0; not for no_fold).

    python tools/wide_stage_loop.py [--units 40] [--tokens 64 144]

Needs an sm_90 GPU; the source also compiles without one (tests).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import solution  # noqa: E402

FEEDS = ("static", "no_fold", "weights", "both", "gathers", "ss_static", "ss_both")
TOKENS = (64, 144)
UNIT_STAGES = 56            # K = 7168 in stages of 4 scale blocks
WEIGHT_ROWS = 33 * 4096     # d2048's gate and up rows, 3,584 bytes each
ACT_ROWS = 512              # tokens whose activation rows the tiles read


def _ss_wgmma_source(n: int) -> str:
    """wgmma_ss_e4m3<n>: d (+)= a.b, m64n{n}k32 e4m3, both operands by
    descriptor (the kernels' wrappers take a from registers)."""
    regs = n // 2
    outputs = ", ".join(f"%{i}" for i in range(regs))
    constraints = ", ".join(f'"+f"(d[{i // 4}][{i % 4}])' for i in range(regs))
    return f"""
template <> __device__ __forceinline__ void wgmma_ss_e4m3<{n}>(float (&d)[{n // 8}][4], uint32_t a_descriptor,
                                                           uint32_t b_descriptor, uint32_t accumulate) {{
    asm volatile("{{\\n.reg .pred accumulate;\\n.reg .b64 a, b;\\nsetp.ne.b32 accumulate, %{regs + 2}, 0;\\n"
                 "mov.b64 a, {{%{regs}, %{regs + 3}}};\\nmov.b64 b, {{%{regs + 1}, %{regs + 3}}};\\n"
                 "wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{outputs}}}, a, b, accumulate, 1, 1;\\n}}\\n"
                 : {constraints}
                 : "r"(a_descriptor), "r"(b_descriptor), "r"(accumulate), "r"(kWgmmaDescriptorHigh));
}}
"""


# The loop's kernels, on solution.py's device code compiled from the same
# text (the consumer stage, its layouts, the barrier, TMA and copy helpers);
# the host entry uses solution.py's tensor_map.
LOOP_KERNEL_SOURCE = r"""
namespace moe {
template <int N>
__device__ __forceinline__ void wgmma_ss_e4m3(float (&d)[N / 8][4], uint32_t a_descriptor, uint32_t b_descriptor,
                                              uint32_t accumulate);
""" + "".join(_ss_wgmma_source(n) for n in TOKENS) + r"""
constexpr int kLoopWeightBytesPerRow = 3584, kLoopActBytesPerRow = 7168;
// The feeds (FEEDS in the Python below, in this order).
enum LoopFeed { kStatic, kNoFold, kWeights, kBoth, kGathers, kSsStatic, kSsBoth };
// Loading warps: one thread for TMA, or four warps whose copies gather the activations.
template <int kFeed> constexpr int kLoopLoaderWarps = kFeed == kGathers ? 4 : 1;
// wide_compute_stage_folded without the fold: each block's MMA on the raw
// fp4 words (wrong values, the same MMAs; the thirtieth session's
// wide_folded_no_convert bound, apart from the kernel).
template <int kTokens, int kRing>
__device__ __forceinline__ void stage_without_fold(float (&acc)[kTokens / 8][4], uint8_t* smem, uint64_t* full,
                                                   uint64_t* empty, int s, bool first_of_tile,
                                                   const WideLaneOffsets& offsets) {
    using W = WideLayout<kTokens>;
    uint32_t scales[2][1];
    const uint8_t* base = wide_stage_slot<W, kRing>(smem, full, s, offsets, scales);
    const uint32_t act_descriptor = wgmma_descriptor_low(base + W::kActOffset);
    wide_stage_blocks<W, kRing>(base, empty, s, offsets, [&](int block, const uint32_t (&words)[2]) {
        const uint32_t a[4] = {words[0], words[1], words[0] ^ scales[0][0], words[1] ^ scales[1][0]};
        wgmma_fence();
        wgmma_e4m3_mma<kTokens>(acc, a, act_descriptor + W::act_offset(0, 2 * block) / 16,
                                !first_of_tile || block > 0);
    });
}
template <int kTokens, int kFeed>
__global__ void __launch_bounds__((WideLayout<kTokens>::kConsumerWarps + kLoopLoaderWarps<kFeed>) * 32, 1)
stage_loop_kernel(int units, int unit_stages, const uint8_t* __restrict__ acts, int act_rows,
                  const uint8_t* __restrict__ scale_bytes, int weight_rows,
                  long long* cycles, float* sink, const __grid_constant__ TensorMap weight_map,
                  const __grid_constant__ TensorMap act_map) {
    using W = WideStage1<kTokens>;
    constexpr int kRing = W::kRing, kLoaders = kLoopLoaderWarps<kFeed> * 32;
    extern __shared__ __align__(16) uint8_t smem_base[];
    __shared__ uint64_t full[kRing], empty[kRing];
    uint8_t* smem = align_shared<1024>(smem_base);
    const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xFFFFFFFFu, tid >> 5, 0);
    // Every slot: e4m3 activations of 1.0, fp4 codes of 1.0 and scale bytes
    // 127, inside the fold's window (the fed ways overwrite the first two).
    for (int i = tid; i < kRing * W::kStageBytes / 4; i += blockDim.x) {
        const int offset = i * 4 % W::kStageBytes;
        reinterpret_cast<uint32_t*>(smem)[i] = offset < W::kWeightOffset ? 0x38383838u
                                             : offset < W::kScaleOffset ? 0x22222222u : 0x7F7F7F7Fu;
    }
    if (tid == 0)
        for (int j = 0; j < kRing; ++j) {
            mbarrier_init(&full[j], kFeed == kGathers ? 1 + kLoaders : 1);
            mbarrier_init(&empty[j], W::kConsumerWarps * 32);
        }
    fence_mbarrier_init();
    fence_async_shared();   // the slots' contents before the MMAs and TMA (the async proxy) touch them
    __syncthreads();

    if (warp >= W::kConsumerWarps) {   // the loads
        const int p = tid - W::kConsumerWarps * 32;
        if (kFeed != kGathers && p != 0) return;
        constexpr int SB = W::kStageBlocks, kChunks = SB * kScaleBlock / 16;   // a token's 16-byte chunks a stage
        for (int unit_index = 0, s = 0; unit_index < units; ++unit_index) {
            const int unit = unit_index * gridDim.x + blockIdx.x;   // each unit new weights and tokens
            for (int stage = 0; stage < unit_stages; ++stage, ++s) {
                const int slot = s % kRing;
                if (s >= kRing) mbarrier_wait(&empty[slot], (s / kRing - 1) & 1);
                uint8_t* base = smem + slot * W::kStageBytes;
                if constexpr (kFeed == kStatic || kFeed == kNoFold) {
                    mbarrier_arrive(&full[slot]);
                    continue;
                }
                if (p == 0) {
                    mbarrier_arrive_expecting(&full[slot], W::kWeightBytes + (kFeed == kBoth ? kTokens * 128 : 0));
#pragma unroll
                    for (int i = 0; i < 2; ++i)
                        tma_load_2d(base + W::kWeightOffset + i * (kRows / 2) * (SB * 16), &weight_map,
                                    stage * SB * 16, (unit * kRows + i * (kRows / 2)) % weight_rows, &full[slot]);
                    if constexpr (kFeed == kBoth)
                        tma_load_2d(base + W::kActOffset, &act_map, stage * 128, unit * kTokens % act_rows,
                                    &full[slot]);
                }
                if constexpr (kFeed == kGathers) {
                    // As stage1_wide_kernel's loaders: the tokens' 16-byte chunks and a weight row's
                    // scale word per thread (from the weight bytes, codes of 1.0 read as scale 2^-93,
                    // inside the fold's window), one group a stage; the previous stage is marked
                    // full once its group has landed.
                    for (int c = p; c < kTokens * kChunks; c += kLoaders) {
                        const int token = c / kChunks, chunk = c % kChunks;
                        cp_async_16(base + W::kActOffset + W::act_offset(token, chunk),
                                    acts + (size_t)((unit * kTokens + token) % act_rows) * kLoopActBytesPerRow
                                    + stage * 128 + chunk * 16, 16);
                    }
                    cp_async_small<4>(base + W::kScaleOffset + p * SB, scale_bytes
                                      + (size_t)((unit * kRows + p) % weight_rows) * kLoopWeightBytesPerRow
                                      + stage * SB, 4);
                    cp_async_commit();
                    if (stage > 0) {
                        cp_async_wait<1>();
                        fence_async_shared();
                        mbarrier_arrive(&full[(s - 1) % kRing]);
                    }
                }
            }
            if constexpr (kFeed == kGathers) {
                cp_async_wait<0>();
                fence_async_shared();
                mbarrier_arrive(&full[(s - 1) % kRing]);
            }
        }
        return;
    }

    const WideLaneOffsets offsets = wide_lane_offsets<W>(warp * 16, lane, [](int r) { return r; });
    float acc[kTokens / 8][4];
#pragma unroll
    for (int nt = 0; nt < kTokens / 8; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.0f;
    FoldedRows rows{};
    uint32_t out_of_window = 0;
    float total = 0.0f;
    const long long start = clock64();
    for (int unit = 0, s = 0; unit < units; ++unit) {
        for (int stage = 0; stage < unit_stages; ++stage, ++s)
            if constexpr (kFeed == kNoFold)
                stage_without_fold<kTokens, kRing>(acc, smem, full, empty, s, stage == 0, offsets);
            else
                wide_compute_stage_folded<W, kRing>(acc, smem, full, empty, s, stage == 0, offsets, rows,
                                                    out_of_window);
        wgmma_wait<0>();
        total += acc[0][0];   // row 16 warp + g, token 2t: 7168 products of 1.0 a unit (not for no_fold)
    }
    const long long stop = clock64();
    sink[blockIdx.x * W::kConsumerWarps * 32 + tid] = out_of_window != 0 ? -1.0f : total;
    if (tid % 128 == 0) cycles[blockIdx.x * 2 + tid / 128] = stop - start;
}
// The other design: four fold warps of their own fold each stage's fp4
// weights into e4m3 bytes in the slot (128 rows of 128 bytes, the 128-byte
// swizzle of the activations), and the consumers issue m64nNk32 MMAs with
// both operands in shared memory, four a stage and one commit, keeping two
// stages in flight. Fed kSsStatic (slots only marked full) or kSsBoth
// (weights and activations by TMA, as kBoth). Each slot grows by the 16 KB
// of folded weights, so the ring is 3 slots at 144 tokens and 5 at 64 (the
// kernels': 4 and 6). The folded bytes land in the order of the kernels'
// folded activations (folded_act_position), so a kernel built this way
// would multiply the right pairs; here the sums are only checked on 1.0s,
// not scaled by the rows' 2^(base - 127), and no window test is made.
template <int kTokens>
struct SsLayout : WideLayout<kTokens> {
    using L = WideLayout<kTokens>;
    static constexpr int kFoldedOffset = L::kStageBytes, kSlotBytes = L::kStageBytes + kRows * 128;
    static constexpr int kRing = (227 * 1024 - 2048) / kSlotBytes, kFoldWarps = 4;
};
template <int kTokens, int kFeed>
__global__ void __launch_bounds__((WideLayout<kTokens>::kConsumerWarps + 1 + SsLayout<kTokens>::kFoldWarps) * 32, 1)
ss_loop_kernel(int units, int unit_stages, int act_rows, int weight_rows, long long* cycles, float* sink,
               const __grid_constant__ TensorMap weight_map, const __grid_constant__ TensorMap act_map) {
    using W = SsLayout<kTokens>;
    constexpr int kRing = W::kRing, SB = W::kStageBlocks;
    extern __shared__ __align__(16) uint8_t smem_base[];
    __shared__ uint64_t full[kRing], folded[kRing], empty[kRing];
    uint8_t* smem = align_shared<1024>(smem_base);
    const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xFFFFFFFFu, tid >> 5, 0);
    for (int i = tid; i < kRing * W::kSlotBytes / 4; i += blockDim.x) {
        const int offset = i * 4 % W::kSlotBytes;
        reinterpret_cast<uint32_t*>(smem)[i] = offset < W::kWeightOffset ? 0x38383838u
                                             : offset < W::kScaleOffset ? 0x22222222u
                                             : offset < W::kFoldedOffset ? 0x7F7F7F7Fu : 0u;
    }
    if (tid == 0)
        for (int j = 0; j < kRing; ++j) {
            mbarrier_init(&full[j], 1);
            mbarrier_init(&folded[j], W::kFoldWarps * 32);
            mbarrier_init(&empty[j], W::kConsumerWarps * 32);
        }
    fence_mbarrier_init();
    fence_async_shared();
    __syncthreads();
    const int stages = units * unit_stages;

    if (warp == W::kConsumerWarps) {   // the loads
        if (lane != 0) return;
        for (int s = 0; s < stages; ++s) {
            const int slot = s % kRing, stage = s % unit_stages, unit = s / unit_stages * gridDim.x + blockIdx.x;
            if (s >= kRing) mbarrier_wait(&empty[slot], (s / kRing - 1) & 1);
            uint8_t* base = smem + slot * W::kSlotBytes;
            if constexpr (kFeed == kSsStatic) {
                mbarrier_arrive(&full[slot]);
            } else {
                mbarrier_arrive_expecting(&full[slot], W::kWeightBytes + kTokens * 128);
#pragma unroll
                for (int i = 0; i < 2; ++i)
                    tma_load_2d(base + W::kWeightOffset + i * (kRows / 2) * (SB * 16), &weight_map, stage * SB * 16,
                                (unit * kRows + i * (kRows / 2)) % weight_rows, &full[slot]);
                tma_load_2d(base + W::kActOffset, &act_map, stage * 128, unit * kTokens % act_rows, &full[slot]);
            }
        }
        return;
    }
    if (warp > W::kConsumerWarps) {   // the fold: thread f folds weight row f of every stage
        const int row = tid - (W::kConsumerWarps + 1) * 32;
        uint32_t lo_at_zero = 0, hi_at_zero = 0;
        for (int s = 0; s < stages; ++s) {
            const int slot = s % kRing;
            mbarrier_wait(&full[slot], (s / kRing) & 1);   // (the loader waited for the slot's previous MMAs)
            uint8_t* base = smem + slot * W::kSlotBytes;
            const uint32_t scales = *reinterpret_cast<const uint32_t*>(base + W::kScaleOffset + row * SB);
            if (s % unit_stages == 0) folded_e4m3_table(-(int)(scales & 0xFFu), lo_at_zero, hi_at_zero);
            uint4 words[SB];
#pragma unroll
            for (int b = 0; b < SB; ++b)
                words[b] = *reinterpret_cast<const uint4*>(base + W::kWeightOffset + W::weight_offset(row, b));
#pragma unroll
            for (int b = 0; b < SB; ++b) {
                const uint32_t scale = byte_perm(scales, 0u, 0x4440u | b);
                const uint32_t lo = lo_at_zero + scale * 0x08080800u, hi = hi_at_zero + scale * 0x08080808u;
                const uint2 q0 = fp4_word_to_folded_e4m3(words[b].x, lo, hi);
                const uint2 q1 = fp4_word_to_folded_e4m3(words[b].y, lo, hi);
                const uint2 q2 = fp4_word_to_folded_e4m3(words[b].z, lo, hi);
                const uint2 q3 = fp4_word_to_folded_e4m3(words[b].w, lo, hi);
                uint8_t* dst = base + W::kFoldedOffset + (row >> 3) * 1024 + (row & 7) * 128;   // the row's atom
                // K in folded_act_position's order, as the kernels' folded activations: word i's
                // values 0-3 at bytes 4i.., its values 4-7 at 16 + 4i..
                *reinterpret_cast<uint4*>(dst + (((2 * b) ^ (row & 7)) << 4)) = make_uint4(q0.x, q1.x, q2.x, q3.x);
                *reinterpret_cast<uint4*>(dst + (((2 * b + 1) ^ (row & 7)) << 4)) = make_uint4(q0.y, q1.y, q2.y, q3.y);
            }
            fence_async_shared();   // the folded bytes before the MMAs (the async proxy) read them
            mbarrier_arrive(&folded[slot]);
        }
        return;
    }

    const int group = warp / 4;   // warpgroup: weight rows 64 group .. +63
    float acc[kTokens / 8][4];
#pragma unroll
    for (int nt = 0; nt < kTokens / 8; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.0f;
    float total = 0.0f;
    const long long start = clock64();
    for (int unit = 0, s = 0; unit < units; ++unit) {
        for (int stage = 0; stage < unit_stages; ++stage, ++s) {
            const int slot = s % kRing;
            mbarrier_wait(&folded[slot], (s / kRing) & 1);
            const uint8_t* base = smem + slot * W::kSlotBytes;
            const uint32_t a = wgmma_descriptor_low(base + W::kFoldedOffset + group * 64 * 128);
            const uint32_t b = wgmma_descriptor_low(base + W::kActOffset);
            wgmma_fence();
#pragma unroll
            for (int block = 0; block < SB; ++block)
                wgmma_ss_e4m3<kTokens>(acc, a + 2 * block, b + W::act_offset(0, 2 * block) / 16,
                                       stage > 0 || block > 0);
            wgmma_commit();
            wgmma_wait<1>();   // the previous stage's MMAs are complete: release its slot
            mbarrier_arrive_if(&empty[(s + kRing - 1) % kRing], s > 0);
        }
        wgmma_wait<0>();
        total += acc[0][0];   // 7168 products of 1.0 a unit
    }
    const long long stop = clock64();
    sink[blockIdx.x * W::kConsumerWarps * 32 + tid] = total;
    if (tid % 128 == 0) cycles[blockIdx.x * 2 + tid / 128] = stop - start;
}
template <int kTokens, int kFeed>
void launch_loop(int ctas, int units, const uint8_t* acts, const uint8_t* weights, const TensorMap& weight_map,
                 const TensorMap& act_map, long long* cycles, float* sink, cudaStream_t stream) {
    if constexpr (kFeed >= kSsStatic) {
        using W = SsLayout<kTokens>;
        const int smem = W::kRing * W::kSlotBytes + 1024;
        cudaFuncSetAttribute(ss_loop_kernel<kTokens, kFeed>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        ss_loop_kernel<kTokens, kFeed><<<ctas, (W::kConsumerWarps + 1 + W::kFoldWarps) * 32, smem, stream>>>(
            units, UNIT_STAGES_VALUE, ACT_ROWS_VALUE, WEIGHT_ROWS_VALUE, cycles, sink, weight_map, act_map);
    } else {
        using W = WideStage1<kTokens>;
        const int smem = W::kRing * W::kStageBytes + 1024;
        cudaFuncSetAttribute(stage_loop_kernel<kTokens, kFeed>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        stage_loop_kernel<kTokens, kFeed><<<ctas, (W::kConsumerWarps + kLoopLoaderWarps<kFeed>) * 32, smem,
                                            stream>>>(units, UNIT_STAGES_VALUE, acts, ACT_ROWS_VALUE, weights,
                                                      WEIGHT_ROWS_VALUE, cycles, sink, weight_map, act_map);
    }
}
}  // namespace moe
""".replace("UNIT_STAGES_VALUE", str(UNIT_STAGES)).replace("ACT_ROWS_VALUE", str(ACT_ROWS)).replace(
    "WEIGHT_ROWS_VALUE", str(WEIGHT_ROWS))
LOOP_HOST_SOURCE = r"""
void run_loop(int64_t tokens, int64_t feed, int64_t units, torch::Tensor weights, torch::Tensor acts,
              torch::Tensor cycles, torch::Tensor sink) {
    using namespace moe;
    const int ctas = (int)cycles.size(0) / 2;
    const TensorMap weight_map = tensor_map(weights.data_ptr<uint8_t>(), weights.size(0), kLoopWeightBytesPerRow,
                                            kLoopWeightBytesPerRow, 64, kRows / 2);
    const TensorMap act_map = tensor_map(acts.data_ptr<uint8_t>(), acts.size(0), kLoopActBytesPerRow,
                                         kLoopActBytesPerRow, 128, (int)tokens);
    auto* c = reinterpret_cast<long long*>(cycles.data_ptr<int64_t>());
    auto* s = sink.data_ptr<float>();
    const uint8_t* a = acts.data_ptr<uint8_t>();
    const uint8_t* w = weights.data_ptr<uint8_t>();
    auto stream = at::cuda::getCurrentCUDAStream();
#define LOOP_CASE(N, F) \
    if (tokens == N && feed == F) return launch_loop<N, F>(ctas, (int)units, a, w, weight_map, act_map, c, s, stream);
#define LOOP_FEEDS(N) LOOP_CASE(N, 0) LOOP_CASE(N, 1) LOOP_CASE(N, 2) LOOP_CASE(N, 3) LOOP_CASE(N, 4) \
                      LOOP_CASE(N, 5) LOOP_CASE(N, 6)
    LOOP_FEEDS(64) LOOP_FEEDS(144)
    TORCH_CHECK(false, "no stage loop for tokens ", tokens, " feed ", feed);
}
"""
SOURCE = solution.KERNEL_SOURCE + LOOP_KERNEL_SOURCE + solution.HOST_SOURCE + LOOP_HOST_SOURCE


def build():
    import torch
    build_dir = solution._writable_dir(os.path.join(solution._cache_root(), "wide_stage_loop"))
    return solution._load_extension("wide_stage_loop", "9.0a", build_dir, "void run_loop(int64_t, int64_t, int64_t, "
                                    "torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor);", SOURCE,
                                    "run_loop"), torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", type=int, default=40, help=f"units of {UNIT_STAGES} stages per CTA")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), choices=TOKENS)
    args = parser.parse_args()
    module, torch = build()
    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    weights = torch.full((WEIGHT_ROWS, 3584), 0x22, dtype=torch.uint8, device="cuda")   # fp4 codes of 1.0
    acts = torch.full((ACT_ROWS, 7168), 0x38, dtype=torch.uint8, device="cuda")         # e4m3 1.0
    cycles = torch.zeros(2 * ctas, dtype=torch.int64, device="cuda")
    sink = torch.zeros(ctas, 256, device="cuda")   # each consumer thread's sum (see stage_loop_kernel)
    print(f"{'tokens':>6} {'feed':>9} {'cycles/stage':>13} {'bound':>6} {'us/stage':>9} {'weights TB/s':>13} "
          f"{'sums':>5}")
    for tokens in args.tokens:
        for feed, name in enumerate(FEEDS):
            module.run_loop(tokens, feed, 1, weights, acts, cycles, sink)   # warm-up
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            module.run_loop(tokens, feed, args.units, weights, acts, cycles, sink)
            stop.record()
            torch.cuda.synchronize()
            stages = args.units * UNIT_STAGES
            per_stage = cycles.double().median().item() / stages
            us = start.elapsed_time(stop) * 1e3
            weight_bytes = ctas * stages * 128 * 64   # 128 rows x 64 bytes a stage
            # Every weight and activation is 1.0 once folded, so a consumer's sum over the units
            # is 7168 a unit; no_fold multiplies raw codes.
            sums = "-" if name == "no_fold" else "ok" if bool((sink == 7168.0 * args.units).all()) else "WRONG"
            print(f"{tokens:>6} {name:>9} {per_stage:>13.0f} {4 * tokens:>6} {us / stages:>9.3f} "
                  f"{weight_bytes / us / 1e6:>13.2f} {sums:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

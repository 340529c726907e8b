"""How fast a warpgroup's chain of e4m3 MMAs runs, apart from everything
else the wide kernels do: the question behind the folded wide stage 1's
unit-stage (4 scale blocks, about 0.55 us with no fp4 conversion at all,
thirtieth session, against about 0.13 us of tensor work).

One CTA per SM, two warpgroups (as the wide kernels' consumers), each
issuing `steps` MMAs m64nNk32 (e4m3, A from registers, B from shared
memory), in one of these orders:

  one_acc   every MMA into one accumulator; commit, then wait until one
            group is pending (the wide kernels' order)
  one_acc_0 the same, waiting for each MMA (its full latency)
  two_accs  even and odd MMAs into two accumulators (two dependency chains)
  halves    each step as two m64n(N/2)k32 MMAs into the accumulator's two
            halves (two chains in the same registers as one_acc)
  four_1    four MMAs into one accumulator, one commit, then wait for all

Prints cycles per step and warpgroup (clock64) and the GPU's e4m3 TFLOP/s
(events). With two warpgroups sharing an SM's tensor cores at 4096 e4m3
MACs per cycle, a step of one warpgroup costs N cycles at best.

    python tools/wgmma_chain.py [--steps 8192] [--tokens 64 144]

Needs an sm_90 GPU; the source also compiles without one (tests).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import solution  # noqa: E402

MODES = ("one_acc", "one_acc_0", "two_accs", "halves", "four_1")
TOKENS = (64, 144)

# The project's own MMA helpers and wrappers (solution.py's GEMM source: the
# descriptor, fence, commit, wait and the m64nNk32 e4m3 wrappers, compiled
# from the same text), so that the chain measured is the kernels'
# instructions; plus m64n72k32, the halves of 144 tokens, which the kernels
# do not build.
KERNEL_SOURCE = (solution.COMMON_SOURCE + solution.GEMM_CONFIG_SOURCE + solution.GEMM_SOURCE
                 + "namespace moe {\n" + solution._wgmma_source(72, "e4m3") + r"""
template <int N>
__device__ __forceinline__ void mma(float (&d)[N / 8][4], const uint32_t (&a)[4], uint32_t b, uint32_t accumulate) {
    if constexpr (N == 72) wgmma_m64n72k32_e4m3(d, a, b, accumulate);
    else wgmma_e4m3_mma<N>(d, a, b, accumulate);
}
// Step s's A fragment: fresh registers each step, as a converted block is.
__device__ __forceinline__ void fragment(uint32_t (&a)[4], uint32_t seed, int s) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = (seed + 0x01010101u * (uint32_t)(s + i)) & 0x3F3F3F3Fu;
}
template <int N, int kMode>
__global__ void __launch_bounds__(256, 1) chain_kernel(int steps, long long* cycles, float* sink) {
    extern __shared__ __align__(16) uint8_t smem_base[];
    uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_base) + 1023) & ~uintptr_t(1023));
    for (int i = threadIdx.x; i < N * 128 / 16; i += blockDim.x)
        reinterpret_cast<uint4*>(smem)[i] = make_uint4(0x38383838u, 0x38383838u, 0x38383838u, 0x38383838u);
    fence_async_shared();
    __syncthreads();
    const uint32_t b = wgmma_descriptor_low(smem), seed = threadIdx.x * 0x9E3779B9u;
    // Half h of the tokens: N/2 rows of 128 bytes, (N/2) / 8 atoms of 1024 bytes on.
    const uint32_t half_offset = (N / 2 / 8) * 1024 / 16;
    float acc[N / 8][4] = {}, acc2[N / 8][4] = {}, lo[N / 16][4] = {}, hi[N / 16][4] = {};
    uint32_t a[4];
    const long long start = clock64();
    if constexpr (kMode == 0 || kMode == 1) {
        for (int s = 0; s < steps; ++s) {
            fragment(a, seed, s);
            wgmma_fence();
            mma<N>(acc, a, b + 2 * (s & 3), 1u);
            wgmma_commit();
            if constexpr (kMode == 0) wgmma_wait<1>(); else wgmma_wait<0>();
        }
    } else if constexpr (kMode == 2) {
        for (int s = 0; s < steps; s += 2) {
            fragment(a, seed, s);
            wgmma_fence();
            mma<N>(acc, a, b + 2 * (s & 3), 1u);
            wgmma_commit();
            wgmma_wait<1>();
            fragment(a, seed, s + 1);
            wgmma_fence();
            mma<N>(acc2, a, b + 2 * ((s + 1) & 3), 1u);
            wgmma_commit();
            wgmma_wait<1>();
        }
    } else if constexpr (kMode == 3) {
        for (int s = 0; s < steps; ++s) {
            fragment(a, seed, s);
            wgmma_fence();
            mma<N / 2>(lo, a, b + 2 * (s & 3), 1u);
            mma<N / 2>(hi, a, b + half_offset + 2 * (s & 3), 1u);
            wgmma_commit();
            wgmma_wait<1>();
        }
    } else {
        for (int s = 0; s < steps; s += 4) {
            uint32_t a4[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j) fragment(a4[j], seed, s + j);
            wgmma_fence();
#pragma unroll
            for (int j = 0; j < 4; ++j) mma<N>(acc, a4[j], b + 2 * j, 1u);
            wgmma_commit();
            wgmma_wait<0>();
        }
    }
    wgmma_wait<0>();
    const long long stop = clock64();
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < N / 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) total += acc[i][j] + acc2[i][j];
#pragma unroll
    for (int i = 0; i < N / 16; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) total += lo[i][j] + hi[i][j];
    sink[blockIdx.x * blockDim.x + threadIdx.x] = total;
    if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 2 + threadIdx.x / 128] = stop - start;
}
template <int N, int kMode>
void launch(int ctas, int steps, long long* cycles, float* sink, cudaStream_t stream) {
    const int smem = 120 * 1024;   // one CTA per SM
    cudaFuncSetAttribute(chain_kernel<N, kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    chain_kernel<N, kMode><<<ctas, 256, smem, stream>>>(steps, cycles, sink);
}
}  // namespace moe
""")

HOST_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
void run_chain(int64_t tokens, int64_t mode, int64_t steps, torch::Tensor cycles, torch::Tensor sink) {
    const int ctas = (int)cycles.size(0) / 2;
    auto* c = cycles.data_ptr<int64_t>();
    auto* s = sink.data_ptr<float>();
    auto stream = at::cuda::getCurrentCUDAStream();
#define CHAIN_CASE(N, M) if (tokens == N && mode == M) return moe::launch<N, M>(ctas, (int)steps, (long long*)c, s, stream);
#define CHAIN_MODES(N) CHAIN_CASE(N, 0) CHAIN_CASE(N, 1) CHAIN_CASE(N, 2) CHAIN_CASE(N, 3) CHAIN_CASE(N, 4)
    CHAIN_MODES(64) CHAIN_MODES(144)
    TORCH_CHECK(false, "no chain kernel for tokens ", tokens, " mode ", mode);
}
"""


def build():
    import torch
    build_dir = solution._writable_dir(os.path.join(solution._cache_root(), "wgmma_chain"))
    return solution._load_extension("wgmma_chain", "9.0a", build_dir, "void run_chain(int64_t, int64_t, int64_t, "
                                    "torch::Tensor, torch::Tensor);", KERNEL_SOURCE + HOST_SOURCE, "run_chain"), torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8192, help="MMA steps per warpgroup (a multiple of 4)")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), choices=TOKENS)
    args = parser.parse_args()
    module, torch = build()
    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    cycles = torch.zeros(2 * ctas, dtype=torch.int64, device="cuda")
    sink = torch.zeros(256 * ctas, device="cuda")
    print(f"{'tokens':>6} {'mode':>10} {'cycles/step':>12} {'best (N)':>9} {'TFLOP/s':>8}")
    for tokens in args.tokens:
        for mode, name in enumerate(MODES):
            module.run_chain(tokens, mode, 64, cycles, sink)   # warm-up
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            module.run_chain(tokens, mode, args.steps, cycles, sink)
            stop.record()
            torch.cuda.synchronize()
            per_step = cycles.double().median().item() / args.steps
            flops = ctas * 2 * args.steps * 64 * tokens * 32 * 2   # two warpgroups, 2 FLOPs per MAC
            print(f"{tokens:>6} {name:>10} {per_step:>12.1f} {tokens:>9} {flops / start.elapsed_time(stop) / 1e9:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

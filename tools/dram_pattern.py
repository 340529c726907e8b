"""How fast the weight stream can run in each of four access patterns, apart
from everything else the kernels do: the question behind the 8-token e4m3
stage 1's DRAM at 72% of peak (ncu, forty-seventh session), where the
largest stall sample is the wait for a stage's weights (forty-eighth).

Each CTA streams the weights of 128 rows (an expert's row block, as stage
1's CTAs do) over K in stages of 16 KB (128 bytes of each row: 256 fp4
values) through a ring of shared-memory slots filled by the copy engine,
one thread issuing, every thread waiting for the slot and reading a word of
it before the slot is refilled. The rows are 3,584 bytes apart (d_hidden
7168). Patterns:

  raw_2d    two 2-D TMA boxes of 128 bytes x 64 rows per stage, through
            the kernels' own tensor map (solution.py's tensor_map): what
            the narrow kernels read, 128-byte runs 3,584 bytes apart
  raw_1d    one-row bulk copies of `run` bytes (128: the same bytes as
            raw_2d; 256, 512: a stage of 64 or 32 rows, K's runs longer)
  shuffled  the bytes AITER's shuffled layout (SPEC section 3) puts in one
            stage: 8 runs of 2,048 contiguous bytes (16 rows x 256 values),
            57,344 bytes apart
  contig    one 16 KB bulk copy of contiguous bytes
  ldg       no copy engine: every thread's 16-byte loads of contiguous
            bytes (a plain read's ceiling)

Prints us and TB/s per pattern, ring depth and CTAs per SM.

    python tools/dram_pattern.py [--experts 257] [--reps 5]

Needs an sm_90 GPU; the source also compiles without one (tests).
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import solution  # noqa: E402

PATTERNS = ("raw_2d", "raw_1d", "shuffled", "contig", "ldg")
RINGS = ((4, 2), (8, 2), (3, 4))   # (slots, CTAs per SM)
RUNS = (128, 256, 512)             # raw_1d's bytes per row and stage
ROWS_PER_CTA, STAGE_BYTES, ROW_BYTES = 128, 16384, 3584

KERNEL_SOURCE = solution.COMMON_SOURCE + solution.GEMM_CONFIG_SOURCE + solution.GEMM_SOURCE + r"""
namespace moe {
// A one-dimensional bulk copy of `bytes` (a multiple of 16) to shared
// memory, counted on the barrier.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* barrier) {
#ifdef MOE_HAS_WGMMA
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(barrier)) : "memory");
#else
    __trap();
#endif
}
constexpr int kRowsPerCta = 128, kStageBytes = 16384, kMaxSlots = 8;

template <int kPattern>
__global__ void __launch_bounds__(256) stream_kernel(const uint8_t* __restrict__ weights, int row_bytes, int slots,
                                                     int run, const __grid_constant__ TensorMap map, float* sink) {
    extern __shared__ __align__(16) uint8_t smem_raw[];
    __shared__ uint64_t full[kMaxSlots];
    // 128-byte swizzled boxes need 1024-byte aligned destinations.
    uint8_t* ring = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    const int tid = threadIdx.x, lane = tid & 31;
    const int row0 = blockIdx.x * kRowsPerCta, stages = row_bytes * kRowsPerCta / kStageBytes;
    const uint8_t* cta_bytes = weights + (size_t)row0 * row_bytes;
    float acc = 0.0f;
    if constexpr (kPattern == 4) {
        // Contiguous 16-byte loads, four in flight per thread.
        const uint4* src = reinterpret_cast<const uint4*>(cta_bytes);
        const int count = row_bytes * kRowsPerCta / 16;
        for (int i = tid; i < count; i += 4 * 256) {
            uint4 v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) v[u] = i + u * 256 < count ? __ldg(src + i + u * 256) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int u = 0; u < 4; ++u) acc += (float)(v[u].x ^ v[u].y ^ v[u].z ^ v[u].w);
        }
    } else {
        if (tid == 0) {
            for (int j = 0; j < slots; ++j) mbarrier_init(&full[j], 1);
            fence_mbarrier_init();
        }
        __syncthreads();
        // Warp 0 fills stage s's slot: lane 0 arrives expecting the bytes
        // first, then the lanes issue the copies.
        auto issue = [&](int s) {
            uint8_t* dst = ring + (s % slots) * kStageBytes;
            uint64_t* barrier = &full[s % slots];
            if (lane == 0) mbarrier_arrive_expecting(barrier, kStageBytes);
            __syncwarp();
            if constexpr (kPattern == 0) {
                if (lane < 2) tma_load_2d(dst + lane * (kStageBytes / 2), &map, s * 128, row0 + lane * 64, barrier);
            } else if constexpr (kPattern == 1) {
                // Stage s: rows of group s % groups, their K run s / groups.
                const int rows = kStageBytes / run, groups = kRowsPerCta / rows;
                const int first = s % groups * rows, offset = s / groups * run;
                for (int r = lane; r < rows; r += 32)
                    bulk_copy(dst + r * run, cta_bytes + (size_t)(first + r) * row_bytes + offset, run, barrier);
            } else if constexpr (kPattern == 2) {
                if (lane < 8)
                    bulk_copy(dst + lane * 2048, cta_bytes + (size_t)lane * 16 * row_bytes + s * 2048, 2048, barrier);
            } else {
                if (lane == 0) bulk_copy(dst, cta_bytes + (size_t)s * kStageBytes, kStageBytes, barrier);
            }
        };
        if (tid < 32)
            for (int s = 0; s < slots && s < stages; ++s) issue(s);
        for (int s = 0; s < stages; ++s) {
            mbarrier_wait(&full[s % slots], (s / slots) & 1);
            acc += (float)ring[(s % slots) * kStageBytes + tid * 64];
            __syncthreads();
            if (tid < 32 && s + slots < stages) issue(s + slots);
        }
    }
    sink[blockIdx.x * 256 + tid] = acc;
}
}  // namespace moe
"""

# The kernels' tensor-map helper and the check macro it uses, taken from
# solution.py's host source so that raw_2d reads through the same map.
_TENSOR_MAP = (re.search(r"#if !defined\(USE_ROCM\)\n// A tensor map of bytes .*?#endif\n",
                         solution.HOST_SOURCE, re.S).group(0)
               + re.search(r"TensorMap tensor_map\(.*?\n}\n", solution.HOST_SOURCE, re.S).group(0))
_CHECK = re.search(r"#define MOE_CUDA_CHECK.*?while \(0\)\n", solution.HOST_SOURCE, re.S).group(0)

HOST_SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cudaTypedefs.h>
namespace moe {
""" + _CHECK + _TENSOR_MAP + r"""
template <int kPattern>
void launch(const torch::Tensor& weights, int row_bytes, int slots, int run, int ctas_per_sm,
            const torch::Tensor& sink) {
    const int64_t rows = weights.numel() / row_bytes;
    const TensorMap map = tensor_map(weights.data_ptr(), rows, row_bytes, row_bytes, 128, 64);
    int device = 0, shared_per_sm = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&device));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&shared_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    // The ring, or the SM's share of one CTA where that is more: exactly
    // ctas_per_sm CTAs fit (1 KB per CTA reserved, 64 B of static barriers).
    const int smem = std::max(slots * kStageBytes + 1024, shared_per_sm / ctas_per_sm - 1024 - 128);
    MOE_CUDA_CHECK(cudaFuncSetAttribute(stream_kernel<kPattern>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    stream_kernel<kPattern><<<(int)(rows / kRowsPerCta), 256, smem, c10::cuda::getCurrentCUDAStream()>>>(
        weights.data_ptr<uint8_t>(), row_bytes, slots, run, map, sink.data_ptr<float>());
    MOE_CUDA_CHECK(cudaGetLastError());
}
}  // namespace moe
void run_stream(int64_t pattern, torch::Tensor weights, int64_t row_bytes, int64_t slots, int64_t run,
                int64_t ctas_per_sm, torch::Tensor sink) {
    TORCH_CHECK(slots >= 1 && slots <= moe::kMaxSlots, "slots: 1 to ", moe::kMaxSlots);
    TORCH_CHECK(run >= 128 && moe::kStageBytes % run == 0 && row_bytes % run == 0
                && moe::kRowsPerCta % (moe::kStageBytes / run) == 0, "run: a stage of whole rows");
    using Launch = void (*)(const torch::Tensor&, int, int, int, int, const torch::Tensor&);
    constexpr Launch launches[] = {moe::launch<0>, moe::launch<1>, moe::launch<2>, moe::launch<3>, moe::launch<4>};
    TORCH_CHECK(pattern >= 0 && pattern < (int64_t)std::size(launches), "no pattern ", pattern);
    launches[pattern](weights, (int)row_bytes, (int)slots, (int)run, (int)ctas_per_sm, sink);
}
"""
DECLARATION = "void run_stream(int64_t, torch::Tensor, int64_t, int64_t, int64_t, int64_t, torch::Tensor);"


def build():
    import torch
    build_dir = solution._writable_dir(os.path.join(solution._cache_root(), "dram_pattern"))
    return solution._load_extension("dram_pattern", "9.0a", build_dir, DECLARATION, KERNEL_SOURCE + HOST_SOURCE,
                                    "run_stream"), torch


def rows_to_time():
    """(pattern, run, slots, CTAs per SM) of each row the tool prints."""
    for pattern, name in enumerate(PATTERNS):
        for run in RUNS if name == "raw_1d" else (128,):
            for slots, ctas_per_sm in RINGS if name != "ldg" else ((1, 2), (1, 4)):
                yield pattern, run, slots, ctas_per_sm


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=257, help="experts of 512 rows (stage 1 at d_expert 256)")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per row (median)")
    args = parser.parse_args()
    module, torch = build()
    rows = args.experts * 512
    weights = torch.randint(0, 256, (rows, ROW_BYTES), dtype=torch.uint8, device="cuda")
    sink = torch.zeros(rows // ROWS_PER_CTA * 256, device="cuda")
    print(f"{rows * ROW_BYTES / 1e6:.0f} MB in CTAs of {ROWS_PER_CTA} rows, stages of {STAGE_BYTES} bytes")
    print(f"{'pattern':>9} {'run':>5} {'slots':>5} {'CTAs/SM':>7} {'us':>8} {'TB/s':>6}")
    for pattern, run, slots, ctas_per_sm in rows_to_time():
        module.run_stream(pattern, weights, ROW_BYTES, slots, run, ctas_per_sm, sink)   # warm-up
        times = []
        for _ in range(args.reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            module.run_stream(pattern, weights, ROW_BYTES, slots, run, ctas_per_sm, sink)
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) * 1e3)
        us = sorted(times)[len(times) // 2]
        print(f"{PATTERNS[pattern]:>9} {run:>5} {slots:>5} {ctas_per_sm:>7} {us:>8.1f} "
              f"{rows * ROW_BYTES / us / 1e6:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

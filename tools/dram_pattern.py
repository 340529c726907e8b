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

Prints us and TB/s per pattern, ring depth and CTAs per SM. A second table
asks what a CTA's length costs (the narrow stage 1's K slices at 16 tokens):
raw_2d with each row block's K cut into slices, streamed by a CTA per slice
(each pays its pipeline's fill and drain, and its SM slot waits for the next
CTA), by persistent CTAs that empty their ring at each slice's end (a loop
around the kernels' per-CTA pipeline), or by persistent CTAs whose ring
runs on from slice to slice. The gaps bound what a persistent narrow stage
1 could win, and which of the two forms it takes.
`--experts 64` streams bs=16 E=33's stage-1 bytes (32 experts of 1,024
rows) in as many 128-row blocks.

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
# The second table: K in 1, 4 or 7 slices (28, 7 or 4 stages of a row block
# per CTA; the 8-token stage 1 at bs=16 E=33 runs 6, in 5 slices) on the
# 8-token stage 1's ring (4 slots, 2 CTAs an SM) and a deeper occupancy.
LIFETIME_SLICES = (1, 4, 7)
LIFETIME_RINGS = ((4, 2), (3, 4))
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

// The work is units: each 128-row block's K in `slices` equal slices of
// whole stages, unit u being slice u / row_blocks of row block u %
// row_blocks (the slice slowest, as in stage 1's grid). CTA b streams units
// b, b + gridDim.x, ...: a grid of a CTA per unit, or fewer CTAs that
// persist, their ring running on from unit to unit or, with `drain`,
// emptied at each unit's end (each unit's first copies issued only once its
// predecessor's last stage is read, as a CTA that looped over the kernels'
// whole per-unit pipeline would). (ldg: a CTA per whole row block, the host
// checks.)
template <int kPattern>
__global__ void __launch_bounds__(256) stream_kernel(const uint8_t* __restrict__ weights, int row_bytes, int slots,
                                                     int run, int row_blocks, int slices, int drain,
                                                     const __grid_constant__ TensorMap map, float* sink) {
    extern __shared__ __align__(16) uint8_t smem_raw[];
    __shared__ uint64_t full[kMaxSlots];
    // 128-byte swizzled boxes need 1024-byte aligned destinations.
    uint8_t* ring = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    const int tid = threadIdx.x, lane = tid & 31;
    const int unit_stages = row_bytes * kRowsPerCta / kStageBytes / slices, units = row_blocks * slices;
    const int stages = (units - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x * unit_stages;
    float acc = 0.0f;
    if constexpr (kPattern == 4) {
        // Contiguous 16-byte loads, four in flight per thread.
        const uint4* src = reinterpret_cast<const uint4*>(weights + (size_t)blockIdx.x * kRowsPerCta * row_bytes);
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
        // first, then the lanes issue the copies. The CTA's stage s is stage
        // k of its unit's row block (first row row0).
        auto issue = [&](int s) {
            const int u = (int)blockIdx.x + s / unit_stages * (int)gridDim.x;
            const int row0 = u % row_blocks * kRowsPerCta, k = u / row_blocks * unit_stages + s % unit_stages;
            const uint8_t* cta_bytes = weights + (size_t)row0 * row_bytes;
            uint8_t* dst = ring + (s % slots) * kStageBytes;
            uint64_t* barrier = &full[s % slots];
            if (lane == 0) mbarrier_arrive_expecting(barrier, kStageBytes);
            __syncwarp();
            if constexpr (kPattern == 0) {
                if (lane < 2) tma_load_2d(dst + lane * (kStageBytes / 2), &map, k * 128, row0 + lane * 64, barrier);
            } else if constexpr (kPattern == 1) {
                // Stage k: rows of group k % groups, their K run k / groups.
                const int rows = kStageBytes / run, groups = kRowsPerCta / rows;
                const int first = k % groups * rows, offset = k / groups * run;
                for (int r = lane; r < rows; r += 32)
                    bulk_copy(dst + r * run, cta_bytes + (size_t)(first + r) * row_bytes + offset, run, barrier);
            } else if constexpr (kPattern == 2) {
                if (lane < 8)
                    bulk_copy(dst + lane * 2048, cta_bytes + (size_t)lane * 16 * row_bytes + k * 2048, 2048, barrier);
            } else {
                if (lane == 0) bulk_copy(dst, cta_bytes + (size_t)k * kStageBytes, kStageBytes, barrier);
            }
        };
        // Warp 0 issues stage `issued` once its slot's last stage (issued -
        // slots) is read, and, with drain, every stage of the units before
        // its own.
        int issued = 0;
        auto issue_ready = [&](int last_read) {
            while (issued < stages && issued - slots <= last_read
                   && (!drain || issued / unit_stages * unit_stages <= last_read + 1))
                issue(issued++);
        };
        if (tid < 32) issue_ready(-1);
        for (int s = 0; s < stages; ++s) {
            mbarrier_wait(&full[s % slots], (s / slots) & 1);
            acc += (float)ring[(s % slots) * kStageBytes + tid * 64];
            __syncthreads();
            if (tid < 32) issue_ready(s);
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
// grid_ctas: the CTAs of the grid, at most one per unit (0: one per unit).
template <int kPattern>
void launch(const torch::Tensor& weights, int row_bytes, int slots, int run, int ctas_per_sm, int slices,
            int grid_ctas, int drain, const torch::Tensor& sink) {
    const int64_t rows = weights.numel() / row_bytes;
    const int row_blocks = (int)(rows / kRowsPerCta), units = row_blocks * slices;
    const int ctas = grid_ctas > 0 ? std::min(grid_ctas, units) : units;
    TORCH_CHECK(sink.numel() >= (int64_t)ctas * 256, "sink: 256 floats per CTA");
    const TensorMap map = tensor_map(weights.data_ptr(), rows, row_bytes, row_bytes, 128, 64);
    int device = 0, shared_per_sm = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&device));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&shared_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    // The ring, or the SM's share of one CTA where that is more: exactly
    // ctas_per_sm CTAs fit (1 KB per CTA reserved, 64 B of static barriers).
    const int smem = std::max(slots * kStageBytes + 1024, shared_per_sm / ctas_per_sm - 1024 - 128);
    MOE_CUDA_CHECK(cudaFuncSetAttribute(stream_kernel<kPattern>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    stream_kernel<kPattern><<<ctas, 256, smem, c10::cuda::getCurrentCUDAStream()>>>(
        weights.data_ptr<uint8_t>(), row_bytes, slots, run, row_blocks, slices, drain, map, sink.data_ptr<float>());
    MOE_CUDA_CHECK(cudaGetLastError());
}
}  // namespace moe
void run_stream(int64_t pattern, torch::Tensor weights, int64_t row_bytes, int64_t slots, int64_t run,
                int64_t ctas_per_sm, int64_t slices, int64_t grid_ctas, int64_t drain, torch::Tensor sink) {
    TORCH_CHECK(slots >= 1 && slots <= moe::kMaxSlots, "slots: 1 to ", moe::kMaxSlots);
    TORCH_CHECK(run >= 128 && moe::kStageBytes % run == 0 && row_bytes % run == 0
                && moe::kRowsPerCta % (moe::kStageBytes / run) == 0, "run: a stage of whole rows");
    TORCH_CHECK(slices >= 1 && row_bytes * moe::kRowsPerCta / moe::kStageBytes % slices == 0,
                "slices: equal slices of whole stages");
    TORCH_CHECK(pattern != 4 || (slices == 1 && grid_ctas == 0), "ldg: a CTA per row block");
    using Launch = void (*)(const torch::Tensor&, int, int, int, int, int, int, int, const torch::Tensor&);
    constexpr Launch launches[] = {moe::launch<0>, moe::launch<1>, moe::launch<2>, moe::launch<3>, moe::launch<4>};
    TORCH_CHECK(pattern >= 0 && pattern < (int64_t)std::size(launches), "no pattern ", pattern);
    launches[pattern](weights, (int)row_bytes, (int)slots, (int)run, (int)ctas_per_sm, (int)slices, (int)grid_ctas,
                      (int)drain, sink);
}
"""
DECLARATION = ("void run_stream(int64_t, torch::Tensor, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, "
               "int64_t, torch::Tensor);")


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


# The second table's grids: a CTA per unit; persistent CTAs (as many as fit
# at once) whose ring is emptied at each unit's end; persistent CTAs whose
# ring runs on from unit to unit.
GRIDS = ("per-unit", "drained", "run-on")


def lifetime_rows():
    """(slices, grid, slots, CTAs per SM) of each row of the second table:
    raw_2d with each row block's K in slices, streamed as GRIDS says."""
    for slices in LIFETIME_SLICES:
        for grid in GRIDS:
            for slots, ctas_per_sm in LIFETIME_RINGS:
                yield slices, grid, slots, ctas_per_sm


def time_us(module, torch, reps, *args) -> float:
    """Median us of `reps` event-timed run_stream(*args) after a warm-up."""
    module.run_stream(*args)
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        module.run_stream(*args)
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=257, help="experts of 512 rows (stage 1 at d_expert 256)")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per row (median)")
    args = parser.parse_args()
    module, torch = build()
    rows = args.experts * 512
    row_blocks = rows // ROWS_PER_CTA
    weights = torch.randint(0, 256, (rows, ROW_BYTES), dtype=torch.uint8, device="cuda")
    sink = torch.zeros(row_blocks * max(LIFETIME_SLICES) * 256, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    mb = rows * ROW_BYTES / 1e6
    print(f"{mb:.0f} MB in CTAs of {ROWS_PER_CTA} rows, stages of {STAGE_BYTES} bytes")
    print(f"{'pattern':>9} {'run':>5} {'slots':>5} {'CTAs/SM':>7} {'us':>8} {'TB/s':>6}")
    for pattern, run, slots, ctas_per_sm in rows_to_time():
        us = time_us(module, torch, args.reps, pattern, weights, ROW_BYTES, slots, run, ctas_per_sm, 1, 0, 0, sink)
        print(f"{PATTERNS[pattern]:>9} {run:>5} {slots:>5} {ctas_per_sm:>7} {us:>8.1f} {mb / us:>6.2f}")
    print(f"raw_2d by CTA length: each row block's {ROW_BYTES * ROWS_PER_CTA // STAGE_BYTES} stages in slices")
    print(f"{'slices':>6} {'stages':>6} {'grid':>10} {'slots':>5} {'CTAs/SM':>7} {'CTAs':>6} {'us':>8} {'TB/s':>6}")
    for slices, grid, slots, ctas_per_sm in lifetime_rows():
        units = row_blocks * slices
        ctas = units if grid == "per-unit" else min(units, ctas_per_sm * sms)
        us = time_us(module, torch, args.reps, 0, weights, ROW_BYTES, slots, 128, ctas_per_sm, slices,
                     0 if grid == "per-unit" else ctas, int(grid == "drained"), sink)
        stages = ROW_BYTES * ROWS_PER_CTA // STAGE_BYTES // slices
        print(f"{slices:>6} {stages:>6} {grid:>10} {slots:>5} {ctas_per_sm:>7} {ctas:>6} {us:>8.1f} {mb / us:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

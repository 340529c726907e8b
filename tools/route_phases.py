"""Where the call's first kernel (route_and_quantize_kernel) spends its time.

At 512 tokens that kernel takes about 16 us of every call (bs=512 E=257,
d512, d2048). With its Qa CTAs returning at once it took as long (BENCHMARKS,
twentieth and twenty-first sessions, on the Qa of then), and with two Qa CTAs
per SM too (thirty-first); the routing CTA's 2 x 4,608 scattered 4-byte
stores are not the cost either: staged through shared memory, they moved
the cold kernel by 0.0 us (forty-ninth session; 3.2 us off the unflushed
one in the twenty-second, when the timed call did not follow).

This tool builds solution.py's kernels with stamps: the routing CTA's
thread 0 records clock64 after each of route_pairs' phases (each ends at a
CTA barrier) and %globaltimer at its start and end, and the Qa CTAs
%globaltimer at their start (the earliest) and end (the latest: one
atomicMax per CTA, after a barrier; with one per warp, 16 K atomics on one
word at 512 tokens, the latest end read 20 us where the unstamped kernel
takes 16.4, H200, 2026-12-04). Each shape's call runs after eval.py's L2
flush; the table gives each phase's us (medians over the calls; cycles are
converted at the routing CTA's own cycles per ns over its whole run, so the
phases add up to its globaltimer span, and %globaltimer ticks by 32 ns or
1 us, by GPU).

    python tools/route_phases.py [N ...]    benchmark shapes N (0-6; default 1 2 5)

The stamped build is a copy with text edits (EDITS, each of which must
apply exactly once, as tools/timing_variants.py's do) and one more host
function, moe_forward_stamped (moe_forward's arguments; returns the stamps).
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import solution  # noqa: E402
import stamped_build  # noqa: E402

# The stamps: clock64 after each route_pairs phase (0-5), the routing CTA's
# globaltimer at its start and end (6, 7), the Qa CTAs' earliest start and
# latest end (8, 9).
PHASES = ("zero the counts", "count the pairs", "scan, offsets", "tile table", "sort the pairs")
STAMPS = 10
STAMP_SOURCE = r"""
__device__ unsigned long long moe_route_stamps[10];
__device__ __forceinline__ unsigned long long moe_globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#define MOE_ROUTE_STAMP(i) do { if (threadIdx.x == 0) moe_route_stamps[i] = clock64(); } while (0)
"""

# (old, new) text edits of solution.KERNEL_SOURCE.
EDITS = (
    ("__device__ void route_pairs(", STAMP_SOURCE + "__device__ void route_pairs("),
    ("    __shared__ int bad;\n    const int tid = threadIdx.x;\n",
     "    __shared__ int bad;\n    const int tid = threadIdx.x;\n"
     "    if (tid == 0) moe_route_stamps[6] = moe_globaltimer();\n    MOE_ROUTE_STAMP(0);\n"),
    ("    if (tid == 0) bad = 0;\n    __syncthreads();\n",
     "    if (tid == 0) bad = 0;\n    __syncthreads();\n    MOE_ROUTE_STAMP(1);\n"),
    ("    __syncthreads();\n\n    // Exclusive scan of (pairs, tiles) per expert",
     "    __syncthreads();\n    MOE_ROUTE_STAMP(2);\n\n    // Exclusive scan of (pairs, tiles) per expert"),
    ("        *bad_ids = bad;\n    }\n    __syncthreads();\n",
     "        *bad_ids = bad;\n    }\n    __syncthreads();\n    MOE_ROUTE_STAMP(3);\n"),
    ("            tiles[tile_base[e] + j] = pack_tile(e, cursor[e] + offset, min(tile_tokens, counts[e] - offset));\n"
     "        }\n    }\n    __syncthreads();\n",
     "            tiles[tile_base[e] + j] = pack_tile(e, cursor[e] + offset, min(tile_tokens, counts[e] - offset));\n"
     "        }\n    }\n    __syncthreads();\n    MOE_ROUTE_STAMP(4);\n"),
    ("                sorted_weights[row] = weights[i];\n            }\n    }\n}\n",
     "                sorted_weights[row] = weights[i];\n            }\n    }\n    __syncthreads();\n"
     "    MOE_ROUTE_STAMP(5);\n    if (tid == 0) moe_route_stamps[7] = moe_globaltimer();\n}\n"),
    ("    if (blockIdx.x == 0) {   // CTA-uniform: route_pairs' barriers see every thread\n",
     "    if (blockIdx.x != 0 && threadIdx.x == 0) atomicMin(&moe_route_stamps[8], moe_globaltimer());\n"
     "    if (blockIdx.x == 0) {   // CTA-uniform: route_pairs' barriers see every thread\n"),
    ("        quantize_hidden_row_folded<kFp8>(hidden, d_hidden, d_hidden_pad, act, act_scale, block_scale, accumulator,\n"
     "                                         blockIdx.x - 1);\n"
     "    else\n"
     "        quantize_hidden_columns<kFp8>(hidden, d_hidden, d_hidden_pad, act, act_scale, accumulator, blockIdx.x - 1,\n"
     "                                      blockIdx.y * kPrepareColumns + threadIdx.x * 8);\n",
     "        quantize_hidden_row_folded<kFp8>(hidden, d_hidden, d_hidden_pad, act, act_scale, block_scale, accumulator,\n"
     "                                         blockIdx.x - 1);\n"
     "    else\n"
     "        quantize_hidden_columns<kFp8>(hidden, d_hidden, d_hidden_pad, act, act_scale, accumulator, blockIdx.x - 1,\n"
     "                                      blockIdx.y * kPrepareColumns + threadIdx.x * 8);\n"
     "    __syncthreads();\n"
     "    if (threadIdx.x == 0) atomicMax(&moe_route_stamps[9], moe_globaltimer());\n"),
)


def stamped_kernel_source(source: str) -> str:
    """source (solution.KERNEL_SOURCE) with EDITS; SystemExit if one does not apply exactly once."""
    return stamped_build.apply_edits(source, EDITS, "route_phases")


def wrapper_source(declaration: str) -> tuple:
    """(declaration, definition) of moe_forward_stamped: moe_forward's
    parameters (from its declaration), the stamps reset before the call and
    returned after it, stream-ordered."""
    params, arguments = stamped_build.moe_forward_signature(declaration)
    head = f"torch::Tensor moe_forward_stamped({params})"
    body = f"""{head} {{
    unsigned long long init[{STAMPS}] = {{}};
    init[8] = ~0ull;
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    MOE_CUDA_CHECK(cudaMemcpyToSymbolAsync(moe::moe_route_stamps, init, sizeof init, 0, cudaMemcpyHostToDevice,
                                           stream));
    moe_forward({arguments});
    auto stamps = torch::empty({{{STAMPS}}}, hidden_states.options().dtype(torch::kInt64));
    MOE_CUDA_CHECK(cudaMemcpyFromSymbolAsync(stamps.data_ptr(), moe::moe_route_stamps, sizeof init, 0,
                                             cudaMemcpyDeviceToDevice, stream));
    return stamps;
}}
"""
    return declaration + head + ";\n", body


def build(arch: str):
    """The stamped extension, built (or loaded) in the kernel cache beside solution.py's."""
    declaration, definition = wrapper_source(solution.HOST_DECLARATION)
    return stamped_build.build("route_phases", stamped_kernel_source(solution.KERNEL_SOURCE), declaration, definition,
                               arch)


def phase_us(stamps: list) -> list:
    """Each phase's us, then the routing CTA's and the Qa CTAs' spans (us
    from the routing CTA's start to the Qa CTAs' first start and last end)."""
    cycles = stamps[5] - stamps[0]
    ns_per_cycle = (stamps[7] - stamps[6]) / cycles if cycles > 0 else 0.0
    phases = [(stamps[i + 1] - stamps[i]) * ns_per_cycle / 1e3 for i in range(5)]
    return phases + [(stamps[7] - stamps[6]) / 1e3, (stamps[8] - stamps[6]) / 1e3, (stamps[9] - stamps[6]) / 1e3]


def main(argv) -> int:
    import eval as harness
    from ab_bench import benchmark_inputs, selected_shapes

    calls = 10
    module = build(solution._cuda_arch(torch.cuda.get_device_capability()))
    timer = harness.cuda_timer()
    columns = [*PHASES, "routing CTA", "Qa first start", "Qa last end"]
    print(f"us, medians of {calls} calls after eval.py's L2 flush (times after 'routing CTA': from its start)")
    print(f"{'shape':28s}" + "".join(f"{c:>16s}" for c in columns))
    for label, data in benchmark_inputs(selected_shapes(" ".join(argv) or "1 2 5")):
        args = solution._moe_forward_args(data)
        call = lambda _: module.moe_forward_stamped(*args)  # noqa: E731
        call(data)
        timer.hide_host_cost(harness.host_call_ns(call, data))
        rows = []
        for _ in range(calls):
            timer.cold_start()   # as eval.py times a call: the L2 flushed, the launch hidden
            rows.append(phase_us(call(data).tolist()))
        medians = [statistics.median(column) for column in zip(*rows)]
        print(f"{label:28s}" + "".join(f"{us:16.2f}" for us in medians), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

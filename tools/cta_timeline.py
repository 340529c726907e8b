"""When each CTA of the GEMM kernels runs, and what that says about the time
no kernel-level number shows: a grid's last, part-empty wave, CTAs that
share an SM against those that have it alone, and the SM-time the crowded
experts' repeated tiles take (the shared expert's 22 tiles of 283 at
bs=512 E=257; BENCHMARKS, fifty-sixth and fifty-seventh sessions).

This tool builds solution.py's kernels with stamps: thread 0 of every CTA
of stage1_kernel, stage2_kernel, stage1_wide_kernel and stage2_wide_kernel
records %globaltimer at its entry, after its wait for the kernel before
(wait_for_previous_kernel) and at its exit (any return), its SM (%smid),
and, once it has work, its tile's expert and rows (narrow kernels; the wide
ones, persistent, mark only that they had work). Each shape's call runs
after eval.py's L2 flush, as eval.py times it; the table gives, per kernel,
medians over the calls of:

  CTAs     CTAs that had work / CTAs launched (a + after it: the grid
           had more than CAPACITY CTAs, and those past it are not counted)
  slots    the most CTAs with work running at once
  span     first start (after the wait) to last exit, us
  CTA us   p10 / p50 / p90 of a working CTA's time from its wait to its exit
  lone     p50 of those CTAs that had their SM to themselves for most of
           their time (a grid's last wave), and how many there were
  idle     1 - (sum of working CTAs' times) / (slots x span): the slots the
           grid leaves empty, its ramp-up and last wave
  tail     span's end minus the last moment every slot was busy, us
  shared   the share of the working CTAs' time spent on the last expert's
           tiles (the shared expert in the official shapes; narrow kernels)
  repeat   the share spent on tiles that are not their expert's first
           (the shared expert's and every crowded routed expert's; narrow)
  empty    CTAs with no work (the narrow grids' tiles past the routing's
           count: max_tiles is an upper bound) and the p50 of their time
           from entry to exit, us: what they cost the slots they pass through

    python tools/cta_timeline.py [N ...]    benchmark shapes N (0-6; default 1 2 4)

The stamped build is a copy with text edits (EDITS, each of which must
apply exactly once, as tools/route_phases.py's do) and one more host
function, moe_forward_stamped (moe_forward's arguments; returns the stamps).
The stamps cost thread 0 of each CTA six global stores and three timer reads.
"""
import os
import statistics
import sys
from typing import Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import solution  # noqa: E402
import stamped_build  # noqa: E402

# Stamp slots, one per kernel form: the narrow stages, then the wide ones
# (their e4m3 form and their bf16 redo, which runs after it in the same call).
KERNELS = ("stage1", "stage2", "stage1_wide", "stage1_wide_redo", "stage2_wide", "stage2_wide_redo")
CAPACITY = 65536    # CTAs stamped per kernel (linear block index); later ones are not
FIELDS = 6          # entry ns, go ns, exit ns, SM, 1 + expert (0: no work), tile rows + 65536 x tile index

STAMP_SOURCE = r"""
// cta_timeline's stamps (tools/cta_timeline.py): FIELDS words per CTA.
__device__ unsigned long long moe_cta_stamps[6][65536][6];
__device__ unsigned int moe_cta_grid[6][3];
__device__ __forceinline__ unsigned long long moe_cta_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned long long* moe_cta_slot(int kernel) {
    const unsigned long long id = blockIdx.x + (unsigned long long)gridDim.x * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
    return id < 65536 ? moe_cta_stamps[kernel][id] : nullptr;
}
__device__ __forceinline__ void moe_cta_begin(int kernel) {
    if (threadIdx.x != 0) return;
    unsigned int sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        moe_cta_grid[kernel][0] = gridDim.x;
        moe_cta_grid[kernel][1] = gridDim.y;
        moe_cta_grid[kernel][2] = gridDim.z;
    }
    if (unsigned long long* s = moe_cta_slot(kernel)) {
        s[0] = moe_cta_now();
        s[3] = sm;
    }
}
__device__ __forceinline__ void moe_cta_stamp(int kernel, int field, unsigned long long value) {
    if (threadIdx.x != 0) return;
    if (unsigned long long* s = moe_cta_slot(kernel)) s[field] = value;
}
// Its destructor stamps the exit on every return path; it holds no state, so
// nothing stays live across the kernel for it.
struct MoeCtaExit {
    int kernel;
    __device__ ~MoeCtaExit() { moe_cta_stamp(kernel, 2, moe_cta_now()); }
};
"""

_WAIT = "    wait_for_previous_kernel();\n    let_next_kernel_launch();\n"
_STAMPED_WAIT = ("    moe_cta_begin(kStampKernel);\n    MoeCtaExit moe_cta_exit{kStampKernel};\n"
                 "    wait_for_previous_kernel();\n    moe_cta_stamp(kStampKernel, 1, moe_cta_now());\n"
                 "    let_next_kernel_launch();\n")
# The narrow kernels' tile lookup (the tile index: stage 1's z, y where its K
# slices halve; stage 2's y),
# and the same with the tile's expert, rows and index stamped after it.
def _narrow_tile(index: str) -> str:
    return f"    Tile tile;\n    if (!load_tile(tile, tiles, num_tiles, {index})) return;\n"


def _narrow_work(index: str) -> str:
    return (_narrow_tile(index) + "    moe_cta_stamp(kStampKernel, 4, 1 + tile.expert);\n"
            f"    moe_cta_stamp(kStampKernel, 5, tile.rows + ((unsigned long long)({index}) << 16));\n")

# (old, new) text edits of solution.KERNEL_SOURCE.
EDITS = (
    ("__device__ __forceinline__ bool load_tile(", STAMP_SOURCE + "__device__ __forceinline__ bool load_tile("),
    ("    constexpr bool kShuffledStage1 = kFolded && S::kStage1WeightBoxes > 0;\n"
     "    extern __shared__ __align__(16) uint8_t smem[];\n" + _WAIT + _narrow_tile("S::kHalvingSlices ? blockIdx.y : blockIdx.z"),
     "    constexpr bool kShuffledStage1 = kFolded && S::kStage1WeightBoxes > 0;\n"
     "    extern __shared__ __align__(16) uint8_t smem[];\n    constexpr int kStampKernel = 0;\n"
     + _STAMPED_WAIT + _narrow_work("S::kHalvingSlices ? blockIdx.y : blockIdx.z")),
    ("    static_assert(!kFoldedRows || FP8, \"folded intermediate rows: e4m3 configs\");\n"
     "    extern __shared__ __align__(16) uint8_t smem[];\n" + _WAIT + _narrow_tile("blockIdx.y"),
     "    static_assert(!kFoldedRows || FP8, \"folded intermediate rows: e4m3 configs\");\n"
     "    extern __shared__ __align__(16) uint8_t smem[];\n    constexpr int kStampKernel = 1;\n"
     + _STAMPED_WAIT + _narrow_work("blockIdx.y")),
    ("    __shared__ uint64_t full[kRing], empty[kRing];\n" + _WAIT
     + "    const int num_tiles = *num_wide_tiles, units = num_tiles * columns * slices;\n"
       "    if ((int)blockIdx.x >= units) return;\n",
     "    __shared__ uint64_t full[kRing], empty[kRing];\n    constexpr int kStampKernel = kFolded ? 2 : 3;\n"
     + _STAMPED_WAIT
     + "    const int num_tiles = *num_wide_tiles, units = num_tiles * columns * slices;\n"
       "    if ((int)blockIdx.x >= units) return;\n    moe_cta_stamp(kStampKernel, 4, 1);\n"),
    # stage2_wide_kernel, then its body's working CTAs (the bf16 body run by
    # the folded kernel, after a row that did not fold, stamps as kernel 5).
    ("    using W = WideStage2<kTokens>;\n" + _WAIT + "    if constexpr (kFolded)\n"
     "        if (*stage2_redo != 0) {",
     "    using W = WideStage2<kTokens>;\n    constexpr int kStampKernel = kFolded ? 4 : 5;\n"
     + _STAMPED_WAIT + "    if constexpr (kFolded)\n        if (*stage2_redo != 0) {"),
    ("    if (cta_tiles <= 0) return;\n",
     "    if (cta_tiles <= 0) return;\n    constexpr int kStampKernel = kFolded ? 4 : 5;\n"
     "    moe_cta_stamp(kStampKernel, 4, 1);\n"),
)


def stamped_kernel_source(source: str) -> str:
    """source (solution.KERNEL_SOURCE) with EDITS; SystemExit if one does not apply exactly once."""
    return stamped_build.apply_edits(source, EDITS, "cta_timeline")


def wrapper_source(declaration: str) -> tuple:
    """(declaration, definition) of moe_forward_stamped: moe_forward's
    parameters (from its declaration); the stamps returned after the call
    ([stamps, grids]) and then cleared for the next one, stream-ordered (the
    arrays start zeroed; cleared before a call, their 19 MB would sit dirty
    in the L2 that eval.py's flush had just emptied)."""
    params, arguments = stamped_build.moe_forward_signature(declaration)
    head = f"std::vector<torch::Tensor> moe_forward_stamped({params})"
    body = f"""{head} {{
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    void* stamps_at = nullptr;
    void* grids_at = nullptr;
    MOE_CUDA_CHECK(cudaGetSymbolAddress(&stamps_at, moe::moe_cta_stamps));
    MOE_CUDA_CHECK(cudaGetSymbolAddress(&grids_at, moe::moe_cta_grid));
    const size_t stamp_bytes = sizeof(unsigned long long) * {len(KERNELS)} * {CAPACITY} * {FIELDS};
    const size_t grid_bytes = sizeof(unsigned int) * {len(KERNELS)} * 3;
    moe_forward({arguments});
    auto stamps = torch::empty({{{len(KERNELS)}, {CAPACITY}, {FIELDS}}}, hidden_states.options().dtype(torch::kInt64));
    auto grids = torch::empty({{{len(KERNELS)}, 3}}, hidden_states.options().dtype(torch::kInt32));
    MOE_CUDA_CHECK(cudaMemcpyAsync(stamps.data_ptr(), stamps_at, stamp_bytes, cudaMemcpyDeviceToDevice, stream));
    MOE_CUDA_CHECK(cudaMemcpyAsync(grids.data_ptr(), grids_at, grid_bytes, cudaMemcpyDeviceToDevice, stream));
    MOE_CUDA_CHECK(cudaMemsetAsync(stamps_at, 0, stamp_bytes, stream));
    MOE_CUDA_CHECK(cudaMemsetAsync(grids_at, 0, grid_bytes, stream));
    return {{stamps, grids}};
}}
"""
    return declaration + head + ";\n", body


def build(arch: str):
    """The stamped extension, built (or loaded) in the kernel cache beside solution.py's."""
    declaration, definition = wrapper_source(solution.HOST_DECLARATION)
    return stamped_build.build("cta_timeline", stamped_kernel_source(solution.KERNEL_SOURCE), declaration, definition,
                               arch)


def kernel_ctas(stamps, grid) -> list:
    """The CTAs one kernel stamped: (tile index, entry, go, exit, SM,
    expert or None for no work, rows), times in ns; [] if it did not run.
    (The wide kernels stamp no tile: index 0, rows 0.)"""
    launched = grid[0] * grid[1] * grid[2]
    ctas = []
    for entry, go, leave, sm, expert, tile_rows in stamps[:min(launched, CAPACITY)]:
        if entry:
            ctas.append((tile_rows >> 16, entry, go, leave, sm, expert - 1 if expert else None, tile_rows & 0xFFFF))
    return ctas


def _percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def summarize(ctas, launched: int, shared_expert: Optional[int]) -> dict:
    """The table's columns for one kernel's CTAs (kernel_ctas), us; shared
    and repeat None where shared_expert is (the wide kernels: a persistent
    CTA takes many tiles, and its stamps name none)."""
    work = [c for c in ctas if c[5] is not None]
    if not work:
        return {"ctas": f"0/{launched}"}
    idle_ctas = [(c[3] - c[1]) / 1e3 for c in ctas if c[5] is None]
    start, end = min(c[2] for c in work), max(c[3] for c in work)
    # Running working CTAs over time, from their starts (+1) and exits (-1).
    events = sorted([(c[2], 1) for c in work] + [(c[3], -1) for c in work])
    running, slots = 0, 0
    for _, step in events:
        running += step
        slots = max(slots, running)
    running, last_full = 0, start
    for time, step in events:
        if running == slots:
            last_full = time    # the moment this step ends a full interval
        running += step
    durations = [(c[3] - c[2]) / 1e3 for c in work]
    # A CTA is lone if, for most of its time, no other working CTA ran on its SM.
    by_sm = {}
    for c in work:
        by_sm.setdefault(c[4], []).append(c)
    lone = []
    for c in work:
        shared_ns = sum(max(0, min(c[3], o[3]) - max(c[2], o[2])) for o in by_sm[c[4]] if o is not c)
        if shared_ns < (c[3] - c[2]) / 2:
            lone.append((c[3] - c[2]) / 1e3)
    first_tile = {}
    for c in sorted(work):
        first_tile.setdefault(c[5], c[0])
    total = sum(durations)
    share = lambda keep: sum(d for c, d in zip(work, durations) if keep(c)) / total if total else 0.0  # noqa: E731
    span = (end - start) / 1e3
    counted = f"{len(work)}/{launched}" + ("+" if launched > CAPACITY else "")   # +: CTAs past CAPACITY unseen
    return {"ctas": counted, "slots": slots, "span": span,
            "p10": _percentile(durations, 0.1), "p50": _percentile(durations, 0.5),
            "p90": _percentile(durations, 0.9), "lone": (statistics.median(lone) if lone else 0.0, len(lone)),
            "idle": 1 - total / (slots * span) if slots and span else 0.0, "tail": (end - last_full) / 1e3,
            "shared": None if shared_expert is None else share(lambda c: c[5] == shared_expert),
            "repeat": None if shared_expert is None else share(lambda c: c[0] != first_tile[c[5]]),
            "empty": (len(idle_ctas), statistics.median(idle_ctas) if idle_ctas else 0.0)}


def row(label: str, s: dict) -> str:
    if "slots" not in s:
        return f"{label:34s} {s['ctas']:>11s}"
    percent = lambda share: "     -" if share is None else f"{100 * share:5.1f}%"  # noqa: E731
    return (f"{label:34s} {s['ctas']:>11s} {s['slots']:6d} {s['span']:8.1f} "
            f"{s['p10']:6.1f} {s['p50']:6.1f} {s['p90']:6.1f} {s['lone'][0]:6.1f} ({s['lone'][1]:4d}) "
            f"{percent(s['idle'])} {s['tail']:6.1f} {percent(s['shared'])} {percent(s['repeat'])} "
            f"{s['empty'][0]:6d} {s['empty'][1]:6.2f}")


HEADER = (f"{'shape, kernel':34s} {'CTAs':>11s} {'slots':>6s} {'span':>8s} {'p10':>6s} {'p50':>6s} {'p90':>6s} "
          f"{'lone':>6s} {'(n)':>6s} {'idle':>6s} {'tail':>6s} {'shared':>6s} {'repeat':>6s} {'empty':>6s} {'(us)':>6s}")


def median_summary(summaries: list) -> dict:
    """Per column, the median over calls (the first call's CTA counts)."""
    merged = dict(summaries[0])
    for key in ("span", "p10", "p50", "p90", "idle", "tail", "shared", "repeat"):
        if merged.get(key) is not None:
            merged[key] = statistics.median(s[key] for s in summaries)
    if "slots" in merged:
        merged["slots"] = int(statistics.median(s["slots"] for s in summaries))
    if "lone" in merged:   # (p50 us, count)
        merged["lone"] = (statistics.median(s["lone"][0] for s in summaries),
                          int(statistics.median(s["lone"][1] for s in summaries)))
    if "empty" in merged:   # (count, p50 us)
        merged["empty"] = (int(statistics.median(s["empty"][0] for s in summaries)),
                           statistics.median(s["empty"][1] for s in summaries))
    return merged


def main(argv) -> int:
    import eval as harness
    from ab_bench import benchmark_inputs, selected_shapes

    calls = 5
    module = build(solution._cuda_arch(torch.cuda.get_device_capability()))
    timer = harness.cuda_timer()
    print(f"medians of {calls} calls after eval.py's L2 flush; us; see this file's docstring for the columns")
    print(HEADER)
    for label, data in benchmark_inputs(selected_shapes(" ".join(argv) or "1 2 4")):
        args = solution._moe_forward_args(data)
        call = lambda _: module.moe_forward_stamped(*args)  # noqa: E731
        call(data)
        timer.hide_host_cost(harness.host_call_ns(call, data))
        shared_expert = data[1].shape[0] - 1
        per_kernel = {}
        for _ in range(calls):
            timer.cold_start()   # as eval.py times a call: the L2 flushed, the launch hidden
            stamps, grids = (t.cpu().tolist() for t in call(data))
            for k, name in enumerate(KERNELS):
                ctas = kernel_ctas(stamps[k], grids[k])
                if ctas:
                    launched = grids[k][0] * grids[k][1] * grids[k][2]
                    per_kernel.setdefault(name, []).append(
                        summarize(ctas, launched, None if "wide" in name else shared_expert))
        for name, summaries in per_kernel.items():
            print(row(f"{label} {name}", median_summary(summaries)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

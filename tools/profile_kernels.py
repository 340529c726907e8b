"""Where a call's time goes, on the official benchmark shapes.

    python tools/profile_kernels.py [repeats]   per-kernel device time per call (each kernel from its
                                                predecessor's end: see call_kernel_times)
    python tools/profile_kernels.py --sweep [BS:ROUTED:D_EXPERT ...]
                                                each GEMM config the chooser can pick, timed, and the
                                                chosen config with stage 1's K in 1, 2, 3, 4 and 8 slices
                                                and stage 2's CTAs over 1, 2, 4 and 8 row tiles, on the
                                                benchmark shapes or the shapes given (d_hidden 7168,
                                                top-8 routed + 1 shared expert, seed 1), e.g. 384:256:256
                                                to find where the chooser should switch configs
    python tools/profile_kernels.py --timeline N [SOLUTION.py ...]
                                                one call on benchmark shape N (0-6) by each version
                                                named (default this checkout's), as eval.py times it
                                                (after an L2 flush, its launch hidden behind a spin):
                                                each kernel's start, end and us from the call's first
                                                kernel, in launch order, by its full template name
                                                (the per-kernel view adds a kernel's instantiations
                                                together, and runs its calls warm)
    python tools/profile_kernels.py --once N [SOLUTION.py]
                                                benchmark shape N (0-6, or all) called twice, by this
                                                checkout's solution.py or the one named, for ncu and
                                                compute-sanitizer:
        ncu -k regex:stage1 -s 5 -c 1 --set full python tools/profile_kernels.py --once 0
    python tools/profile_kernels.py --save FILE [N ...]
                                                the benchmark shapes' inputs (all, or those numbered
                                                N, 0-6) and the test shapes', to FILE
    python tools/profile_kernels.py --load FILE  each input in FILE called once: no other kernels run
    python tools/profile_kernels.py --host       host us per call on each benchmark shape: validate_inputs,
                                                _moe_forward_args (the Python before the C++), moe_forward
                                                (the C++: allocations, tensor maps, launches) and the whole
                                                custom_kernel, each the least of 50 calls to an idle GPU
        (racecheck fails inside cuBLAS, which the input generator uses, so it runs on saved inputs)

The per-kernel view runs each shape under torch.profiler. The sweep times
every tile_tokens for every shape (median of event-timed calls after an L2
flush, as eval.py times), to check the config chooser against measurements.
"""
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ab_bench  # noqa: E402
from ab_bench import benchmark_inputs  # noqa: E402
import eval as harness  # noqa: E402
import reference  # noqa: E402
import solution  # noqa: E402


def call_kernel_times(kernels: list, repeats: int, spans: list = None) -> dict:
    """Per-call us of each kernel name, from (start, end, name) events of
    `repeats` calls that ran apart. A kernel counts from when the kernel
    before it ended, or from its own start if later: under programmatic
    dependent launch its CTAs are placed, and its span starts, while its
    predecessor still runs, and the overlap is the predecessor's time.
    spans, if given, receives each call's us from its first kernel's start
    to its last kernel's end."""
    times = defaultdict(float)
    if not kernels or len(kernels) % repeats:
        return times
    kernels = sorted(kernels)
    per_call = len(kernels) // repeats
    for i in range(0, len(kernels), per_call):
        call = kernels[i:i + per_call]
        previous_end = call[0][0]
        for start, end, name in call:
            times[name] += max(0.0, end - max(start, previous_end)) / repeats
            previous_end = max(previous_end, end)
        if spans is not None:
            spans.append(previous_end - call[0][0])
    return times


def kernel_name(event_name: str) -> str:
    """A kernel's profiler name without its parameter list, return type and
    namespace: 'void moe::stage1_wide_kernel<144, true>(unsigned char const*,
    ...)' gives 'stage1_wide_kernel<144, true>'."""
    return event_name.split("(")[0].replace("void ", "").replace("moe::", "")


def profiled_kernels(call, data, repeats: int, cold: bool = False) -> list:
    """(start, end, kernel_name) of every kernel that `repeats` calls of
    call(data) launch under torch.profiler, after one call unprofiled; the
    calls are synchronised apart, so gaps between kernels show. cold: each
    call as eval.py times it (CudaTimer.cold_start: the L2 flushed and the
    launch hidden behind a spin), so that the gaps are the device's, not
    the host's; the flush's and the spin's own kernels are left out."""
    call(data)
    torch.cuda.synchronize()
    timer = harness.cuda_timer() if cold else None
    start_kernels = set()
    if cold:
        timer.hide_host_cost(harness.host_call_ns(call, data))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            timer.cold_start()
            torch.cuda.synchronize()
        start_kernels = {event.name for event in prof.events()
                         if event.device_type == torch.autograd.DeviceType.CUDA}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            if cold:
                timer.cold_start()
            call(data)
            torch.cuda.synchronize()
    return [(event.time_range.start, event.time_range.end, kernel_name(event.name))
            for event in prof.events()
            if event.device_type == torch.autograd.DeviceType.CUDA and event.name not in start_kernels]


def kernel_times(call, data, repeats: int, spans: list = None) -> dict:
    """Device us per call of each kernel `call(data)` launches, as
    call_kernel_times counts them, a kernel's template instantiations
    together."""
    kernels = [(start, end, name.split("<")[0][-40:]) for start, end, name in profiled_kernels(call, data, repeats)]
    return call_kernel_times(kernels, repeats, spans)


def call_timeline(events: list) -> list:
    """(start, end, name) events of one call, in start order, their times
    from the first kernel's start."""
    events = sorted(events)
    first = events[0][0] if events else 0.0
    return [(start - first, end - first, name) for start, end, name in events]


def timeline(which: str, solution_paths: list) -> None:
    label, data = list(benchmark_inputs())[int(which)]
    versions = [(path, ab_bench.load(path, f"timeline_version_{i}")) for i, path in enumerate(solution_paths)]
    for path, version in versions or [("solution.py", solution)]:
        events = profiled_kernels(version.custom_kernel, data, 1, cold=True)
        print(f"{label}, {path}: {'start':>8} {'end':>8} {'us':>7}  kernel (one call as timed: L2 flushed, "
              "launch hidden)")
        for start, end, name in call_timeline(events):
            print(f"{'':<{len(label) + len(path) + 3}}{start:8.1f} {end:8.1f} {end - start:7.1f}  {name}")
        print(flush=True)


def per_kernel(repeats: int) -> None:
    for label, data in benchmark_inputs():
        spans = []
        times = kernel_times(solution.custom_kernel, data, repeats, spans)
        busy = sum(times.values())
        span = sorted(spans)[len(spans) // 2] if spans else float("nan")
        parts = ", ".join(f"{name} {us:.1f}" for name, us in sorted(times.items(), key=lambda kv: -kv[1]))
        print(f"{label}: {busy:.1f} us busy, {span:.1f} us first start to last end = {parts}", flush=True)


SLICES = (1, 2, 3, 4, 5, 6, 8)   # stage 1 K slices the sweep times for the chosen config (5: bs=16 E=33's)
ROW_TILES = (1, 2, 4, 8)   # row tiles per stage-2 CTA the sweep times for the chosen config


def sweep(shapes=None) -> None:
    module = solution._backend(torch.device("cuda"))[1]
    timer = harness.cuda_timer()

    def median_us(call, data) -> float:
        call(data)
        times = sorted(timer.time_call(call, data)[1] / 1e3 for _ in range(15))
        return times[len(times) // 2]

    # every compiled config, and the 8-token e4m3 one with its stage 1 per block (token_scaled off)
    configs = [*solution.GEMM_CONFIGS, *solution.PER_BLOCK_STAGE1_CONFIGS]
    width = max(len(str(c)) for c in configs) + 2
    header = f"{'shape':<28}" + "".join(f"{str(c):>{width}}" for c in configs)
    print(header + "   chosen")
    stage_rows = []
    for label, data in benchmark_inputs(shapes):
        m, top_k, n_experts = data[0].shape[0], data[10].shape[1], data[1].shape[0]
        row, stage_row = [], []
        for config in configs:
            call = lambda d: solution._run_kernels(module, d, config)  # noqa: E731
            row.append(median_us(call, data))
            kernels = kernel_times(call, data, 3)
            stage_row.append("%.1f+%.1f" % ab_bench.stage_split(kernels)[:2])
        chosen = solution.choose_config(m, top_k, n_experts, data[11]["d_expert"],
                                        solution._has_wgmma(data[0].device.index))
        sliced = [median_us(lambda d: solution._run_kernels(module, d, chosen, stage1_splits=n), data)
                  for n in SLICES]
        row_tiled = [median_us(lambda d: solution._run_kernels(module, d, chosen, stage2_row_tiles=n), data)
                     for n in ROW_TILES]
        print(f"{label:<28}" + "".join(f"{us:{width}.1f}" for us in row) + f"   {chosen} (stage 1 in "
              + "/".join(map(str, SLICES)) + " slices: " + "/".join(f"{us:.1f}" for us in sliced)
              + "; stage 2 CTAs of " + "/".join(map(str, ROW_TILES)) + " row tiles: "
              + "/".join(f"{us:.1f}" for us in row_tiled) + ")", flush=True)
        stage_rows.append(f"{label:<28}" + "".join(f"{t:>{width}}" for t in stage_row))
    print("columns: tile tokens / warp rows x warp tokens / scale blocks per stage / stages, stage 1's K split\n"
          "as the host code chooses; median us of 15 calls")
    print("\nstage 1 + stage 2 us (torch.profiler, 3 calls, no L2 flush)")
    print(header)
    print("\n".join(stage_rows))


def once(which: str, solution_path: str = None) -> None:
    # another version of solution.py, e.g. a commit's, to compare counters with
    version = ab_bench.load(solution_path, "other_solution") if solution_path else solution
    shapes = list(benchmark_inputs())
    for label, data in shapes if which == "all" else [shapes[int(which)]]:
        for _ in range(2):
            version.custom_kernel(data)
        torch.cuda.synchronize()
        print(label, "done", flush=True)


def save(path: str, which: list[int]) -> None:
    cases = list(benchmark_inputs([solution.BENCHMARK_SHAPES[i] for i in which]))
    with open(os.path.join(os.path.dirname(__file__), "..", "specs", "tests.txt")) as f:
        cases += [(case.spec, reference.generate_input(**case.args)) for case in harness.parse_specs(f.read())]
    torch.save(cases, path)


def load(path: str) -> None:
    for label, data in torch.load(path, weights_only=False):
        solution.custom_kernel(data)
        torch.cuda.synchronize()
        print(label, "done", flush=True)


def host_cost() -> None:
    """Where a call's host time goes: eval.py's host_call_ns (the call's wall
    time, issued to an idle GPU) of the input check alone, of building
    moe_forward's arguments (choose_config, the byte views), of moe_forward
    itself (its allocations, tensor maps and launches) and of the whole
    custom_kernel."""
    module = solution._backend(torch.device("cuda"))[1]

    def least_us(call, data) -> float:
        return min(harness.host_call_ns(call, data) for _ in range(50)) / 1e3

    print(f"{'shape':<28} {'validate':>9} {'args':>7} {'moe_forward':>12} {'custom_kernel':>14}"
          "   host us, least of 50 calls")
    for label, data in benchmark_inputs():
        solution.custom_kernel(data)
        args = solution._moe_forward_args(data)
        validate = least_us(solution.validate_inputs, data)
        build_args = least_us(solution._moe_forward_args, data)
        forward = least_us(lambda _: module.moe_forward(*args), data)
        total = least_us(solution.custom_kernel, data)
        print(f"{label:<28} {validate:9.1f} {build_args:7.1f} {forward:12.1f} {total:14.1f}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sweep"]:
        sweep([tuple(map(int, shape.split(":"))) + (1, None) for shape in sys.argv[2:]])
    elif sys.argv[1:2] == ["--timeline"]:
        timeline(sys.argv[2], sys.argv[3:])
    elif sys.argv[1:2] == ["--once"]:
        once(*sys.argv[2:4])
    elif sys.argv[1:2] == ["--save"]:
        save(sys.argv[2], [int(n) for n in sys.argv[3:]])
    elif sys.argv[1:2] == ["--load"]:
        load(sys.argv[2])
    elif sys.argv[1:2] == ["--host"]:
        host_cost()
    else:
        per_kernel(int(sys.argv[1]) if len(sys.argv) > 1 else 5)

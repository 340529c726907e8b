"""Versions of solution.py timed against a base on the official benchmark
shapes, in one process, their calls interleaved round by round so that
clock and machine drift fall on all alike (absolute times move by a few
percent between H200s; a difference measured this way does not).

    python tools/ab_bench.py BASE.py [CANDIDATE.py ...] [rounds]
    python tools/ab_bench.py --smoke VERSION.py   build it, one checked call per shape


CANDIDATE defaults to this checkout's solution.py; rounds (default 6) of 5
event-timed calls each per version, after an L2 flush as eval.py times them.
Every version must pass the reference check on every shape, but for
timing-only versions, named .ab/timing_*.py: deliberately wrong variants
(a write removed, a path forced) that bound what a change could gain.
They are timed unchecked, marked so, and their smoke run fails only if
they crash or hang. A second table
splits each version's call into stage 1, stage 2 and the rest (per-kernel
device time under torch.profiler, as tools/profile_kernels.py counts it), so
that a ratio can be traced to the kernel that moved. For the
committed version, and a branch's:
    mkdir -p .ab && git show HEAD:solution.py > .ab/base.py   (.ab/ is git-ignored: carry it)
    git show BRANCH:solution.py > .ab/candidate_BRANCH.py
Each version builds its own kernels (about a minute each, in parallel if
they are imported beforehand in separate processes).
"""
import importlib.util
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import eval as harness  # noqa: E402
import reference  # noqa: E402
import solution  # noqa: E402


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def benchmark_inputs(shapes=None):
    """(label, input) of each benchmark shape (or of `shapes`, in
    solution.BENCHMARK_SHAPES's form), generated one at a time."""
    for bs, routed, d_expert, seed, _ in shapes or solution.BENCHMARK_SHAPES:
        label = f"bs={bs} E={routed + solution.N_SHARED} d_expert={d_expert}"
        yield label, reference.generate_input(solution.D_HIDDEN, d_expert, routed, solution.TOP_K,
                                              solution.N_SHARED, bs, seed)


def selected_shapes(indices: str):
    """The benchmark shapes AB_SHAPES names ("5 6": indices 0-6), for a change
    that touches only some of them; None (all) when it names none."""
    return [solution.BENCHMARK_SHAPES[int(i)] for i in indices.split()] or None


def stage_split(times: dict) -> tuple:
    """(stage 1, stage 2, everything else) us of one call's per-kernel us.
    Each kernel's span counts whole, its redo kernels' (the bf16
    stage1_wide_kernel and stage2_wide_kernel launched after the folded
    ones) included: a kernel launched early by programmatic dependent launch
    overlaps the one before, so the parts can add to more than the call
    (no_empty_fallbacks at bs=128 E=33 dropped 6.0 us of parts against 4.7
    of the call, H200, 2026-12-05)."""
    stage1 = sum(us for name, us in times.items() if "stage1_kernel" in name or "stage1_wide_kernel" in name)
    stage2 = sum(us for name, us in times.items() if "stage2_kernel" in name or "stage2_wide_kernel" in name)
    return stage1, stage2, sum(times.values()) - stage1 - stage2


def timing_only(path: str) -> bool:
    """A version timed without the reference check (see the module docstring)."""
    return os.path.basename(path).startswith("timing_")


def smoke(path: str) -> int:
    """Builds one version and checks one call of it per benchmark shape, so
    that a version which fails or hangs (run under `timeout`) can be left out
    of the timing instead of stopping it."""
    version = load(path, "smoke_version")
    print(path, version._backend(torch.device("cuda"))[0], flush=True)
    all_ok = True
    for label, data in benchmark_inputs():
        ok, message = reference.check_implementation(data, version.custom_kernel(data))
        torch.cuda.synchronize()
        print(f"{path}: {label}", "pass" if ok else f"FAILS: {message}"
              + (" (timing only: kept)" if timing_only(path) else ""), flush=True)
        all_ok &= ok or timing_only(path)
    return 0 if all_ok else 1


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--smoke"]:
        return smoke(args[1])
    rounds = int(args.pop()) if len(args) > 1 and args[-1].isdigit() else 6
    base_path, candidate_paths = args[0], args[1:] or [os.path.join(os.path.dirname(__file__), "..", "solution.py")]
    versions = [load(path, f"ab_version_{i}") for i, path in enumerate([base_path] + candidate_paths)]
    names = ["base"] + [os.path.splitext(os.path.basename(path))[0] for path in candidate_paths]
    timer = harness.cuda_timer()
    for i, path in enumerate(candidate_paths):
        print(f"candidate {i + 1}: {path}" + (" (timing only, not checked)" if timing_only(path) else ""))
    print(f"{'shape':<28} {'base us':>9}" + "".join(f" {f'cand {i + 1} us':>10} {'/base':>6}"
                                                   for i in range(len(candidate_paths))), flush=True)
    from profile_kernels import kernel_times   # it imports this module
    ratios, all_ok, splits = [[] for _ in candidate_paths], True, []
    for label, data in benchmark_inputs(selected_shapes(os.environ.get("AB_SHAPES", ""))):
        times = [[] for _ in versions]
        for name, version, path in zip(names, versions, [base_path] + candidate_paths):
            if timing_only(path):
                version.custom_kernel(data)
                continue
            ok, message = reference.check_implementation(data, version.custom_kernel(data))
            all_ok &= ok
            if not ok:
                print(f"{label}: {name} FAILS the check: {message}")
        for _ in range(rounds):
            for i, version in enumerate(versions):
                timer.hide_host_cost(harness.host_call_ns(version.custom_kernel, data))
                times[i] += [timer.time_call(version.custom_kernel, data)[1] / 1e3 for _ in range(5)]
        medians = [sorted(t)[len(t) // 2] for t in times]
        row = f"{label:<28} {medians[0]:9.1f}"
        for i, us in enumerate(medians[1:]):
            ratios[i].append(us / medians[0])
            row += f" {us:10.1f} {ratios[i][-1]:6.3f}"
        print(row, flush=True)
        splits.append(f"{label:<28}" + "".join(
            " %7.1f+%6.1f+%5.1f" % stage_split(kernel_times(version.custom_kernel, data, 3)) for version in versions))
        del data
        torch.cuda.empty_cache()
    print(f"{'geomean ratio':<28} {'':>9}" + "".join(f" {'':>10} {math.exp(sum(map(math.log, r)) / len(r)):6.3f}"
                                                     for r in ratios))
    print(f"median of {rounds * 5} event-timed calls after an L2 flush, the versions' calls interleaved")
    print("\nstage 1 + stage 2 + the rest, us per call (torch.profiler, 3 calls, no L2 flush; "
          "kernel spans, which overlap under programmatic launch)")
    print(f"{'shape':<28}" + "".join(f" {name[:21]:>21}" for name in names))
    print("\n".join(splits))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())

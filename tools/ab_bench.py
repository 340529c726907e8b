"""Two versions of solution.py timed against each other on the official
benchmark shapes, in one process, their calls interleaved round by round so
that clock and machine drift fall on both alike (absolute times move by a
few percent between H200s; a difference measured this way does not).

    python tools/ab_bench.py BASE.py [CANDIDATE.py] [rounds]

CANDIDATE defaults to this checkout's solution.py; rounds (default 6) of 5
event-timed calls each, after an L2 flush as eval.py times them. Both must
pass the reference check on every shape. For the committed version:
    mkdir -p .ab && git show HEAD:solution.py > .ab/base.py   (.ab/ is git-ignored: carry it)
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


def main() -> int:
    base_path = sys.argv[1]
    candidate_path = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "..",
                                                                        "solution.py")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    versions = [load(base_path, "ab_base"), load(candidate_path, "ab_candidate")]
    timer = harness.cuda_timer()
    print(f"{'shape':<28} {'base us':>9} {'cand us':>9} {'cand/base':>9}", flush=True)
    ratios, all_ok = [], True
    for bs, routed, d_expert, seed, _ in solution.BENCHMARK_SHAPES:
        label = f"bs={bs} E={routed + solution.N_SHARED} d_expert={d_expert}"
        data = reference.generate_input(solution.D_HIDDEN, d_expert, routed, solution.TOP_K, solution.N_SHARED,
                                        bs, seed)
        times = [[], []]
        for i, version in enumerate(versions):
            ok, message = reference.check_implementation(data, version.custom_kernel(data))
            all_ok &= ok
            if not ok:
                print(f"{label}: {'base' if i == 0 else 'candidate'} FAILS the check: {message}")
        for _ in range(rounds):
            for i, version in enumerate(versions):
                timer.hide_host_cost(harness.host_call_ns(version.custom_kernel, data))
                times[i] += [timer.time_call(version.custom_kernel, data)[1] / 1e3 for _ in range(5)]
        base_us, candidate_us = (sorted(t)[len(t) // 2] for t in times)
        ratios.append(candidate_us / base_us)
        print(f"{label:<28} {base_us:9.1f} {candidate_us:9.1f} {ratios[-1]:9.3f}", flush=True)
        del data
        torch.cuda.empty_cache()
    print(f"{'geomean ratio':<28} {'':>9} {'':>9} {math.exp(sum(map(math.log, ratios)) / len(ratios)):9.3f}")
    print(f"median of {rounds * 5} event-timed calls after an L2 flush, base and candidate interleaved")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Per-kernel device time of custom_kernel on the official benchmark shapes.

    python tools/profile_kernels.py [repeats]

Runs each shape under torch.profiler and prints the mean time of every
kernel per call, to show where a call's time goes.
"""
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import reference  # noqa: E402
import solution  # noqa: E402


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    for bs, routed, d_expert, seed, _ in solution.BENCHMARK_SHAPES:
        data = reference.generate_input(solution.D_HIDDEN, d_expert, routed, solution.TOP_K,
                                        solution.N_SHARED, bs, seed)
        solution.custom_kernel(data)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                solution.custom_kernel(data)
            torch.cuda.synchronize()
        per_kernel = defaultdict(float)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel[event.name.split("(")[0].split("<")[0][-40:]] += event.device_time / repeats
        total = sum(per_kernel.values())
        parts = ", ".join(f"{name} {us:.1f}" for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1]))
        print(f"bs={bs} E={routed + 1} d_expert={d_expert}: {total:.1f} us = {parts}", flush=True)
        del data


if __name__ == "__main__":
    main()

"""What a cold call pays for, by how the L2 is left before it: eval.py's
flush writes 1 GiB, so the call starts with the L2 full of the flush's dirty
lines and the GPU's address translations holding the flush buffer's pages.
Each mode below undoes one of those, and the call is timed after each (CUDA
events around it, launch hidden behind a spin, as eval.py does):

    write   eval.py's cold start: the flush (write 1 GiB), then the spin
    clean   the flush, then 256 MB of another buffer read: the L2 holds clean
            lines, so the call's misses write nothing back
    touch   the flush, then one 4-byte load per 64 KB of the weights and
            their scales (a few MB): their pages' translations warm, the L2
            nearly as dirty as after the flush
    read    1 GiB read instead of written: no dirty lines, translations as cold

    python tools/flush_modes.py [N ...]     benchmark shapes N (0-6; default all),
                                            modes interleaved call by call
    python tools/flush_modes.py --versions A.py B.py [--] [N ...]
                                            each version of solution.py timed so too,
                                            versions and modes interleaved (e.g. .ab/base.py
                                            and this checkout's, for a change that aims at
                                            the gap)

The table gives each mode's median us and its difference to `write`: clean -
write bounds what writing the flush's lines back costs the call, touch - write
what the translations do (H200, 2026-12-04: about -5 us and 0 on the four
narrow-tile shapes; BENCHMARKS.md, forty-seventh session).
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import eval as harness  # noqa: E402
import solution  # noqa: E402
from ab_bench import benchmark_inputs, load, selected_shapes  # noqa: E402

MODES = ("write", "clean", "touch", "read")
CLEAN_BYTES = 256 << 20
TOUCH_STRIDE_BYTES = 64 << 10
CALLS = 30


def weight_tensors(data) -> tuple:
    """The input's weights and weight scales (gate_up_weight, down_weight and
    their scales: fields 1-4 of task.input_t)."""
    return tuple(data[1:5])


def touch(tensors) -> torch.Tensor:
    """One 4-byte load per TOUCH_STRIDE_BYTES of each tensor, summed so that
    the loads cannot be dropped."""
    total = torch.zeros((), dtype=torch.int64, device=tensors[0].device)
    for t in tensors:
        words = t.view(torch.uint8).reshape(-1)
        words = words[: words.numel() // 4 * 4].view(torch.int32)
        total += words[:: TOUCH_STRIDE_BYTES // 4].sum()
    return total


def time_modes(kernels: list, data, timer: harness.CudaTimer, clean_buffer: torch.Tensor) -> list:
    """Median us per mode of each kernel in `kernels`."""
    spin_cycles = int(timer.spin_ns * timer._cycles_per_ns)
    tensors = weight_tensors(data)
    times = [{mode: [] for mode in MODES} for _ in kernels]
    for _ in range(CALLS):
        for mode, (version, kernel) in ((m, v) for m in MODES for v in enumerate(kernels)):
            torch.cuda.synchronize()
            if mode == "read":
                timer._flush.sum()
            else:
                timer._flush.zero_()
            if mode == "clean":
                clean_buffer.sum()
            elif mode == "touch":
                touch(tensors)
            torch.cuda._sleep(spin_cycles)
            timer._start.record()
            kernel(data)
            timer._end.record()
            torch.cuda.synchronize()
            times[version][mode].append(timer._start.elapsed_time(timer._end) * 1e3)
    return [{mode: statistics.median(values) for mode, values in t.items()} for t in times]


def main(argv) -> int:
    paths = []
    if argv[:1] == ["--versions"]:
        argv = argv[1:]
        while argv and argv[0].endswith(".py"):
            paths.append(argv.pop(0))
        argv = argv[1:] if argv[:1] == ["--"] else argv
    kernels = [load(path, f"version{i}").custom_kernel for i, path in enumerate(paths)] or [solution.custom_kernel]
    names = paths or ["solution.py"]
    timer = harness.cuda_timer()
    clean_buffer = torch.ones(CLEAN_BYTES // 4, dtype=torch.int32, device="cuda")
    print(f"median us of {CALLS} calls per mode, modes interleaved; diff: mode - write")
    print(f"{'shape':28s}{'version':>24s}" + "".join(f"{m:>9s}" for m in MODES)
          + "".join(f"{'d ' + m:>10s}" for m in MODES[1:]))
    for label, data in benchmark_inputs(selected_shapes(" ".join(argv))):
        for kernel in kernels:
            kernel(data)
        timer.hide_host_cost(max(harness.host_call_ns(kernel, data) for kernel in kernels))
        for name, us in zip(names, time_modes(kernels, data, timer, clean_buffer)):
            print(f"{label:28s}{name[-24:]:>24s}" + "".join(f"{us[m]:9.1f}" for m in MODES)
                  + "".join(f"{us[m] - us['write']:10.1f}" for m in MODES[1:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""tools/dram_pattern.py: its kernels build for sm_90a without spills and
each copy pattern issues its copy instruction (no GPU needed); on an sm_90
GPU, the tool runs and prints a row per pattern and ring."""
import os
import re
import sys

import microbenchmarks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import dram_pattern  # noqa: E402
import kernel_resources  # noqa: E402

# The SASS each pattern's copies become: the tensor copy (UTMALDG), the
# one-dimensional bulk copy (UBLKCP), or plain global loads (LDG).
COPY_INSTRUCTION = {0: "UTMALDG", 1: "UBLKCP", 2: "UBLKCP", 3: "UBLKCP", 4: "LDG"}


def test_every_pattern_builds_for_sm90a_and_issues_its_copies(tmp_path):
    microbenchmarks.skip_without_nvcc_and_cuobjdump()
    returncode, report = kernel_resources.ptxas_report(str(tmp_path), dram_pattern.KERNEL_SOURCE + "".join(
        f"template __global__ void moe::stream_kernel<{p}>(const uint8_t*, int, int, int, int, int, int, "
        f"const __grid_constant__ moe::TensorMap, float*);\n" for p in range(len(dram_pattern.PATTERNS))))
    assert returncode == 0, report
    streams = [kernel for kernel in kernel_resources.ptxas_kernels(report) if "stream_kernel" in kernel[0]]
    assert len(streams) == len(dram_pattern.PATTERNS), report
    assert all(stores == loads == "0" for _, _, stores, loads in streams), streams
    kernels = {name: sass for name, sass in kernel_resources.sass_functions(str(tmp_path)).items()
               if "stream_kernel" in name}
    assert len(kernels) == len(dram_pattern.PATTERNS)
    for pattern, instruction in COPY_INSTRUCTION.items():
        (sass,) = [s for name, s in kernels.items() if f"stream_kernelILi{pattern}E" in name]
        issued = {i for i in set(COPY_INSTRUCTION.values()) if re.search(rf"\b{i}[.\s]", sass)}
        assert issued == {instruction}, (pattern, issued)


def test_the_tool_runs_on_sm90():
    lines = microbenchmarks.run_on_sm90(dram_pattern.__file__, "--experts", "33", "--reps", "1")
    expected = [(dram_pattern.PATTERNS[p], str(r), str(s), str(c)) for p, r, s, c in dram_pattern.rows_to_time()]
    rows = [line.split() for line in lines[2:2 + len(expected)]]
    assert [tuple(row[:4]) for row in rows] == expected
    assert all(float(row[5]) > 0 for row in rows)
    # The second table: a row per (slices, grid, ring), after its title and header.
    lifetime = [line.split() for line in lines[4 + len(expected):]]
    expected = [(str(n), grid, str(s), str(c)) for n, grid, s, c in dram_pattern.lifetime_rows()]
    assert [(row[0], row[2], row[3], row[4]) for row in lifetime] == expected
    assert all(float(row[7]) > 0 for row in lifetime)
    # 33 experts: 132 row blocks, so a CTA per unit is 132 x slices CTAs.
    assert all(int(row[5]) == 132 * int(row[0]) for row in lifetime if row[2] == "per-unit")

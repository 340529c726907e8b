"""tools/wide_stage_loop.py: its kernels build for sm_90a without spills or
serialised MMAs, each issuing the folded consumers' e4m3 MMAs and only the
loads its feed names (no GPU needed); on an sm_90 GPU, the tool runs."""
import os
import sys

import microbenchmarks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import kernel_resources  # noqa: E402
import wide_stage_loop  # noqa: E402

# Per feed: whether its kernel issues TMA loads (UTMALDG) and cp.async copies (LDGSTS).
EXPECTED_LOADS = {"static": (False, False), "no_fold": (False, False), "weights": (True, False), "both": (True, False),
                  "gathers": (True, True), "ss_static": (False, False), "ss_both": (True, False)}


def test_every_feed_builds_for_sm90a_and_issues_its_loads(tmp_path):
    microbenchmarks.skip_without_nvcc_and_cuobjdump()
    returncode, report = kernel_resources.ptxas_report(str(tmp_path), wide_stage_loop.solution.KERNEL_SOURCE
                                                       + wide_stage_loop.LOOP_KERNEL_SOURCE + "".join(
        f"template void moe::launch_loop<{n}, {f}>(int, int, const uint8_t*, const uint8_t*, const moe::TensorMap&, "
        "const moe::TensorMap&, long long*, float*, cudaStream_t);\n"
        for n in wide_stage_loop.TOKENS for f in range(len(wide_stage_loop.FEEDS))))
    assert returncode == 0, report
    assert "C75" not in report, report   # ptxas serialising the MMAs would void the timing
    loops = [kernel for kernel in kernel_resources.ptxas_kernels(report) if "loop_kernel" in kernel[0]]
    assert len(loops) == len(wide_stage_loop.TOKENS) * len(wide_stage_loop.FEEDS), report
    assert all(stores == "0" for _, _, stores, _ in loops), loops
    kernels = kernel_resources.int_template_kernels(str(tmp_path), "loop_kernel")   # stage_ and ss_loop_kernel
    assert len(kernels) == len(wide_stage_loop.TOKENS) * len(wide_stage_loop.FEEDS)
    for (n, feed), sass in kernels.items():
        shapes = kernel_resources.qgmma_shapes(sass)
        assert shapes == {f"64x{n}x32"}, (n, feed, shapes)
        loads = ("UTMALDG" in sass, "LDGSTS" in sass)
        assert loads == EXPECTED_LOADS[wide_stage_loop.FEEDS[feed]], (n, feed, loads)


def test_the_tool_runs_on_sm90():
    lines = microbenchmarks.run_on_sm90(wide_stage_loop.__file__, "--units", "2", "--tokens", "64")
    rows = [line.split() for line in lines[1:]]
    assert [row[1] for row in rows] == list(wide_stage_loop.FEEDS)
    assert all(float(row[2]) >= 4 * 64 * 0.9 for row in rows)   # no faster than the tensor cores' bound
    assert [row[-1] for row in rows] == ["-" if feed == "no_fold" else "ok" for feed in wide_stage_loop.FEEDS]

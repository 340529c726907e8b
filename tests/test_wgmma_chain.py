"""tools/wgmma_chain.py: its kernels build for sm_90a and issue the MMAs each
order names (no GPU needed); on an sm_90 GPU, the tool runs."""
import os
import sys

import microbenchmarks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import kernel_resources  # noqa: E402
import wgmma_chain  # noqa: E402

# The one QGMMA shape each order issues (halves: N/2 tokens).
EXPECTED_SHAPE = {0: "64x{n}x32", 1: "64x{n}x32", 2: "64x{n}x32", 3: "64x{h}x32", 4: "64x{n}x32"}


def test_every_mode_builds_for_sm90a_and_issues_its_mmas(tmp_path):
    microbenchmarks.skip_without_nvcc_and_cuobjdump()
    returncode, report = kernel_resources.ptxas_report(str(tmp_path), wgmma_chain.KERNEL_SOURCE + "".join(
        f"template void moe::launch<{n}, {m}>(int, int, long long*, float*, cudaStream_t);\n"
        for n in wgmma_chain.TOKENS for m in range(len(wgmma_chain.MODES))))
    assert returncode == 0, report
    assert "C75" not in report, report   # ptxas serialising the MMAs would void the timing
    kernels = kernel_resources.int_template_kernels(str(tmp_path), "chain_kernel")
    assert len(kernels) == len(wgmma_chain.TOKENS) * len(wgmma_chain.MODES)
    for (n, mode), sass in kernels.items():
        shapes = kernel_resources.qgmma_shapes(sass)
        assert shapes == {EXPECTED_SHAPE[mode].format(n=n, h=n // 2)}, (n, mode, shapes)


def test_the_tool_runs_on_sm90():
    lines = microbenchmarks.run_on_sm90(wgmma_chain.__file__, "--steps", "64", "--tokens", "64")
    rows = [line.split() for line in lines[1:]]
    assert [row[1] for row in rows] == list(wgmma_chain.MODES)
    assert all(float(row[2]) > 0 for row in rows)

"""tools/wide_stage_loop.py: its kernels build for sm_90a without spills or
serialised MMAs, each issuing the folded consumers' e4m3 MMAs and only the
loads its feed names (no GPU needed); on an sm_90 GPU, the tool runs."""
import os
import re
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import wide_stage_loop  # noqa: E402

# Per feed: whether its kernel issues TMA loads (UTMALDG) and cp.async copies (LDGSTS).
EXPECTED_LOADS = {"static": (False, False), "no_fold": (False, False), "weights": (True, False), "both": (True, False),
                  "gathers": (True, True), "ss_static": (False, False), "ss_both": (True, False)}


def test_every_feed_builds_for_sm90a_and_issues_its_loads(tmp_path):
    if shutil.which("nvcc") is None or shutil.which("cuobjdump") is None:
        pytest.skip("nvcc or cuobjdump not on PATH")
    source = tmp_path / "loop.cu"
    source.write_text(wide_stage_loop.solution.KERNEL_SOURCE + wide_stage_loop.LOOP_KERNEL_SOURCE + "".join(
        f"template void moe::launch_loop<{n}, {f}>(int, int, const uint8_t*, const uint8_t*, const moe::TensorMap&, "
        "const moe::TensorMap&, long long*, float*, cudaStream_t);\n"
        for n in wide_stage_loop.TOKENS for f in range(len(wide_stage_loop.FEEDS))))
    build = subprocess.run(["nvcc", "-c", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                            "-Xptxas", "-v", "-o", str(tmp_path / "loop.o"), str(source)],
                           capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout + build.stderr
    assert "C75" not in build.stderr, build.stderr   # ptxas serialising the MMAs would void the timing
    reports = [r for r in build.stderr.split("Compiling entry function")[1:] if "loop_kernel" in r.split()[0]]
    assert len(reports) == len(wide_stage_loop.TOKENS) * len(wide_stage_loop.FEEDS), build.stderr
    assert all(re.search(r"\b0 bytes spill stores", r) for r in reports), reports
    sass = subprocess.run(["cuobjdump", "-sass", str(tmp_path / "loop.o")], capture_output=True, text=True,
                          check=True).stdout
    functions = [f for f in re.split(r"Function : ", sass)[1:] if "loop_kernel" in f.split()[0]]
    assert len(functions) == len(wide_stage_loop.TOKENS) * len(wide_stage_loop.FEEDS)
    for function in functions:
        n, feed = map(int, re.search(r"loop_kernelILi(\d+)ELi(\d)E", function.split()[0]).groups())
        shapes = set(re.findall(r"QGMMA\.(\d+x\d+x\d+)\.F32\.E4M3\.E4M3", function))
        assert shapes == {f"64x{n}x32"}, (n, feed, shapes)
        loads = ("UTMALDG" in function, "LDGSTS" in function)
        assert loads == EXPECTED_LOADS[wide_stage_loop.FEEDS[feed]], (n, feed, loads)


def test_the_tool_runs_on_sm90():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    run = subprocess.run([sys.executable, wide_stage_loop.__file__, "--units", "2", "--tokens", "64"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line.split() for line in run.stdout.splitlines()[1:]]
    assert [row[1] for row in rows] == list(wide_stage_loop.FEEDS)
    assert all(float(row[2]) >= 4 * 64 * 0.9 for row in rows)   # no faster than the tensor cores' bound
    assert [row[-1] for row in rows] == ["-" if feed == "no_fold" else "ok" for feed in wide_stage_loop.FEEDS]

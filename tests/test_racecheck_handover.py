"""tools/racecheck_handover.cu builds (no GPU needed; it runs on the device)."""
import os
import shutil
import subprocess

import pytest

SOURCE = os.path.join(os.path.dirname(__file__), "..", "tools", "racecheck_handover.cu")


def test_the_handover_probe_builds_for_sm90a(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    build = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-o", str(tmp_path / "handover"),
                            SOURCE], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr

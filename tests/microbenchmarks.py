"""What the microbenchmark tools' tests share (tests/test_dram_pattern.py,
test_wgmma_chain.py, test_wide_stage_loop.py): the skip of their sm_90a
build check where nvcc or cuobjdump is missing, and the run of the tool
itself on an sm_90 GPU."""
import shutil
import subprocess
import sys

import pytest


def skip_without_nvcc_and_cuobjdump() -> None:
    if shutil.which("nvcc") is None or shutil.which("cuobjdump") is None:
        pytest.skip("nvcc or cuobjdump not on PATH")


def run_on_sm90(script: str, *args: str) -> list:
    """The stdout lines of `python script args`, run on an sm_90 GPU (the
    test skips without one); the test fails if the tool exits nonzero."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    run = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout.splitlines()

"""tools/route_phases.py without a GPU: its stamp edits apply to this
solution.py's kernel source exactly once each, the stamped source builds
for sm_90a, and the phase arithmetic turns stamps into the us it reports
(its host wrapper: tests/test_stamped_build.py)."""
import os
import shutil
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)
import kernel_resources  # noqa: E402
import route_phases  # noqa: E402
import solution  # noqa: E402


def test_every_edit_applies_and_stamps_every_phase():
    stamped = route_phases.stamped_kernel_source(solution.KERNEL_SOURCE)
    assert all(f"MOE_ROUTE_STAMP({i});" in stamped for i in range(len(route_phases.PHASES) + 1))
    assert "moe_route_stamps[8]" in stamped and "moe_route_stamps[9]" in stamped


def test_an_edit_whose_text_is_gone_refuses():
    with pytest.raises(SystemExit, match="0 times, not once"):
        route_phases.stamped_kernel_source(solution.KERNEL_SOURCE.replace("if (tid == 0) bad = 0;", "bad = 0;"))


def test_phase_us_from_stamps():
    # 2 cycles per ns; the routing CTA from globaltimer 1,000 to 11,000 ns; Qa from 1,500 to 13,000.
    stamps = [0, 2000, 6000, 8000, 10000, 20000, 1000, 11000, 1500, 13000]
    assert route_phases.phase_us(stamps) == pytest.approx([1.0, 2.0, 1.0, 1.0, 5.0, 10.0, 0.5, 12.0])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_stamped_source_builds_for_sm90a(tmp_path):
    returncode, report = kernel_resources.ptxas_report(
        str(tmp_path), route_phases.stamped_kernel_source(solution.KERNEL_SOURCE))
    assert returncode == 0, report
    assert "route_and_quantize_kernel" in report

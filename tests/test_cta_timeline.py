"""tools/cta_timeline.py without a GPU: its stamp edits apply to this
solution.py's kernel source exactly once each, the stamped source builds
for sm_90a without spills, and the summary arithmetic turns CTA stamps
into the columns it reports (its host wrapper: tests/test_stamped_build.py)."""
import os
import shutil
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)
import cta_timeline  # noqa: E402
import kernel_resources  # noqa: E402
import solution  # noqa: E402


def test_every_edit_applies_and_stamps_every_gemm_kernel():
    stamped = cta_timeline.stamped_kernel_source(solution.KERNEL_SOURCE)
    for kernel in ("constexpr int kStampKernel = 0;", "constexpr int kStampKernel = 1;",
                   "constexpr int kStampKernel = kFolded ? 2 : 3;"):
        assert stamped.count(kernel) == 1
    # stage2_wide_kernel's, then its body's (stage2_wide_body, a function of its own)
    assert stamped.count("constexpr int kStampKernel = kFolded ? 4 : 5;") == 2
    assert stamped.count("moe_cta_begin(kStampKernel);") == 4
    assert stamped.count("moe_cta_stamp(kStampKernel, 4,") == 4   # each kernel marks its work


def test_an_edit_whose_text_is_gone_refuses():
    with pytest.raises(SystemExit, match="0 times, not once"):
        cta_timeline.stamped_kernel_source(solution.KERNEL_SOURCE.replace("    if (cta_tiles <= 0) return;\n", ""))


def test_the_device_arrays_match_the_host_sizes():
    assert f"moe_cta_stamps[{len(cta_timeline.KERNELS)}][{cta_timeline.CAPACITY}][{cta_timeline.FIELDS}]" \
        in cta_timeline.STAMP_SOURCE
    assert f"id < {cta_timeline.CAPACITY}" in cta_timeline.STAMP_SOURCE


def test_kernel_ctas_reads_the_launched_stamped_ctas():
    # A 2 x 2 grid: CTA 1 never stamped (entry 0), CTA 3 without work; entries past the grid are ignored.
    # The last field holds the tile's rows and, above 16 bits, its index (tiles 2 and 1 here).
    stamps = [[5, 6, 9, 3, 8, 24 + 2 * 65536], [0] * 6, [5, 7, 8, 4, 2, 8 + 65536], [5, 7, 7, 1, 0, 0],
              [1, 1, 1, 1, 1, 1]]
    assert cta_timeline.kernel_ctas(stamps, [2, 2, 1]) == [
        (2, 5, 6, 9, 3, 7, 24), (1, 5, 7, 8, 4, 1, 8), (0, 5, 7, 7, 1, None, 0)]
    assert cta_timeline.kernel_ctas(stamps, [0, 0, 0]) == []


def test_summary_of_a_small_grid():
    # (tile, entry, go, exit ns, SM, expert, rows): tiles 0 and 1 of expert 5 share SM 0 for 10 us; the
    # shared expert 7's tile runs alone on SM 1 for the last 6 us; tile 3 had no work.
    ctas = [(0, 0, 0, 10_000, 0, 5, 24), (1, 0, 0, 10_000, 0, 5, 24), (2, 0, 10_000, 16_000, 1, 7, 24),
            (3, 0, 0, 100, 2, None, 0)]
    s = cta_timeline.summarize(ctas, launched=4, shared_expert=7)
    assert s["ctas"] == "3/4" and s["slots"] == 2
    assert s["span"] == pytest.approx(16.0) and s["tail"] == pytest.approx(6.0)
    assert s["idle"] == pytest.approx(1 - 26 / 32)
    assert (s["p10"], s["p50"], s["p90"]) == pytest.approx((6.0, 10.0, 10.0))
    assert s["lone"] == (pytest.approx(6.0), 1)
    assert s["shared"] == pytest.approx(6 / 26) and s["repeat"] == pytest.approx(10 / 26)
    assert s["empty"] == (1, pytest.approx(0.1))   # tile 3: entry 0, exit 100 ns
    assert "3/4" in cta_timeline.row("bs=1 stage1", s)


def test_the_wide_kernels_have_no_tile_columns():
    ctas = [(0, 0, 0, 10_000, 0, 0, 0), (1, 0, 0, 8_000, 1, 0, 0)]   # persistent CTAs: work marked, no tile
    s = cta_timeline.summarize(ctas, launched=2, shared_expert=None)
    assert s["shared"] is None and s["repeat"] is None and s["tail"] == pytest.approx(2.0)
    assert cta_timeline.row("bs=128 stage1_wide", s).split()[-4:] == ["-", "-", "0", "0.00"]
    assert cta_timeline.median_summary([s, s])["span"] == pytest.approx(10.0)


def test_a_kernel_with_no_work_says_so():
    s = cta_timeline.summarize([(0, 0, 0, 100, 0, None, 0)], launched=8, shared_expert=7)
    assert s == {"ctas": "0/8"} and cta_timeline.row("x", s).split() == ["x", "0/8"]


def test_median_summary_takes_each_column_over_calls():
    a = {"ctas": "3/4", "slots": 2, "span": 10.0, "p10": 1.0, "p50": 2.0, "p90": 3.0, "lone": (4.0, 1),
         "idle": 0.1, "tail": 1.0, "shared": 0.2, "repeat": 0.3, "empty": (5, 0.5)}
    b = dict(a, span=20.0, lone=(8.0, 3), slots=3, empty=(7, 0.9))
    c = dict(a, span=30.0, lone=(6.0, 2), empty=(6, 0.7))
    m = cta_timeline.median_summary([a, b, c])
    assert m["span"] == 20.0 and m["lone"] == (6.0, 2) and m["ctas"] == "3/4"
    assert m["empty"] == (6, pytest.approx(0.7))
    m = cta_timeline.median_summary([a, b])   # an even count: the slots' median 2.5 printed whole
    assert m["slots"] == 2 and "3/4" in cta_timeline.row("x", m)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_stamped_source_builds_for_sm90a_without_spills(tmp_path):
    returncode, report = kernel_resources.ptxas_report(
        str(tmp_path), cta_timeline.stamped_kernel_source(solution.KERNEL_SOURCE))
    assert returncode == 0, report
    kernels = kernel_resources.ptxas_kernels(report)
    assert any("stage1_kernel" in k[0] for k in kernels) and any("stage2_wide_kernel" in k[0] for k in kernels)
    assert all(k[2] == "0" and k[3] == "0" for k in kernels), [k for k in kernels if k[2] != "0" or k[3] != "0"]

"""tools/ab_bench.py: how a call's per-kernel times are split by stage, and which versions are timed unchecked."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import ab_bench  # noqa: E402
import pytest  # noqa: E402


def test_stage_split_sums_each_stage_and_leaves_the_rest():
    times = {"stage1_kernel": 60.0, "stage2_kernel": 38.5, "route_and_quantize_kernel": 3.5,
             "swiglu_quantize_kernel": 2.9, "convert_output_kernel": 1.3}
    assert ab_bench.stage_split(times) == pytest.approx((60.0, 38.5, 7.7))


def test_stage_split_counts_the_wide_kernels_as_their_stages():
    times = {"stage1_wide_kernel": 60.0, "stage2_wide_kernel": 30.0, "convert_output_kernel": 1.0}
    assert ab_bench.stage_split(times) == pytest.approx((60.0, 30.0, 1.0))


def test_stage_split_of_no_kernels_is_zero():
    assert ab_bench.stage_split({}) == (0.0, 0.0, 0.0)


def test_only_timing_files_skip_the_reference_check():
    assert ab_bench.timing_only(".ab/timing_no_atomics.py")
    assert not ab_bench.timing_only(".ab/candidate_timing.py")
    assert not ab_bench.timing_only("solution.py")


def test_ab_shapes_picks_the_named_benchmark_shapes_in_order():
    shapes = ab_bench.selected_shapes("6 5")
    assert shapes == [ab_bench.solution.BENCHMARK_SHAPES[6], ab_bench.solution.BENCHMARK_SHAPES[5]]
    assert ab_bench.selected_shapes("") is None and ab_bench.selected_shapes("  ") is None
    with pytest.raises(IndexError):
        ab_bench.selected_shapes("7")

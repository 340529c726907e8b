"""tools/profile_kernels.py: how per-kernel times are counted from profiler events."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import profile_kernels  # noqa: E402


def test_kernel_times_count_from_the_previous_kernels_end():
    """Under programmatic dependent launch a kernel's span starts while the one
    before it runs; that overlap belongs to the one before. A gap between two
    kernels belongs to neither, but shows in the call's span."""
    events = [(0.0, 10.0, "route"), (4.0, 30.0, "stage1"), (25.0, 40.0, "stage2"), (42.0, 45.0, "convert"),
              (100.0, 112.0, "route"), (105.0, 128.0, "stage1"), (128.0, 140.0, "stage2"), (140.0, 144.0, "convert")]
    spans = []
    times = profile_kernels.call_kernel_times(events[::-1], 2, spans)   # any event order
    assert times == {"route": 11.0, "stage1": 18.0, "stage2": 11.0, "convert": 3.5}
    assert spans == [45.0, 44.0]


def test_kernel_names_keep_their_template_arguments():
    """The timeline tells a kernel's instantiations apart (the folded wide
    stage 1 from its bf16 redo), unlike the per-kernel view."""
    name = "void moe::stage1_wide_kernel<144, true>(unsigned char const*, float const*, int)"
    assert profile_kernels.kernel_name(name) == "stage1_wide_kernel<144, true>"
    assert profile_kernels.kernel_name("moe::convert_output_kernel(float const*, int)") == "convert_output_kernel"


def test_a_calls_timeline_starts_at_its_first_kernel():
    events = [(105.0, 128.0, "stage1"), (100.0, 112.0, "route"), (128.0, 140.0, "stage2")]
    assert profile_kernels.call_timeline(events) == [(0.0, 12.0, "route"), (5.0, 28.0, "stage1"),
                                                     (28.0, 40.0, "stage2")]
    assert profile_kernels.call_timeline([]) == []


def test_kernel_times_need_whole_calls():
    assert profile_kernels.call_kernel_times([(0.0, 1.0, "route")], 2) == {}


def test_once_runs_the_named_solution_file(tmp_path, monkeypatch, capsys):
    """--once N FILE calls FILE's custom_kernel, not this checkout's (ncu's
    counters of two versions in one device call)."""
    calls = tmp_path / "calls.txt"
    other = tmp_path / "other_solution.py"
    other.write_text(f"def custom_kernel(data):\n    open({str(calls)!r}, 'a').write(f'{{data}} ')\n")
    monkeypatch.setattr(profile_kernels, "benchmark_inputs", lambda: iter([("a", 1), ("b", 2)]))
    monkeypatch.setattr(profile_kernels.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(profile_kernels.solution, "custom_kernel", lambda data: calls.write_text("checkout's"))
    profile_kernels.once("1", str(other))
    assert calls.read_text() == "2 2 "
    assert capsys.readouterr().out == "b done\n"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the profiler's CUDA events)")
def test_a_cold_call_leaves_out_the_flush_and_the_spin():
    """profiled_kernels(cold=True) runs the L2 flush and the spin before the
    call, as eval.py times it, and reports the call's kernels alone: here
    the one kernel of an in-place add, which no flush or spin launches."""
    x = torch.zeros(1 << 20, device="cuda")
    warm = profile_kernels.profiled_kernels(lambda t: t.add_(1.0), x, 1)
    cold = profile_kernels.profiled_kernels(lambda t: t.add_(1.0), x, 1, cold=True)
    assert len(warm) == 1
    assert [name for _, _, name in cold] == [name for _, _, name in warm]

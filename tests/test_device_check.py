"""tools/device_check.sh, run with a fake python3, nvidia-smi and
compute-sanitizer on PATH (no GPU): nothing runs after a failed build, the
A/B step leaves out versions whose smoke check fails or hangs and times
nothing when the base or the checkout fails, a lean call's switches
(PYTEST_K, AB_TIMELINE=0) take effect, basetests runs the selected tests
on the base, and the robust step's two halves run on their own."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A version file holding FAIL fails its smoke check; one holding HANG outlasts the timeout.
# The build step reports the PyTorch fallback for a checkout holding NOBUILD.
FAKE_PYTHON = """#!/bin/bash
if [ "$1" = -c ]; then
  if grep -q NOBUILD solution.py; then echo torch; else echo cuda; fi
fi
if [ "$1" = -m ] && [ "$2" = pytest ]; then echo "pytest on solution.py: $(cat solution.py)"; fi
if [ "$1" = tools/ab_bench.py ] && [ "$2" = --smoke ]; then
  grep -q FAIL "$3" && exit 1
  grep -q HANG "$3" && sleep 30
fi
echo "python3 $*"
"""


def run_script(tmp_path, checkout, versions, parts, **env_extra):
    """stdout of device_check.sh PARTS in a fake repository whose
    solution.py holds `checkout` and .ab/ the `versions` (name: text),
    with env_extra added to the environment."""
    if shutil.which("timeout") is None:
        pytest.skip("needs coreutils timeout")
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    (repo / ".ab").mkdir()
    script = (REPO / "tools" / "device_check.sh").read_text()
    assert "timeout 400" in script
    (repo / "tools" / "device_check.sh").write_text(script.replace("timeout 400", "timeout 2"))
    (repo / "solution.py").write_text(checkout)
    for name, text in versions.items():
        (repo / ".ab" / name).write_text(text)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python3", FAKE_PYTHON), ("nvidia-smi", "#!/bin/bash\necho gpu\n"),
                       ("compute-sanitizer", "#!/bin/bash\necho \"compute-sanitizer $*\"\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    # The script's own switches come from env_extra only, not from the caller's environment.
    env = {name: value for name, value in os.environ.items()
           if name not in ("PYTEST_K", "BASE_PYTEST_K", "AB_TIMELINE", "AB_SHAPES", "DRAM_EXPERTS")}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), **env_extra)
    run = subprocess.run(["bash", str(repo / "tools" / "device_check.sh"), *parts], capture_output=True, text=True,
                         env=env, timeout=120)
    return run.stdout


def run_ab(tmp_path, checkout, versions, **env_extra):
    out = run_script(tmp_path, checkout, versions, ["ab"], **env_extra)
    return out, [line for line in out.splitlines() if line.startswith("python3 tools/ab_bench.py .ab")]


@pytest.mark.parametrize("parts, builds", [(["ab"], False), (["mma"], False), (["ab", "mma"], False),
                                           (["routephases"], False), (["ctatimeline", "ab"], False), (["dram"], False),
                                           (["selfbench", "ab"], True), (["tests"], True), ([], True)])
def test_the_build_step_runs_unless_only_tools_with_their_own_builds_are_asked(tmp_path, parts, builds):
    assert ("=== build" in run_script(tmp_path, "ok", {"base.py": "ok"}, parts)) == builds


def test_ab_leaves_out_versions_that_fail_or_hang(tmp_path):
    out, timing = run_ab(tmp_path, "ok", {"base.py": "ok", "candidate_good.py": "ok", "candidate_bad.py": "FAIL",
                                          "candidate_hang.py": "HANG"})
    assert timing == ["python3 tools/ab_bench.py .ab/base.py solution.py .ab/candidate_good.py"], out
    assert "left out" in out and ".ab/candidate_bad.py" in out and ".ab/candidate_hang.py" in out


def test_ab_times_timing_only_versions_after_the_candidates(tmp_path):
    out, timing = run_ab(tmp_path, "ok", {"base.py": "ok", "candidate_good.py": "ok", "timing_bound.py": "ok"})
    assert timing == ["python3 tools/ab_bench.py .ab/base.py solution.py .ab/candidate_good.py .ab/timing_bound.py"], out


def test_ab_writes_the_timelines_of_the_checked_versions(tmp_path):
    run_ab(tmp_path, "ok", {"base.py": "ok", "candidate_good.py": "ok", "timing_bound.py": "ok"})
    log = (tmp_path / "out" / "ab_timeline.log").read_text().splitlines()
    assert log == [f"python3 tools/profile_kernels.py --timeline {n} .ab/base.py solution.py .ab/candidate_good.py"
                   for n in range(7)]


def test_ab_without_timelines_when_asked(tmp_path):
    out, timing = run_ab(tmp_path, "ok", {"base.py": "ok", "candidate_good.py": "ok"}, AB_TIMELINE="0")
    assert timing == ["python3 tools/ab_bench.py .ab/base.py solution.py .ab/candidate_good.py"], out
    assert not (tmp_path / "out" / "ab_timeline.log").exists() and "ab_timeline.log" not in out, out


@pytest.mark.parametrize("selection", [None, "wide or nan"])
def test_tests_run_the_selected_gpu_tests(tmp_path, selection):
    extra = {"PYTEST_K": selection} if selection else {}
    out = run_script(tmp_path, "ok", {}, ["tests"], **extra)
    pytest_lines = [line for line in out.splitlines() if line.startswith("python3 -m pytest")]
    expected = "python3 -m pytest -q -rfs --tb=short " + (f"-k {selection} " if selection else "") \
        + "tests/test_solution.py"
    assert pytest_lines == [expected], out


def test_basetests_run_the_selected_gpu_tests_on_the_base(tmp_path):
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    for name in ("reference.py", "task.py", "eval.py"):
        (repo / name).write_text("")
    out = run_script(tmp_path, "ok", {"base.py": "BASE"}, ["tests", "basetests"], PYTEST_K="wide",
                     BASE_PYTEST_K="redo")
    assert "python3 -m pytest -q -rfs --tb=short -k wide tests/test_solution.py" in out.splitlines(), out
    assert "python3 -m pytest -q -rfs --tb=short -k redo tests/test_solution.py" in out.splitlines(), out
    assert "pytest on solution.py: BASE" in out.splitlines() and "pytest on solution.py: ok" in out.splitlines()
    assert (tmp_path / "out" / "pytest_base.log").exists()
    out = run_script(tmp_path / "again", "ok", {}, ["basetests"])
    assert "skipped: .ab/base.py is missing" in out, out


@pytest.mark.parametrize("failing", ["base", "checkout"])
def test_ab_times_nothing_when_the_base_or_checkout_fails(tmp_path, failing):
    out, timing = run_ab(tmp_path, "FAIL" if failing == "checkout" else "ok",
                         {"base.py": "FAIL" if failing == "base" else "ok", "candidate_good.py": "ok"})
    assert timing == [] and "no A/B" in out, out


@pytest.mark.parametrize("parts, builds, sanitizes", [(["sanitize"], False, True), (["multibuild"], True, False),
                                                      (["robust"], True, True)])
def test_robust_is_multibuild_and_sanitize(tmp_path, parts, builds, sanitizes):
    out = run_script(tmp_path, "ok", {}, parts)
    assert ("four processes importing at once" in out) == builds, out
    assert ("compute-sanitizer --tool racecheck" in out) == sanitizes, out


def test_host_step_times_the_host_cost_when_named(tmp_path):
    out = run_script(tmp_path, "ok", {}, ["host"])
    assert "python3 tools/profile_kernels.py --host" in out, out
    assert "tools/ab_bench.py" not in out, out


def test_nothing_runs_after_the_kernels_fail_to_build(tmp_path):
    out = run_script(tmp_path, "NOBUILD", {"base.py": "ok"}, ["tests", "ab"])
    assert "stopping: the CUDA kernels did not build" in out, out
    assert "pytest" not in out and "ab_bench" not in out, out


@pytest.mark.parametrize("versions, expected", [
    ({}, "python3 tools/flush_modes.py 0 3"),
    ({"base.py": "ok"}, "python3 tools/flush_modes.py --versions .ab/base.py solution.py -- 0 3")])
def test_flush_step_times_the_checkout_and_the_base_when_there(tmp_path, versions, expected):
    out = run_script(tmp_path, "ok", versions, ["flush"], FLUSH_SHAPES="0 3")
    assert expected in out.splitlines(), out


# The stamped-build tools' parts: (part, the variable naming its shapes, the tool).
STAMPED_PARTS = [("routephases", "ROUTE_SHAPES", "route_phases"), ("ctatimeline", "CTA_SHAPES", "cta_timeline")]


@pytest.mark.parametrize("part, variable, tool", STAMPED_PARTS)
@pytest.mark.parametrize("shapes", ["", "2 6"])
def test_stamped_build_steps_run_on_the_named_shapes(tmp_path, part, variable, tool, shapes):
    out = run_script(tmp_path, "ok", {}, [part], **({variable: shapes} if shapes else {}))
    assert f"python3 tools/{tool}.py {shapes}".strip() in out.splitlines(), out


@pytest.mark.parametrize("part, variable, tool", STAMPED_PARTS)
def test_stamped_build_steps_are_not_part_of_all(tmp_path, part, variable, tool):
    assert tool not in run_script(tmp_path, "ok", {}, [])


@pytest.mark.parametrize("experts, expected", [("", ["64", "257"]), ("33", ["33"])])
def test_dram_step_streams_each_named_expert_count(tmp_path, experts, expected):
    out = run_script(tmp_path, "ok", {}, ["dram"], **({"DRAM_EXPERTS": experts} if experts else {}))
    runs = [line for line in out.splitlines() if line.startswith("python3 tools/dram_pattern.py")]
    assert runs == [f"python3 tools/dram_pattern.py --experts {n}" for n in expected], out


def test_dram_step_is_not_part_of_all(tmp_path):
    assert "dram_pattern" not in run_script(tmp_path, "ok", {}, [])

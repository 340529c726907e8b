"""eval.py: spec parsing, standalone and popcorn modes, failure reporting.

The end-to-end tests run eval.py as a subprocess on specs/cpu.txt, whose
cases are small enough for the CPU reference path.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import eval as harness  # noqa: E402  (the repository root must be on sys.path first)

CPU_SPECS = (REPO / "specs" / "cpu.txt").read_text().splitlines()
TIMEOUT_S = 120
# A popcorn record is `key: value` on one line.
RECORD = re.compile(r"[A-Za-z0-9_.-]+: .*")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("POPCORN_FD", "POPCORN_SEED")}
    # The cases are tiny: intra-op threads gain nothing, and on a busy small
    # machine their spin-waiting slows a run down several times.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def run_standalone(*args, cwd=REPO):
    return subprocess.run([sys.executable, "eval.py", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def run_popcorn(mode, spec, cwd=REPO, **env):
    """Runs eval.py with POPCORN_FD on a pipe, as the official runner does.
    Returns (exit code, what came through the pipe, stderr)."""
    read_end, write_end = os.pipe()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "eval.py", mode, str(spec)], cwd=cwd,
                                env=_env(POPCORN_FD=str(write_end), **env),
                                pass_fds=(write_end,), stdout=out, stderr=err)
        os.close(write_end)
        with os.fdopen(read_end) as channel:
            records = channel.read()
        returncode = proc.wait(timeout=TIMEOUT_S)
        err.seek(0)
        return returncode, records, err.read()


def table_rows(stdout):
    """The table row of each cpu.txt case, by spec."""
    return {spec: next(line for line in stdout.splitlines() if line.startswith(spec))
            for spec in CPU_SPECS}


# ---------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------
def test_parse_specs_skips_comments_and_blank_lines():
    text = ("# a comment\n"
            "\n"
            "dhidden: 256; dexpert: 128; bs: -3; shared: true; kind: fast\n"
            "   \n"
            "  # an indented comment\n"
            "dhidden: 512;bs:8\n")
    cases = harness.parse_specs(text)
    assert [case.spec for case in cases] == ["dhidden: 256; dexpert: 128; bs: -3; shared: true; kind: fast",
                                             "dhidden: 512;bs:8"]
    assert cases[0].args == {"dhidden": 256, "dexpert": 128, "bs": -3, "shared": True, "kind": "fast"}
    assert cases[1].args == {"dhidden": 512, "bs": 8}
    assert all(type(v) is int for v in cases[1].args.values())


@pytest.mark.parametrize("line", ["dhidden 256", "dhidden: 2.5", "dhidden: 256;", "dhidden : 256"])
def test_parse_specs_rejects_what_the_official_parser_rejects(line):
    with pytest.raises(ValueError):
        harness.parse_specs(line)


@pytest.mark.parametrize("name,count", [("tests.txt", 3), ("benchmarks.txt", 7), ("cpu.txt", len(CPU_SPECS))])
def test_spec_files_suit_the_official_parser(name, count):
    lines = (REPO / "specs" / name).read_text().splitlines()
    assert len(lines) == count
    keys = {"dhidden", "dexpert", "nroutedexperts", "nexpertspertoken", "nsharedexperts", "bs", "seed"}
    cases = harness.parse_specs("\n".join(lines))
    assert len(cases) == count   # no line is skipped: none blank or '#'
    for case in cases:
        assert set(case.args) == keys


def test_combine_seeds_is_cantor_pairing():
    assert harness.combine_seeds(1, 2) == 1 + 3 * 4 // 2
    assert harness.combine_seeds(9371, 0) == 9371 + 9371 * 9372 // 2


def test_stats_use_the_sample_standard_deviation():
    stats = harness.Stats.of([1.0, 2.0, 3.0])
    assert (stats.runs, stats.mean, stats.std, stats.best, stats.worst) == (3, 2.0, 1.0, 1.0, 3.0)
    assert stats.err == pytest.approx(1.0 / 3 ** 0.5)


# ---------------------------------------------------------------------------
# Standalone mode
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["test", "benchmark"])
def test_standalone_passes_and_prints_the_table(mode):
    proc = run_standalone(mode, "specs/cpu.txt")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^spec\s+status\s+mean us\s+best us\s+host us\s+rel L2$", proc.stdout, re.M)
    for spec, row in table_rows(proc.stdout).items():
        cells = row[len(spec):].split()
        assert cells[0] == "pass", row
        if mode == "benchmark":
            mean_us, best_us, host_us = map(float, cells[1:4])
            assert 0 < best_us <= mean_us and host_us > 0
        float(cells[4])  # the relative L2 error, from the check's message
    if not torch.cuda.is_available():
        assert "wall clock on CPU" in proc.stdout


# ---------------------------------------------------------------------------
# Popcorn mode
# ---------------------------------------------------------------------------
def test_popcorn_test_mode_reports_every_case():
    returncode, records, stderr = run_popcorn("test", "specs/cpu.txt")
    assert returncode == 0, stderr
    lines = records.splitlines()
    assert all(RECORD.fullmatch(line) for line in lines), records
    assert lines[0] == f"test-count: {len(CPU_SPECS)}"
    for index, spec in enumerate(CPU_SPECS):
        assert f"test.{index}.spec: {spec}" in lines
        assert f"test.{index}.status: pass" in lines
    assert lines[-1] == "check: pass"


@pytest.mark.parametrize("mode", ["benchmark", "leaderboard"])
def test_popcorn_timing_modes_log_the_stats(mode, tmp_path):
    spec = tmp_path / "one.txt"
    spec.write_text(CPU_SPECS[0] + "\n")
    returncode, records, stderr = run_popcorn(mode, spec, POPCORN_SEED="424242")
    assert returncode == 0, stderr
    values = dict(line.split(": ", 1) for line in records.splitlines())
    assert values["benchmark-count"] == "1"
    assert values["benchmark.0.spec"] == CPU_SPECS[0]
    assert int(values["benchmark.0.runs"]) >= 1
    for key in ("mean", "std", "err", "best", "worst"):
        assert float(values[f"benchmark.0.{key}"]) >= 0
    assert values["check"] == "pass"


# ---------------------------------------------------------------------------
# Failing submissions
# ---------------------------------------------------------------------------
WRONG = ("from reference import moe_a4w4_torch\n\n\n"
         "def custom_kernel(data):\n"
         "    return moe_a4w4_torch(data) + 0.5\n")
RAISES = ("def custom_kernel(data):\n"
          "    raise RuntimeError('no kernel here')\n")


def _checkout_with(tmp_path, submission):
    """A copy of the harness with `submission` as submission.py, which eval.py prefers to solution.py."""
    for name in ("eval.py", "reference.py", "task.py"):
        shutil.copy(REPO / name, tmp_path / name)
    (tmp_path / "specs").mkdir()
    shutil.copy(REPO / "specs" / "cpu.txt", tmp_path / "specs" / "cpu.txt")
    (tmp_path / "submission.py").write_text(submission)
    return tmp_path


def test_wrong_output_fails_in_both_modes(tmp_path):
    checkout = _checkout_with(tmp_path, WRONG)

    proc = run_standalone("test", "specs/cpu.txt", cwd=checkout)
    assert proc.returncode == harness.EXIT_FAIL
    assert all(row[len(spec):].split()[0] == "fail" for spec, row in table_rows(proc.stdout).items())

    (checkout / "one.txt").write_text(CPU_SPECS[0] + "\n")
    returncode, records, stderr = run_popcorn("test", "one.txt", cwd=checkout)
    assert returncode == harness.EXIT_FAIL, stderr
    lines = records.splitlines()
    # The multi-line mismatch report must stay one record.
    assert all(RECORD.fullmatch(line) for line in lines), records
    assert "test.0.status: fail" in lines
    assert any(line.startswith("test.0.error: ") and "outside rtol" in line for line in lines)
    assert lines[-1] == "check: fail"


def test_raising_submission_fails_its_cases(tmp_path):
    proc = run_standalone("benchmark", "specs/cpu.txt", cwd=_checkout_with(tmp_path, RAISES))
    assert proc.returncode == harness.EXIT_FAIL
    assert "RuntimeError: no kernel here" in proc.stderr
    assert all(row[len(spec):].split()[0] == "fail" for spec, row in table_rows(proc.stdout).items())


def test_unreadable_spec_file_exits_113(monkeypatch):
    monkeypatch.delenv("POPCORN_FD", raising=False)
    monkeypatch.delenv("POPCORN_SEED", raising=False)
    missing = str(REPO / "specs" / "no-such-file.txt")
    assert harness.main(["eval.py", "test", missing]) == harness.EXIT_BAD_SPEC


# ---------------------------------------------------------------------------
# CUDA timing
# ---------------------------------------------------------------------------
def test_cuda_timer_hides_the_launch_and_times_the_device():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    timer = harness.cuda_timer()
    x = torch.zeros(1, device="cuda")

    def slow_to_launch(_):
        time.sleep(0.002)  # 2 ms of host work before a microsecond of device work
        return x.add_(1)

    host_ns = max(harness.host_call_ns(slow_to_launch, None) for _ in range(3))
    timer.hide_host_cost(host_ns)
    _, device_ns = timer.time_call(slow_to_launch, None)
    assert device_ns < 0.5e6, "the host's 2 ms leaked into the device time"

    spin_cycles = int(1e6 * timer._cycles_per_ns)  # 1 ms of device work

    def one_ms_on_device(_):
        torch.cuda._sleep(spin_cycles)
        return x

    _, device_ns = timer.time_call(one_ms_on_device, None)
    assert device_ns == pytest.approx(1e6, rel=0.2)

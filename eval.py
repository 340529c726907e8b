"""Correctness and timing harness for the moe-mxfp4 submission.

Popcorn mode (POPCORN_FD set), as the official runner calls its harness:
    python eval.py test|benchmark|leaderboard|profile SPECFILE
Results go to file descriptor POPCORN_FD as `key: value` lines under the
official keys; the submission runs in a spawned worker process.

Standalone mode (POPCORN_FD unset):
    python eval.py test|benchmark|leaderboard [SPECFILE]
Runs in this process, reports progress on stderr and a table on stdout.
SPECFILE defaults to specs/tests.txt for test, specs/benchmarks.txt otherwise.

A spec file holds one case per line, `key: value; key: value`, values being
integers, true/false or identifiers. Blank lines and '#' lines are skipped
here; the official parser rejects them, so the repository's spec files have
none.

Timing (../shared/SPEC.md section 5): only the custom_kernel call is timed.
On CUDA every timed call is issued right after an L2 flush and a device-side
spin, so the GPU is still busy while Python launches the call and the CUDA
events measure the kernels, not the launch; the host cost of a call is
measured on its own. On CPU the time is the wall clock of the call.
"""
import base64
import dataclasses
import functools
import importlib
import math
import multiprocessing
import os
import random
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, List, Optional

import torch

from reference import check_implementation, generate_input

# Exit codes of the official harness.
EXIT_PASS, EXIT_USAGE, EXIT_FAIL, EXIT_BAD_SPEC = 0, 2, 112, 113

POPCORN_MODES = ("test", "benchmark", "leaderboard", "profile")
STANDALONE_MODES = ("test", "benchmark", "leaderboard")
DEFAULT_SPECS = {"test": "specs/tests.txt", "benchmark": "specs/benchmarks.txt",
                 "leaderboard": "specs/benchmarks.txt"}

# Repeated timing stops, after at least MIN_REPEATS runs, once the standard
# error of the mean is below TARGET_REL_ERR of it, the summed timed durations
# pass the mode's cap, or MAX_WALL_NS of wall time has gone by (official rules).
MIN_REPEATS = 3
TARGET_REL_ERR = 1e-3
MAX_WALL_NS = 120e9
# A CPU run exists to exercise the harness, not to rank anything.
CPU_MAX_REPEATS = 3
# Leaderboard mode checks every timed call on fresh inputs, moving the seed by this.
RECHECK_SEED_STEP = 13


@dataclasses.dataclass(frozen=True)
class Repeats:
    max_repeats: int
    max_time_ns: float


BENCHMARK_WARMUP = Repeats(100, 1e8)
BENCHMARK = Repeats(1000, 50e9)
LEADERBOARD_WARMUP = Repeats(100, 1e7)
LEADERBOARD = Repeats(100, 30e9)

# The flush writes several times the L2, and at least 1 GiB so that caches
# behind the L2 (AMD's 256 MB Infinity Cache) are flushed as well.
L2_FLUSH_FACTOR = 8
MIN_FLUSH_BYTES = 1 << 30
FALLBACK_L2_BYTES = 64 << 20
# The spin before a timed call lasts twice the call's host cost, within these bounds.
MIN_SPIN_NS = 1_000_000
MAX_SPIN_NS = 20_000_000
HOST_CALLS = 5


# ---------------------------------------------------------------------------
# Spec files and seeds
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class TestCase:
    spec: str
    args: dict


# The official field syntax: no space before the colon.
_FIELD = re.compile(r"\s*([A-Za-z_]\w*):\s*([A-Za-z_]\w*|[+-]?[0-9]+)\s*")


def _parse_value(text: str):
    try:
        return int(text)
    except ValueError:
        return {"true": True, "false": False}.get(text, text)


def parse_specs(text: str) -> List[TestCase]:
    cases = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        args = {}
        for part in line.split(";"):
            match = _FIELD.fullmatch(part)
            if match is None:
                raise ValueError(f"line {number}: invalid field {part!r} in {line!r}")
            args[match[1]] = _parse_value(match[2])
        cases.append(TestCase(spec=line, args=args))
    return cases


def combine_seeds(a: int, b: int) -> int:
    # Cantor pairing: a large secret seed gives a large combined seed, so the
    # small public per-case seeds reveal nothing about it.
    return a + (a + b) * (a + b + 1) // 2


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class Stats:
    """Durations in nanoseconds; the fields and their order are the official keys."""
    runs: int
    mean: float
    std: float
    err: float
    best: float
    worst: float

    @classmethod
    def of(cls, durations: List[float]) -> "Stats":
        runs = len(durations)
        mean = sum(durations) / runs
        std = math.sqrt(sum((d - mean) ** 2 for d in durations) / (runs - 1)) if runs > 1 else 0.0
        return cls(runs=runs, mean=mean, std=std, err=std / math.sqrt(runs),
                   best=float(min(durations)), worst=float(max(durations)))


@dataclasses.dataclass
class CaseResult:
    ok: bool
    message: str                    # the check's message, or why the case failed
    rel_l2: Optional[float] = None  # the worst relative L2 error the checks reported
    timing: Optional[Stats] = None  # CUDA-event time per call, or wall time on CPU
    host: Optional[Stats] = None    # wall time for one call to return


_REL_L2 = re.compile(r"rel_l2=(\S+)")


def rel_l2_of(message: str) -> Optional[float]:
    match = _REL_L2.search(message)
    return float(match[1]) if match else None


# ---------------------------------------------------------------------------
# Running the submission (in the worker process in popcorn mode)
# ---------------------------------------------------------------------------
def load_custom_kernel() -> Callable:
    """custom_kernel from submission.py, the name the official runner gives
    the entry, else from this repository's solution.py."""
    try:
        module = importlib.import_module("submission")
    except ModuleNotFoundError as exc:
        if exc.name != "submission":
            raise
        module = importlib.import_module("solution")
    return module.custom_kernel


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _failures_as_results(run_case: Callable[..., CaseResult]) -> Callable[..., CaseResult]:
    """A submission that raises fails its case instead of ending the run."""
    @functools.wraps(run_case)
    def guarded(*args) -> CaseResult:
        try:
            return run_case(*args)
        except Exception as exc:
            traceback.print_exc()
            return CaseResult(ok=False, message=f"{type(exc).__name__}: {exc}")
    return guarded


class CudaTimer:
    """CUDA-event time of one call, with the L2 cold and the launch hidden."""

    def __init__(self):
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        l2_bytes = getattr(props, "L2_cache_size", 0) or FALLBACK_L2_BYTES
        flush_bytes = max(L2_FLUSH_FACTOR * l2_bytes, MIN_FLUSH_BYTES)
        self._flush = torch.empty(flush_bytes // 4, dtype=torch.int32, device="cuda")
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._cycles_per_ns = self._calibrate_spin()
        self.spin_ns = MIN_SPIN_NS

    def _calibrate_spin(self) -> float:
        # torch.cuda._sleep counts clock cycles; the clock rate is not a device
        # property torch exposes, so measure it.
        cycles = 10_000_000
        torch.cuda._sleep(cycles // 100)
        self._start.record()
        torch.cuda._sleep(cycles)
        self._end.record()
        self._end.synchronize()
        return cycles / (self._start.elapsed_time(self._end) * 1e6)

    def hide_host_cost(self, host_ns: float) -> None:
        self.spin_ns = min(max(2 * host_ns, MIN_SPIN_NS), MAX_SPIN_NS)

    def cold_start(self) -> None:
        """The L2 flushed, then the GPU kept busy for spin_ns: what is
        launched next finds the L2 cold and its launch already done."""
        torch.cuda.synchronize()
        self._flush.zero_()
        torch.cuda._sleep(int(self.spin_ns * self._cycles_per_ns))

    def time_call(self, kernel: Callable, data):
        self.cold_start()
        self._start.record()
        output = kernel(data)
        self._end.record()
        torch.cuda.synchronize()
        return output, self._start.elapsed_time(self._end) * 1e6


@functools.lru_cache(maxsize=None)
def cuda_timer() -> CudaTimer:
    # One per process: the flush buffer is large and the calibration takes time.
    return CudaTimer()


def wall_time_call(kernel: Callable, data):
    start = time.perf_counter_ns()
    output = kernel(data)
    return output, time.perf_counter_ns() - start


def host_call_ns(kernel: Callable, data) -> int:
    """Wall time for one call to return, issued to an idle GPU and not waited for."""
    torch.cuda.synchronize()
    start = time.perf_counter_ns()
    output = kernel(data)
    elapsed = time.perf_counter_ns() - start
    torch.cuda.synchronize()
    del output
    return elapsed


@_failures_as_results
def run_test_case(args: dict) -> CaseResult:
    kernel = load_custom_kernel()
    data = generate_input(**args)
    _synchronize()
    output = kernel(data)
    _synchronize()
    ok, message = check_implementation(data, output)
    return CaseResult(ok=ok, message=message, rel_l2=rel_l2_of(message))


@_failures_as_results
def run_benchmark_case(args: dict, recheck: bool, repeats: Repeats) -> CaseResult:
    kernel = load_custom_kernel()
    args = dict(args)
    data = generate_input(**args)
    # One obligatory check before timing; the call also warms the kernel up.
    ok, message = check_implementation(data, kernel(data))
    if not ok:
        return CaseResult(ok=False, message=message, rel_l2=rel_l2_of(message))
    rel_l2s = [rel_l2_of(message)]

    on_cuda = torch.cuda.is_available()
    if on_cuda:
        host = Stats.of([host_call_ns(kernel, data) for _ in range(HOST_CALLS)])
        timer = cuda_timer()
        timer.hide_host_cost(host.worst)
        time_call, max_repeats = timer.time_call, repeats.max_repeats
    else:
        time_call, max_repeats = wall_time_call, min(repeats.max_repeats, CPU_MAX_REPEATS)

    durations = []
    started = time.perf_counter_ns()
    for _ in range(max_repeats):
        if recheck:
            if "seed" in args:
                args["seed"] += RECHECK_SEED_STEP
            data = generate_input(**args)
        output, elapsed = time_call(kernel, data)
        if recheck:
            ok, message = check_implementation(data, output)
            if not ok:
                return CaseResult(ok=False, message=message, rel_l2=rel_l2_of(message))
            rel_l2s.append(rel_l2_of(message))
        del output
        durations.append(elapsed)
        if len(durations) >= MIN_REPEATS:
            stats = Stats.of(durations)
            if (stats.err < TARGET_REL_ERR * stats.mean
                    or stats.mean * stats.runs > repeats.max_time_ns
                    or time.perf_counter_ns() - started > MAX_WALL_NS):
                break

    timing = Stats.of(durations)
    known = [r for r in rel_l2s if r is not None]
    return CaseResult(ok=True, message=message, rel_l2=max(known) if known else None,
                      timing=timing, host=host if on_cuda else timing)


def run_profile_case(args: dict) -> str:
    from torch.profiler import ProfilerActivity, profile
    kernel = load_custom_kernel()
    data = generate_input(**args)
    _synchronize()
    on_cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        kernel(data)
        _synchronize()
    sort_by = "self_cuda_time_total" if on_cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=20)


# ---------------------------------------------------------------------------
# The modes
# ---------------------------------------------------------------------------
def run_cases(mode: str, cases: List[TestCase], call: Callable, reporter) -> bool:
    """Runs test, benchmark or leaderboard; call(fn, *args) runs fn where the
    submission lives. Returns whether every case passed."""
    if mode == "test":
        reporter.begin("test", len(cases))
        passed = True
        for index, case in enumerate(cases):
            reporter.start(index, case)
            result = call(run_test_case, case.args)
            reporter.finish(index, result)
            passed = passed and result.ok
        return passed

    recheck = mode == "leaderboard"
    warmup, repeats = (LEADERBOARD_WARMUP, LEADERBOARD) if recheck else (BENCHMARK_WARMUP, BENCHMARK)
    # The warm-up brings the GPU clocks and the kernels' caches up; on CPU
    # each case's checked call warms up enough.
    if torch.cuda.is_available():
        call(run_benchmark_case, cases[0].args, False, warmup)
    reporter.begin("benchmark", len(cases))
    passed = True
    for index, case in enumerate(cases):
        reporter.start(index, case)
        result = call(run_benchmark_case, case.args, recheck, repeats)
        reporter.finish(index, result)
        if not result.ok:
            passed = False
            if recheck:  # the official leaderboard stops at the first failure
                break
    return passed


class PopcornLog:
    def __init__(self, fd: int):
        self._file = os.fdopen(fd, "w")
        # The worker must not hold the fd open, or its reader would wait on it.
        os.set_inheritable(fd, False)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self._file.close()

    def __call__(self, key: str, value) -> None:
        # One record per line: a line break inside a message would start a bogus record.
        text = str(value).replace("\n", "\\n")
        print(f"{key}: {text}", file=self._file, flush=True)


class PopcornReporter:
    def __init__(self, log: PopcornLog):
        self._log = log
        self._kind = ""

    def begin(self, kind: str, count: int) -> None:
        self._kind = kind
        self._log(f"{kind}-count", count)

    def start(self, index: int, case: TestCase) -> None:
        self._log(f"{self._kind}.{index}.spec", case.spec)

    def finish(self, index: int, result: CaseResult) -> None:
        key = f"{self._kind}.{index}"
        if not result.ok:
            self._log(f"{key}.status", "fail")
            self._log(f"{key}.error", result.message)
        elif result.timing is None:
            self._log(f"{key}.status", "pass")
            if result.message:
                self._log(f"{key}.message", result.message)
        else:
            for field in dataclasses.fields(Stats):
                self._log(f"{key}.{field.name}", getattr(result.timing, field.name))
            # Not official keys: the host cost of a call, for callers without CUDA graphs.
            self._log(f"{key}.host_mean", result.host.mean)
            self._log(f"{key}.host_best", result.host.best)


class TableReporter:
    def __init__(self):
        self._kind = ""
        self._count = 0
        self._specs: List[str] = []
        self.rows: List[tuple] = []

    def begin(self, kind: str, count: int) -> None:
        self._kind, self._count = kind, count

    def start(self, index: int, case: TestCase) -> None:
        self._specs.append(case.spec)
        print(f"[{self._kind} {index + 1}/{self._count}] {case.spec}", file=sys.stderr, flush=True)

    def finish(self, index: int, result: CaseResult) -> None:
        rel_l2 = "-" if result.rel_l2 is None else f"{result.rel_l2:.3e}"
        status = "pass" if result.ok else "fail"
        times = ("-", "-", "-")
        if result.timing is not None:
            times = tuple(f"{ns / 1e3:.1f}" for ns in (result.timing.mean, result.timing.best,
                                                       result.host.mean))
        self.rows.append((self._specs[index], status) + times + (rel_l2,))
        summary = f"  {status}  rel_l2={rel_l2}"
        if result.timing is not None:
            summary += f"  mean={times[0]} us over {result.timing.runs} runs"
        print(summary, file=sys.stderr, flush=True)
        if not result.ok:
            print("  " + result.message.replace("\n", "\n  "), file=sys.stderr, flush=True)

    def print_table(self, on_cuda: bool) -> None:
        header = ("spec", "status", "mean us", "best us", "host us", "rel L2")
        widths = [max(len(row[i]) for row in (header, *self.rows)) for i in range(len(header))]
        for row in (header, *self.rows):
            cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
            cells += [cell.rjust(width) for cell, width in zip(row[2:], widths[2:])]
            print("  ".join(cells))
        if on_cuda:
            print("times: CUDA events around the call, L2 flushed and launch hidden; "
                  "host us: wall time for the call to return")
        else:
            print("times: wall clock on CPU (no CUDA device); host us is the same wall time")


def popcorn_main(fd: int, mode: str, cases: List[TestCase], seed: int) -> int:
    with PopcornLog(fd) as log:
        context = multiprocessing.get_context("spawn")
        with context.Pool(1, initializer=seed_everything, initargs=(seed,)) as pool:
            def call(fn, *args):
                return pool.apply(fn, args)

            if mode == "profile":
                log("benchmark-count", len(cases))
                for index, case in enumerate(cases):
                    log(f"benchmark.{index}.spec", case.spec)
                    report = call(run_profile_case, case.args)
                    log(f"benchmark.{index}.report",
                        base64.b64encode(report.encode("utf-8"), b"+*").decode("utf-8"))
                log("check", "pass")
                return EXIT_PASS

            passed = run_cases(mode, cases, call, PopcornReporter(log))
            log("check", "pass" if passed else "fail")
            return EXIT_PASS if passed else EXIT_FAIL


def standalone_main(mode: str, cases: List[TestCase], seed: int) -> int:
    seed_everything(seed)
    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        print("no CUDA device: times are wall clock on CPU", file=sys.stderr, flush=True)
    reporter = TableReporter()
    passed = run_cases(mode, cases, lambda fn, *args: fn(*args), reporter)
    reporter.print_table(on_cuda)
    return EXIT_PASS if passed else EXIT_FAIL


def main(argv: List[str]) -> int:
    fd = os.environ.get("POPCORN_FD")
    modes = POPCORN_MODES if fd else STANDALONE_MODES
    if len(argv) < (3 if fd else 2) or argv[1] not in modes:
        spec_arg = "SPECFILE" if fd else "[SPECFILE]"
        print(f"usage: {argv[0]} {'|'.join(modes)} {spec_arg}", file=sys.stderr)
        return EXIT_USAGE
    mode = argv[1]
    spec_path = argv[2] if len(argv) > 2 else DEFAULT_SPECS[mode]

    # Popped so that the worker, and with it the submission, never sees it.
    secret = os.environ.pop("POPCORN_SEED", None)
    secret = int(secret) if secret else None
    try:
        cases = parse_specs(Path(spec_path).read_text())
    except (OSError, ValueError) as exc:
        print(f"cannot read test cases from {spec_path}: {exc}", file=sys.stderr)
        return EXIT_BAD_SPEC
    if not cases:
        print(f"no test cases in {spec_path}", file=sys.stderr)
        return EXIT_BAD_SPEC
    if secret is not None:
        for case in cases:
            if "seed" in case.args:
                case.args["seed"] = combine_seeds(case.args["seed"], secret)

    seed = secret or 42
    if fd:
        return popcorn_main(int(fd), mode, cases, seed)
    return standalone_main(mode, cases, seed)


if __name__ == "__main__":
    sys.exit(main(sys.argv))

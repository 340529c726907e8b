#!/usr/bin/env bash
# One device call that builds the kernels, runs the GPU tests, both harnesses
# and the self-benchmark, and prints short tables last. Logs go to $OUT.
#
#   tools/device_check.sh [tests|basetests|official|profile|host|flush|routephases|ctatimeline|dram|sweep|ab|ncu|stalls|mma|selfbench|bench|robust|multibuild|sanitize|all]...
#   (default: all)
#   (tests = the GPU tests and eval.py test; PYTEST_K="EXPR" runs only the GPU tests that
#    pytest -k EXPR selects, for a lean call; basetests = GPU tests against .ab/base.py, in a
#    copy of this tree with it as solution.py, those BASE_PYTEST_K selects (default PYTEST_K's;
#    not part of "all": a fix on main checked in the call that times a branch on top of it);
#    bench = eval.py benchmark + self-benchmark; selfbench = the self-benchmark alone;
#    host = each benchmark shape's host us per call, split into the input check and the launching
#    (tools/profile_kernels.py --host; not part of "all");
#    flush = each benchmark shape (those FLUSH_SHAPES names, indices 0-6; default all) timed after
#    eval.py's L2 flush and after three variants of it (tools/flush_modes.py), for .ab/base.py
#    and this checkout's solution.py, interleaved, when .ab/base.py is there (not part of "all");
#    routephases = the first kernel's routing CTA phase by phase, and its Qa CTAs' span, on the
#    benchmark shapes ROUTE_SHAPES names (indices 0-6, default "1 2 5"; tools/route_phases.py, its
#    own stamped build, about a minute; not part of "all");
#    ctatimeline = when each CTA of the GEMM kernels runs: slots, CTA times, the last wave, the
#    shared expert's and the repeated tiles' share, on the benchmark shapes CTA_SHAPES names
#    (indices 0-6, default "1 2 4"; tools/cta_timeline.py, its own stamped build; not part of "all");
#    dram = tools/dram_pattern.py for each expert count in DRAM_EXPERTS (default "64 257"; 64:
#    bs=16 E=33's stage-1 bytes): the weight stream in five access patterns with no compute,
#    then raw_2d by CTA length (K slices, a CTA per slice or persistent CTAs); its own build
#    under a timeout, about a minute (not part of "all");
#    sweep = every compiled GEMM config timed on every benchmark shape (not part of "all");
#    ab = .ab/base.py (carried, git-ignored) against this checkout's solution.py and any
#    .ab/candidate_*.py and (timed unchecked) .ab/timing_*.py, calls interleaved in one
#    process (tools/ab_bench.py; not part of "all"; AB_SHAPES="5 6" times only those benchmark
#    shapes, indices 0-6), then one call of each checked version per shape kernel by kernel
#    ($OUT/ab_timeline.log, tools/profile_kernels.py --timeline; AB_TIMELINE=0 skips them:
#    the full GPU tests, three versions' A/B on seven shapes and their timelines ran past a
#    device call's 600 s, 2026-12-03);
#    ncu = hardware counters of stage 1 and stage 2 on the benchmark shapes in $NCU_SHAPES
#    (indices 0-6, default "0 4 5"): throughputs, tensor/ALU/FMA pipes, shared-memory
#    wavefronts and bank conflicts, issue, stall reasons; with
#    NCU_BASE=FILE (e.g. .ab/base.py, carried) the same counters of that solution.py follow;
#    stalls = ncu's warp-stall samples per SASS instruction of stage 1 (or of the
#    kernels matching the regex $STALLS_KERNEL) on the first shape in $NCU_SHAPES,
#    as $OUT/stalls.csv (neither is part of "all");
#    mma = tools/wgmma_chain.py: cycles per step of a warpgroup's e4m3 MMA chain in several
#    orders, apart from the kernels, then tools/wide_stage_loop.py: cycles per stage of the
#    folded wide consumers' loop fed five ways and of a design with fold warps (not part of "all";
#    about 150 s, the second tool building while the first runs);
#    robust = multibuild + sanitize: four processes building at once on an empty cache
#    (multibuild, about 80 s), then compute-sanitizer memcheck and racecheck over the
#    official test shapes and the benchmark shapes in $SANITIZE_SHAPES (sanitize; indices
#    0-6, default all seven: about 5 minutes for racecheck))
#
# The official gpu-mode harness runs from .official/ (git-ignored): copy
# problems/amd_202602/moe-mxfp4/eval.py and problems/amd_202602/utils.py of
# gpu-mode/reference-kernels there and carry the folder with the call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moe_out}
mkdir -p "$OUT"
export MOE_MXFP4_CACHE_DIR="$PWD/.kernel_cache" PYTHONUNBUFFERED=1
parts=${*:-all}
asked() { [[ " $parts " == *" $1 "* ]]; }   # named on the command line
want() { asked "$1" || asked all; }
status=0
step() { echo; echo "=== $1"; }
# The GPU tests of tests/test_solution.py in the current directory, those pytest -k $1 selects (all if empty).
gpu_tests() { python3 -m pytest -q -rfs --tb=short ${1:+-k "$1"} tests/test_solution.py; }

step "device"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# Skipped when only ab, mma, routephases, ctatimeline and dram are asked: ab's smoke step builds
# every version at once (this checkout's too) and stops one that does not pass; the other tools
# build their own.
if [[ -n $(printf '%s\n' $parts | grep -v -x -e ab -e mma -e routephases -e ctatimeline -e dram) ]]; then
step "build"
# The library's path is printed too: the cache may also hold other versions' (ab).
python3 -c "import solution, torch; backend, module = solution._backend(torch.device('cuda'))
print(backend); print('library:', getattr(module, '__file__', ''))" 2>&1 | tee "$OUT/build.log" || status=1
if ! grep -q -x cuda "$OUT/build.log"; then
  # Every later step would time or test the PyTorch fallback: stop while the call is cheap.
  echo "stopping: the CUDA kernels did not build (build.log above)"; exit 1
fi
so=$(sed -n 's/^library: //p' "$OUT/build.log")
if [ -n "$so" ] && command -v cuobjdump >/dev/null; then
  # What the kernels really issue: HMMA for mma.sync, HGMMA for the warpgroup
  # MMAs (a wgmma config showing no HGMMA would have been built for the wrong
  # target), F2FP for any fp8 conversion ptxas adds.
  echo "SASS of $so: tensor-core and conversion instructions per kernel"
  cuobjdump -sass "$so" | awk '/Function :/ {f=$3} {for (i = 1; i <= NF; i++) if ($i ~ /^(HMMA|IMMA|QMMA|HGMMA|QGMMA|F2FP)/) {split($i, m, "."); n[f " " m[1]]++}}
    END {for (k in n) print "  " n[k], k}' | sort -k3
fi
fi

if want tests; then
  step "GPU tests"
  # PYTEST_K="EXPR": only the tests pytest -k EXPR selects (a lean call's targeted tests).
  gpu_tests "${PYTEST_K:-}" 2>&1 | tee "$OUT/pytest.log" | tail -25 || status=1
  step "eval.py test (official tests)"
  python3 eval.py test specs/tests.txt 2>"$OUT/eval_test.err" | tee "$OUT/eval_test.log" || status=1
fi
if asked basetests; then
  step "GPU tests on .ab/base.py"
  if [ -f .ab/base.py ]; then
    base_tree=$(mktemp -d)
    cp -r tests tools reference.py task.py eval.py "$base_tree"/ && cp .ab/base.py "$base_tree"/solution.py
    (cd "$base_tree" && gpu_tests "${BASE_PYTEST_K:-${PYTEST_K:-}}") 2>&1 | tee "$OUT/pytest_base.log" | tail -25 \
      || status=1
    rm -rf "$base_tree"
  else
    echo "skipped: .ab/base.py is missing"
  fi
fi
if want official; then
  step "official gpu-mode eval.py, test mode"
  if [ -f .official/eval.py ]; then
    rm -rf /tmp/official && cp -r .official /tmp/official
    cp task.py reference.py /tmp/official/ && cp solution.py /tmp/official/submission.py
    cp specs/tests.txt /tmp/official/tests.txt
    (cd /tmp/official && MOE_MXFP4_CACHE_DIR="$MOE_MXFP4_CACHE_DIR" POPCORN_FD=3 python3 eval.py test tests.txt 3>"$OUT/official_test.log")
    cat "$OUT/official_test.log"
  else
    echo "skipped: .official/eval.py is missing"
  fi
fi
if want bench; then
  step "eval.py benchmark (official benchmarks)"
  python3 eval.py benchmark specs/benchmarks.txt 2>"$OUT/eval_bench.err" | tee "$OUT/eval_bench.log" || status=1
fi
if asked ab; then   # not part of "all": .ab/base.py against this checkout and .ab/candidate_*.py
  step "A/B: .ab/base.py against solution.py and .ab/candidate_*.py"
  if [ -f .ab/base.py ]; then
    shopt -s nullglob
    candidates=(.ab/candidate_*.py .ab/timing_*.py)   # timing_*: unchecked bounds (tools/ab_bench.py)
    # Every version's kernels built at once (one process each), each then
    # checked once per shape under a timeout: a version that fails or hangs
    # is left out of the timing (see ab_smoke.log) instead of stopping it.
    versions=(.ab/base.py solution.py "${candidates[@]}")
    for version in "${versions[@]}"; do
      (timeout 400 python3 tools/ab_bench.py --smoke "$version" >"$OUT/ab_smoke_$(basename "$version" .py).log" 2>&1 \
        || echo "$version" >>"$OUT/ab_dropped.txt") &
    done
    wait
    cat "$OUT"/ab_smoke_*.log >"$OUT/ab_smoke.log"
    if [ -f "$OUT/ab_dropped.txt" ]; then
      echo "left out (failed or timed out, see ab_smoke.log):"; cat "$OUT/ab_dropped.txt"; status=1
      kept=(); for c in "${candidates[@]}"; do grep -q -x -F "$c" "$OUT/ab_dropped.txt" || kept+=("$c"); done
      candidates=("${kept[@]}")
    fi
    if grep -q -x -e .ab/base.py -e solution.py "$OUT/ab_dropped.txt" 2>/dev/null; then
      echo "no A/B: the base or this checkout failed"
    else
      python3 tools/ab_bench.py .ab/base.py solution.py "${candidates[@]}" 2>"$OUT/ab.err" | tee "$OUT/ab.log" || status=1
      # One call of each checked version per shape, kernel by kernel, by full
      # template name (the split above adds a kernel's instantiations together).
      if [ "${AB_TIMELINE:-1}" != 0 ]; then
        checked=(); for c in "${candidates[@]}"; do [[ $(basename "$c") == timing_* ]] || checked+=("$c"); done
        for n in ${AB_SHAPES:-0 1 2 3 4 5 6}; do
          python3 tools/profile_kernels.py --timeline "$n" .ab/base.py solution.py "${checked[@]}" || status=1
        done >"$OUT/ab_timeline.log" 2>"$OUT/ab_timeline.err"
        echo "each version's kernels in one call: ab_timeline.log"
      fi
    fi
  else
    echo "skipped: .ab/base.py is missing"
  fi
fi
if want profile; then
  step "per-kernel times"
  python3 tools/profile_kernels.py 3 2>"$OUT/profile.err" | tee "$OUT/profile.log" || status=1
fi
if asked host; then   # not part of "all"
  step "host us per call"
  python3 tools/profile_kernels.py --host 2>"$OUT/host.err" | tee "$OUT/host.log" || status=1
fi
if asked flush; then   # not part of "all": .ab/base.py against this checkout when it is there
  step "what the cold start costs (tools/flush_modes.py)"
  flush_versions=()
  [ -f .ab/base.py ] && flush_versions=(--versions .ab/base.py solution.py --)
  python3 tools/flush_modes.py "${flush_versions[@]}" ${FLUSH_SHAPES:-} 2>"$OUT/flush.err" | tee "$OUT/flush.log" || status=1
fi
if asked routephases; then   # not part of "all"
  step "the first kernel's phases (tools/route_phases.py)"
  python3 tools/route_phases.py ${ROUTE_SHAPES:-} 2>"$OUT/route_phases.err" | tee "$OUT/route_phases.log" || status=1
fi
if asked ctatimeline; then   # not part of "all"
  step "when each GEMM CTA runs (tools/cta_timeline.py)"
  python3 tools/cta_timeline.py ${CTA_SHAPES:-} 2>"$OUT/cta_timeline.err" | tee "$OUT/cta_timeline.log" || status=1
fi
if asked dram; then   # not part of "all"
  for experts in ${DRAM_EXPERTS:-64 257}; do
    step "the weight stream alone, $experts experts of 512 rows (tools/dram_pattern.py)"
    timeout 300 python3 tools/dram_pattern.py --experts "$experts" 2>"$OUT/dram_$experts.err" \
      | tee "$OUT/dram_$experts.log" || status=1
  done
fi
if asked sweep; then
  step "config sweep"
  python3 tools/profile_kernels.py --sweep 2>"$OUT/sweep.err" | tee "$OUT/sweep.log" || status=1
fi
# ncu refused the python3 on PATH ("not an executable binary"), and
# sys.executable too (2026-12-01): give it the interpreter's real file, with
# the environment's site-packages on PYTHONPATH (run from its real path,
# Python no longer finds the venv), and say what python3 was.
python_binary=$(python3 -c 'import os, sys; print(os.path.realpath(sys.executable))')
python_path=$(python3 -c 'import site, sys; print(":".join(p for p in site.getsitepackages() + sys.path if p))')
ncu_python() {
  echo "python3: $(command -v python3) -> $python_binary ($(head -c 4 "$python_binary" | od -An -c | tr -s ' '))" >&2
  PYTHONPATH="$python_path" "$@"
}
if asked ncu; then   # not part of "all": about a minute per shape and version
  ncu_counters() {   # log file, then profile_kernels.py's --once arguments
    local log=$1; shift
    # --once calls the shape twice: the first call's stage kernels, up to
    # four (the folded wide path's bf16 fallbacks among them, which leave at
    # once unless needed; two stage kernels per call elsewhere, and then the
    # second call's two follow).
    ncu_python ncu --clock-control none -k regex:"stage[12]_(wide_)?kernel" -c 4 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
      --metrics dram__bytes_read.sum,dram__bytes_read.sum.per_second,lts__t_sector_hit_rate.pct,l1tex__t_sector_hit_rate.pct,lts__t_bytes.sum.per_second,lts__t_sectors_srcunit_tex_op_read.sum,sm__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,l1tex__throughput.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
      "$python_binary" tools/profile_kernels.py --once "$@" >"$log" 2>&1 || status=1
    grep -E "stage[12]_(wide_)?kernel|Duration|Throughput|Registers|Achieved Occupancy|Waves Per SM|Issue Slots Busy|Eligible Warps|dram__|lts__|l1tex__|sm__inst|sm__pipe|stalled" "$log" \
      | grep -v -E " 0(\.0+)?$|  0,0" | sed 's/^ *//' | awk '{$1=$1; print}' | grep -v -E "ratio +0\.0[0-9]?$"
    # No counters: show why (two calls of 2026-12-01 printed nothing here).
    grep -q -E "stage[12]_(wide_)?kernel" "$log" || { echo "no ncu counters; the log ends:"; tail -5 "$log"; }
  }
  for shape in ${NCU_SHAPES:-0 4 5}; do
    step "ncu, benchmark shape $shape: the stage kernels of a call"
    ncu_counters "$OUT/ncu_$shape.log" "$shape"
    if [ -n "${NCU_BASE:-}" ]; then
      step "ncu, benchmark shape $shape, $NCU_BASE"
      ncu_counters "$OUT/ncu_base_$shape.log" "$shape" "$NCU_BASE"
    fi
  done
fi
if asked stalls; then
  shape=$(echo ${NCU_SHAPES:-5} | cut -d' ' -f1)
  kernel=${STALLS_KERNEL:-stage1_(wide_)?kernel}
  step "ncu source counters, $kernel of benchmark shape $shape"
  # The first call's first match: a folded stage's e4m3 kernel, not the bf16
  # fallback after it (ncu replays the kernel, so no warm-up call is needed).
  ncu_python ncu --clock-control none -k regex:"$kernel" -c 1 --section SourceCounters --section WarpStateStats \
    -f -o "$OUT/stalls" "$python_binary" tools/profile_kernels.py --once "$shape" >"$OUT/stalls.log" 2>&1 || status=1
  ncu -i "$OUT/stalls.ncu-rep" --page source --csv --print-source sass >"$OUT/stalls.csv" 2>>"$OUT/stalls.log" || status=1
  rm -f "$OUT/stalls.ncu-rep"
  tail -3 "$OUT/stalls.log"; wc -l "$OUT/stalls.csv"
fi
if asked mma; then
  step "e4m3 MMA chains (tools/wgmma_chain.py)"
  # The second tool builds (CPU only) while the first builds and runs. Both run under timeouts
  # (build included): a microbenchmark that hangs must not take the call's device time.
  (cd tools && timeout 300 python3 -c "import wide_stage_loop; wide_stage_loop.build()" \
    >"$OUT/wide_stage_loop_build.log" 2>&1) &
  loop_build=$!
  timeout 300 python3 tools/wgmma_chain.py 2>&1 | tee "$OUT/wgmma_chain.log" || status=1
  wait "$loop_build" || { echo "wide_stage_loop.py did not build:"; tail -20 "$OUT/wide_stage_loop_build.log"; }
  step "the folded wide consumers' stage loop, fed five ways, and the fold-warp design's (tools/wide_stage_loop.py)"
  timeout 300 python3 tools/wide_stage_loop.py 2>&1 | tee "$OUT/wide_stage_loop.log" || status=1
fi
if want robust || asked multibuild; then
  step "four processes importing at once on an empty cache"
  cache=$(mktemp -d)
  for i in 1 2 3 4; do
    MOE_MXFP4_CACHE_DIR=$cache python3 -c "
import time, torch, reference, solution
start = time.time()
data = reference.generate_input(1024, 256, 8, 2, 1, 16, $i)
ok, message = reference.check_implementation(data, solution.custom_kernel(data))
print('process $i:', solution._backend(torch.device('cuda'))[0], 'pass' if ok else 'FAIL', message,
      f'{time.time() - start:.0f} s')" >"$OUT/multi_$i.log" 2>&1 &
  done
  wait
  cat "$OUT"/multi_*.log
  echo "libraries built: $(find "$cache" -name '*.so' | wc -l); compile units: $(find "$cache" -name '*.o' | wc -l)"
  grep -q "FAIL\|Error" "$OUT"/multi_*.log && status=1
fi
if want robust || asked sanitize; then
  # On inputs saved beforehand: racecheck fails inside the cuBLAS GEMM the
  # input generator runs, so the checked process runs only our kernels.
  # (About 13 GB of inputs for all shapes; racecheck then takes about 5 minutes.)
  inputs=$(mktemp -d)/inputs.pt
  python3 tools/profile_kernels.py --save "$inputs" ${SANITIZE_SHAPES:-} >/dev/null
  for tool in memcheck racecheck; do
    step "compute-sanitizer $tool, official benchmark and test shapes"
    compute-sanitizer --tool $tool --kernel-name kns=moe --error-exitcode 9 \
      python3 tools/profile_kernels.py --load "$inputs" >"$OUT/sanitizer_$tool.log" 2>&1 || status=1
    grep -c " done$" "$OUT/sanitizer_$tool.log" | sed 's/$/ shapes run/'
    tail -2 "$OUT/sanitizer_$tool.log"
  done
  rm -f "$inputs"
fi
if want bench || want selfbench; then
  step "self-benchmark"
  python3 solution.py 2>"$OUT/selfbench.err" | tee "$OUT/selfbench.log" || status=1
fi
exit $status

"""Tests for solution.py: the dispatcher and validation on any machine, the
kernel build check wherever nvcc is, and the kernels themselves on a GPU."""
import os
import gc
import math
import random
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch

import reference
import solution
from inputs import to_cpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import kernel_resources  # noqa: E402

ON_CUDA = torch.cuda.is_available() and not torch.version.hip
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs an NVIDIA GPU (no CUDA device here)")

OFFICIAL_TESTS = [
    (4096, 1024, 256, 8, 1, 8, 9371), (7168, 2048, 32, 8, 1, 32, 2291), (4096, 1536, 64, 6, 1, 128, 81934)]
OFFICIAL_BENCHMARKS = [
    (7168, 256, 256, 8, 1, 16, 9371), (7168, 256, 256, 8, 1, 128, 2291), (7168, 256, 256, 8, 1, 512, 81934),
    (7168, 512, 32, 8, 1, 16, 2291), (7168, 512, 32, 8, 1, 128, 81934), (7168, 512, 32, 8, 1, 512, 81934),
    (7168, 2048, 32, 8, 1, 512, 81934)]


def small_input(dhidden=512, dexpert=256, routed=8, top_k=2, shared=1, bs=7, seed=1):
    return reference.generate_input(dhidden, dexpert, routed, top_k, shared, bs, seed)


def with_replaced(data, index, value):
    data = list(data)
    data[index] = value
    return tuple(data)


def with_gate_up_weight(data, weights):
    """data with new gate/up weights (#1) and their shuffled copy (#5),
    which stage 1's TMA configs read instead."""
    return with_replaced(with_replaced(data, 1, weights), 5, reference.shuffle_weight(weights))


# ---------------------------------------------------------------------------
# Any machine
# ---------------------------------------------------------------------------
@needs_cuda
def test_custom_kernel_matches_reference():
    """(On a CPU custom_kernel runs reference.moe_a4w4_torch itself, which
    test_reference.py checks against an independent loop.)"""
    data = small_input(dhidden=300, dexpert=200, seed=3)
    ok, message = reference.check_implementation(data, solution.custom_kernel(data))
    assert ok, message


def test_zero_tokens_give_empty_output():
    data = small_input(bs=0)
    out = solution.custom_kernel(data)
    assert out.shape == (0, 512) and out.dtype == torch.bfloat16


def test_cuda_arguments_refuse_more_tokens_than_the_accumulator_indices_hold():
    """The CUDA path's arguments are checked in Python before the extension
    sees them (stage 2's 32-bit accumulator offsets; README): one token past
    the limit raises, the limit itself does not (meta tensors, no memory)."""
    data = small_input()
    most = (2 ** 31 - 1) // 512
    for tokens, raises in ((most + 1, True), (most, False)):
        meta = with_replaced(data, 0, torch.empty(tokens, 512, dtype=torch.bfloat16, device="meta"))
        if raises:
            with pytest.raises(ValueError, match=f"at most {most} tokens per call at d_hidden_pad 512, got {most + 1}"):
                solution._moe_forward_args(meta, solution.KernelConfig(8, 16, 8, 8, 4, False))
        else:
            args = solution._moe_forward_args(meta, solution.KernelConfig(8, 16, 8, 8, 4, False))
            assert args[0].shape[0] == most


def test_three_dimensional_scales_are_accepted():
    data = small_input(seed=5)
    e = data[1].shape[0]
    data3 = with_replaced(data, 3, data[3].reshape(e, -1, data[3].shape[1]))
    data3 = with_replaced(data3, 4, data[4].reshape(e, -1, data[4].shape[1]))
    assert torch.equal(solution.custom_kernel(data3), solution.custom_kernel(data))


@pytest.mark.parametrize("index, value, pattern", [
    (0, lambda d: d[0].float(), r"hidden_states: expected dtype torch.bfloat16"),
    (0, lambda d: d[0][:, :-1], r"hidden_states: expected \[M, 512\]"),
    (10, lambda d: d[10].long(), r"topk_ids: expected dtype torch.int32"),
    (9, lambda d: d[9][:, :1], r"topk_weights: expected \[7, 3\]"),
    (2, lambda d: d[2][:, :-1], r"down_weight: expected"),
    (5, lambda d: d[5][:-1], r"gate_up_weight_shuffled: expected gate_up_weight's shape"),
    (3, lambda d: d[3][:-1], r"gate_up_weight_scale: expected"),
    (11, lambda d: {k: v for k, v in d[11].items() if k != "d_expert"}, r"config: missing key 'd_expert'"),
    (11, lambda d: {**d[11], "d_hidden_pad": 500}, r"config\['d_hidden_pad'\]: expected a positive multiple of 256"),
    (11, lambda d: {**d[11], "total_top_k": 4}, r"config\['total_top_k'\]: 4, but topk_ids has 3 columns"),
    (11, lambda d: [1], r"config: expected a dict"),
    (11, lambda d: {**d[11], "bs": 8}, r"config\['bs'\]: 8, but hidden_states has 7 rows"),
    (11, lambda d: {**d[11], "n_routed_experts": 9}, r"n_routed_experts \+ n_shared_experts = 10, but the weights hold 9"),
])
def test_bad_inputs_are_named(index, value, pattern):
    data = small_input()
    with pytest.raises((TypeError, ValueError), match=pattern):
        solution.custom_kernel(with_replaced(data, index, value(data)))


def with_strided_hidden_and_ids(data):
    """data with its hidden states and expert ids in strided views (same values, same device)."""
    device = data[0].device
    hidden = torch.empty((data[0].shape[0], 2 * data[0].shape[1]), dtype=torch.bfloat16, device=device)[:, ::2]
    hidden.copy_(data[0])
    ids = torch.empty((data[10].shape[1], data[10].shape[0]), dtype=torch.int32, device=device).T
    ids.copy_(data[10])
    assert not hidden.is_contiguous() and not ids.is_contiguous()
    return with_replaced(with_replaced(data, 0, hidden), 10, ids)


def test_non_contiguous_inputs_give_the_same_result():
    data = to_cpu(small_input(seed=6))
    assert torch.equal(solution.custom_kernel(with_strided_hidden_and_ids(data)), solution.custom_kernel(data))


@needs_cuda
def test_non_contiguous_inputs_on_cuda():
    """Strided hidden states and ids through the CUDA dispatcher and kernels."""
    data = small_input(seed=6)
    run_checked(with_strided_hidden_and_ids(data), reference_data=data)


def misaligned_copy(tensor):
    """tensor's bytes in a view that starts one byte past an allocation's
    (16-byte aligned) start, in tensor's dtype and shape."""
    raw = tensor.contiguous().view(torch.uint8)
    view = torch.empty(raw.numel() + 1, dtype=torch.uint8, device=tensor.device)[1:].view(raw.shape)
    view.copy_(raw)
    return view.view(tensor.dtype)


def test_moe_forward_args_realign_weights_and_scales():
    """The kernels copy weights and scales 16 bytes at a time and by TMA:
    inputs that start off a 16-byte boundary reach them as aligned copies."""
    data = to_cpu(small_input())
    for index in (1, 2, 3, 4):
        data = with_replaced(data, index, misaligned_copy(data[index]))
        assert data[index].data_ptr() % 16 == 1
    config = solution.KernelConfig(8, 16, 8, 8, 4, True, True, 32)
    args = solution._moe_forward_args(data, config)
    for index in (1, 2, 3, 4):
        assert args[index].data_ptr() % 16 == 0
        assert torch.equal(args[index], data[index].view(torch.uint8))


def test_wrong_tuple_is_refused():
    with pytest.raises(TypeError, match="12-tuple"):
        solution.custom_kernel(small_input()[:11])


@pytest.mark.parametrize("m, top_k, experts, d_expert, expected", [   # the measured best on the H200 (BENCHMARKS.md)
    (16, 9, 257, 256, (8, 16, 8, 8, 4, True, True, 32, 0, False)),
    (128, 9, 257, 256, (8, 16, 8, 8, 4, True, True, 32)), (512, 9, 257, 256, (24, 16, 24, 8, 4, True, True)),
    (16, 9, 33, 512, (8, 16, 8, 8, 4, True, True, 32, 0, False)),
    (128, 9, 33, 512, (64, 16, 64, 4, 4, True, False, 0, 48)),
    (512, 9, 33, 512, (64, 16, 64, 4, 4, True, False, 0, 144)),
    (512, 9, 33, 2048, (64, 16, 64, 4, 4, True, False, 0, 144)),
    # measured off the benchmark shapes, near where the chooser switches tiles
    (384, 9, 257, 256, (16, 16, 16, 8, 3, True, True)), (448, 9, 257, 256, (16, 16, 16, 8, 3, True, True)),
    (640, 9, 257, 256, (24, 16, 24, 8, 4, True, True)), (64, 9, 33, 512, (24, 16, 24, 8, 4, True, True)),
    (96, 9, 33, 512, (32, 16, 32, 8, 3, True, True)), (160, 9, 33, 512, (64, 16, 64, 4, 4, True, False, 0, 48)),
    (176, 9, 33, 512, (64, 16, 64, 4, 4, True, False, 0, 64))])
def test_config_chooser_picks_the_measured_best(m, top_k, experts, d_expert, expected):
    config = solution.choose_config(m, top_k, experts, d_expert, wgmma=True)
    # (token_scaled picks one of a compiled config's two stage-1 forms)
    assert config == solution.KernelConfig(*expected) and config._replace(token_scaled=True) in solution.GEMM_CONFIGS


@pytest.mark.parametrize("m, experts, d_expert", [(16, 257, 256), (512, 33, 512), (512, 33, 2048), (4096, 8, 1024)])
def test_config_chooser_needs_sm90_for_warpgroup_mmas(m, experts, d_expert):
    config = solution.choose_config(m, 9, experts, d_expert, wgmma=False)
    assert not config.wgmma and not config.fp8 and config in solution.GEMM_CONFIGS


def test_every_benchmark_shape_runs_e4m3_mmas_on_sm90_only():
    """The self-benchmark's floors take the fp8 MMA rate where the kernels
    run e4m3 MMAs (issue 4's rule): on sm_90 every benchmark shape's config
    does, elsewhere none."""
    for bs, routed, d_expert, _, _ in solution.BENCHMARK_SHAPES:
        experts = routed + solution.N_SHARED
        top_k = solution.TOP_K + solution.N_SHARED
        assert solution.runs_e4m3_mmas(solution.choose_config(bs, top_k, experts, d_expert, wgmma=True))
        assert not solution.runs_e4m3_mmas(solution.choose_config(bs, top_k, experts, d_expert, wgmma=False))


def test_floor_takes_the_mma_rate_the_kernels_use():
    """A compute-bound input (4,096 tokens on three experts): its floor is
    its FLOPs over the fp8 or the bf16 MMA rate, and a memory-bound one's
    its weight bytes over the read bandwidth at either rate."""
    data = reference.generate_input(512, 256, 2, 2, 1, 4096, 7)
    flops = 2 * 4096 * 3 * 3 * 256 * 512
    assert solution.floor_us(data, e4m3=True) == pytest.approx(flops / solution.FP8_MMA_FLOPS_PER_S * 1e6)
    assert solution.floor_us(data, e4m3=False) == pytest.approx(flops / solution.BF16_MMA_FLOPS_PER_S * 1e6)
    data = reference.generate_input(512, 256, 16, 2, 1, 4, 8)
    active = torch.unique(data[10]).numel()
    weight_bytes = active * 3 * data[11]["d_expert_pad"] * data[11]["d_hidden_pad"] * 17 / 32
    for e4m3 in (True, False):
        assert solution.floor_us(data, e4m3) == pytest.approx(weight_bytes / solution.READ_BYTES_PER_S * 1e6)


def test_moe_forward_args_match_its_declaration():
    # The binding's parameters, in order, against what the dispatcher passes (on the CPU: the args are built
    # without a GPU when the config is given).
    declaration = solution.HOST_DECLARATION[solution.HOST_DECLARATION.index("moe_forward("):]
    params = [p.split()[-1] for p in declaration[declaration.index("(") + 1:declaration.index(")")].split(",")]
    data = to_cpu(small_input())
    config = solution.KernelConfig(8, 16, 8, 8, 4, True, True, 32)
    args = solution._moe_forward_args(data, config, stage1_splits=3, stage2_row_tiles=2)
    assert len(args) == len(params), (params, args)
    named = dict(zip(params, args))
    assert named["d_hidden"] == data[11]["d_hidden"] and named["d_expert"] == data[11]["d_expert"]
    assert named["n_shared_experts"] == data[11].get("n_shared_experts", 0)
    assert [named[field] for field in config._fields] == list(config)
    assert named["stage1_splits"] == 3 and named["stage2_row_tiles"] == 2
    assert named["gate_up_weight"].dtype == torch.uint8 and named["topk_ids"] is data[10]


@pytest.fixture(scope="module")
def kernel_build(tmp_path_factory):
    """The device code alone (no torch headers) through nvcc for sm_90a, once
    for the tests below: (its folder, nvcc's exit status, its report)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    folder = str(tmp_path_factory.mktemp("kernels"))
    return (folder, *kernel_resources.ptxas_report(folder))


def test_kernel_source_builds_for_sm90a_without_spills(kernel_build):
    """Catches build breaks on a machine without a GPU, register spills in
    any kernel, and wgmmas that ptxas serialises (warning C7520: a kernel
    whose wgmmas sit in a branch ptxas thinks divergent measured several %
    slower), and a folded wide stage 1 whose registers leave no room for the
    fallback kernel that waits beside it."""
    _, returncode, report = kernel_build
    print(report)
    assert returncode == 0, report
    kernels = re.findall(r"Compiling entry function '(\w+)'", report)
    # convert; route+quantise for both activation formats and the folded one in both orders; the folded path's fallback
    # kernel and stage 2's two folds of the intermediate rows (bf16 for the wide kernel, E4M3 codes for the
    # e4m3 configs' stage 2 on folded rows); SwiGLU+Qa of split stage 1 for both formats at 1, 2
    # and 4 rows per warp, each keeping or dropping the partial sums' L2 lines; the wide stage 2 of
    # each wide tile width, bf16 and folded; the wide stage 1 of each width, bf16 and folded; and
    # stage 1 and stage 2 for each GEMM config (one set for configs that differ in wide tiles only),
    # and the e4m3 configs' stage 1 also folded, and of some their stage 2 on folded rows, and of some
    # a second stage 2 for a K of one stage
    kernel_sets = {config._replace(wide_tile_tokens=0) for config in solution.GEMM_CONFIGS}
    assert len(kernels) == (1 + 4 + 3 + 2 * 3 * 2 + 4 * len(solution.WIDE_TILE_TOKENS)
                            + 2 * len(kernel_sets) + sum(c.fp8 for c in kernel_sets)
                            + sum(c.fp8 and c.tile_tokens in solution.FOLDED_STAGE2_TOKENS for c in kernel_sets)
                            + sum(c.fp8 and c.tile_tokens in solution.ONE_STAGE_STAGE2_TOKENS
                                  for c in kernel_sets)), kernels
    spills = re.findall(r"(\d+) bytes spill stores", report)
    assert spills and all(s == "0" for s in spills), report
    assert "C7520" not in report, [line for line in report.splitlines() if "C7520" in line]
    # folded_fallback_kernel waits beside the folded wide stage 1 (one CTA per SM), so both must fit one
    # SM's 65,536 registers (allocated per warp in steps of 8 a thread): stream-K took stage 1 to 168
    # registers, the fallback then started only after stage 1, and d2048 ran 4% slower.
    per_warp = {name: 32 * -(-count // 8) * 8 for name, count, _, _ in kernel_resources.ptxas_kernels(report)}
    fallback = next(warp for name, warp in per_warp.items() if "folded_fallback_kernel" in name)
    consumer_warps = int(re.search(r"kConsumerWarps = (\d+)", solution.KERNEL_SOURCE).group(1))
    producer_warps = dict(re.findall(r"struct WideTraits<(\d+)> \{[^}]*kProducerWarps1 = (\d+)",
                                     solution.KERNEL_SOURCE))
    fallback_warps = int(re.search(r"kFallbackThreads = (\d+)", solution.KERNEL_SOURCE).group(1)) // 32
    for tokens in solution.WIDE_TILE_TOKENS:
        stage1 = next(warp for name, warp in per_warp.items() if f"stage1_wide_kernelILi{tokens}ELb1E" in name)
        used = stage1 * (consumer_warps + int(producer_warps[str(tokens)])) + fallback * fallback_warps
        assert used <= 65536, (tokens, stage1 // 32, fallback // 32, used)


GLOBAL_MEMORY_OPCODES = {"LDG", "STG", "ATOMG", "RED", "REDG", "LDGSTS", "UTMALDG", "UTMASTG", "UBLKCP", "LD", "ST",
                         "ATOM"}


@pytest.mark.skipif(shutil.which("cuobjdump") is None, reason="cuobjdump not on PATH")
def test_no_kernel_touches_global_memory_before_its_wait(kernel_build):
    """A kernel launched after another (programmatic dependent launch) must
    not read what an earlier kernel writes before its griddepcontrol.wait
    (SASS ACQBULK). The compiler may move an invariant load above the wait
    (ptxas did, for folded_fallback_kernel's read of the stage-1 redo flag:
    the redo then read stale rows from the third call on, H200, 2026-12-03).
    Every kernel that waits does so before any global access, except
    folded_fallback_kernel, which reads the down scales (inputs, read-only
    loads) and may set stage 2's flag before it, and reads the redo flag
    with a volatile (strong) load after it."""
    folder, returncode, _ = kernel_build
    assert returncode == 0
    waiting = 0
    for name, sass in kernel_resources.sass_functions(folder).items():
        instructions = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)
        if "ACQBULK" not in instructions:
            continue   # the routing kernel, launched normally
        waiting += 1
        wait = instructions.index("ACQBULK")
        before = [op for op in instructions[:wait] if op.split(".")[0] in GLOBAL_MEMORY_OPCODES]
        if "folded_fallback_kernel" in name:
            assert before and all(op.startswith("STG") or op.endswith(".CONSTANT") for op in before), before
            strong = [i for i, op in enumerate(instructions) if op.startswith("LDG") and ".STRONG" in op]
            assert strong and min(strong) > wait, "the redo flag's read is not below the wait"
        else:
            assert not before, (name, before)
    assert waiting >= 10


# Declarations enough for nvcc's front end to parse what ATen/cuda/CUDAContext.h
# includes, where a machine without a GPU lacks the CUDA libraries' headers or
# torch's CUDA build header.
HOST_HEADER_STUBS = {
    "cublas_v2.h": "typedef void* cublasHandle_t;\ntypedef int cublasStatus_t;\n",
    "cublas.h": "", "cublasLt.h": "typedef void* cublasLtHandle_t;\n",
    "cusparse.h": "typedef void* cusparseHandle_t;\n",
    "cusolverDn.h": "typedef int cusolverStatus_t;\ntypedef void* cusolverDnHandle_t;\n", "cusolver_common.h": "",
    "c10/cuda/impl/cuda_cmake_macros.h": "",
}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_launchers_parse_with_torch_headers(tmp_path):
    """The whole extension source, kernels and host launchers, with this
    machine's torch headers and load_inline's flags, through nvcc's host front
    end (cudafe++) and then the host compiler's syntax pass over its output
    (about 50 s, where a full build takes 5 minutes on two cores): the
    device-only build above never sees the launchers, and cudafe++ alone
    passed an error inside a launcher template's body (2026-12-03). It cannot
    stand in for the device's build: a launcher line that the H200's torch
    2.11 headers rejected (`data_ptr<float>()` on a `const auto` tensor whose
    type depended on a template parameter) passes here with torch 2.13's."""
    from torch.utils import cpp_extension
    nvcc_dir = os.path.dirname(os.path.realpath(shutil.which("nvcc")))
    present = [os.path.join(nvcc_dir, "..", "include"), *cpp_extension.include_paths(),
               os.path.join(nvcc_dir, "..", "targets", "x86_64-linux", "include")]
    stubs = tmp_path / "stubs"
    for name, text in HOST_HEADER_STUBS.items():
        if not any(os.path.exists(os.path.join(d, name)) for d in present):
            (stubs / name).parent.mkdir(parents=True, exist_ok=True)
            (stubs / name).write_text("#pragma once\n" + text)
    source = tmp_path / "moe.cu"
    source.write_text(solution.KERNEL_SOURCE + solution.HOST_SOURCE)
    command = ["nvcc", "--dryrun", "--keep", "--keep-dir", str(tmp_path), "-c", str(source),
               "-o", str(tmp_path / "moe.o"),
               "-gencode=arch=compute_90a,code=sm_90a", f"-I{stubs}", f"-I{sysconfig.get_paths()['include']}",
               *[f"-I{d}" for d in cpp_extension.include_paths()], "-DTORCH_EXTENSION_NAME=moe_test",
               *cpp_extension.COMMON_NVCC_FLAGS, *solution.NVCC_FLAGS]
    # nvcc lists its variables, then its commands: preprocessing, cudafe++ (the host front end), then the
    # device's preprocessing, cicc and ptxas (the device-only build above covers those) and the host compiler.
    steps = []
    for line in subprocess.run(command, capture_output=True, text=True).stderr.splitlines():
        if line.startswith("#$ "):
            name, value = re.fullmatch(r"(?:(\w+)=)?(.*)", line[3:]).groups()
            steps.append(f"export {name}='{value.strip()}'" if name else value)
    host_front_end = next((i for i, step in enumerate(steps) if step.startswith("cudafe++ ")), None)
    assert host_front_end is not None, steps
    # The host compiler's step over the front end's output, as a syntax pass: it would include the device
    # build's fatbinary through the stub file, which stands empty here.
    host_compile = [step for step in steps[host_front_end + 1:] if ".cudafe1.cpp" in step
                    and step.split()[0] in ("gcc", "g++", "cc", "c++")]
    assert host_compile, steps
    syntax_pass = re.sub(r' -o "?\S+"?', " ", host_compile[-1]) + " -fsyntax-only"
    (tmp_path / "moe.cudafe1.stub.c").write_text("")
    script = tmp_path / "host_front_end.sh"
    script.write_text("set -e\n" + "\n".join(steps[:host_front_end + 1]) + "\n" + syntax_pass + "\n")
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path)
    errors = [line for line in run.stdout.splitlines() + run.stderr.splitlines() if "error" in line]
    assert run.returncode == 0, "\n".join(errors[:20]) or run.stderr[-3000:]


# ---------------------------------------------------------------------------
# GPU: the kernels against the reference
# ---------------------------------------------------------------------------
def poison_allocator():
    """Fill the memory the caching allocator will hand out next with NaN, so
    that any output element a kernel fails to write shows up."""
    block = torch.full((64 << 20,), float("nan"), device="cuda")
    del block


def check_every_call(run, expected, calls):
    """run() matches expected on each of `calls` calls in a row, each on
    NaN-poisoned fresh memory (a kernel reading another's output too early
    may show only from a process's third call on)."""
    for call in range(calls):
        poison_allocator()
        ok, message = reference.compare_outputs(run(), expected)
        assert ok, f"call {call}: {message}"


def run_checked(data, rel_l2_bound=2e-3, run=None, reference_data=None):
    """Run on data (the allocator poisoned first) and compare with the
    reference on reference_data (default: data)."""
    poison_allocator()
    out = (run or solution.custom_kernel)(data)
    torch.cuda.synchronize()
    expected = reference.ref_kernel(data if reference_data is None else reference_data)
    ok, message = reference.compare_outputs(out, expected)
    assert ok, message
    rel_l2 = float(re.search(r"rel_l2=(\S+)", message).group(1))
    assert rel_l2 <= rel_l2_bound, message
    return out


@needs_cuda
def test_kernels_are_used_on_cuda():
    kind, _ = solution._backend(torch.device("cuda"))
    assert kind == "cuda"


@needs_cuda
@pytest.mark.parametrize("shape", OFFICIAL_TESTS + OFFICIAL_BENCHMARKS, ids=str)
def test_official_shapes(shape):
    run_checked(reference.generate_input(*shape))


def random_shapes(count=50, seed=2026):
    rng = random.Random(seed)
    shapes = []
    for i in range(count):
        routed = rng.choice([1, 2, 3, 7, 8, 16, 32, 64, 128, 256])
        shared = rng.choice([0, 1, 1, 2]) if routed > 1 else 1
        top_k = rng.randint(1, min(9, routed))
        d_hidden = rng.choice([256, 512, 768, 1024, 2048, 7168, 200, 333, 1000, 4000])
        d_expert = rng.choice([256, 512, 1024, 100, 160, 300, 777])
        bs = rng.choice([0, 1, 2, 7, 16, 33, 100, 256, 600])
        # Keep the weights (and the generator's time) at the size of the official shapes or below.
        while (routed + shared) * d_hidden * d_expert > 257 * 7168 * 512 and routed > 1:
            routed //= 2
            top_k = min(top_k, routed)
        shapes.append((d_hidden, d_expert, routed, top_k, shared, bs, 1000 + i))
    return shapes


@needs_cuda
@pytest.mark.parametrize("shape", random_shapes(), ids=str)
def test_random_shapes(shape):
    data = reference.generate_input(*shape)
    if shape[5] == 0:
        assert solution.custom_kernel(data).shape == (0, shape[0])
    else:
        run_checked(data)


@needs_cuda
def test_hidden_rows_wider_than_one_quantize_cta():
    """d_hidden 9000 pads to 9216 columns: Qa of a token row then spans two
    CTAs of the routing-and-Qa kernel (8192 columns each), the second one
    part-way."""
    run_checked(reference.generate_input(9000, 256, 4, 2, 1, 5, 31))


@needs_cuda
@pytest.mark.parametrize("splits,row_tiles", [(1, 1), (5, 3), (2, 8)], ids=lambda n: str(n))
@pytest.mark.parametrize("config", [*solution.GEMM_CONFIGS, *solution.PER_BLOCK_STAGE1_CONFIGS],
                         ids=lambda c: str(c).replace("/", "-"))
@pytest.mark.parametrize("shape", [(7168, 256, 32, 8, 1, 100, 21), (2000, 300, 8, 3, 1, 77, 22),
                                   (1024, 256, 4, 2, 1, 300, 23)], ids=str)
def test_every_gemm_config(shape, config, splits, row_tiles):
    """Each compiled configuration, not only the ones the chooser picks today,
    with stage 1's K whole and in two and five slices (halving in the bf16
    kernels; fewer where K has fewer whole stages), and stage 2's CTAs
    over one row tile, three (the last CTA of each row then has fewer) and
    eight (more stages than the pipeline has slots, so the ring wraps); K of
    224 and 63 scale blocks (stage 1) and 10 (stage 2, d_expert 300) end
    stages and slices of every size part-way, and 300 tokens over five
    experts fill several tiles of every size."""
    module = solution._backend(torch.device("cuda"))[1]
    run_checked(reference.generate_input(*shape),
                run=lambda d: solution._run_kernels(module, d, config, stage1_splits=splits,
                                                    stage2_row_tiles=row_tiles))


def with_row_scales(data, index, low, high, share, gen, up_rows_down_by=None):
    """data with a share of the weight rows of scale tensor `index` given one
    scale byte in [low, high) for all their blocks. Whole rows: a row whose
    blocks differ by 2^14 and more can cancel its large terms exactly, and
    what the float64 reference then keeps of its other terms, any fp32
    accumulation (ours, or a bf16 tensor core's) has already rounded away.
    up_rows_down_by (gate/up scales only): gate rows only, and each picked
    gate row's up row gets its scale bytes lowered by that much (not below
    0), so that silu(gate) * up keeps about its usual size. (A huge
    intermediate value makes stage 2 add huge and small terms: the same
    cancellation, which failed the e4m3 configs on an H200, 2026-12-01.)"""
    scales = data[index].view(torch.uint8).cpu().clone()
    rows = scales.reshape(-1, scales.shape[-1])
    pick = torch.rand(rows.shape[0], generator=gen) < share
    if up_rows_down_by is not None:
        d_expert_pad = data[11]["d_expert_pad"]
        pick &= torch.arange(rows.shape[0]) % (2 * d_expert_pad) < d_expert_pad
        up_rows = torch.nonzero(pick).squeeze(1) + d_expert_pad
        rows[up_rows] = (rows[up_rows].to(torch.int32) - up_rows_down_by).clamp(min=0).to(torch.uint8)
    values = torch.randint(low, high, (rows.shape[0], 1), generator=gen, dtype=torch.uint8)
    rows[pick] = values[pick].expand(-1, rows.shape[1])
    return with_replaced(data, index, scales.to(data[index].device).view(data[index].dtype))


@needs_cuda
@pytest.mark.parametrize("config", [c for c in solution.GEMM_CONFIGS if not c.fp8 and not c.wide_tile_tokens],
                         ids=lambda c: str(c).replace("/", "-"))
def test_bf16_configs_stay_exact_with_weight_scales_above_128_and_near_zero(config):
    """In the bf16 kernels scale bytes above 128 take the two-multiplier
    path and bytes near 0 give bf16 subnormal operands; both must stay
    exact. (The call's own choice on sm_90 is an e4m3 config, which
    test_fp8_configs_stay_exact_over_every_weight_scale_range covers.)"""
    data = reference.generate_input(1024, 512, 16, 4, 1, 64, 23)
    gen = torch.Generator(device="cpu").manual_seed(24)
    for index, low, high in ((3, 129, 141), (4, 0, 4)):
        data = with_row_scales(data, index, low, high, 0.2, gen)
    module = solution._backend(torch.device("cuda"))[1]
    run_checked(data, run=lambda d: solution._run_kernels(module, d, config))


@needs_cuda
@pytest.mark.parametrize("config", [c for c in solution.GEMM_CONFIGS if c.fp8],
                         ids=lambda c: str(c).replace("/", "-"))
@pytest.mark.parametrize("changes", [((3, 0, 4), (3, 129, 141), (4, 0, 4)), ((4, 243, 244),)],
                         ids=["near0-above128", "above242"])
def test_fp8_configs_stay_exact_over_every_weight_scale_range(config, changes):
    """The FP8 path scales each block's sum in one fma while every weight
    scale byte of a stage is at most 242, and by an exponent split above:
    bytes near 0 (subnormal factors), above 128, and above 242 (the split;
    on the down weights only, so that the output stays finite)."""
    data = reference.generate_input(1024, 512, 16, 4, 1, 64, 26)
    gen = torch.Generator(device="cpu").manual_seed(27)
    for index, low, high in changes:
        data = with_row_scales(data, index, low, high, 0.2, gen)
    module = solution._backend(torch.device("cuda"))[1]
    out = run_checked(data, run=lambda d: solution._run_kernels(module, d, config))
    assert torch.isfinite(out).all()


@needs_cuda
@pytest.mark.parametrize("config", solution.GEMM_CONFIGS, ids=lambda c: str(c).replace("/", "-"))
def test_every_config_takes_the_wide_path_in_stage1(config):
    """Weight scales beyond the narrow scaling path (above 128 for bf16, 242
    for e4m3) in a few gate rows of stage 1, their up rows scaled down as
    much (so that silu(gate) * up keeps its usual size): some CTAs meet
    one, most do not. On the narrow path their factors would overflow and
    the comparison fail."""
    data = reference.generate_input(1024, 512, 16, 4, 1, 64, 28)
    low, high = (243, 244) if config.fp8 else (129, 141)
    data = with_row_scales(data, 3, low, high, 0.005, torch.Generator(device="cpu").manual_seed(29),
                           up_rows_down_by=low - 127)
    module = solution._backend(torch.device("cuda"))[1]
    out = run_checked(data, run=lambda d: solution._run_kernels(module, d, config))
    assert torch.isfinite(out).all()


WIDE_144 = solution.KernelConfig(64, 16, 64, 4, 4, True, False, 0, 144)
WIDE_64 = solution.KernelConfig(64, 16, 64, 4, 4, True, False, 0, 64)
WIDE_48 = solution.KernelConfig(64, 16, 64, 4, 4, True, False, 0, 48)
# Every config whose stage 1 has a folded e4m3 form: the wide ones and the
# plain e4m3 ones (below FOLDED_STAGE1_MIN_TOKENS, token-scaled: the
# activations fold, the weights do not).
FOLDED_STAGE1 = [WIDE_48, WIDE_64, WIDE_144, *(c for c in solution.GEMM_CONFIGS if c.fp8)]
TOKEN_SCALED = next(c for c in solution.GEMM_CONFIGS if c.fp8 and c.tile_tokens < solution.FOLDED_STAGE1_MIN_TOKENS)


def config_id(config):
    return {WIDE_48: "wide48", WIDE_64: "wide64", WIDE_144: "wide144"}.get(config, str(config).replace("/", "-"))


def with_gate_up_block(data, expert, row, block, code_byte, scale_byte, scales=None):
    """data with block `block` of gate/up weight row `row` of `expert` set to
    bytes code_byte (two E2M1 codes each) under scale byte scale_byte, the
    scale bytes taken from `scales` (a uint8 tensor shaped as data[3]) if
    given, else from data."""
    d_expert_pad = data[11]["d_expert_pad"]
    weights = data[1].view(torch.uint8).clone()
    weights[expert, row, 16 * block:16 * block + 16] = code_byte
    scales = (data[3].view(torch.uint8) if scales is None else scales).clone()
    scales[expert * 2 * d_expert_pad + row, block] = scale_byte
    return with_replaced(with_gate_up_weight(data, weights.view(data[1].dtype)), 3, scales.view(data[3].dtype))


def with_first_block_scales_moved(data, rows, shift, index=3, block=0):
    """data with scale block `block` (default the first) of the given weight
    rows of scale tensor `index` (3: gate/up, 4: down) moved by `shift`
    binades (for the first block: so the rows' other blocks sit -shift
    from it)."""
    scales = data[index].view(torch.uint8).cpu().clone()
    flat = scales.reshape(-1, scales.shape[-1])
    flat[rows, block] = (flat[rows, block].to(torch.int32) + shift).clamp(1, 254).to(torch.uint8)
    return with_replaced(data, index, scales.to(data[index].device).view(data[index].dtype))


@needs_cuda
@pytest.mark.parametrize("config", FOLDED_STAGE1, ids=config_id)
@pytest.mark.parametrize("shift", [-8, -4, 3, 8], ids=lambda n: f"shift{n}")
def test_folded_stage1_in_and_past_its_window(shift, config):
    """The folded stage 1s (wide at 64 and 144 tokens, plain e4m3) fold
    each weight row's blocks against its first block of the K slice,
    exactly from -5 to 6 binades. Moving 40 rows' first blocks by -4 or 3
    binades leaves their other blocks inside that window (their own
    exponents spread by about one binade); by -8 or 8 it puts them outside,
    where the wide unit sets redo_tiles and the bf16 kernel computes stage
    1 again, and the plain CTA runs its K again per block. Without that
    fallback the moved rows' outputs are NaN or wrong."""
    data = reference.generate_input(1024, 512, 16, 4, 1, 64, 41)
    rows = torch.randint(0, data[3].shape[0], (40,), generator=torch.Generator().manual_seed(42))
    data = with_first_block_scales_moved(data, rows, shift)
    module = solution._backend(torch.device("cuda"))[1]
    run_checked(data, run=lambda d: solution._run_kernels(module, d, config))


@needs_cuda
@pytest.mark.parametrize("config", FOLDED_STAGE1, ids=config_id)
def test_folded_stage1_tests_the_window_in_the_k_tail(config):
    """d_hidden 1,056 is 33 scale blocks: the last stage of 8 holds one
    block, whose scale bytes the plain folded stage 1 tests with the rest
    masked (they are zero-filled). Here that block of 40 rows moves 9
    binades up, 8 or more above the rows' first block of the slice and
    outside the window: a test that skipped it, or masked too much, would
    fold it at a shift the table does not hold."""
    data = reference.generate_input(1056, 512, 16, 4, 1, 64, 57)
    d_expert_pad = data[11]["d_expert_pad"]
    rows = torch.randint(0, data[3].shape[0], (40,), generator=torch.Generator().manual_seed(43))
    weights = data[1].view(torch.uint8).cpu().clone().reshape(-1, data[1].shape[-1])
    weights[rows, 16 * 32:16 * 33] = 0x35   # codes of 1.5 and 3: nonzero in every word
    assert data[1].shape[0] * 2 * d_expert_pad == data[3].shape[0]
    data = with_gate_up_weight(data, weights.reshape(data[1].shape).to(data[1].device).view(data[1].dtype))
    data = with_first_block_scales_moved(data, rows, 9, block=32)
    module = solution._backend(torch.device("cuda"))[1]
    run_checked(data, run=lambda d: solution._run_kernels(module, d, config))


@needs_cuda
def test_token_scaled_stage1_takes_the_per_block_pass_above_its_limit():
    """The 8-token e4m3 stage 1 adds each block's sum P times 2^(s - 121)
    in its tokens' units, so a weight scale byte s above 224 must send the
    CTA to its per-block pass. Here three gate rows of every expert hold
    codes of 6 under scale bytes 240-242 and every hidden value is 6 *
    2^-14 (one block exponent, so every folded byte is 384): P = 1152 per
    block, 32 blocks, 2^15.2 * 2^(240 - 121) = 2^134 in the tokens' units,
    which overflows, while the true gate value, 2^114 at 240, does not.
    The up rows' scale bytes come down by 100, so that silu(gate) * up
    stays near 2^3."""
    data = reference.generate_input(1024, 512, 16, 4, 1, 64, 56)
    d_expert_pad = data[11]["d_expert_pad"]
    gate_rows, up_rows = [3, 40, 77], [d_expert_pad + 3, d_expert_pad + 40, d_expert_pad + 77]
    weights = data[1].view(torch.uint8).clone()
    weights[:, gate_rows] = 0x77
    scales = data[3].view(torch.uint8).clone()
    per_expert = scales.view(data[1].shape[0], 2 * d_expert_pad, -1)
    per_expert[:, gate_rows] = torch.tensor([240, 241, 242], dtype=torch.uint8, device=scales.device)[:, None]
    per_expert[:, up_rows] = (per_expert[:, up_rows].to(torch.int32) - 100).clamp(min=0).to(torch.uint8)
    data = with_replaced(with_gate_up_weight(data, weights.view(data[1].dtype)), 3, scales.view(data[3].dtype))
    data = with_replaced(data, 0, torch.full_like(data[0], 6 * 2.0 ** -14))
    module = solution._backend(torch.device("cuda"))[1]
    out = run_checked(data, run=lambda d: solution._run_kernels(module, d, TOKEN_SCALED))
    assert torch.isfinite(out).all()


@needs_cuda
@pytest.mark.parametrize("config", [WIDE_48, WIDE_64, WIDE_144], ids=config_id)
def test_wide_stage1_ctas_over_several_whole_k_units(config):
    """Stage 1's K whole over more units than CTAs (1,024 intermediate
    columns: 16 per tile, 20 tiles of 144 tokens, 40 of 64, over at most
    132 CTAs): a CTA's loaders fill the next unit's stages while its
    consumers run a unit's SwiGLU and Qa, and the units after a CTA's first
    write other tiles' rows and columns (full tiles and part-full ones: the
    experts' token counts vary around 128)."""
    data = reference.generate_input(1024, 1024, 16, 4, 1, 512, 51)
    module = solution._backend(torch.device("cuda"))[1]
    run_checked(data, run=lambda d: solution._run_kernels(module, d, config, stage1_splits=1))


@needs_cuda
@pytest.mark.parametrize("config", [WIDE_48, WIDE_64, WIDE_144], ids=config_id)
@pytest.mark.parametrize("shift", [-8, -4, 3, 8], ids=lambda n: f"shift{n}")
def test_folded_wide_stage2_in_and_past_its_window(shift, config):
    """The same for the wide stage 2's down-weight rows (64 and 144 tokens): moved by
    -4 or 3 binades they fold and the e4m3 kernel runs; by -8 or 8
    folded_fallback_kernel finds them outside the window before stage 2
    starts, and the bf16 kernel does all of stage 2 (the e4m3 kernel's
    bytes for those rows would be wrong)."""
    data = reference.generate_input(1024, 512, 16, 4, 1, 64, 44)
    rows = torch.randint(0, data[4].view(torch.uint8).reshape(-1, data[4].shape[-1]).shape[0], (40,),
                         generator=torch.Generator().manual_seed(45))
    data = with_first_block_scales_moved(data, rows, shift, index=4)
    module = solution._backend(torch.device("cuda"))[1]
    run_checked(data, run=lambda d: solution._run_kernels(module, d, config))


def with_first_intermediate_block_raised(data, shift):
    """data whose intermediate rows have their first block 2^shift times the
    rest (the up rows of columns 0-31 scaled up by shift binades), with the
    down weights of those 32 columns zero, so that the whole output comes
    from the rest of each row."""
    d_expert_pad = data[11]["d_expert_pad"]
    scales = data[3].view(torch.uint8).cpu().clone()
    rows = scales.reshape(-1, 2 * d_expert_pad, scales.shape[-1])
    rows[:, d_expert_pad:d_expert_pad + 32] = (rows[:, d_expert_pad:d_expert_pad + 32].to(torch.int32)
                                               + shift).clamp(max=254).to(torch.uint8)
    data = with_replaced(data, 3, scales.to(data[3].device).view(data[3].dtype))
    down = data[2].view(torch.uint8).clone()
    down[..., :16] = 0   # K columns 0-31: two fp4 codes per byte
    return with_replaced(data, 2, down.view(data[2].dtype))


@needs_cuda
@pytest.mark.parametrize("config", [WIDE_48, WIDE_64, WIDE_144], ids=config_id)
@pytest.mark.parametrize("shift", [10, 13, 16, 20])
def test_folded_wide_stage2_at_and_past_the_edge_of_e4m3(shift, config):
    """Intermediate rows whose first block is 2^shift times the rest (the up
    rows of columns 0-31 scaled up): the rest of each row lies shift
    binades below the row's largest, at 10-16 partly in E4M3's subnormals
    (fold_inter_rows_kernel keeps the values a byte holds exactly and sends
    the row to the bf16 stage 2 otherwise), at 20 beyond them (every row
    runs in bf16). The down weights of those 32 columns are zero, so the
    whole output comes from the small values, which wrong bytes would
    change."""
    data = with_first_intermediate_block_raised(reference.generate_input(1024, 512, 16, 4, 1, 64, 46), shift)
    module = solution._backend(torch.device("cuda"))[1]
    out = run_checked(data, run=lambda d: solution._run_kernels(module, d, config))
    assert out.float().abs().max() > 0


FOLDED_ROWS = [c for c in solution.GEMM_CONFIGS if c.fp8 and c.tile_tokens in solution.FOLDED_STAGE2_TOKENS]


@needs_cuda
@pytest.mark.parametrize("config", FOLDED_ROWS, ids=config_id)
@pytest.mark.parametrize("shift", [10, 13, 16, 20])
def test_folded_rows_stage2_at_and_past_the_edge_of_e4m3(shift, config):
    """The e4m3 configs' stage 2 on folded rows (d_expert 256: a row tile is
    one stage): intermediate rows whose first block is 2^shift times the
    rest (the up rows of columns 0-31 scaled up), so that the rest lies
    shift binades below the row's largest: at 10 folded through the table,
    at 13 into E4M3's subnormals (byte by byte), at 16 and 20 beyond them
    (the row's factor is NaN and its CTAs take the per-block pass on its
    codes). The down weights of those 32 columns are zero, so the whole
    output comes from the small values, which wrong bytes would change."""
    data = with_first_intermediate_block_raised(reference.generate_input(1024, 256, 16, 4, 1, 64, 57), shift)
    module = solution._backend(torch.device("cuda"))[1]
    out = run_checked(data, run=lambda d: solution._run_kernels(module, d, config))
    assert out.float().abs().max() > 0


@needs_cuda
@pytest.mark.parametrize("config", FOLDED_ROWS, ids=config_id)
def test_folded_rows_stage2_takes_the_per_block_pass_above_its_limit(config):
    """Down-weight scale bytes of 225-242 in a fifth of the rows: a stage
    that meets one takes the per-block pass, on the folded rows' bytes
    with the block scales the fold wrote (2^(base - 6)), not the
    token-scaled one, whose sums in the rows' units could overflow
    there."""
    data = reference.generate_input(1024, 256, 16, 4, 1, 64, 58)
    data = with_row_scales(data, 4, 225, 243, 0.2, torch.Generator(device="cpu").manual_seed(59))
    module = solution._backend(torch.device("cuda"))[1]
    out = run_checked(data, run=lambda d: solution._run_kernels(module, d, config))
    assert torch.isfinite(out).all()


@needs_cuda
@pytest.mark.parametrize("config", FOLDED_STAGE1, ids=config_id)
def test_folded_stage1_falls_back_for_tokens_qa_cannot_fold(config):
    """Tokens whose block exponents span more than E4M3's 15 binades (one
    block of 1e4, the rest of 1e-3) have no folded bytes: Qa marks their
    scale NaN and stage 1 runs again, exactly: in bf16 (wide), or per
    block on the E2M1 codes Qa stores for those tokens instead (plain)."""
    data = reference.generate_input(1024, 512, 16, 4, 1, 64, 43)
    hidden = data[0].clone()
    hidden[5] *= 1e-3
    hidden[5, 64:96] = 1e4
    hidden[17] *= 1e-3
    hidden[17, 1000:1032] = -1e4
    module = solution._backend(torch.device("cuda"))[1]
    run_checked(with_replaced(data, 0, hidden), run=lambda d: solution._run_kernels(module, d, config))


@needs_cuda
@pytest.mark.parametrize("config", FOLDED_STAGE1, ids=config_id)
def test_folded_stage1_on_hidden_states_near_the_bottom_of_fp32(config):
    """Hidden states 2^-116 times their usual size, and the gate/up weight
    scales 2^116 times theirs, so that the products keep their size: the
    plain e4m3 form's block scales 2^(b - 6) would not be normal floats, so
    Qa keeps those tokens' E2M1 codes and stage 1 runs per block; the wide
    form folds them (token scales near 2^-122)."""
    data = reference.generate_input(1024, 512, 16, 4, 1, 64, 47)
    scales = data[3].view(torch.uint8).to(torch.int32) + 116
    assert int(scales.max()) <= 242   # below the per-block pass's exponent split
    data = with_replaced(data, 0, data[0] * 2.0 ** -116)
    data = with_replaced(data, 3, scales.to(torch.uint8).view(data[3].dtype))
    module = solution._backend(torch.device("cuda"))[1]
    run_checked(data, run=lambda d: solution._run_kernels(module, d, config))


@needs_cuda
@pytest.mark.parametrize("config", [c for c in FOLDED_STAGE1 if c.fp8], ids=config_id)
@pytest.mark.parametrize("half", ["gate", "up"])
def test_folded_stage1_keeps_a_nan_scale_over_zero_codes(half, config):
    """A gate or up row's block of zero codes under scale byte 255 (E8M0
    NaN) is NaN in the reference, so every token routed to that expert
    comes out NaN. The fold's window test lets zero codes pass at any
    shift; the plain folded pass must send such a CTA to its per-block
    pass, which keeps the NaN. (The wide e4m3 stage 1 adds zero there: the
    README's known exception.)"""
    data = reference.generate_input(1024, 512, 16, 4, 1, 64, 48)
    row = 5 if half == "gate" else data[11]["d_expert_pad"] + 5
    data = with_gate_up_block(data, 3, row, 2, 0, 255)
    module = solution._backend(torch.device("cuda"))[1]
    out = run_checked(data, run=lambda d: solution._run_kernels(module, d, config))
    assert torch.isnan(out).any() and not torch.isnan(out).all()


@needs_cuda
@pytest.mark.parametrize("config", FOLDED_STAGE1, ids=config_id)
def test_folded_stage1_keeps_a_nan_scale_near_the_top_of_the_window(config):
    """A gate row whose blocks all have scale byte 250 but one, 255 (E8M0
    NaN), over nonzero codes: 255 lies within 6 binades of the row's first
    block, so a fold against 250 would read it as a finite 2^5 shift. The
    folded stage 1s must not fold such a row (the wide one: a first scale
    above kFoldMaxFirstScale, 248), and the tokens routed to that expert
    come out NaN as in the reference. Every other weight scale is 2^100
    times its usual size and the hidden states 2^-100 times theirs, so
    that the products keep their size."""
    data = reference.generate_input(1024, 512, 16, 4, 1, 64, 50)
    expert, row = 3, 5
    scales = data[3].view(torch.uint8).to(torch.int32) + 100
    assert int(scales.max()) <= 242   # below the plain pass's exponent split
    scales = scales.to(torch.uint8)
    scales[expert * 2 * data[11]["d_expert_pad"] + row] = 250
    data = with_gate_up_block(data, expert, row, 2, 0x22, 255, scales)   # codes of 1.0
    data = with_replaced(data, 0, data[0] * 2.0 ** -100)
    module = solution._backend(torch.device("cuda"))[1]
    out = run_checked(data, run=lambda d: solution._run_kernels(module, d, config))
    assert torch.isnan(out).any() and not torch.isnan(out).all()


@needs_cuda
@pytest.mark.parametrize("splits", [1, 0], ids=["one_slice", "chosen_slices"])
@pytest.mark.parametrize("config", [WIDE_48, WIDE_64, WIDE_144], ids=config_id)
def test_folded_wide_stage1_redo_is_right_on_every_call(config, splits):
    """A gate row's block of scale byte 255 over nonzero codes: the folded
    wide stage 1 meets it outside its window and the bf16 kernel runs all
    of stage 1 again (with K in one slice, each unit's SwiGLU and Qa in the
    CTA). Only the tokens routed to that expert may come out NaN, and the
    rest must match on every call, each on NaN-poisoned fresh memory: a
    redo that read the fallback's rows before they were written went
    unseen in a process's first two calls and gave up to 53 of the 53
    other tokens NaN or near zero from the third on (one slice, 144
    tokens, H200, 2026-12-03; never under CUDA_LAUNCH_BLOCKING=1)."""
    data = with_gate_up_block(reference.generate_input(1024, 512, 16, 4, 1, 64, 50), 3, 5, 2, 0x22, 255)
    expected = reference.ref_kernel(data)
    assert torch.isnan(expected).any() and not torch.isnan(expected).all()
    module = solution._backend(torch.device("cuda"))[1]
    check_every_call(lambda: solution._run_kernels(module, data, config, stage1_splits=splits), expected, 12)


@needs_cuda
@pytest.mark.parametrize("config", [WIDE_48, WIDE_64, WIDE_144], ids=config_id)
def test_folded_wide_stage2_redo_is_right_on_every_call(config):
    """Down-weight rows whose first block lies 8 binades off the rest: the
    fallback kernel finds them outside the fold before stage 2 starts, the
    e4m3 stage 2 leaves, and the bf16 one runs all of stage 2: the same
    result on every call, each on NaN-poisoned fresh memory."""
    data = reference.generate_input(1024, 512, 16, 4, 1, 64, 54)
    rows = torch.randint(0, data[4].view(torch.uint8).reshape(-1, data[4].shape[-1]).shape[0], (40,),
                         generator=torch.Generator().manual_seed(55))
    data = with_first_block_scales_moved(data, rows, 8, index=4)
    module = solution._backend(torch.device("cuda"))[1]
    check_every_call(lambda: solution._run_kernels(module, data, config), reference.ref_kernel(data), 8)


@needs_cuda
@pytest.mark.parametrize("config", FOLDED_STAGE1, ids=config_id)
def test_nan_scales_in_the_padding_contribute_nothing(config):
    """SPEC section 2: padding rows and K blocks contribute nothing, so
    scale bytes of 255 there (gate/up rows past d_expert in each half, K
    blocks past d_hidden; down rows past d_hidden, K blocks past d_expert)
    leave the output as it is without them. (The reference's dequantised
    padding blocks would turn NaN, so the expected output is the
    reference's on the unpoisoned scales.)"""
    data = reference.generate_input(960, 384, 16, 4, 1, 64, 49)
    d_hidden, d_expert = data[11]["d_hidden"], data[11]["d_expert"]
    d_hidden_pad, d_expert_pad = data[11]["d_hidden_pad"], data[11]["d_expert_pad"]
    assert d_hidden_pad > d_hidden and d_expert_pad > d_expert
    gate_up = data[3].view(torch.uint8).clone().reshape(-1, 2 * d_expert_pad, d_hidden_pad // 32)
    gate_up[:, d_expert:d_expert_pad] = 255
    gate_up[:, d_expert_pad + d_expert:] = 255
    gate_up[:, :, -(-d_hidden // 32):] = 255
    down = data[4].view(torch.uint8).clone().reshape(-1, d_hidden_pad, d_expert_pad // 32)
    down[:, d_hidden:] = 255
    down[:, :, -(-d_expert // 32):] = 255
    poisoned = with_replaced(data, 3, gate_up.reshape(data[3].shape).view(data[3].dtype))
    poisoned = with_replaced(poisoned, 4, down.reshape(data[4].shape).view(data[4].dtype))
    module = solution._backend(torch.device("cuda"))[1]
    out = run_checked(poisoned, run=lambda d: solution._run_kernels(module, d, config), reference_data=data)
    assert not torch.isnan(out).any()


@needs_cuda
def test_memory_stays_flat_over_10000_calls():
    """Allocated memory is the same after 10,000 calls as after one, and the
    results stay within the atomics' one-ulp variation (README)."""
    data = reference.generate_input(1024, 256, 32, 8, 1, 16, 25)
    first = solution.custom_kernel(data)
    out = solution.custom_kernel(data)
    torch.cuda.synchronize()
    # Garbage of earlier tests (a failed test's traceback holds its tensors
    # in a cycle) is freed now, not during the loop (2026-12-01).
    gc.collect()
    baseline = torch.cuda.memory_allocated()
    for i in range(10_000):
        out = solution.custom_kernel(data)
        if i % 1000 == 0:
            assert torch.allclose(out.float(), first.float(), rtol=2.0 ** -7, atol=1e-30), i
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == baseline


@needs_cuda
def test_one_hot_expert_takes_every_token():
    data = reference.generate_input(2048, 512, 32, 8, 1, 300, 7)
    ids = data[10].clone()
    ids[:, :-1] = 5
    run_checked(with_replaced(data, 10, ids))


@needs_cuda
def test_same_expert_twice_in_a_row_counts_twice():
    data = reference.generate_input(1024, 256, 16, 4, 1, 20, 8)
    ids = data[10].clone()
    ids[:, 1] = ids[:, 0]
    run_checked(with_replaced(data, 10, ids))


@needs_cuda
def test_repeated_calls_agree():
    """Stage 2 adds into an fp32 accumulator with atomics, so the summation
    order, and at most the last bf16 bit, may change between calls."""
    data = reference.generate_input(7168, 256, 256, 8, 1, 128, 11)
    first = solution.custom_kernel(data).float()
    for _ in range(5):
        again = solution.custom_kernel(data).float()
        assert ((again - first).abs() <= first.abs() * 2.0 ** -7 + 1e-30).all()


@needs_cuda
def test_custom_kernel_refuses_more_tokens_than_the_accumulator_indices_hold():
    data = reference.generate_input(7168, 256, 8, 2, 1, 8, 15)
    tokens = (2 ** 31 - 1) // 7168 + 1
    data = with_replaced(data, 0, torch.empty(tokens, 7168, dtype=torch.bfloat16, device="cuda"))
    data = with_replaced(data, 9, torch.zeros(tokens, data[9].shape[1], device="cuda"))
    data = with_replaced(data, 10, torch.zeros(tokens, data[10].shape[1], dtype=torch.int32, device="cuda"))
    data = with_replaced(data, 11, {**data[11], "bs": tokens})
    with pytest.raises(ValueError, match=f"at most {tokens - 1} tokens per call at d_hidden_pad 7168, got {tokens}"):
        solution.custom_kernel(data)


def output_of_a_child_call(setup, call):
    """What a fresh Python process in the repository prints when it runs
    setup (lines that import nothing but torch, solution and reference),
    then call, printing "raised: MESSAGE" for a RuntimeError; it must exit
    cleanly. Checks inside the extension are tried this way: on the H200
    machine a TORCH_CHECK thrown there ended the process with a segmentation
    fault (2026-12-03), which would take pytest down with it."""
    script = ("import torch, solution, reference\n" + setup
              + f"try:\n    {call}\nexcept RuntimeError as error:\n    print('raised:', error)\n")
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900,
                           cwd=os.path.join(os.path.dirname(__file__), ".."))
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-2000:]
    return child.stdout


def setup_of_many_tokens(tokens, d_hidden, d_expert, seed):
    """output_of_a_child_call's setup for `data`, a call of `tokens` zero
    tokens with 9 pairs each (8 routed experts, top-8, 1 shared; all on
    expert 0), without drawing that many tokens' inputs, and `module`."""
    return (f"data = reference.generate_input({d_hidden}, {d_expert}, 8, 8, 1, 8, {seed})\n"
            f"tokens = {tokens}\n"
            f"data = (torch.zeros(tokens, {d_hidden}, dtype=torch.bfloat16, device='cuda'),) + data[1:9] + (\n"
            "    torch.full((tokens, 9), 0.1, device='cuda'), torch.zeros(tokens, 9, dtype=torch.int32, device='cuda'),\n"
            "    {**data[11], 'bs': tokens})\n"
            "module = solution._backend(torch.device('cuda'))[1]\n")


@needs_cuda
def test_a_check_inside_the_extension_raises_runtime_error():
    """A check inside moe_forward (a config with no kernels built) raises
    RuntimeError with its message."""
    out = output_of_a_child_call("data = reference.generate_input(512, 256, 8, 2, 1, 8, 1)\n"
                                 "module = solution._backend(torch.device('cuda'))[1]\n",
                                 "solution._run_kernels(module, data, "
                                 "solution.KernelConfig(8, 16, 8, 8, 5, True, True, 32))")
    assert "raised: moe_mxfp4: no kernels built for tile_tokens=8, warp_rows=16" in out, out


@needs_cuda
def test_stage1_slices_beyond_32_bit_offsets_raise():
    """swiglu_quantize_kernel indexes stage 1's partial sums with ints: two
    slices of 9 * 58,255 rows of 2,048 (gate, up) pairs are 2^31 + 28,672 of
    them, past what an int holds, and the call raises before stage 1 is
    launched instead of writing out of bounds."""
    tokens = 2 ** 31 // (2 * 9 * 2048) + 1
    out = output_of_a_child_call(setup_of_many_tokens(tokens, 1024, 2048, 55),
                                 "solution._run_kernels(module, data, stage1_splits=2)")
    assert f"raised: moe_mxfp4: stage 1's partial sums outgrow 32-bit offsets (2 slices of {9 * tokens} rows)" in out, out


@needs_cuda
def test_narrow_grids_past_their_tile_bound_raise_before_any_kernel():
    """The narrow kernels' grids give the tile a dimension of its own, at most
    65,535: 60,000 tokens of 9 pairs forced onto 8-token tiles over 9
    experts could make 540,000 / 8 + 9 + 1 tiles, and the call raises
    before the routing kernel is queued (the chooser takes wide tiles long
    before such a call)."""
    tokens = 60000
    out = output_of_a_child_call(
        setup_of_many_tokens(tokens, 256, 256, 56),
        "solution._run_kernels(module, data, solution.KernelConfig(8, 16, 8, 8, 4, True, True, 32))")
    assert f"raised: moe_mxfp4: {tokens * 9 // 8 + 9 + 1} tiles outgrow the grid's 65535" in out, out


@needs_cuda
@pytest.mark.parametrize("config", [None, WIDE_144], ids=["chosen", "wide144"])
def test_misaligned_weights_and_scales_give_the_same_result(config):
    data = reference.generate_input(1024, 512, 16, 4, 1, 64, 52)
    misaligned = data
    for index in (1, 2, 3, 4):
        misaligned = with_replaced(misaligned, index, misaligned_copy(data[index]))
    module = solution._backend(torch.device("cuda"))[1]
    run_checked(misaligned, run=lambda d: solution._run_kernels(module, d, config), reference_data=data)


@needs_cuda
def test_the_extension_refuses_misaligned_weights():
    """The dispatcher realigns; a direct caller of moe_forward gets a
    RuntimeError naming the tensor."""
    out = output_of_a_child_call(
        "data = reference.generate_input(1024, 512, 16, 4, 1, 16, 53)\n"
        "args = list(solution._moe_forward_args(data))\n"
        "view = torch.empty(args[1].numel() + 1, dtype=torch.uint8, device='cuda')[1:].view(args[1].shape)\n"
        "view.copy_(args[1])\n"
        "args[1] = view\n"
        "module = solution._backend(torch.device('cuda'))[1]\n",
        "module.moe_forward(*args)")
    assert "raised: moe_mxfp4: gate_up_weight must start on a 16-byte boundary" in out, out


@needs_cuda
def test_out_of_range_expert_id_poisons_output():
    data = reference.generate_input(512, 256, 8, 2, 1, 9, 12)
    ids = data[10].clone()
    ids[3, 0] = 99
    out = solution.custom_kernel(with_replaced(data, 10, ids))
    assert torch.isnan(out.float()).all()


@needs_cuda
def test_nan_in_hidden_states_stays_in_its_row():
    data = reference.generate_input(1024, 256, 8, 2, 1, 16, 13)
    hidden = data[0].clone()
    hidden[4, 17] = float("nan")
    data = with_replaced(data, 0, hidden)
    out = solution.custom_kernel(data).float()
    assert torch.isnan(out[4]).all()
    rows = [i for i in range(16) if i != 4]
    expected = reference.ref_kernel(data)
    ok, message = reference.compare_outputs(out[rows].bfloat16(), expected[rows])
    assert ok, message


@needs_cuda
@pytest.mark.parametrize("config", solution.GEMM_CONFIGS, ids=lambda c: str(c).replace("/", "-"))
def test_nan_in_hidden_states_through_the_k_split_fix_up(config):
    """As above, with stage 1's K in two slices for every config: the
    fix-up kernel's Qa of the slices' sums must turn each of that token's
    intermediate blocks to NaN and leave the other tokens' as the
    reference's."""
    data = reference.generate_input(1024, 256, 8, 2, 1, 16, 13)
    hidden = data[0].clone()
    hidden[4, 17] = float("nan")
    data = with_replaced(data, 0, hidden)
    module = solution._backend(torch.device("cuda"))[1]
    out = solution._run_kernels(module, data, config, stage1_splits=2).float()
    assert torch.isnan(out[4]).all()
    rows = [i for i in range(16) if i != 4]
    ok, message = reference.compare_outputs(out[rows].bfloat16(), reference.ref_kernel(data)[rows])
    assert ok, message


@needs_cuda
def test_cuda_graph_replay_with_new_inputs():
    """Captured once, replayed after new values are copied into the same
    input buffers (every tensor of the tuple, AITER's shuffled copies among
    them: the folded stage 1s read gate_up_weight_shuffled): the kernels
    read the buffers, not values fixed at capture."""
    data = reference.generate_input(2048, 512, 32, 8, 1, 64, 14)
    fresh = reference.generate_input(2048, 512, 32, 8, 1, 64, 15)
    solution.custom_kernel(data)  # build and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = solution.custom_kernel(data)
    for index in range(11):
        data[index].copy_(fresh[index])
    graph.replay()
    torch.cuda.synchronize()
    ok, message = reference.compare_outputs(out, reference.ref_kernel(fresh))
    assert ok, message


def test_out_of_range_expert_id_is_refused_to_cpu():
    data = to_cpu(small_input())
    ids = data[10].clone()
    ids[2, 1] = 9
    with pytest.raises(ValueError, match=r"topk_ids: expert ids must lie in \[0, 9\), got \[0, 9\]"):
        solution.custom_kernel(with_replaced(data, 10, ids))


def test_tensors_on_different_devices_are_refused():
    data = small_input()
    with pytest.raises(ValueError, match=r"topk_weights: on meta, but hidden_states is on (cpu|cuda:0)"):
        solution.custom_kernel(with_replaced(data, 9, torch.empty(data[9].shape, device="meta")))


def test_unwritable_cache_directory_falls_back_to_a_temporary_one(tmp_path, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("")
    chosen = solution._writable_dir(str(blocked / "cache"))
    assert chosen != str(blocked / "cache") and os.path.isdir(chosen)
    assert "not writable" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# Build faults (no GPU needed: the build is replaced by stand-ins)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("capability, arch", [((9, 0), "9.0a"), ((8, 9), "8.9"), ((10, 0), "10.0"),
                                              ((8, 0), None), ((7, 5), None)])
def test_cuda_arch_for_capability(capability, arch):
    assert solution._cuda_arch(capability) == arch


def test_failed_build_warns_once_and_falls_back(monkeypatch):
    def no_compiler(arch):
        raise RuntimeError("nvcc: command not found")
    monkeypatch.setattr(solution, "_build_kernels", no_compiler)
    with pytest.warns(RuntimeWarning, match=r"building the CUDA kernels failed \(RuntimeError: nvcc: command not "
                                            r"found\); using the PyTorch a4w4 path"):
        assert solution._cuda_backend((9, 0)) == ("torch", None)


def test_gpu_older_than_built_for_warns_and_falls_back():
    with pytest.warns(RuntimeWarning, match=r"compute capability 8.0 is older than the kernels are built for"):
        assert solution._cuda_backend((8, 0)) == ("torch", None)


@pytest.mark.parametrize("capability", [(8, 9), (10, 0), (12, 0)])
def test_gpu_no_test_has_run_on_warns_and_keeps_the_kernels(monkeypatch, capability):
    """Only sm_90 GPUs have run the kernels: on other archs they still run
    (they build there, test_kernel_source_builds_for_other_dispatch_archs),
    after a warning that says they are untested."""
    monkeypatch.setattr(solution, "_build_kernels", lambda arch: ("built for", arch))
    with pytest.warns(RuntimeWarning, match=rf"tested on sm_90 GPUs \(H100, H200\) only; on compute capability "
                                            rf"{capability[0]}\.{capability[1]} they run untested"):
        assert solution._cuda_backend(capability) == ("cuda", ("built for", solution._cuda_arch(capability)))


def test_sm90_builds_the_kernels_without_a_warning(monkeypatch, recwarn):
    monkeypatch.setattr(solution, "_build_kernels", lambda arch: ("built for", arch))
    assert solution._cuda_backend((9, 0)) == ("cuda", ("built for", "9.0a"))
    assert not [w for w in recwarn if "moe_mxfp4" in str(w.message)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_kernel_source_builds_for_other_dispatch_archs(tmp_path):
    """Dispatch builds the kernels for any sm_89+ GPU (_cuda_arch), yet the
    build tests above are sm_90a's: the device code must also compile where
    its Hopper paths are guarded out (sm_89) and for the newest arch nvcc
    here offers that dispatch would pick (sm_100)."""
    (tmp_path / "kernels.cu").write_text(solution.KERNEL_SOURCE)
    build = subprocess.run(["nvcc", "-std=c++17", "-O1", "-gencode=arch=compute_89,code=sm_89",
                            "-gencode=arch=compute_100,code=sm_100", "-c", str(tmp_path / "kernels.cu"),
                            "-o", str(tmp_path / "kernels.o")], capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout + build.stderr


def test_cpu_tensors_take_the_torch_path_without_a_warning():
    """CPU tensors are a supported input (README: Dispatch), not a fallback:
    the PyTorch path runs without a warning."""
    import warnings
    data = to_cpu(small_input(bs=3, seed=5))
    solution._backend_cache.pop(("cpu", None), None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        output = solution.custom_kernel(data)
    assert output.shape == (3, data[11]["d_hidden"]) and output.dtype == torch.bfloat16


def test_the_extension_links_the_shared_libstdcxx(monkeypatch, tmp_path):
    """load_inline gets LINK_FLAGS and the cache key covers them: on the H200
    machine an extension built without them carried a private copy of the
    C++ runtime, and a TORCH_CHECK inside it crashed the process."""
    import torch.utils.cpp_extension as cpp_extension
    monkeypatch.setenv(solution.CACHE_DIR_ENV, str(tmp_path))
    seen = {}
    monkeypatch.setattr(cpp_extension, "load_inline", lambda **kwargs: seen.update(kwargs) or "module")
    assert solution._load_extension("name", "9.0a", str(tmp_path)) == "module"
    assert seen["extra_ldflags"] == solution.LINK_FLAGS
    assert ("-l:libstdc++.so.6" in solution.LINK_FLAGS) == sys.platform.startswith("linux")
    key = solution._build_location("9.0a")[1]
    monkeypatch.setattr(solution, "LINK_FLAGS", ["-lother"])
    assert solution._build_location("9.0a")[1] != key


def test_a_second_build_in_a_process_keeps_its_cache_key(monkeypatch, tmp_path):
    """torch's load_inline appends its own link flags to the extra_ldflags
    list it is given. Given LINK_FLAGS itself, the cache key of the
    process's next build changed and it built everything again in a new
    directory (ab_bench's smoke run, on an H200: 75 s more per version,
    2026-12-03). Here a load_inline that appends as torch's does."""
    import torch.utils.cpp_extension as cpp_extension
    monkeypatch.setenv(solution.CACHE_DIR_ENV, str(tmp_path))

    def appending_load_inline(**kwargs):
        kwargs["extra_ldflags"].append("-ltorch")
        kwargs["extra_cuda_cflags"].append("-DTORCH_EXTENSION_NAME=x")
        return "module"
    monkeypatch.setattr(cpp_extension, "load_inline", appending_load_inline)
    key = solution._build_location("9.0a")
    assert solution._load_extension("name", "9.0a", str(tmp_path)) == "module"
    assert solution._build_location("9.0a") == key


def test_corrupt_cached_library_is_rebuilt(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(solution.CACHE_DIR_ENV, str(tmp_path))
    build_dir, name = solution._build_location("9.0a")
    with open(os.path.join(build_dir, f"{name}.so"), "wb") as truncated:
        truncated.write(b"\x7fELF")
    seen = []

    def load(name, arch, build_dir):
        seen.append(sorted(os.listdir(build_dir)))
        if len(seen) == 1:
            raise ImportError(f"{name}.so: file too short")
        return "module"

    monkeypatch.setattr(solution, "_load_extension", load)
    assert solution._build_kernels("9.0a") == "module"
    assert seen == [[f"{name}.so"], []]   # the bad library was removed before the second load
    assert "does not load" in capsys.readouterr().err


def test_failed_first_build_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv(solution.CACHE_DIR_ENV, str(tmp_path))
    def compile_error(name, arch, build_dir):
        raise ImportError("undefined symbol: moe_forward")
    monkeypatch.setattr(solution, "_load_extension", compile_error)
    with pytest.raises(ImportError, match="undefined symbol"):
        solution._build_kernels("9.0a")


# ---------------------------------------------------------------------------
# torch.library op
# ---------------------------------------------------------------------------
def test_custom_op_under_torch_compile():
    data = to_cpu(small_input(dhidden=300, dexpert=200, seed=21))
    torch.library.opcheck(solution.moe_op, solution.moe_op_args(data),
                          test_utils=("test_faketensor",))
    compiled = torch.compile(lambda *args: solution.moe_op(*args) * 2, backend="aot_eager", fullgraph=True)
    out = compiled(*solution.moe_op_args(data))
    assert torch.equal(out, solution.custom_kernel(data) * 2)


def test_custom_op_passes_the_config_custom_kernel_reads(monkeypatch):
    """The op's config carries what the dispatcher reads (the shared
    experts' count steers the host's tile estimate), so that a compiled
    model gets the choices an eager call gets."""
    data = to_cpu(small_input(seed=23))
    seen = {}
    monkeypatch.setattr(solution, "custom_kernel", lambda d: seen.setdefault("config", d[11]) and d[0].clone())
    solution.moe_op(*solution.moe_op_args(data))
    read = ("d_hidden", "d_expert", "d_hidden_pad", "d_expert_pad", "n_shared_experts")
    assert {k: seen["config"][k] for k in read} == {k: data[11][k] for k in read}
    assert data[11]["n_shared_experts"] == 1


@needs_cuda
def test_custom_op_under_torch_compile_on_cuda():
    data = reference.generate_input(1024, 256, 16, 4, 1, 33, 22)
    compiled = torch.compile(lambda *args: solution.moe_op(*args), fullgraph=True)
    ok, message = reference.check_implementation(data, compiled(*solution.moe_op_args(data)))
    assert ok, message


# ---------------------------------------------------------------------------
# The kernels' bit-level format helpers, compiled for the host by nvcc and
# checked against reference.py (no GPU needed)
# ---------------------------------------------------------------------------
HELPER_DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
int main() {
    char kind[32];
    unsigned int x;
    while (scanf("%31s %x", kind, &x) == 2) {
        const float f = moe::bits_to_float(x);
        unsigned int out = 0;
        if (!strcmp(kind, "code")) out = moe::e2m1_code(f);
        else if (!strcmp(kind, "value")) out = moe::float_to_bits(moe::e2m1_value(x));
        else if (!strcmp(kind, "round")) out = moe::float_to_bits(moe::e2m1_round(f));
        else if (!strcmp(kind, "pair0")) out = moe::fp4_pair_to_bf16<0>(x);
        else if (!strcmp(kind, "pair1")) out = moe::fp4_pair_to_bf16<1>(x);
        else if (!strcmp(kind, "pair2")) out = moe::fp4_pair_to_bf16<2>(x);
        else if (!strcmp(kind, "pair3")) out = moe::fp4_pair_to_bf16<3>(x);
        else if (!strcmp(kind, "low")) out = moe::weight_multiplier_low(x);
        else if (!strcmp(kind, "high")) out = moe::weight_multiplier_high(x);
        else if (!strcmp(kind, "byte0")) out = moe::weight_multiplier_of_byte(x, 0);
        else if (!strcmp(kind, "byte1")) out = moe::weight_multiplier_of_byte(x, 1);
        else if (!strcmp(kind, "byte2")) out = moe::weight_multiplier_of_byte(x, 2);
        else if (!strcmp(kind, "byte3")) out = moe::weight_multiplier_of_byte(x, 3);
        else if (!strcmp(kind, "above128")) out = moe::any_scale_above(x, 128);
        else if (!strcmp(kind, "position")) out = moe::act_position((int)x);
        else if (!strcmp(kind, "e4m3")) out = moe::e2m1_to_e4m3(x);
        else if (!strcmp(kind, "even")) out = moe::fp4_even_to_e4m3(x);
        else if (!strcmp(kind, "odd")) out = moe::fp4_odd_to_e4m3(x);
        else if (!strcmp(kind, "fp8position")) out = moe::fp8_act_position((int)x);
        else if (!strcmp(kind, "above242")) out = moe::any_scale_above(x, moe::kFp8NarrowScale);
        else if (!strcmp(kind, "qa")) out = moe::float_to_bits(moe::exact_pow2(moe::qa_exponent(f)));
        else if (!strcmp(kind, "shifted")) out = moe::e2m1_to_e4m3_shifted(x & 15u, (int)(x >> 4) - 8);
        else if (!strcmp(kind, "foldposition")) out = moe::folded_act_position((int)x);
        else if (!strncmp(kind, "codesshift", 10)) out = moe::e4m3_codes_shifted(x, atoi(kind + 10));
        else if (!strncmp(kind, "outside", 7))   // outside<start>: the window test of four scale bytes
            out = moe::scale_bytes_outside_window(x, (unsigned)atoi(kind + 7) * 0x01010101u);
        else if (!strcmp(kind, "perblockeven") || !strcmp(kind, "perblockodd")) {
            const uint2 bytes = moe::folded_to_per_block_order(
                moe::fp4_word_to_folded_e4m3(x, moe::kE4m3CodesLo, moe::kE4m3CodesHi));
            out = kind[8] == 'e' ? bytes.x : bytes.y;
        }
        else if (!strcmp(kind, "slice"))   // z, slices, stage blocks, K blocks: a byte each
            out = moe::halving_slice_first_block(x >> 24, (x >> 16) & 255, x & 255, (x >> 8) & 255);
        else if (!strcmp(kind, "maxslices")) out = moe::max_halving_slices(x & 255, (x >> 8) & 255);
        else if (!strncmp(kind, "foldx", 5) || !strncmp(kind, "foldy", 5)) {
            uint32_t lo, hi;
            moe::folded_e4m3_table(atoi(kind + 5), lo, hi);
            const uint2 bytes = moe::fp4_word_to_folded_e4m3(x, lo, hi);
            out = kind[4] == 'x' ? bytes.x : bytes.y;
        }
        printf("%08x\n", out);
    }
    return 0;
}
"""


ROUTING_DRIVER = r"""
#include <stdio.h>
int main() {
    int m, top_k, experts, shared, tile;
    while (scanf("%d %d %d %d %d", &m, &top_k, &experts, &shared, &tile) == 5)
        printf("%.6f\n", moe::expected_tiles(m, top_k, experts, shared, tile));
    return 0;
}
"""


def poisson_tiles(mean, tile):
    """E[ceil(n / tile)] for n ~ Poisson(mean), summed term by term."""
    total, n_max = 0.0, int(mean + 20 * math.sqrt(mean) + 2 * tile)
    survival = 1.0   # P(n > k - 1) before term k
    for k in range(n_max + 1):
        survival -= math.exp(k * math.log(mean) - mean - math.lgamma(k + 1)) if mean > 0 else float(k == 0)
        if k % tile == 0:
            total += max(survival, 0.0)   # P(n > k)
    return total


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_expected_tiles_follow_the_routing_model(tmp_path):
    """expected_tiles (host code in the routing source) against the model it
    states, summed exactly here: shared experts ceil(m / T) tiles each,
    routed experts Poisson; within 1% where it takes the normal
    approximation (means above 30)."""
    (tmp_path / "routing.cu").write_text(solution.COMMON_SOURCE + solution.ROUTING_SOURCE + ROUTING_DRIVER)
    build = subprocess.run(["nvcc", "-std=c++17", "-O2", "-gencode=arch=compute_90a,code=sm_90a",
                            str(tmp_path / "routing.cu"), "-o", str(tmp_path / "routing")],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr
    cases = [(512, 9, 33, 1, 144), (512, 9, 33, 1, 64), (128, 9, 33, 1, 64), (16, 9, 257, 1, 8),
             (128, 9, 257, 1, 8), (512, 9, 257, 1, 24), (7, 9, 257, 1, 8), (1, 9, 33, 1, 144),
             (20000, 9, 33, 1, 144), (512, 8, 32, 0, 144)]
    invalid = [(512, 9, 33, 9, 144), (512, 9, 33, -1, 144)]   # taken as no shared experts
    text = "".join(" ".join(map(str, case)) + "\n" for case in cases + invalid)
    run = subprocess.run([str(tmp_path / "routing")], input=text, capture_output=True, text=True, timeout=60)
    got = [float(line) for line in run.stdout.split()]
    assert len(got) == len(cases) + len(invalid), run.stdout + run.stderr
    for (m, top_k, experts, shared, tile), value in zip(cases, got):
        mean = m * (top_k - shared) / (experts - shared)
        model = shared * math.ceil(m / tile) + (experts - shared) * poisson_tiles(mean, tile)
        assert value == pytest.approx(model, rel=1e-6 if mean <= 30 else 1e-2), (m, top_k, experts, shared, tile)
    assert 37 < got[0] < 40   # bs=512 E=33: about 38 wide tiles (BENCHMARKS.md)
    no_shared = 33 * poisson_tiles(512 * 9 / 33, 144)
    for case, value in zip(invalid, got[len(cases):]):
        assert value == pytest.approx(no_shared, rel=1e-2), case


@pytest.fixture(scope="module")
def helpers(tmp_path_factory):
    """Run (kind, uint32) queries through the helpers; returns a function."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    folder = tmp_path_factory.mktemp("helpers")
    (folder / "helpers.cu").write_text(solution.COMMON_SOURCE + HELPER_DRIVER)
    build = subprocess.run(["nvcc", "-std=c++17", "-O2", "-gencode=arch=compute_90a,code=sm_90a",
                            str(folder / "helpers.cu"), "-o", str(folder / "helpers")],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr

    def query(kind, values):
        text = "".join(f"{kind} {int(v) & 0xFFFFFFFF:x}\n" for v in values)
        run = subprocess.run([str(folder / "helpers")], input=text, capture_output=True, text=True, timeout=60)
        # Checked, so that a crash (its buffered output lost) or an unknown kind fails
        # the test instead of handing it an empty list that every zip-loop accepts.
        assert run.returncode == 0, run.stderr
        out = [int(line, 16) for line in run.stdout.split()]
        assert len(out) == len(values), (kind, len(out), len(values))
        return out
    return query


def float_bits(values):
    return torch.tensor(values, dtype=torch.float32).view(torch.int32).tolist()


def bf16_halves(word):
    """The two bf16 values (low half first) of a 32-bit word, as floats."""
    halves = torch.tensor([(word & 0xFFFF) << 16, (word >> 16) << 16], dtype=torch.int64)
    return halves.to(torch.int32).view(torch.float32).tolist()


def test_halving_slices_cover_k_in_whole_stages(helpers):
    """Stage 1's halving K slices (halving_slice_first_block): they start at
    0, end at K, are each non-empty up to max_halving_slices (one more would
    leave one empty), end on whole stages except at K, the first is half the
    stages (rounded up), and none is larger than the one before it."""
    for k_blocks in (1, 7, 10, 63, 64, 224, 255):
        for stage_blocks in (4, 8):
            stages = -(-k_blocks // stage_blocks)
            most = helpers("maxslices", [stage_blocks << 8 | k_blocks])[0]
            assert most == stages.bit_length()
            for slices in range(1, most + 2):
                bounds = helpers("slice", [z << 24 | slices << 16 | stage_blocks << 8 | k_blocks
                                           for z in range(slices + 1)])
                assert bounds[0] == 0 and bounds[-1] == k_blocks
                sizes = [-(-(b - a) // stage_blocks) for a, b in zip(bounds, bounds[1:])]
                if slices > most:
                    assert 0 in sizes
                    continue
                assert all(b % stage_blocks == 0 for b in bounds[:-1])
                assert min(sizes) > 0 and sizes == sorted(sizes, reverse=True), (k_blocks, slices, sizes)
                assert slices == 1 or sizes[0] == -(-stages // 2)


def test_e2m1_code_matches_the_reference(helpers):
    grid = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 1e30, float("inf")]
    values = grid + [-v for v in grid] + [v * (1 + d) for v in grid[1:14] for d in (1e-6, -1e-6)]
    values += torch.randn(2000, generator=torch.Generator().manual_seed(1)).mul(3).tolist()
    bits = float_bits(values)
    # Every rounding boundary and binade edge, 40 ulps either side, and every
    # sign, exponent and top mantissa pattern (NaNs, infinities and
    # subnormals among them), each with random low bits.
    edges = float_bits([0.25, 0.5, 0.75, 1.0, 1.25, 1.75, 2.0, 2.5, 3.5, 4.0, 5.0, 6.0])
    bits += [(e + d) | sign for e in edges for d in range(-40, 41) for sign in (0, 1 << 31)]
    low = torch.randint(0, 1 << 16, (1 << 16,), generator=torch.Generator().manual_seed(2)).tolist()
    bits += [top << 16 | low[top] for top in range(1 << 16)]
    expected = reference.e2m1_encode(torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32))
    assert helpers("code", bits) == expected.tolist()


def test_e2m1_values_match_the_reference(helpers):
    got = torch.tensor(helpers("value", range(16)), dtype=torch.int64).to(torch.int32).view(torch.float32)
    assert torch.equal(got, reference.e2m1_decode(torch.arange(16)).float())


def test_e2m1_round_is_the_value_of_the_code(helpers):
    """e2m1_round(x), Qa's rounding kept as a float, is bit for bit
    e2m1_value(e2m1_code(x)): every rounding boundary of E2M1 (0.25, 0.75,
    1.25, 1.75, 2.5, 3.5, 5 and 6) and a few ulps either side, both signs,
    zeros, subnormals, infinities, NaN, and random floats of every binade."""
    gen = torch.Generator().manual_seed(46)
    edges = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0,
                          1e-45, 1e-38, 1e30, float("inf"), float("nan")], dtype=torch.float32)
    near = (edges.view(torch.int32).unsqueeze(1) + torch.arange(-3, 4, dtype=torch.int32)).flatten()
    random_bits = torch.randint(0, 2 ** 31, (20000,), generator=gen, dtype=torch.int64).to(torch.int32)
    scaled = (torch.rand(20000, generator=gen) * 8).view(torch.int32)
    bits = torch.cat([near, near | torch.tensor(-2 ** 31, dtype=torch.int32), random_bits, scaled,
                      scaled | torch.tensor(-2 ** 31, dtype=torch.int32)]).tolist()
    codes = helpers("code", bits)
    assert helpers("round", bits) == helpers("value", codes)


def e4m3_bytes(values):
    return torch.tensor(values, dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8).tolist()


def test_shifted_e4m3_is_the_exact_folded_value(helpers):
    """Every E2M1 code times 2^d, over the fold's whole range of d, is the
    E4M3 byte torch rounds that value to: exact, subnormals included."""
    queries = [code | (d + 8) << 4 for d in range(-8, 7) for code in range(16)]
    values = [v * 2.0 ** d for d in range(-8, 7) for v in reference.e2m1_decode(torch.arange(16)).tolist()]
    assert all(torch.tensor(values).to(torch.float8_e4m3fn).float() == torch.tensor(values))
    assert helpers("shifted", queries) == e4m3_bytes(values)


def test_folded_words_follow_the_table_and_the_fragment_order(helpers):
    """fp4_word_to_folded_e4m3 through folded_e4m3_table's table gives each
    of a word's eight codes as e2m1_to_e4m3_shifted does (values 0-3 in .x,
    4-7 in .y), for every shift the table covers; folded_act_position puts
    a block's activations at the k those bytes take."""
    words = [0, 0xFFFFFFFF, 0x88888888, 0x01234567, 0x89ABCDEF]
    words += torch.randint(0, 2 ** 32, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    for d in range(-5, 7):
        for half, kind in ((0, f"foldx{d}"), (1, f"foldy{d}")):
            got = helpers(kind, words)
            for word, out in zip(words, got):
                codes = [(word >> (4 * (4 * half + i))) & 15 for i in range(4)]
                expected = e4m3_bytes([v * 2.0 ** d for v in reference.e2m1_decode(torch.tensor(codes)).tolist()])
                assert [(out >> (8 * i)) & 0xFF for i in range(4)] == expected, (hex(word), d, half)
    positions = helpers("foldposition", range(32))
    assert sorted(positions) == list(range(32))
    for t in range(4):
        for j in range(4):
            assert positions[8 * t + j] == 4 * t + j and positions[8 * t + 4 + j] == 16 + 4 * t + j


def test_bf16_qa_lanes_store_eight_neighbouring_positions(helpers):
    """quantize_h_rows_bf16's lane j of a block (j in 0..3) takes values j,
    j + 4, ..., j + 28 and stores them as positions 8j..8j+7 in one 16-byte
    store: value j + 4m must sit at act_position 8j + m."""
    positions = helpers("position", range(32))
    assert [positions[j + 4 * m] for j in range(4) for m in range(8)] == list(range(32))


def test_fp4_pairs_are_bf16_values_times_2_pow_minus_126(helpers):
    words = [0, 0xFFFFFFFF, 0x88888888, 0x12345678, 0x9ABCDEF0]
    words += torch.randint(0, 2 ** 32, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    for j in range(4):
        for word, out in zip(words, helpers(f"pair{j}", words)):
            codes = torch.tensor([(word >> (4 * j)) & 0xF, (word >> (4 * j + 16)) & 0xF])
            expected = [v * 2.0 ** -126 for v in reference.e2m1_decode(codes).tolist()]
            got = bf16_halves(out)
            assert got == expected, (j, hex(word))
            # -0 for code 8, so the sign survives the scale multiply.
            assert [math.copysign(1, g) for g in got] == [-1.0 if c & 8 else 1.0 for c in codes.tolist()]


def test_weight_multipliers_make_every_scale_exactly(helpers):
    """low * high == 2^(s-1) for every E8M0 byte, each factor a finite bf16 in
    both halves; the one-factor form (all four scales <= 128) agrees with low."""
    scales = list(range(256))
    for s, low, high in zip(scales, helpers("low", scales), helpers("high", scales)):
        low_values, high_values = bf16_halves(low), bf16_halves(high)
        if s == 255:
            assert all(math.isnan(v) for v in high_values)
            continue
        assert low_values[0] == low_values[1] and high_values[0] == high_values[1], s
        assert math.isfinite(low_values[0]) and math.isfinite(high_values[0]), s
        assert low_values[0] * high_values[0] == 2.0 ** (s - 1), s
        if s <= 128:
            assert high_values[0] == 1.0, s
    rng = random.Random(4)
    for k in range(4):
        words = [sum(rng.randrange(129) << (8 * i) for i in range(4) if i != k) | s << (8 * k) for s in range(129)]
        assert helpers(f"byte{k}", words) == helpers("low", range(129)), k


def test_scales_above_128_are_detected(helpers):
    rng = random.Random(5)
    words = [sum(rng.choice([0, 1, 127, 128, 129, 200, 255]) << (8 * i) for i in range(4)) for _ in range(500)]
    words += [byte << (8 * i) | 0x80 << (8 * ((i + 1) % 4)) for byte in range(256) for i in range(4)]
    expected = [int(any((w >> (8 * i)) & 0xFF > 128 for i in range(4))) for w in words]
    assert helpers("above128", words) == expected


def random_blocks(helpers, position_helper, seed, count=20):
    """(weight words, activations, exact dot product) for random scale
    blocks: what a layout test's MMA must give. Word t (the block's fp4x2
    bytes 4t..4t+3) is thread t's of a quad; the activations are stored at
    the kernel's permutation `position_helper`, checked to be one."""
    position = helpers(position_helper, range(32))
    assert sorted(position) == list(range(32))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        row = torch.randint(0, 256, (16,), generator=gen).tolist()
        act = torch.randint(-8, 9, (32,), generator=gen).double().tolist()
        codes = [(row[p // 2] >> (4 * (p % 2))) & 0xF for p in range(32)]
        weight = reference.e2m1_decode(torch.tensor(codes)).double().tolist()
        stored = [0.0] * 32
        for p in range(32):
            stored[position[p]] = act[p]
        words = [int.from_bytes(bytes(row[4 * t:4 * t + 4]), "little") for t in range(4)]
        yield words, stored, sum(w * a for w, a in zip(weight, act))


def test_weight_pairs_and_activation_layout_agree(helpers):
    """Emulates one warp's two k16 MMA steps over a scale block the way the
    GEMM main loop builds them: thread t's weight word t gives its A pairs,
    step s taking pairs 2s (k 2t, 2t+1) and 2s+1 (k 2t+8, 2t+9); the B
    fragments are the activations at act_position. The MMA's dot product
    must equal the plain one over the block."""
    for words, stored, expected in random_blocks(helpers, "position", seed=6):
        mma = 0.0
        for t, word in enumerate(words):
            pairs = [bf16_halves(helpers(f"pair{j}", [word])[0]) for j in range(4)]
            for s in range(2):
                for half in range(2):
                    for lane in range(2):
                        k = 16 * s + 8 * half + 2 * t + lane
                        mma += pairs[2 * s + half][lane] * 2.0 ** 126 * stored[k]
        assert mma == expected


def e4m3_values(word):
    """The four E4M3 bytes of a 32-bit word (byte 0 first), as floats."""
    return torch.tensor(list(word.to_bytes(4, "little")), dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()


def test_e2m1_codes_are_e4m3_values_times_2_pow_minus_6(helpers):
    codes = list(range(16))
    values = reference.e2m1_decode(torch.tensor(codes)).tolist()
    got = [e4m3_values(b)[0] for b in helpers("e4m3", codes)]
    assert got == [v * 2.0 ** -6 for v in values]
    assert math.copysign(1.0, got[8]) == -1.0   # -0 keeps its sign


def test_fp4_words_are_e4m3_even_and_odd_values(helpers):
    words = [0, 0xFFFFFFFF, 0x76543210, 0xFEDCBA98] + random.Random(7).choices(range(1 << 32), k=300)
    for word, even, odd in zip(words, helpers("even", words), helpers("odd", words)):
        codes = [(word >> (4 * i)) & 0xF for i in range(8)]
        values = [v * 2.0 ** -6 for v in reference.e2m1_decode(torch.tensor(codes)).tolist()]
        assert e4m3_values(even) == values[0::2] and e4m3_values(odd) == values[1::2], hex(word)


def test_fp8_weight_bytes_and_activation_layout_agree(helpers):
    """Emulates one warpgroup k32 MMA row over a scale block as the FP8 main
    loop builds it: thread t of a quad gives word t's even values for k
    4t..4t+3 and its odd values for k 16+4t..; the activations sit at
    fp8_act_position. The dot product must equal the plain one."""
    for words, stored, expected in random_blocks(helpers, "fp8position", seed=8):
        mma = 0.0
        for t, word in enumerate(words):
            even, odd = e4m3_values(helpers("even", [word])[0]), e4m3_values(helpers("odd", [word])[0])
            for j in range(4):
                mma += even[j] * 2.0 ** 6 * stored[4 * t + j] + odd[j] * 2.0 ** 6 * stored[16 + 4 * t + j]
        assert mma == expected


def test_per_block_order_pairs_with_the_per_block_weight_conversion(helpers):
    """The token-scaled stage 1's activations are Qa's folded bytes put in
    the per-block order (folded_to_per_block_order) and its weights go
    through fp4_even_to_e4m3 / fp4_odd_to_e4m3: a word's eight values must
    land in the same bytes both ways (here through the code table, the
    folded bytes of shift -6, so that the bytes themselves agree too)."""
    words = [0, 0xFFFFFFFF, 0x76543210, 0xFEDCBA98] + random.Random(10).choices(range(1 << 32), k=300)
    assert helpers("perblockeven", words) == helpers("even", words)
    assert helpers("perblockodd", words) == helpers("odd", words)


def test_e4m3_codes_shifted_are_the_exact_folded_values(helpers):
    """fold_inter_codes_kernel rewrites E4M3 bytes of E2M1 codes (values times
    2^-6, as Qa writes them) as the bytes of the same values times 2^d, for
    every d of the fold's window: through the table from -5 up, byte by
    byte (subnormal results) below. Signs, -0 among them, are kept."""
    rng = random.Random(11)
    words = [0, 0x80808080, 0x1C1C1C1C, 0x9C9C9C9C, 0x1C181410, 0x0C080400]
    words += [int.from_bytes(bytes(rng.choice([0, 0x80]) | rng.randrange(8) << 2 for _ in range(4)), "little")
              for _ in range(300)]
    for d in range(-8, 7):
        got = helpers(f"codesshift{d}", words)
        for word, out in zip(words, got):
            values = [e4m3_values(word)[i] * 2.0 ** (6 + d) for i in range(4)]
            assert e4m3_values(out) == values, (hex(word), d)
            assert [math.copysign(1.0, v) for v in e4m3_values(out)] == \
                   [math.copysign(1.0, v) for v in e4m3_values(word)], (hex(word), d)


def test_scales_above_the_fp8_narrow_limit_are_detected(helpers):
    rng = random.Random(9)
    words = [sum(rng.choice([0, 128, 241, 242, 243, 250, 255]) << (8 * i) for i in range(4)) for _ in range(500)]
    words += [byte << (8 * i) | 0x80 << (8 * ((i + 1) % 4)) for byte in range(256) for i in range(4)]
    expected = [int(any((w >> (8 * i)) & 0xFF > 242 for i in range(4))) for w in words]
    assert helpers("above242", words) == expected


def test_scale_bytes_outside_the_fold_window_are_flagged(helpers):
    # gemm_mainloop's kFolded window test, four bytes at a time: byte i's
    # bit 7 where it lies outside [start, start + 11], as fold_checked tests
    # one byte, for every start whose window does not wrap (the rows whose
    # would are sent to the per-block pass before any test).
    rng = random.Random(10)
    width = (int(re.search(r"kFoldMaxShift = (-?\d+)", solution.KERNEL_SOURCE).group(1))
             - int(re.search(r"kFoldTableMinShift = (-?\d+)", solution.KERNEL_SOURCE).group(1)))
    assert width == 11
    for start in [0, 1, 5, 100, 121, 127, 200, 243, 255 - width]:
        near = [(start + d) % 256 for d in range(-3, width + 4)] + [0, 255]
        words = [sum(rng.choice(near) << (8 * i) for i in range(4)) for _ in range(300)]
        words += [byte << (8 * i) | start << (8 * ((i + 1) % 4)) for byte in range(256) for i in range(4)]
        expected = [sum(0x80 << (8 * i) for i in range(4) if not start <= (w >> (8 * i)) & 0xFF <= start + width)
                    for w in words]
        assert helpers(f"outside{start}", words) == expected, start


def test_qa_exponent_matches_the_reference(helpers):
    amaxes = [0.0, 1e-45, 1e-40, 2.0 ** -126, 1.0, 1.75, 1.7499999, 1.875, 2.0, 3.9, 6.0, 7.5, 8.0, 448.0,
              2.0 ** 100, 3.3e38, float("inf")]
    amaxes += torch.rand(1000, generator=torch.Generator().manual_seed(3)).mul(64).tolist()
    expected = torch.exp2(reference.activation_scale_exponent(torch.tensor(amaxes, dtype=torch.float32)))
    got = torch.tensor(helpers("qa", float_bits(amaxes)), dtype=torch.int64).to(torch.int32).view(torch.float32)
    assert torch.equal(got, expected)

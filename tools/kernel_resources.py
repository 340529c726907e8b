"""What each kernel costs the SM, without a GPU: registers and spills from
`nvcc -Xptxas -v` on solution.py's device code (sm_90a), and each GEMM
config's dynamic shared memory (its pipeline stages, from GemmShape, by a
small host program built from the same source), for issue 4's closing notes
and for reading before a device call.

    python tools/kernel_resources.py

Needs nvcc on PATH (CUDA 12.x or 13.x); takes about half a minute.
"""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import solution  # noqa: E402

ARCH = ["-gencode=arch=compute_90a,code=sm_90a"]

# Stage 1 at the official d_hidden (7168: 224 scale blocks) and stage 2 at
# each official d_expert (256, 512, 2048), one row tile per CTA.
SHARED_MEMORY_DRIVER = r"""
#include <cstdio>
using namespace moe;
template <int NT, int MT, int WT, int SB, int STAGES, bool WG, bool FP8, int MT2>
void show() {
    using S1 = GemmShape<NT, MT, WT, SB, STAGES, WG, FP8>;
    using S2 = GemmShape<NT, MT2, WT, SB, STAGES, WG, FP8>;
    const int stage1 = S1::shared_bytes(224, S1::kTokens * kStage1HStride * (int)sizeof(float), 1, S1::kStages);
    printf("%-34s %8.1f %4d x %5.1f", (std::to_string(NT * 8) + " tokens " + std::to_string(MT * 16) + " rows, "
                                       + (WG ? "wgmma " : "mma.sync ") + (FP8 ? "e4m3" : "bf16")).c_str(),
           stage1 / 1024.0, S1::kStages, S1::kStageBytes / 1024.0);
    for (int k_blocks : {8, 16, 64})
        printf(" %8.1f", S2::shared_bytes(k_blocks, kStage2EpilogueBytes<S2>, 1, kStage2Ring<S2>) / 1024.0);
    // At d_expert 256 over 8 row tiles, where the ring matters: the second kernel for a K of one stage where
    // the config has one.
    printf(" %8.1f", S2::shared_bytes(8, kStage2EpilogueBytes<S2>, 8, S2::kStage2OneStageKernel
                                      ? kStage2Ring<S2, true> : kStage2Ring<S2>) / 1024.0);
    // The folded-rows stage 2 there, where the config has one (its own shape for
    // FOLDED_STAGE2_TWO_TILE_TOKENS).
    using S2F = GemmShape<NT, folded_stage2_mt(NT, MT2), WT, SB, STAGES, WG, FP8>;
    if (FP8 && folded_stage2_tokens(NT * 8))
        printf(" %8.1f", S2F::shared_bytes(8, kStage2EpilogueBytes<S2F>, 8, kStage2Ring<S2F>) / 1024.0);
    else
        printf(" %8s", "-");
    printf("\n");
}
// A wide kernel; each CTA's share of the SM is 227 KB over its CTAs per SM
// (stage 1's kCtasPerSm1, stage 2's kCtasPerSm). Stage 1's folded form
// (8-block stages) holds its token scales too.
template <typename W>
void show_wide(int stage, int ctas_per_sm, int folded_bytes) {
    printf("wide stage %d%s, %d tokens, %d per SM: %.1f KB (%d x %.1f KB stages, %.1f KB epilogue", stage,
           folded_bytes ? " folded" : "", W::kTokens, ctas_per_sm, (W::kSharedBytes + folded_bytes) / 1024.0, W::kRing, W::kStageBytes / 1024.0,
           W::kEpilogueBytes / 1024.0);
    if (folded_bytes) printf(", %.1f KB token scales", folded_bytes / 1024.0);
    printf(")\n");
}
int main() {
    printf("%-34s %8s %12s %8s %8s %8s %8s %8s\n", "config", "stage 1", "(stages KB)", "s2 K256", "s2 K512",
           "s2 K2048", "K256 x8", "folded");
#define MOE_SHOW(NT, MT, WT, SB, STAGES, WG, FP8, MT2) show<NT, MT, WT, SB, STAGES, WG, FP8, MT2>();
    MOE_GEMM_CONFIGS(MOE_SHOW)
    MOE_SHOW_WIDE_KERNELS
}
"""
# Each wide tile width's three kernels (stage 1 in bf16 and folded, stage 2), in WIDE_TILE_TOKENS' order.
SHARED_MEMORY_DRIVER = SHARED_MEMORY_DRIVER.replace("MOE_SHOW_WIDE_KERNELS", "\n    ".join(
    f"show_wide<WideStage1<{n}>>(1, WideStage1<{n}>::kCtasPerSm1, 0);\n"
    f"    show_wide<WideStage1<{n}, true>>(1, WideStage1<{n}>::kCtasPerSm1, WideStage1<{n}, true>::kFoldedExtraBytes);\n"
    f"    show_wide<WideStage2<{n}>>(2, WideStage2<{n}>::kCtasPerSm, 0);" for n in sorted(solution.WIDE_TILE_TOKENS)))


def ptxas_report(folder: str, source_text: str = "") -> tuple:
    """(nvcc's exit status, its output with ptxas's per-kernel report) for
    solution.py's device code (or source_text: the microbenchmarks') compiled
    for sm_90a into folder/kernels.o: the build tests/test_solution.py holds
    to no spills, and registers() prints."""
    source = os.path.join(folder, "kernels.cu")
    with open(source, "w") as f:
        f.write(source_text or solution.KERNEL_SOURCE)
    result = subprocess.run(["nvcc", "-std=c++17", "-O3", *ARCH, "-Xptxas", "-v", "-c", source,
                             "-o", os.path.join(folder, "kernels.o")], capture_output=True, text=True, timeout=600)
    return result.returncode, result.stdout + result.stderr


def sass_functions(folder: str) -> dict:
    """Each kernel's SASS in folder/kernels.o (ptxas_report's), by mangled name (cuobjdump)."""
    sass = subprocess.run(["cuobjdump", "-sass", os.path.join(folder, "kernels.o")], capture_output=True, text=True,
                          check=True).stdout
    return {function.split()[0]: function for function in re.split(r"Function : ", sass)[1:]}


def int_template_kernels(folder: str, kernel: str) -> dict:
    """The SASS of each instantiation kernel<A, B> (two int arguments) in
    folder/kernels.o, by (A, B): the microbenchmarks' kernels."""
    found = {}
    for name, sass in sass_functions(folder).items():
        match = re.search(kernel + r"ILi(\d+)ELi(\d+)E", name)
        if match:
            found[tuple(map(int, match.groups()))] = sass
    return found


def qgmma_shapes(sass: str) -> set:
    """The shapes (as "64x144x32") of the e4m3 warpgroup MMAs a kernel's SASS issues."""
    return set(re.findall(r"QGMMA\.(\d+x\d+x\d+)\.F32\.E4M3\.E4M3", sass))


def ptxas_kernels(report: str) -> list:
    """(mangled name, registers, spill store bytes, spill load bytes) of each
    kernel in ptxas's -v report, in its order."""
    kernels, name, spills = [], None, ("?", "?")
    for line in report.splitlines():
        match = re.search(r"Compiling entry function '(\w+)'", line)
        if match:
            name = match.group(1)
        match = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if match:
            spills = match.groups()
        match = re.search(r"Used (\d+) registers", line)
        if match and name:
            kernels.append((name, int(match.group(1)), *spills))
            name = None
    return kernels


def registers(folder: str) -> int:
    returncode, report = ptxas_report(folder)
    if returncode:
        print(report)
        return 1
    print(f"{'kernel':<56} {'registers':>9} {'spill stores':>12} {'spill loads':>11}")
    for mangled, count, stores, loads in ptxas_kernels(report):
        name = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip()
        name = re.sub(r"\(.*", "", re.sub(r"^void ", "", name)).replace("moe::", "")
        print(f"{name:<56} {count:>9} {stores:>12} {loads:>11}")
    return 0


def shared_memory_table(folder: str) -> str:
    """The table of each GEMM config's dynamic shared memory (KB), built in folder."""
    source = os.path.join(folder, "shared.cu")
    with open(source, "w") as f:
        f.write("#include <string>\n" + solution.KERNEL_SOURCE + SHARED_MEMORY_DRIVER)
    binary = os.path.join(folder, "shared")
    result = subprocess.run(["nvcc", "-std=c++17", "-O1", *ARCH, source, "-o", binary], capture_output=True,
                            text=True)
    if result.returncode:
        raise RuntimeError(result.stdout + result.stderr)
    return subprocess.run([binary], capture_output=True, text=True, check=True).stdout


def main() -> int:
    with tempfile.TemporaryDirectory() as folder:
        if registers(folder):
            return 1
        print("\ndynamic shared memory per CTA, KB (stage 2: one row tile, by d_expert)")
        print(shared_memory_table(folder), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

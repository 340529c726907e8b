"""Which kernels two versions of solution.py compile differently, without a
GPU: each version's device code built for sm_90a (as tools/kernel_resources.py
builds it), then per kernel its SASS instruction count in each, and whether
the two differ only in register names (same opcodes and operands otherwise,
in the same order: a change that cannot move that kernel's time beyond
register-bank effects). Branch targets are compared as labels numbered in
address order, so an instruction added in one place does not make every
later branch differ. Kernels whose SASS is identical are not listed.

    python tools/sass_diff.py A.py B.py [KERNEL_SUBSTRING]

With KERNEL_SUBSTRING, the differing kernels whose mangled name contains it
are printed as a unified diff. Needs nvcc and cuobjdump; about a minute.
"""
import difflib
import importlib.util
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_resources  # noqa: E402

_ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")
_REGISTER = re.compile(r"\bR\d+\b")
# A branch-like instruction's target, a byte address within the function.
_BRANCH = re.compile(r"\b(BRA|BSSY|CALL\.REL(?:\.NOINC)?|JMP|BRX|SSY|PBK|PCNT)\b([^;]*?)\b0x([0-9a-f]+)\b")


def instructions(function_sass: str) -> list:
    """A kernel's SASS instructions (cuobjdump's lines with an address), the
    address and encoding comments removed."""
    return with_branch_labels([_ADDRESS.sub("", line.split(";")[0]).strip() + " ;"
                               for line in function_sass.splitlines() if _ADDRESS.search(line)])


def with_branch_labels(lines: list) -> list:
    """Branch targets written L0, L1, ... in address order, so that an
    instruction added or removed elsewhere leaves every branch line as it
    was (only a new target renumbers the labels after it)."""
    targets = sorted({int(match.group(3), 16) for match in map(_BRANCH.search, lines) if match})
    label = {target: f"L{i}" for i, target in enumerate(targets)}
    return [_BRANCH.sub(lambda m: f"{m.group(1)}{m.group(2)}{label[int(m.group(3), 16)]}", line) for line in lines]


def without_register_names(lines: list) -> list:
    """The instructions with every general register written R and the
    operand-reuse flags dropped: equal for two allocations of one schedule."""
    return [_REGISTER.sub("R", line).replace(".reuse", "") for line in lines]


def kernel_sass(path: str) -> dict:
    """Each kernel's instructions in the version of solution.py at path, by mangled name."""
    spec = importlib.util.spec_from_file_location("sass_diff_version", path)
    version = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(version)
    folder = tempfile.mkdtemp(prefix="sass_diff_")
    status, report = kernel_resources.ptxas_report(folder, version.KERNEL_SOURCE)
    if status != 0:
        raise RuntimeError(f"{path}: nvcc failed\n{report[-3000:]}")
    return {name: instructions(sass) for name, sass in kernel_resources.sass_functions(folder).items()}


def main(argv) -> int:
    if len(argv) not in (2, 3):
        print(__doc__)
        return 2
    first, second = kernel_sass(argv[0]), kernel_sass(argv[1])
    differing = [name for name in sorted(set(first) | set(second)) if first.get(name) != second.get(name)]
    print(f"{len(first)} and {len(second)} kernels; {len(differing)} differ")
    for name in differing:
        a, b = first.get(name, []), second.get(name, [])
        renamed = bool(a) and without_register_names(a) == without_register_names(b)
        print(f"{len(a):6d} {len(b):6d}  {'register names only' if renamed else 'instructions differ':20s} {name}")
        if len(argv) == 3 and argv[2] in name:
            print("\n".join(difflib.unified_diff(a, b, argv[0], argv[1], lineterm="", n=1)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""What the stamped-build tools share (tools/route_phases.py,
tools/cta_timeline.py): a copy of solution.py's kernels with text edits
that must each apply exactly once, a host function that calls moe_forward
with its own parameters, and the build of that copy beside solution.py's
in the kernel cache."""
import hashlib
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import solution  # noqa: E402


def apply_edits(source: str, edits, tool: str) -> str:
    """source with each (old, new) edit; SystemExit if one does not apply exactly once."""
    for old, new in edits:
        if source.count(old) != 1:
            raise SystemExit(f"{tool}: an edit matches {source.count(old)} times, not once:\n{old}")
        source = source.replace(old, new)
    return source


def moe_forward_signature(declaration: str) -> tuple:
    """(parameter list, call arguments) of moe_forward in declaration
    (solution.HOST_DECLARATION), for a wrapper that passes them on."""
    params = re.search(r"moe_forward\((.*?)\);", declaration, re.S).group(1)
    return params, ", ".join(p.split()[-1] for p in params.replace("\n", " ").split(","))


def build(tool: str, kernel_source: str, declaration: str, definition: str, arch: str):
    """The extension of kernel_source, solution.py's host code and the
    wrapper (declaration, definition) moe_forward_stamped, built (or loaded)
    in the kernel cache beside solution.py's."""
    source = kernel_source + solution.HOST_SOURCE + definition
    key = hashlib.sha256("\0".join([source, declaration, arch]).encode()).hexdigest()[:16]
    build_dir = os.path.join(solution._cache_root(), f"{tool}_{key}")
    os.makedirs(build_dir, exist_ok=True)
    return solution._load_extension(f"moe_{tool}_{key}", arch, build_dir, declaration=declaration,
                                    source=source, function="moe_forward_stamped")

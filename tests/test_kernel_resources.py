"""tools/kernel_resources.py: the shared-memory table (needs nvcc, no GPU)."""
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import kernel_resources  # noqa: E402
import solution  # noqa: E402

# Hopper's most dynamic shared memory per CTA.
SM90_MAX_SHARED_KB = 227


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_every_config_has_a_row_and_fits_an_sm90_cta(tmp_path):
    table = kernel_resources.shared_memory_table(str(tmp_path)).splitlines()
    # Stage 1 in bf16 and folded (8-block stages), stage 2.
    wide_kernels = [(tokens, stage) for tokens in sorted(solution.WIDE_TILE_TOKENS) for stage in ("1", "1 folded", "2")]
    rows, wide = table[1:-len(wide_kernels)], table[-len(wide_kernels):]
    for (tokens, stage), line in zip(wide_kernels, wide):
        assert line.startswith(f"wide stage {stage}, {tokens} tokens, "), line
        per_sm = int(line.split(", ")[2].split()[0])
        assert float(line.split(": ")[1].split()[0]) <= SM90_MAX_SHARED_KB / per_sm - 1, line
    kernel_sets = list(dict.fromkeys(config._replace(wide_tile_tokens=0) for config in solution.GEMM_CONFIGS))
    assert len(rows) == len(kernel_sets), rows
    for row, config in zip(rows, kernel_sets):
        assert row.startswith(f"{config.tile_tokens} tokens {config.warp_rows} rows"), (row, config)
        numbers = [float(x) for x in row.split(",")[1].split()[2:] if x not in ("x", "-")]
        stage1, stages, stage_kb, *stage2 = numbers
        assert stages == config.stages and stage1 >= stages * stage_kb, row
        assert max(stage1, *stage2) <= SM90_MAX_SHARED_KB, row

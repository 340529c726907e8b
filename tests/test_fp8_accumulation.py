"""tools/fp8_accumulation.py: the fold it measures is exact inside its window
and reports every block outside it; the tool says why it cannot run without
an sm_89+ GPU."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import fp8_accumulation  # noqa: E402
import reference  # noqa: E402


def test_fold_is_exact_inside_the_window_and_counts_the_rest():
    gen = torch.Generator().manual_seed(7)
    rows, blocks = 6, 40
    codes = torch.randint(0, 16, (rows, blocks * 32), generator=gen)
    values = reference.e2m1_decode(codes)
    # Each row's exponents within the 15-binade window below its largest,
    # except row 5: two blocks 16 and 20 binades below.
    exponents = 3.0 - torch.randint(0, fp8_accumulation.FOLD_WINDOW, (rows, blocks), generator=gen).float()
    exponents[:, 0] = 3.0
    exponents[5, 7], exponents[5, 9] = 3.0 - 16, 3.0 - 20
    values[4, 32 * 3:32 * 4] = 0.0                       # a zero block is never lost, whatever its exponent
    exponents[4, 3] = -127.0
    folded, base, lost = fold = fp8_accumulation.fold(values, exponents)
    assert torch.equal(folded.to(torch.float8_e4m3fn).float(), folded), "a folded value is not E4M3"
    exact = (values.unflatten(-1, (-1, 32)) * torch.exp2(exponents).unsqueeze(-1)).flatten(-2)
    restored = folded * torch.exp2(base).unsqueeze(-1)
    kept = torch.ones_like(exact, dtype=torch.bool)
    kept[5, 32 * 7:32 * 8] = kept[5, 32 * 9:32 * 10] = False
    assert torch.equal(restored[kept], exact[kept])
    assert torch.equal(restored[~kept], torch.zeros_like(restored[~kept]))
    nonzero_lost = int((values[5, 32 * 7:32 * 8] != 0).any()) + int((values[5, 32 * 9:32 * 10] != 0).any())
    assert lost.tolist() == [0, 0, 0, 0, 0, nonzero_lost]
    assert fold[1].tolist() == [3.0 - fp8_accumulation.FOLD_HEADROOM] * rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the tool measures instead")
def test_says_it_needs_a_gpu(capsys):
    fp8_accumulation.main()
    assert "needs an sm_89+ GPU" in capsys.readouterr().out

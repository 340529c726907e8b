"""tools/flush_modes.py: which input tensors its `touch` mode loads from, and which words."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import flush_modes  # noqa: E402


def test_touch_sums_one_word_per_stride_of_each_tensor():
    stride_words = flush_modes.TOUCH_STRIDE_BYTES // 4
    a = torch.arange(3 * stride_words + 5, dtype=torch.int32)
    b = torch.full((2 * stride_words,), 7, dtype=torch.int32).view(torch.uint8).reshape(-1, 8)
    expected = (0 + stride_words + 2 * stride_words + 3 * stride_words) + 7 * 2
    assert int(flush_modes.touch((a, b))) == expected


def test_weight_tensors_are_the_weights_and_their_scales():
    data = tuple(range(12))
    assert flush_modes.weight_tensors(data) == (1, 2, 3, 4)

"""Helpers the test modules share for the 12-tuple of task.input_t."""
import torch


def to_cpu(data):
    """The input tuple with every tensor moved to the CPU."""
    return tuple(x.cpu() if isinstance(x, torch.Tensor) else x for x in data)

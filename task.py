"""Types for the DeepSeek-R1 MXFP4 MoE problem (GPU MODE "moe-mxfp4").

The names and meaning match the official problem definition, so the official
eval.py imports this file unchanged. ../shared/SPEC.md section 1 describes
every element of the input tuple.
"""
from typing import Dict, Tuple, TypeVar

import torch

input_t = TypeVar("input_t", bound=Tuple[
    torch.Tensor,  # hidden_states                  [M, d_hidden]                              bf16
    torch.Tensor,  # gate_up_weight                 [E, 2*d_expert_pad, d_hidden_pad//2]       fp4x2 (raw)
    torch.Tensor,  # down_weight                    [E, d_hidden_pad, d_expert_pad//2]         fp4x2 (raw)
    torch.Tensor,  # gate_up_weight_scale           [E*2*d_expert_pad, d_hidden_pad//32]       e8m0  (raw)
    torch.Tensor,  # down_weight_scale              [E*d_hidden_pad, d_expert_pad//32]         e8m0  (raw)
    torch.Tensor,  # gate_up_weight_shuffled        [E, 2*d_expert_pad, d_hidden_pad//2]       fp4x2 (shuffled)
    torch.Tensor,  # down_weight_shuffled           [E, d_hidden_pad, d_expert_pad//2]         fp4x2 (shuffled)
    torch.Tensor,  # gate_up_weight_scale_shuffled  [pad256(E*2*d_expert_pad), pad8(d_hidden_pad//32)]  e8m0
    torch.Tensor,  # down_weight_scale_shuffled     [pad256(E*d_hidden_pad), pad8(d_expert_pad//32)]    e8m0
    torch.Tensor,  # topk_weights                   [M, total_top_k]                           fp32
    torch.Tensor,  # topk_ids                       [M, total_top_k]                           int32
    Dict,          # config
])
output_t = TypeVar("output_t", bound=torch.Tensor)


class TestSpec:
    dhidden: int           # hidden dimension (7168 for DeepSeek-R1)
    dexpert: int           # intermediate dimension per expert (per partition)
    nroutedexperts: int    # routed experts on this GPU
    nexpertspertoken: int  # routed top-k per token (8 for DeepSeek-R1)
    nsharedexperts: int    # shared experts, always selected with weight 1.0
    bs: int                # tokens in the batch
    seed: int

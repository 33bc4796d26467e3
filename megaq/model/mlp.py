"""Feed-forward block: fc1 (column-parallel) -> GELU or SwiGLU -> fc2 (row-parallel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megaq.kernels.fused_swiglu import swiglu
from megaq.model.config import GPTConfig
from megaq.model.init import ParamInit
from megaq.parallel.comm import Group
from megaq.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    """With SwiGLU, linear_fc1's full weight is [gate; up] (2 x ffn rows) and is split
    with stride 2, so each rank holds matching gate and up rows at every TP size."""

    def __init__(self, config: GPTConfig, tp_group: Group, init: ParamInit):
        super().__init__()
        self.swiglu = config.swiglu
        ffn = config.ffn_hidden_size
        common = dict(bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel,
                      params_dtype=config.params_dtype)
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, 2 * ffn if self.swiglu else ffn, tp_group,
            init_weight=init.normal("mlp.linear_fc1.weight"), stride=2 if self.swiglu else 1, **common)
        self.linear_fc2 = RowParallelLinear(
            ffn, config.hidden_size, tp_group,
            init_weight=init.normal("mlp.linear_fc2.weight", scaled=True), **common)
        # [gate | up] -> silu(gate) * up (a fused Triton kernel on CUDA), or GELU. None:
        # fc1's FP8 GEMM applies SwiGLU itself (megaq.parallelize.apply_fp8), so that its
        # backward hands fc1 the FP8 dY in one pass
        self.activation = swiglu if self.swiglu else F.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fc1(x)
        if self.activation is not None:
            y = self.activation(y)
        return self.linear_fc2(y)

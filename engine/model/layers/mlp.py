"""The SwiGLU MLP, tensor-parallel: Qwen's MLP and DeepSeek's dense and shared-expert MLPs."""
from __future__ import annotations

import torch
from torch import nn

from engine.distributed import TPGroup
from engine.model import kernels
from engine.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``[..., 2I] -> [..., I]`` (new tensor): ``silu(gate) * up`` of the gate | up halves, one kernel."""
    act = gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    kernels.silu_and_mul(act, gate_up)
    return act


class SwiGLUMLP(nn.Module):
    """``[T, H] -> [T, H]`` (new tensor): one gate-up GEMM (column-parallel, gate | up),
    ``silu(gate) * up`` in one kernel, down_proj (row-parallel, one all-reduce under TP). With
    the decode GEMV on (``kernels.decode_gemv_rows``, one rank), a decode step's down_proj
    reads gate | up and applies ``silu(gate) * up`` in its prologue: no activation kernel."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        rows = self.down_proj.decode_gemv_rows
        if rows and self.down_proj.tp.size == 1 and gate_up.dim() == 2 and gate_up.shape[0] <= rows:
            return kernels.decode_gemv(gate_up, self.down_proj.weight, activation="silu_mul")
        return self.down_proj(swiglu(gate_up))

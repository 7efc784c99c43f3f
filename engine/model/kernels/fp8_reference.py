"""Torch reference of the FP8 ops (``engine.model.kernels.fp8``): the CPU path and the readable
definition. Activations are quantized per token group, both operands dequantized, and the
product taken in float32."""
from __future__ import annotations

import torch

from engine.model.kernels.fp8 import FP8_DTYPE, FP8_MAX, GROUP, SCALE_FLOOR, dequantize_weight


def quantize_per_token_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    groups = -(-k // GROUP)
    padded = x.new_zeros(m, groups * GROUP, dtype=torch.float32)
    padded[:, :k] = x
    padded = padded.view(m, groups, GROUP)
    scales = padded.abs().amax(dim=-1).clamp(min=SCALE_FLOOR) / FP8_MAX
    q = (padded / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * GROUP)[:, :k].contiguous(), scales


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the FP8 GEMM sees it: quantized per token group and dequantized, float32."""
    q, scales = quantize_per_token_group(x)
    return (q.float().view(x.shape[0], -1) * scales.repeat_interleave(GROUP, dim=1)[:, :x.shape[1]])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = _quantized_activations(rows) @ dequantize_weight(weight, weight_scale).T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def fp8_expert_linear(x: torch.Tensor, weights: torch.Tensor, weight_scales: torch.Tensor,
                      expert_ids: torch.Tensor) -> torch.Tensor:
    dequantized = dequantize_weight(weights, weight_scales)                      # [E, N, K]
    per_assignment = dequantized[expert_ids.clamp(min=0)]                         # [T, J, N, K]
    out = torch.einsum("tjnk,tk->tjn", per_assignment, _quantized_activations(x))
    return out.masked_fill_((expert_ids < 0)[..., None], 0.0).to(x.dtype)

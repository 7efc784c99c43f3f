"""FP8 (e4m3) W8A8 ops behind the kernel interface (blueprint/contracts.md, phase 12).

Weights are ``float8_e4m3fn`` with float32 scales that multiply a stored block back
(``w ≈ q * scale``): one scale per 128 x 128 block (``[ceil(N / 128), ceil(K / 128)]``, the
"weight_scale_inv" of Qwen3-*-FP8 and DeepSeek-V3), or one per output row and 128 columns
(``[N, ceil(K / 128)]``, per-channel checkpoints). Activations are quantized at run time per
token and group of 128 channels (``quantize_per_token_group``): ``scale = max(|x|) / 448``
over the group (never below ``SCALE_FLOOR / 448``), ``q = clamp(x / scale, -448, 448)`` rounded
to e4m3. A group never crosses a multiple of 128 (the last one may be shorter), so each
K-block of the weight meets activation scales of exactly one group.

The backend is chosen from the input's device like every kernel op: CPU tensors use the
torch reference (``fp8_reference.py``: quantize the activations, dequantize both operands,
matmul in float32), CUDA tensors the Triton kernels (``triton/fp8.py``; the vllm backend
uses them too). Shape checks only, no host sync.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from engine.model import kernels
from engine.model.kernels import FP8_DTYPE, FP8_MAX

__all__ = ["quantize_per_token_group", "fp8_linear", "fp8_expert_linear", "weight_block_rows", "dequantize_weight",
           "quantize_weight"]

GROUP = 128          # activation group and weight block along K; weight block along N (block-wise scales)
SCALE_FLOOR = 1e-10  # an all-zero group gets scale SCALE_FLOOR / 448, never 0

_BACKENDS = {"torch": "engine.model.kernels.fp8_reference", "triton": "engine.model.kernels.triton.fp8",
             "vllm": "engine.model.kernels.triton.fp8"}


def _ops(x: torch.Tensor) -> ModuleType:
    return importlib.import_module(_BACKENDS[kernels.backend(x.device)])


def weight_block_rows(weight: torch.Tensor, scale: torch.Tensor) -> int:
    """Rows of ``weight [..., N, K]`` one scale row covers: 128 (block-wise) or 1 (per channel);
    any other scale shape is a ValueError naming both shapes."""
    n, k = weight.shape[-2:]
    cols = -(-k // GROUP)
    if scale.shape[:-2] == weight.shape[:-2] and scale.shape[-1] == cols:
        if scale.shape[-2] == -(-n // GROUP):
            return GROUP
        if scale.shape[-2] == n:
            return 1
    raise ValueError(f"FP8 weight {tuple(weight.shape)} needs scales [..., ceil(N/128) or N, ceil(K/128)] = "
                     f"[..., {-(-n // GROUP)} or {n}, {cols}], got {tuple(scale.shape)}")


def quantize_per_token_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (any float dtype, unit last stride) -> (``q [M, K]`` e4m3, ``scales [M,
    ceil(K / 128)]`` float32), new tensors: group g of row m is columns ``[128 g, 128 g + 128)``,
    ``q = clamp(x / scales[m, g], -448, 448)`` rounded to nearest e4m3 (saturated, never NaN)."""
    kernels._require(x.dim() == 2 and x.stride(-1) == 1,
                     lambda: f"quantize_per_token_group: x must be [M, K] with a unit last stride, got "
                     f"{tuple(x.shape)} strides {x.stride()}")
    return _ops(x).quantize_per_token_group(x)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + bias`` with W the FP8 ``weight [N, K]`` times ``weight_scale`` (per 128 x 128
    block or per row and 128 columns, see ``weight_block_rows``) and x quantized per token
    group: a new ``[..., N]`` tensor in x's dtype, float32 accumulation. ``x [..., K]``
    (unit last stride), ``bias [N]`` or None."""
    weight_block_rows(weight, weight_scale)
    kernels._require(weight.dim() == 2 and weight.dtype == FP8_DTYPE and x.shape[-1] == weight.shape[1]
                     and x.stride(-1) == 1 and (bias is None or bias.shape == weight.shape[:1]),
                     lambda: f"fp8_linear: bad inputs x {tuple(x.shape)}, weight {tuple(weight.shape)} "
                     f"{weight.dtype}, bias {None if bias is None else tuple(bias.shape)}")
    return _ops(x).fp8_linear(x, weight, weight_scale, bias)


def fp8_expert_linear(x: torch.Tensor, weights: torch.Tensor, weight_scales: torch.Tensor,
                      expert_ids: torch.Tensor) -> torch.Tensor:
    """``out[t, j] = W[expert_ids[t, j]] @ x[t]`` for FP8 expert matrices ``weights [E, N, K]``
    with ``weight_scales [E, ceil(N/128) or N, ceil(K/128)]``, x quantized per token group: a
    new ``[T, J, N]`` tensor in x's dtype (float32 accumulation). ``x [T, K]`` (unit last
    stride), ``expert_ids [T, J]`` int64 in ``[0, E)``, or -1 for a zero row (another rank's
    expert). Any number of tokens: assignments are grouped by expert on the device (no host
    sync, CUDA-graph safe), each expert's weights read once per group of rows."""
    weight_block_rows(weights, weight_scales)
    kernels._require(x.dim() == 2 and weights.dim() == 3 and weights.dtype == FP8_DTYPE
                     and weights.shape[2] == x.shape[1] and x.stride(-1) == 1
                     and expert_ids.dim() == 2 and expert_ids.shape[0] == x.shape[0],
                     lambda: f"fp8_expert_linear: bad inputs x {tuple(x.shape)}, weights {tuple(weights.shape)} "
                     f"{weights.dtype}, expert_ids {tuple(expert_ids.shape)}")
    return _ops(x).fp8_expert_linear(x, weights, weight_scales, expert_ids)


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight [..., N, K]`` e4m3 times its ``scale`` (see ``weight_block_rows``), a new tensor
    in ``dtype`` (torch ops: any device; for loading and for the reference, not a step)."""
    rows = weight_block_rows(weight, scale)
    n, k = weight.shape[-2:]
    full = scale.repeat_interleave(rows, dim=-2)[..., :n, :].repeat_interleave(GROUP, dim=-1)[..., :k]
    return (weight.float() * full).to(dtype)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (e4m3 ``[N, K]``, float32 scales ``[ceil(N/128), ceil(K/128)]``), new
    tensors on weight's device: each 128 x 128 block (the last ones may be smaller) divided by
    ``max(|block|) / 448`` (an all-zero block by ``SCALE_FLOOR / 448``), saturated, rounded.
    Online quantization of a checkpoint's bf16 weights."""
    n, k = weight.shape
    rows, cols = -(-n // GROUP), -(-k // GROUP)
    padded = weight.new_zeros(rows * GROUP, cols * GROUP, dtype=torch.float32)
    padded[:n, :k] = weight
    blocks = padded.view(rows, GROUP, cols, GROUP)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=SCALE_FLOOR) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows * GROUP, cols * GROUP)[:n, :k].contiguous(), scale

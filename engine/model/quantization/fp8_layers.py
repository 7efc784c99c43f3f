"""FP8 weights for the linear layers and routed experts: the parameters they hold, how the
checkpoint fills them, and the ``quant_method`` that computes with them.

A quantized layer holds ``weight`` (e4m3, this rank's shard) and ``weight_scale_inv`` (float32,
the scales of this rank's blocks: ``[ceil(N/128), ceil(K/128)]`` block-wise, ``[N, ceil(K/128)]``
per channel); experts hold ``gate_up_proj`` / ``down_proj`` and ``*_scale_inv`` stacked over
their experts. The scales load through the layer's own weight loader, which narrows them in
whole blocks (``block_rows``), so a shard's scales are always its own blocks. Checkpoint scales
of one per channel (``[N, 1]``) are repeated over the 128-column blocks as they load. Online,
each checkpoint tensor is quantized whole on the device and then sharded like an FP8 one.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.model.kernels import fp8
from engine.model.layers.linear import UNQUANTIZED, RowParallelLinear
from engine.model.layers.mlp import swiglu
from engine.model.layers.moe import RoutedExperts
from engine.model.loader import LazyTensor
from engine.model.quantization.scheme import Fp8Scheme


class Fp8Linear:
    """``quant_method`` of an FP8 linear layer: ``kernels.fp8.fp8_linear`` on its weight and scales."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8.fp8_linear(x, layer.weight, layer.weight_scale_inv, bias)

    def after_loading(self, layer: nn.Module) -> None:
        """The weights stay as loaded."""


class DequantizedAfterLoading(Fp8Linear):
    """For a layer whose weight its module reads as a plain matrix (MLA's ``kv_b_proj``, absorbed
    into the decode query and output): loaded as FP8, then dequantized to the model dtype, and
    computed unquantized from then on."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def after_loading(self, layer: nn.Module) -> None:
        weight = fp8.dequantize_weight(layer.weight, layer.weight_scale_inv, self.dtype)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        del layer.weight_scale_inv
        layer.quant_method = UNQUANTIZED


class Fp8Experts:
    """``quant_method`` of FP8 routed experts: ``(x [T, H], weights [T, k], local ids [T, k]; -1:
    another rank's expert) -> [T, H]``, the gate-up and down projections through
    ``kernels.fp8.fp8_expert_linear`` (one path at every step size), combined by the weights."""

    def apply(self, layer: RoutedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        tokens, per_token = ids.shape
        act = swiglu(fp8.fp8_expert_linear(x, layer.gate_up_proj, layer.gate_up_proj_scale_inv, ids))  # [T, k, I]
        y = fp8.fp8_expert_linear(act.view(tokens * per_token, -1), layer.down_proj, layer.down_proj_scale_inv,
                                  ids.view(-1, 1))                                                   # [T*k, 1, H]
        return torch.bmm(weights.unsqueeze(1), y.view(tokens, per_token, -1)).squeeze(1)

    def after_loading(self, layer: RoutedExperts) -> None:
        """The weights stay as loaded."""


def _new(like: nn.Parameter, shape, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised frozen parameter carrying ``like``'s attributes (loader, expected shards)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.__dict__.update(like.__dict__)
    return param


def _read(loaded: torch.Tensor | LazyTensor) -> torch.Tensor:
    return loaded.materialize() if isinstance(loaded, LazyTensor) else loaded


def _online_loader(load, scale: nn.Parameter):
    """A weight loader that quantizes a whole checkpoint tensor (128 x 128 blocks, on the weight's
    device) and hands the e4m3 tensor and its scales to the layer's loader ``load``."""
    def quantize_and_load(param, loaded, shard_id=None, presliced=False):
        q, scales = fp8.quantize_weight(_read(loaded).to(param.device))
        load(param, q, shard_id, presliced)
        load(scale, scales, shard_id, presliced)
    return quantize_and_load


def _per_channel_loader(load, k_blocks: int):
    """A scale loader that repeats a checkpoint's per-channel scales ``[N, 1]`` over the weight's
    ``k_blocks`` blocks of 128 columns before the layer's loader ``load`` shards them."""
    def repeat_and_load(param, loaded, shard_id=None, presliced=False):
        load(param, _read(loaded).expand(*loaded.shape[:-1], k_blocks), shard_id, presliced)
    return repeat_and_load


def quantize_weight_param(module: nn.Module, name: str, scheme: Fp8Scheme, device: torch.device,
                          full_k: int) -> None:
    """Replace ``module.<name>`` (``[..., N, K]``, not yet allocated) by an e4m3 parameter and add
    ``module.<name>_scale_inv`` (``weight`` -> ``weight_scale_inv``), both on ``device``, with the
    loaders the scheme needs; ``full_k`` is K before tensor-parallel splitting (per-channel scales
    repeat over its blocks)."""
    weight = getattr(module, name)
    *lead, n, k = weight.shape
    rows = -(-n // scheme.block_rows) if scheme.block_rows > 1 else n
    q = _new(weight, weight.shape, fp8.FP8_DTYPE, device)
    scale = _new(weight, (*lead, rows, -(-k // fp8.GROUP)), torch.float32, device)
    scale.block_rows, scale.scale_of = scheme.block_rows, q
    if scheme.online:
        q.weight_loader = _online_loader(weight.weight_loader, scale)
        scale.expected_shards = set()  # filled with the weight, never read from the checkpoint
    elif scheme.block_rows == 1:
        scale.weight_loader = _per_channel_loader(weight.weight_loader, -(-full_k // fp8.GROUP))
    setattr(module, name, q)
    module.register_parameter(f"{name}_scale_inv", scale)


def quantize_linear(layer: nn.Module, scheme: Fp8Scheme, device: torch.device, dequantize_to=None) -> None:
    """Make ``layer`` (a linear layer of ``engine.model.layers.linear``) FP8; ``dequantize_to`` (a dtype):
    dequantize once loaded (``DequantizedAfterLoading``)."""
    k = layer.weight.shape[1] * (layer.tp.size if isinstance(layer, RowParallelLinear) else 1)
    quantize_weight_param(layer, "weight", scheme, device, k)
    layer.quant_method = Fp8Linear() if dequantize_to is None else DequantizedAfterLoading(dequantize_to)


def quantize_experts(experts: RoutedExperts, scheme: Fp8Scheme, device: torch.device) -> None:
    """Make ``experts``' stacked gate-up and down weights FP8."""
    for name in ("gate_up_proj", "down_proj"):
        quantize_weight_param(experts, name, scheme, device, getattr(experts, name).shape[-1])
    experts.quant_method = Fp8Experts()

"""Tensor-parallel linear layers and their weight loaders.

Column layers split the output dim across ranks, row layers the input dim (and
sum the partial products with one all-reduce). Parameters are created with the
current default dtype and device. Every parameter carries
``param.weight_loader(param, loaded, shard_id=None, presliced=False)``: a full
(checkpoint) tensor is sliced for this rank; with ``presliced=True`` the caller
says it already holds this rank's shard, which is copied as is. A tensor of any
other shape is a ValueError naming both shapes, so a shard-shaped tensor is never
mistaken for a full one (a [4, 4] tensor never loads into a tp=2 row layer with in=8).

A layer computes through its ``quant_method`` (``UnquantizedLinear``: ``F.linear`` on the
weight; a quantization scheme swaps in its own, e.g. FP8 weights with block scales). A
parameter that holds one entry per ``block_rows`` weight rows (a block-scale grid) is
narrowed in whole blocks by the packed layers' loaders (``narrow_rows``).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TPGroup, all_gather_last_dim, all_reduce_sum, get_tp_group
from engine.model import kernels

WeightLoader = Callable[..., None]  # (param, loaded, shard_id=None, presliced=False) -> None


_deferred = False


@contextmanager
def deferred_parameters():
    """Inside, ``new_parameter`` makes parameters on the meta device (no memory): a builder that
    gives some of them another form (quantized weights) makes the real ones after construction."""
    global _deferred
    previous, _deferred = _deferred, True
    try:
        yield
    finally:
        _deferred = previous


def new_parameter(*shape: int, weight_loader: WeightLoader) -> nn.Parameter:
    """An uninitialised, frozen parameter of the default dtype/device (meta inside
    ``deferred_parameters``) with its loader attached."""
    param = nn.Parameter(torch.empty(*shape, device="meta" if _deferred else None), requires_grad=False)
    param.weight_loader = weight_loader
    return param


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
          decode_gemv_rows: int = 0) -> torch.Tensor:
    """``x @ weight.T + bias`` (a new tensor): up to ``decode_gemv_rows`` rows (a decode step's;
    0: never, ``kernels.decode_gemv_rows``) through ``kernels.decode_gemv``, else cuBLAS."""
    if decode_gemv_rows and x.dim() == 2 and x.shape[0] <= decode_gemv_rows:
        return kernels.decode_gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def narrow_rows(param: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """``param.data`` rows for weight rows ``[start, start + length)``: the same rows, or the blocks
    covering them when ``param.block_rows`` weight rows share one entry (start on a block edge)."""
    rows = getattr(param, "block_rows", 1)
    return param.data.narrow(0, start // rows, -(-length // rows))


class UnquantizedLinear:
    """The default ``quant_method`` of the linear layers: ``y = x W^T + b`` on the layer's weight
    (a decode step's rows through the decode GEMV when the layer was built with it on)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense(x, layer.weight, bias, layer.decode_gemv_rows)

    def after_loading(self, layer: nn.Module) -> None:
        """Nothing to do once the checkpoint is loaded."""


UNQUANTIZED = UnquantizedLinear()


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, or a ValueError saying ``what`` does not split evenly."""
    if numerator % denominator:
        raise ValueError(f"{what} = {numerator} is not divisible by {denominator}")
    return numerator // denominator


def load_shard(dst: torch.Tensor, loaded: torch.Tensor, dim: int, index: int, count: int,
               presliced: bool = False) -> None:
    """Copy into ``dst`` (in place) chunk ``index`` of ``count`` equal chunks of the full tensor
    ``loaded`` along ``dim``, or, when ``presliced``, ``loaded`` itself (it must have ``dst``'s
    shape). Any other shape is a ValueError naming both shapes."""
    full_shape = list(dst.shape)
    full_shape[dim] *= count
    expected = list(dst.shape) if presliced else full_shape
    if list(loaded.shape) != expected:
        kind = "this rank's pre-sliced shard" if presliced else "the full tensor"
        raise ValueError(
            f"cannot load a tensor of shape {tuple(loaded.shape)} into a shard of shape "
            f"{tuple(dst.shape)} (expected {kind}, shape {tuple(expected)})")
    dst.copy_(loaded if presliced else loaded.narrow(dim, index * dst.shape[dim], dst.shape[dim]))


class ReplicatedLinear(nn.Module):
    """``y = x W^T + b`` with the whole W on every rank (small projections every rank needs
    in full, e.g. MLA's ``q_a_proj`` and ``kv_a_proj_with_mqa``): ``[..., in] -> [..., out]``."""

    quant_method = UNQUANTIZED

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.decode_gemv_rows = kernels.decode_gemv_rows(torch.get_default_device())
        self.weight = new_parameter(out_features, in_features, weight_loader=self.weight_loader)
        self.bias = new_parameter(out_features, weight_loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None,
                      presliced: bool = False) -> None:
        load_shard(param.data, loaded, 0, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W split by output rows: ``[..., in] -> [..., out / tp]``,
    or ``[..., out]`` when ``gather_output`` (rank order)."""

    quant_method = UNQUANTIZED

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 gather_output: bool = False, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or get_tp_group()
        self.gather_output = gather_output
        self.decode_gemv_rows = kernels.decode_gemv_rows(torch.get_default_device())
        out_local = divide(out_features, self.tp.size, "out_features")
        self.weight = new_parameter(out_local, in_features, weight_loader=self.weight_loader)
        self.bias = new_parameter(out_local, weight_loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None,
                      presliced: bool = False) -> None:
        load_shard(param.data, loaded, 0, self.tp.rank, self.tp.size, presliced)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
        return all_gather_last_dim(y, self.tp.name) if self.gather_output and self.tp.size > 1 else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one GEMM (e.g. gate and up):
    ``[..., in] -> [..., sum(out_sizes) / tp]``, laid out shard 0 | shard 1 | ... per rank.
    Loaded per shard: ``weight_loader(param, loaded, shard_id=i)``."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, tp: TPGroup | None = None):
        tp = tp or get_tp_group()
        self.local_sizes = [divide(n, tp.size, f"out_sizes[{i}]") for i, n in enumerate(out_sizes)]
        super().__init__(in_features, sum(out_sizes), bias=bias, tp=tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None,
                      presliced: bool = False) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.local_sizes):
            raise ValueError(f"shard_id must be one of 0..{len(self.local_sizes) - 1}, got {shard_id!r}")
        dst = narrow_rows(param, sum(self.local_sizes[:shard_id]), self.local_sizes[shard_id])
        load_shard(dst, loaded, 0, self.tp.rank, self.tp.size, presliced)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one GEMM: ``[..., hidden] -> [..., q_size + 2 * kv_size]``
    laid out Q | K | V; split the output with ``q_size`` / ``kv_size``.

    Each rank holds ``num_heads = total_num_heads / tp`` query heads and
    ``num_kv_heads = max(1, total_num_kv_heads / tp)`` KV heads; when tp exceeds the
    KV heads, rank r holds (a replica of) KV head ``r * total_num_kv_heads // tp``.
    Loaded per shard: ``weight_loader(param, loaded, shard_id="q" | "k" | "v")``.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, tp: TPGroup | None = None):
        tp = tp or get_tp_group()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp.size, "total_num_heads")
        if tp.size >= total_num_kv_heads:
            divide(tp.size, total_num_kv_heads, "tp size (more ranks than KV heads)")
            self.num_kv_heads = 1
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp.size, "total_num_kv_heads")
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.kv_head_start = tp.rank * total_num_kv_heads // tp.size
        self.kv_shard_count = total_num_kv_heads // self.num_kv_heads
        local_out = self.q_size + 2 * self.kv_size
        super().__init__(hidden_size, local_out * tp.size, bias=bias, tp=tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None,
                      presliced: bool = False) -> None:
        if shard_id == "q":
            dst = narrow_rows(param, 0, self.q_size)
            load_shard(dst, loaded, 0, self.tp.rank, self.tp.size, presliced)
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            dst = narrow_rows(param, offset, self.kv_size)
            load_shard(dst, loaded, 0, self.kv_head_start // self.num_kv_heads, self.kv_shard_count, presliced)
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W split by input columns: ``[..., in / tp] -> [..., out]``.

    For tp > 1 the partial products are summed by one ``all_reduce_sum`` and the
    (replicated) bias is added once, after it.
    """

    quant_method = UNQUANTIZED

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or get_tp_group()
        self.decode_gemv_rows = kernels.decode_gemv_rows(torch.get_default_device())
        in_local = divide(in_features, self.tp.size, "in_features")
        self.weight = new_parameter(out_features, in_local, weight_loader=self.weight_loader)
        self.bias = new_parameter(out_features, weight_loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None,
                      presliced: bool = False) -> None:
        if param is self.bias:
            load_shard(param.data, loaded, 0, 0, 1)
        else:
            load_shard(param.data, loaded, 1, self.tp.rank, self.tp.size, presliced)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.quant_method.apply(self, x, self.bias)
        y = all_reduce_sum(self.quant_method.apply(self, x, None), self.tp.name)
        return y if self.bias is None else y + self.bias

"""Building a model whose linear weights are FP8: ``engine.model.models.registry.build_model`` hands a
config with ``quantization`` set to ``build_quantized_model``.

The model is constructed with its ``new_parameter`` tensors deferred (meta, no memory), so an
FP8 model never holds its weights in bf16 first. Then, by module name: every linear layer and
routed-experts module gets FP8 weights and scales on the device, except

- the layers the checkpoint's ignore list names (``Fp8Scheme.ignores``; a merged layer — QKV,
  gate-up, stacked experts — follows its checkpoint parts, which must agree), and
- online: Qwen2-MoE's ``shared_expert_gate`` (a 1-row projection) and MLA's ``kv_b_proj``
  (read as a plain matrix), which stay in the model dtype as FP8 checkpoints keep them.

A quantized layer's shard and merge boundaries must fall on 128-row blocks (the last block
may be partial); an FP8 checkpoint that would need a block cut is refused, naming the layer,
the size and the TP degree; online, such a layer stays unquantized (one log line). MLA's
``kv_b_proj`` of an FP8 checkpoint loads as FP8 and is dequantized once loaded. Everything
else (embeddings, LM head, biases) is then allocated in the model dtype.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from engine.distributed import TPGroup
from engine.model.config import ModelConfig
from engine.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    deferred_parameters,
)
from engine.model.layers.mla import MultiHeadLatentAttention
from engine.model.layers.moe import RoutedExperts
from engine.model.models.registry import creating_in
from engine.model.quantization.fp8_layers import quantize_experts, quantize_linear
from engine.model.quantization.scheme import BLOCK, Fp8Scheme

log = logging.getLogger(__name__)

LINEAR_LAYERS = (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear)
KEPT_ONLINE = ("shared_expert_gate",)


def build_quantized_model(cls: type[nn.Module], config: ModelConfig, device: torch.device, dtype: torch.dtype,
                          tp: TPGroup | None) -> nn.Module:
    """``cls(config, tp)`` on ``device``, its linear weights in the FP8 format of
    ``config.quantization`` (everything else in ``dtype``), not yet loaded."""
    scheme = Fp8Scheme.from_config(config.quantization)
    with creating_in(dtype, device), deferred_parameters():
        model = cls(config, tp)
    modules = dict(model.named_modules())
    kept = []
    for name, module in modules.items():
        if not isinstance(module, (*LINEAR_LAYERS, RoutedExperts)):
            continue
        parent, _, attr = name.rpartition(".")
        read_directly = isinstance(modules.get(parent), MultiHeadLatentAttention) and attr == "kv_b_proj"
        cut = _block_cut(name, module, scheme)
        if scheme.online and (attr in KEPT_ONLINE or read_directly or cut):
            kept.append(name)
        elif not scheme.online and _ignored(model, name, module, scheme):
            continue
        elif cut:
            raise ValueError(cut)
        elif isinstance(module, RoutedExperts):
            quantize_experts(module, scheme, device)
        else:
            quantize_linear(module, scheme, device, dequantize_to=dtype if read_directly else None)
    _allocate_deferred(model, device)
    if scheme.scale_name != "weight_scale_inv":
        model.checkpoint_suffixes = {f".{scheme.scale_name}": ".weight_scale_inv"}
    if kept:
        log.info("online FP8: %d linear modules stay in %s: %s", len(kept), dtype, ", ".join(kept))
    return model


def _row_parts(module: nn.Module) -> list[int]:
    """Output rows of each part of a (merged) layer on this rank."""
    if isinstance(module, RoutedExperts):
        return [module.intermediate_size] * 2
    if isinstance(module, QKVParallelLinear):
        return [module.q_size, module.kv_size, module.kv_size]
    if isinstance(module, MergedColumnParallelLinear):
        return module.local_sizes
    return [module.weight.shape[0]]


def _block_cut(name: str, module: nn.Module, scheme: Fp8Scheme) -> str | None:
    """Why ``module``'s FP8 blocks cannot be laid out on this rank (a shard or merge boundary
    inside a 128-block), or None."""
    tp = module.tp.size if hasattr(module, "tp") else 1
    if isinstance(module, RowParallelLinear) and tp > 1 and module.weight.shape[1] % BLOCK:
        return (f"{name}: in_features per rank = {module.weight.shape[1]} at tensor parallel {tp} is not a "
                f"multiple of the FP8 block ({BLOCK}): a shard boundary would cut a block")
    if scheme.block_rows == 1 or isinstance(module, RowParallelLinear):
        return None
    parts = _row_parts(module)
    cut = [n for i, n in enumerate(parts) if n % BLOCK and (tp > 1 or i < len(parts) - 1)]
    if cut:
        return (f"{name}: out_features per rank = {parts} at tensor parallel {tp}: {cut[0]} is not a multiple of "
                f"the FP8 block ({BLOCK}): a shard or merge boundary would cut a block")
    return None


def _ignored(model: nn.Module, name: str, module: nn.Module, scheme: Fp8Scheme) -> bool:
    """Whether the checkpoint stores ``module`` unquantized: every checkpoint layer it is made of
    (q/k/v_proj of a QKV layer; for experts, the first and last expert's projections) ignored;
    some but not all is an error."""
    parent, _, attr = name.rpartition(".")
    if isinstance(module, RoutedExperts):
        names = [f"{name}.{e}.{proj}" for e in sorted({0, module.num_experts - 1}) for proj in model.expert_params]
    else:
        parts = [p for p, (packed, _) in getattr(model, "packed_modules", {}).items() if packed == attr]
        names = [f"{parent}.{p}" for p in parts] or [name]
    flags = {scheme.ignores(n) for n in names}
    if len(flags) > 1:
        raise ValueError(f"{name}: the checkpoint's ignore list names some of {names} but not all; they share "
                         "one quantized weight")
    return flags.pop()


def _allocate_deferred(model: nn.Module, device: torch.device) -> None:
    """Give every parameter still on the meta device real (uninitialised) memory on ``device``,
    keeping its dtype, attributes and sharing (a tied LM head stays its embedding's)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None and param.is_meta:
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                                   requires_grad=False)
                    made[id(param)].__dict__.update(param.__dict__)
                module._parameters[key] = made[id(param)]

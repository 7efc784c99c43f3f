"""Shared by the phase-03 tests: seeded full weights, the shard each rank must
hold (sliced here, independently of the layers), and op counts from the profiler."""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from engine.distributed import TPGroup
from engine.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

IN, OUT = 16, 24             # Column / Row sizes (OUT divides by 1, 2, 3, 4)
GATE_UP = [24, 24]           # Merged sizes
HEAD_DIM = 4
KINDS = ["column", "merged", "qkv", "qkv_replicated_kv", "row"]
GEMMS = ("aten::mm", "aten::addmm", "aten::bmm")
ALL_REDUCE = "agent_infer::all_reduce_sum"


def rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def heads(kind: str) -> tuple[int, int]:
    """(query heads, KV heads): 8/4, or 8/2 so that tp 4 replicates each KV head on 2 ranks."""
    return (8, 2) if kind == "qkv_replicated_kv" else (8, 4)


def kv_heads_of_rank(rank: int, tp: int, total_kv: int) -> list[int]:
    """The KV heads a rank holds: an equal contiguous block, or one head shared by tp / total_kv ranks."""
    if tp > total_kv:
        return [rank // (tp // total_kv)]
    per_rank = total_kv // tp
    return list(range(rank * per_rank, (rank + 1) * per_rank))


def full_shards(kind: str, bias: bool, seed: int = 0) -> dict:
    """``{shard_id: (full weight, full bias or None)}`` for a layer of ``kind``."""
    if kind == "column":
        sizes = {None: OUT}
    elif kind == "row":
        return {None: (rand(seed, OUT, IN), rand(seed + 1, OUT) if bias else None)}
    elif kind == "merged":
        sizes = dict(enumerate(GATE_UP))
    else:
        num_heads, num_kv = heads(kind)
        sizes = {"q": num_heads * HEAD_DIM, "k": num_kv * HEAD_DIM, "v": num_kv * HEAD_DIM}
    return {sid: (rand(seed + 2 * i, n, IN), rand(seed + 2 * i + 1, n) if bias else None)
            for i, (sid, n) in enumerate(sizes.items())}


def local_part(kind: str, shard_id, full: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's piece of one full weight or bias, sliced by the test's own rules."""
    if kind == "row":
        return full if full.dim() == 1 else full.chunk(tp.size, dim=1)[tp.rank]
    if shard_id in ("k", "v"):
        rows = full.view(heads(kind)[1], HEAD_DIM, *full.shape[1:])
        return torch.cat([rows[h] for h in kv_heads_of_rank(tp.rank, tp.size, heads(kind)[1])])
    return full.chunk(tp.size, dim=0)[tp.rank]


def make_layer(kind: str, tp: TPGroup, bias: bool = True, presliced: bool = False, seed: int = 0):
    """Build ``kind`` for ``tp``, poison its parameters with NaN, load the seeded full
    weights (or this rank's pre-sliced parts) through the weight loaders.

    Returns ``(layer, expected local weight, expected local bias or None)``.
    """
    num_heads, num_kv = heads(kind)
    layer: nn.Module = {
        "column": lambda: ColumnParallelLinear(IN, OUT, bias=bias, tp=tp),
        "row": lambda: RowParallelLinear(IN, OUT, bias=bias, tp=tp),
        "merged": lambda: MergedColumnParallelLinear(IN, GATE_UP, bias=bias, tp=tp),
        "qkv": lambda: QKVParallelLinear(IN, HEAD_DIM, num_heads, num_kv, bias=bias, tp=tp),
        "qkv_replicated_kv": lambda: QKVParallelLinear(IN, HEAD_DIM, num_heads, num_kv, bias=bias, tp=tp),
    }[kind]()
    with torch.no_grad():
        for p in layer.parameters():
            p.fill_(float("nan"))
    weights, biases = [], []
    for shard_id, (w, b) in full_shards(kind, bias, seed).items():
        w_local = local_part(kind, shard_id, w, tp)
        layer.weight.weight_loader(layer.weight, w_local if presliced else w, shard_id, presliced=presliced)
        weights.append(w_local)
        if b is not None:
            b_local = local_part(kind, shard_id, b, tp)
            layer.bias.weight_loader(layer.bias, b_local if presliced else b, shard_id, presliced=presliced)
            biases.append(b_local)
    return layer, torch.cat(weights), torch.cat(biases) if biases else None


def op_counts(fn, *args) -> Counter:
    """How often each op ran during ``fn(*args)``, as recorded by the profiler."""
    with torch.profiler.profile() as prof:
        fn(*args)
    return Counter(e.name for e in prof.events())

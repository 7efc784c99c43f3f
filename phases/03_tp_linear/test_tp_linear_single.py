"""Phase 03 in one process: the shard a layer built for "rank r of n" holds, the
weight loaders' double-shard guard, tp = 1 math against float64, simulated ranks
that add up to the full layer, and the GEMM / all-reduce counts."""
import pytest
import torch
import torch.nn.functional as F

from engine.distributed import TPGroup
from engine.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from linear_cases import ALL_REDUCE, GEMMS, HEAD_DIM, IN, KINDS, OUT, full_shards, make_layer, op_counts, rand

RANKS = [(r, n) for n in (1, 2, 4) for r in range(n)]


@pytest.mark.parametrize("presliced", [False, True], ids=["full", "presliced"])
@pytest.mark.parametrize("rank,size", RANKS)
@pytest.mark.parametrize("kind", KINDS)
def test_layer_for_rank_holds_exactly_its_shard(kind, rank, size, presliced):
    layer, weight, bias = make_layer(kind, TPGroup(rank, size), presliced=presliced)
    torch.testing.assert_close(layer.weight, weight, rtol=0, atol=0)
    torch.testing.assert_close(layer.bias, bias, rtol=0, atol=0)


def test_qkv_local_sizes_and_replicated_kv_heads():
    """8 query / 2 KV heads at tp 4: 2 query heads and 1 KV head per rank, head r // 2."""
    for rank in range(4):
        layer = QKVParallelLinear(IN, HEAD_DIM, 8, 2, tp=TPGroup(rank, 4))
        assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
        assert (layer.q_size, layer.kv_size) == (2 * HEAD_DIM, HEAD_DIM)
        assert layer.weight.shape == (4 * HEAD_DIM, IN)
        k_full = rand(7, 2 * HEAD_DIM, IN)
        layer.weight.weight_loader(layer.weight, k_full, "k")
        torch.testing.assert_close(layer.weight[2 * HEAD_DIM:3 * HEAD_DIM], k_full[(rank // 2) * HEAD_DIM:][:HEAD_DIM])


@pytest.mark.parametrize("kind", KINDS)
def test_tp1_layer_matches_float64_math(kind):
    layer, weight, bias = make_layer(kind, TPGroup())
    x = rand(11, 5, IN)
    expected = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_replicated_layer_holds_the_whole_weight_and_matches_float64_math(bias):
    """ReplicatedLinear (MLA's small projections): the loader copies the whole tensor (a shape that
    differs is a ValueError), the forward is x W^T + b."""
    layer = ReplicatedLinear(IN, OUT, bias=bias)
    weight, b = rand(3, OUT, IN), rand(4, OUT)
    layer.weight.weight_loader(layer.weight, weight)
    if bias:
        layer.bias.weight_loader(layer.bias, b)
    assert torch.equal(layer.weight, weight) and (torch.equal(layer.bias, b) if bias else layer.bias is None)
    x = rand(5, 7, IN)
    expected = F.linear(x.double(), weight.double(), b.double() if bias else None)
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        layer.weight.weight_loader(layer.weight, rand(5, OUT + 1, IN))


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("kind", ["column", "merged", "qkv"])
def test_column_shards_concatenate_to_the_full_output(kind, size):
    """Each shard's blocks from all simulated ranks, in rank order, are that shard's full output."""
    x = rand(12, 3, IN)
    shards = full_shards(kind, bias=True)
    widths = [w.shape[0] // size for w, _ in shards.values()]
    per_rank = [make_layer(kind, TPGroup(r, size))[0](x).split(widths, dim=-1) for r in range(size)]
    for i, (w, b) in enumerate(shards.values()):
        got = torch.cat([blocks[i] for blocks in per_rank], dim=-1).double()
        torch.testing.assert_close(got, F.linear(x.double(), w.double(), b.double()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [2, 4])
def test_row_partial_products_sum_to_the_full_output(size):
    """Without a process group the all-reduce is an identity, so each simulated rank returns its partial product."""
    x = rand(13, 3, IN)
    total = sum(make_layer("row", TPGroup(r, size), bias=False)[0](x.chunk(size, dim=-1)[r]).double()
                for r in range(size))
    w, _ = full_shards("row", bias=False)[None]
    torch.testing.assert_close(total, F.linear(x.double(), w.double()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["qkv", "merged"])
def test_merged_projections_run_one_gemm(kind):
    layer = make_layer(kind, TPGroup(1, 2))[0]
    counts = op_counts(layer, rand(14, 6, IN))
    assert sum(counts[g] for g in GEMMS) == 1, counts


@pytest.mark.parametrize("size,reduces", [(1, 0), (2, 1), (4, 1)])
def test_row_parallel_forward_all_reduces_once(size, reduces):
    """One all_reduce_sum per forward for tp > 1 (none at tp 1), one GEMM either way."""
    layer = make_layer("row", TPGroup(0, size))[0]
    counts = op_counts(layer, rand(15, 6, IN // size))
    assert counts[ALL_REDUCE] == reduces, counts
    assert sum(counts[g] for g in GEMMS) == 1, counts


def test_wrong_shapes_are_value_errors_naming_both_shapes():
    col = ColumnParallelLinear(IN, OUT, tp=TPGroup(1, 2))
    with pytest.raises(ValueError, match=r"\(5, 16\).*\(12, 16\)"):
        col.weight.weight_loader(col.weight, torch.zeros(5, IN))
    row = RowParallelLinear(IN, OUT, bias=True, tp=TPGroup(0, 2))
    with pytest.raises(ValueError, match=r"\(12,\).*\(24,\)"):
        row.bias.weight_loader(row.bias, torch.zeros(OUT // 2))
    merged = MergedColumnParallelLinear(IN, [8, 8], tp=TPGroup(0, 2))
    with pytest.raises(ValueError, match="shard_id"):
        merged.weight.weight_loader(merged.weight, torch.zeros(8, IN), 2)
    qkv = QKVParallelLinear(IN, HEAD_DIM, 4, 2, tp=TPGroup(0, 2))
    with pytest.raises(ValueError, match="shard_id"):
        qkv.weight.weight_loader(qkv.weight, torch.zeros(8, IN), None)
    with pytest.raises(ValueError, match=r"\(3, 16\).*\(4, 16\)"):
        qkv.weight.weight_loader(qkv.weight, torch.zeros(3, IN), "k")


def test_shard_shaped_tensor_is_not_taken_for_a_full_one():
    """Double-shard guard: a checkpoint tensor of the local shard's shape is an error unless the
    caller says it is pre-sliced, and a full tensor passed as pre-sliced is an error too."""
    row = RowParallelLinear(8, 4, tp=TPGroup(1, 2))
    with pytest.raises(ValueError, match=r"\(4, 4\).*full tensor, shape \(4, 8\)"):
        row.weight.weight_loader(row.weight, torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"\(4, 8\).*pre-sliced"):
        row.weight.weight_loader(row.weight, torch.zeros(4, 8), presliced=True)
    row.weight.weight_loader(row.weight, torch.ones(4, 4), presliced=True)
    assert torch.equal(row.weight, torch.ones(4, 4))


@pytest.mark.parametrize("build", [
    lambda: ColumnParallelLinear(IN, 10, tp=TPGroup(0, 4)),
    lambda: RowParallelLinear(10, OUT, tp=TPGroup(0, 4)),
    lambda: MergedColumnParallelLinear(IN, [8, 6], tp=TPGroup(0, 4)),
    lambda: QKVParallelLinear(IN, HEAD_DIM, 6, 2, tp=TPGroup(0, 4)),
    lambda: QKVParallelLinear(IN, HEAD_DIM, 6, 2, tp=TPGroup(0, 3)),
], ids=["column", "row", "merged", "qkv-heads", "qkv-kv-heads"])
def test_sizes_that_do_not_split_are_value_errors(build):
    with pytest.raises(ValueError, match="divisible"):
        build()


def test_parameters_take_the_default_dtype_and_device():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            layer = QKVParallelLinear(IN, HEAD_DIM, 4, 2, bias=True)
    finally:
        torch.set_default_dtype(previous)
    assert layer.weight.dtype == layer.bias.dtype == torch.float64
    assert layer.weight.device.type == layer.bias.device.type == "meta"
    assert not layer.weight.requires_grad


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_bf16_tp1_layer_matches_float64_math(kind):
    layer, weight, bias = make_layer(kind, TPGroup())
    layer = layer.to("cuda", torch.bfloat16)
    x = rand(16, 9, IN)
    out = layer(x.to("cuda", torch.bfloat16))
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    expected = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(out.double().cpu(), expected, rtol=2e-2, atol=2e-2)

"""Phase 03 under torchrun: every TP layer, loaded from full and from pre-sliced
weights (same seeds on every rank), against float64 math of the full layer. Layers
are loaded on the CPU, then run on ``tp_device`` (the CPU, or ``cuda:LOCAL_RANK``
with ``GATES_TORCHRUN_DEVICE=cuda``: NCCL)."""
import pytest
import torch
import torch.nn.functional as F

from engine.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from linear_cases import ALL_REDUCE, IN, KINDS, OUT, full_shards, make_layer, op_counts, rand

pytestmark = pytest.mark.torchrun


@pytest.mark.parametrize("presliced", [False, True], ids=["full", "presliced"])
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "row"])
def test_column_layers_give_this_rank_block_of_the_full_output(tp_group, tp_device, kind, presliced):
    layer, weight, bias = make_layer(kind, tp_group, presliced=presliced)
    x = rand(20, 5, IN)
    torch.testing.assert_close(layer.to(tp_device)(x.to(tp_device)).double().cpu(),
                               F.linear(x.double(), weight.double(), bias.double()), rtol=1e-5, atol=1e-5)


def test_column_gather_output_is_the_full_output(tp_group, tp_device):
    layer = ColumnParallelLinear(IN, OUT, bias=True, gather_output=True, tp=tp_group)
    (w, b), = full_shards("column", bias=True).values()
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    x = rand(21, 2, 3, IN)
    out = layer.to(tp_device)(x.to(tp_device)).cpu()
    assert out.shape == (2, 3, OUT)
    torch.testing.assert_close(out.double(), F.linear(x.double(), w.double(), b.double()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("presliced", [False, True], ids=["full", "presliced"])
def test_row_layer_gives_the_full_output_with_bias_once(tp_group, tp_device, presliced):
    layer = make_layer("row", tp_group, bias=True, presliced=presliced)[0].to(tp_device)
    (w, b), = full_shards("row", bias=True).values()
    x = rand(22, 5, IN)
    x_local = x.chunk(tp_group.size, dim=-1)[tp_group.rank].to(tp_device)
    counts = op_counts(layer, x_local)
    assert counts[ALL_REDUCE] == 1, counts
    out = layer(x_local).cpu()
    torch.testing.assert_close(out.double(), F.linear(x.double(), w.double(), b.double()), rtol=1e-5, atol=1e-5)


def test_column_then_row_equals_the_full_two_layer_product(tp_group, tp_device):
    """The MLP pattern: column output stays sharded, row input takes it, one all-reduce."""
    up = ColumnParallelLinear(IN, OUT, bias=True, tp=tp_group)
    down = RowParallelLinear(OUT, IN, bias=True, tp=tp_group)
    w1, b1, w2, b2 = rand(30, OUT, IN), rand(31, OUT), rand(32, IN, OUT), rand(33, IN)
    for param, full in ((up.weight, w1), (up.bias, b1), (down.weight, w2), (down.bias, b2)):
        param.weight_loader(param, full)
    up.to(tp_device), down.to(tp_device)
    x = rand(34, 4, IN)
    expected = F.linear(torch.relu(F.linear(x.double(), w1.double(), b1.double())), w2.double(), b2.double())
    out = down(torch.relu(up(x.to(tp_device)))).cpu()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)

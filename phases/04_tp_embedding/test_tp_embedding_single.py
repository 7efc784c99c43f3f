"""Phase 04 in one process: vocab ranges and padding, the shard each rank holds,
the out-of-range mask, and simulated ranks that add up to the full embedding / LM head."""
import pytest
import torch
import torch.nn.functional as F

from embedding_cases import DIM, boundary_ids, make_vocab_layer, padded_shard, seeded
from engine.distributed import TPGroup
from engine.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding

SPLITS = [(1000, 1), (1000, 3), (1000, 4), (997, 2), (5, 4)]


@pytest.mark.parametrize("vocab,size", SPLITS + [(151936, 4)])
def test_vocab_ranges_tile_the_vocabulary(vocab, size):
    layers = [VocabParallelEmbedding(vocab, 1, tp=TPGroup(r, size)) for r in range(size)]
    rows = -(-vocab // size)
    assert [(e.vocab_start, e.vocab_end) for e in layers] == [(min(r * rows, vocab), min((r + 1) * rows, vocab))
                                                               for r in range(size)]
    assert all(e.weight.shape == (rows, 1) for e in layers)
    assert sum(e.vocab_end - e.vocab_start for e in layers) == vocab  # every id owned exactly once
    if vocab % size == 0:  # e.g. Qwen's 151936 at tp 4: no padding at all
        assert all(e.shard_size == e.vocab_end - e.vocab_start for e in layers)


def test_parameters_take_the_default_device_and_dtype():
    with torch.device("meta"):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            emb, head = VocabParallelEmbedding(1000, 8, tp=TPGroup(1, 4)), ParallelLMHead(1000, 8, tp=TPGroup(1, 4))
        finally:
            torch.set_default_dtype(previous)
    for p in (emb.weight, head.weight):
        assert p.device.type == "meta" and p.dtype == torch.bfloat16


@pytest.mark.parametrize("presliced", [None, "padded", "owned"])
@pytest.mark.parametrize("vocab,size", SPLITS)
@pytest.mark.parametrize("cls", [VocabParallelEmbedding, ParallelLMHead])
def test_layer_for_rank_holds_its_rows_and_zero_padding(cls, vocab, size, presliced):
    for rank in range(size):
        tp = TPGroup(rank, size)
        layer, weight, bias = make_vocab_layer(cls, vocab, tp, presliced, bias=cls is ParallelLMHead)
        torch.testing.assert_close(layer.weight, padded_shard(weight, tp), rtol=0, atol=0)
        if bias is not None:
            torch.testing.assert_close(layer.bias, padded_shard(bias, tp), rtol=0, atol=0)


@pytest.mark.parametrize("vocab,size", SPLITS)
def test_embedding_masks_ids_outside_each_rank_and_sums_to_the_full_lookup(vocab, size):
    drawn = torch.randint(0, vocab, (7,), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([boundary_ids(vocab, size), drawn])
    total = torch.zeros(len(ids), DIM, dtype=torch.float64)
    for rank in range(size):
        layer, weight, _ = make_vocab_layer(VocabParallelEmbedding, vocab, TPGroup(rank, size))
        out = layer(ids.view(1, -1)).squeeze(0).double()  # the all-reduce is an identity without a process group
        mine = (ids >= layer.vocab_start) & (ids < layer.vocab_end)
        assert (out[~mine] == 0).all()
        torch.testing.assert_close(out[mine], weight[ids[mine]].double(), rtol=0, atol=0)
        total += out
    torch.testing.assert_close(total, weight[ids].double(), rtol=0, atol=0)


@pytest.mark.parametrize("vocab,size", SPLITS)
def test_lm_head_rank_logits_concatenate_to_the_full_logits(vocab, size):
    hidden = seeded(4, 3, DIM)
    parts = []
    for rank in range(size):
        layer, weight, bias = make_vocab_layer(ParallelLMHead, vocab, TPGroup(rank, size), bias=True)
        parts.append(layer(hidden))
    logits = torch.cat(parts, dim=-1)[:, :vocab].double()  # the gather is an identity without a process group
    torch.testing.assert_close(logits, F.linear(hidden.double(), weight.double(), bias.double()), rtol=1e-6, atol=1e-6)


def test_tp1_embedding_and_lm_head_match_float64_math():
    emb, weight, _ = make_vocab_layer(VocabParallelEmbedding, 1000, TPGroup())
    ids = torch.tensor([[0, 999, 17], [500, 1, 2]])
    torch.testing.assert_close(emb(ids).double(), weight[ids].double(), rtol=0, atol=0)
    head, w_head, b_head = make_vocab_layer(ParallelLMHead, 1000, TPGroup(), bias=True, seed=5)
    hidden = seeded(6, 4, DIM)
    logits = head(hidden)
    assert logits.shape == (4, 1000)
    torch.testing.assert_close(logits.double(), F.linear(hidden.double(), w_head.double(), b_head.double()),
                               rtol=1e-6, atol=1e-6)


def test_tied_lm_head_shares_the_embedding_weight():
    emb, weight, _ = make_vocab_layer(VocabParallelEmbedding, 997, TPGroup())
    head = ParallelLMHead(997, DIM, tp=TPGroup())
    head.tie_to(emb)
    assert head.weight is emb.weight
    hidden = seeded(7, 2, DIM)
    torch.testing.assert_close(head(hidden).double(), hidden.double() @ weight.double().T, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="tie"):
        ParallelLMHead(997, DIM, tp=TPGroup(0, 2)).tie_to(emb)


def test_wrong_shapes_are_value_errors_naming_both_shapes():
    emb = VocabParallelEmbedding(1000, DIM, tp=TPGroup(1, 3))
    with pytest.raises(ValueError, match=r"\(333, 8\).*\(334, 8\)"):
        emb.weight.weight_loader(emb.weight, torch.zeros(333, DIM))
    with pytest.raises(ValueError, match=r"\(1000, 4\).*\(334, 8\)"):
        emb.weight.weight_loader(emb.weight, torch.zeros(1000, 4))
    with pytest.raises(ValueError, match=r"\(334, 8\).*full shape \(1000, 8\)"):
        emb.weight.weight_loader(emb.weight, torch.zeros(334, DIM))
    with pytest.raises(ValueError, match=r"\(1000, 8\).*this rank's rows"):
        emb.weight.weight_loader(emb.weight, torch.zeros(1000, DIM), presliced=True)


@pytest.mark.cuda
@pytest.mark.parametrize("cls", [VocabParallelEmbedding, ParallelLMHead])
def test_cuda_bf16_tp1_matches_float64_math(cls):
    layer, weight, _ = make_vocab_layer(cls, 1000, TPGroup())
    layer = layer.to("cuda", torch.bfloat16)
    if cls is VocabParallelEmbedding:
        ids = boundary_ids(1000, 4)
        out, expected = layer(ids.cuda()), weight[ids].double()
    else:
        hidden = seeded(8, 5, DIM)
        out, expected = layer(hidden.to("cuda", torch.bfloat16)), hidden.double() @ weight.double().T
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    torch.testing.assert_close(out.double().cpu(), expected, rtol=2e-2, atol=2e-2)

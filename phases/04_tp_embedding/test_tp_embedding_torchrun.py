"""Phase 04 under torchrun: vocab-parallel embedding and LM head (even and uneven
vocabularies, full and pre-sliced loads, tied weights) against float64 lookups.
Layers are loaded on the CPU, then run on ``tp_device`` (the CPU, or
``cuda:LOCAL_RANK`` with ``GATES_TORCHRUN_DEVICE=cuda``: NCCL)."""
import pytest
import torch
import torch.nn.functional as F

from embedding_cases import DIM, boundary_ids, make_vocab_layer, seeded
from engine.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding

pytestmark = pytest.mark.torchrun

VOCABS = [1000, 997]  # 997 pads the last shard at tp 2 and 4


@pytest.mark.parametrize("presliced", [None, "padded", "owned"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_embedding_equals_the_full_lookup_on_every_boundary(tp_group, tp_device, vocab, presliced):
    layer, weight, _ = make_vocab_layer(VocabParallelEmbedding, vocab, tp_group, presliced)
    ids = torch.stack([boundary_ids(vocab, tp_group.size), boundary_ids(vocab, tp_group.size).flip(0)])
    out = layer.to(tp_device)(ids.to(tp_device)).cpu()
    assert out.shape == (*ids.shape, DIM)
    # one rank adds each row, the others zeros
    torch.testing.assert_close(out.double(), weight[ids].double(), rtol=0, atol=0)


@pytest.mark.parametrize("presliced", [None, "padded", "owned"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_lm_head_returns_exactly_the_full_vocab_logits(tp_group, tp_device, vocab, presliced):
    layer, weight, bias = make_vocab_layer(ParallelLMHead, vocab, tp_group, presliced, bias=True)
    hidden = seeded(40, 3, DIM)
    logits = layer.to(tp_device)(hidden.to(tp_device)).cpu()
    assert logits.shape == (3, vocab)  # the padding columns never reach the logits
    torch.testing.assert_close(logits.double(), F.linear(hidden.double(), weight.double(), bias.double()),
                               rtol=1e-6, atol=1e-6)


def test_tied_embedding_and_lm_head(tp_group, tp_device):
    emb, weight, _ = make_vocab_layer(VocabParallelEmbedding, 997, tp_group)
    emb.to(tp_device)
    head = ParallelLMHead(997, DIM, tp=tp_group)  # no parameter of its own once tied
    head.tie_to(emb)
    assert head.weight is emb.weight
    ids = boundary_ids(997, tp_group.size).to(tp_device)
    hidden = emb(ids)
    torch.testing.assert_close(head(hidden).double().cpu(), weight[ids.cpu()].double() @ weight.double().T,
                               rtol=1e-6, atol=1e-6)

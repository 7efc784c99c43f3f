"""Under TP only rank 0 samples; every rank ends with rank 0's token ids (on ``tp_device``:
the CPU, or ``cuda:LOCAL_RANK`` with ``GATES_TORCHRUN_DEVICE=cuda``, where the broadcast is NCCL's)."""
import pytest
import torch
import torch.distributed as dist

from engine.model.layers.sampler import Sampler

ROWS, VOCAB, TOP_K = 32, 64, 8


def rank_logits(rank: int) -> torch.Tensor:
    """Each rank's logits favour its own disjoint block of TOP_K tokens."""
    gen = torch.Generator().manual_seed(100 + rank)
    logits = torch.randn(ROWS, VOCAB, generator=gen)
    logits[:, rank * TOP_K:(rank + 1) * TOP_K] += 20.0
    return logits


@pytest.mark.torchrun
def test_every_rank_gets_rank0_tokens(tp_group, tp_device, monkeypatch):
    assert tp_group.size > 1
    device = tp_device
    rank = tp_group.rank
    temperatures = torch.where(torch.arange(ROWS) % 4 == 0, 0.0, 1.0)
    args = [t.to(device) for t in (
        rank_logits(rank), temperatures, torch.full((ROWS,), TOP_K), torch.full((ROWS,), 0.95),
        torch.arange(ROWS) + 1000 * rank, torch.full((ROWS,), rank))]  # seeds and steps differ per rank too
    calls = []
    real_sample = Sampler._sample
    monkeypatch.setattr(Sampler, "_sample", staticmethod(lambda *a: calls.append(1) or real_sample(*a)))
    ids = Sampler(tp_group)(*args).cpu()
    assert len(calls) == (1 if rank == 0 else 0), f"rank {rank} sampled {len(calls)} times"

    truth = rank_logits(0).to(torch.float64)
    greedy = temperatures == 0
    assert torch.equal(ids[greedy], truth.argmax(dim=1)[greedy])
    assert bool(((ids >= 0) & (ids < TOP_K)).all()), f"rank {rank} kept tokens outside rank 0's top-k: {ids}"
    gathered = [None] * tp_group.size
    dist.all_gather_object(gathered, ids.tolist())
    assert all(g == gathered[0] for g in gathered)

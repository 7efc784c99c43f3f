"""Vocab-parallel token embedding and LM head.

Rank r owns the vocabulary rows ``[r * shard_size, (r + 1) * shard_size)`` with
``shard_size = ceil(vocab / tp)``; rows past the vocabulary are zero padding and
never reach the logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TPGroup, all_gather_last_dim, all_reduce_sum, get_tp_group
from engine.model.layers.linear import new_parameter


class VocabParallelEmbedding(nn.Module):
    """``[...] int64 ids -> [..., dim]`` rows of this rank's vocabulary slice, summed over ranks.

    ``weight`` is ``[shard_size, dim]``; ids outside ``[vocab_start, vocab_end)``
    contribute zero on this rank, so the all-reduce yields each id's row once.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or get_tp_group()
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // self.tp.size)
        self.vocab_start = min(self.tp.rank * self.shard_size, num_embeddings)
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        self.weight = new_parameter(self.shard_size, embedding_dim, weight_loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None,
                      presliced: bool = False) -> None:
        """Loads the full vocabulary (sliced here) or, with ``presliced``, this rank's rows
        (padded to the shard or not); padding rows are zeroed in every case. Rows are dim 0
        (weight or bias)."""
        owned = self.vocab_end - self.vocab_start
        full = (self.num_embeddings, *param.shape[1:])
        if presliced and loaded.shape in (param.shape, (owned, *param.shape[1:])):
            loaded = loaded[:owned]
        elif not presliced and loaded.shape == full:
            loaded = loaded[self.vocab_start:self.vocab_end]
        else:
            expected = (f"this rank's rows {tuple(param.shape)} or {(owned, *param.shape[1:])}" if presliced
                        else f"the full shape {full}")
            raise ValueError(f"cannot load a tensor of shape {tuple(loaded.shape)} into a vocab shard of shape "
                             f"{tuple(param.shape)} (expected {expected})")
        param.data[:owned].copy_(loaded)
        param.data[owned:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        in_shard = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local_ids = torch.where(in_shard, ids - self.vocab_start, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill_(~in_shard.unsqueeze(-1), 0)
        return all_reduce_sum(rows, self.tp.name)


class ParallelLMHead(VocabParallelEmbedding):
    """``[..., dim] -> [..., vocab]`` logits: local logits of this rank's rows, gathered in
    rank order, padding columns cut off. ``tie_to(embedding)`` shares the embedding's weight."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, tp: TPGroup | None = None):
        super().__init__(num_embeddings, embedding_dim, tp)
        self.bias = new_parameter(self.shard_size, weight_loader=self.weight_loader) if bias else None

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Use ``embedding.weight`` as this head's weight (same parameter, no copy)."""
        if embedding.weight.shape != self.weight.shape or embedding.vocab_start != self.vocab_start:
            raise ValueError(
                f"cannot tie an LM head shard {tuple(self.weight.shape)} from row {self.vocab_start} to an "
                f"embedding shard {tuple(embedding.weight.shape)} from row {embedding.vocab_start}")
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight, self.bias)
        if self.tp.size > 1:
            logits = all_gather_last_dim(logits, self.tp.name)
        return logits[..., :self.num_embeddings]

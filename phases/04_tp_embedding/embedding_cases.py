"""Shared by the phase-04 tests: seeded full tables, the padded shard each rank
must hold (computed here, independently of the layers), boundary token ids."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.distributed import TPGroup
from engine.model.layers.embedding import VocabParallelEmbedding

DIM = 8


def seeded(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def padded_shard(full: torch.Tensor, tp: TPGroup, fill: float = 0.0) -> torch.Tensor:
    """Rank ``tp.rank``'s rows of ``full`` padded to ``ceil(vocab / tp) * tp`` rows of ``fill``."""
    rows = -(-full.shape[0] // tp.size)
    padded = F.pad(full, (0, 0) * (full.dim() - 1) + (0, rows * tp.size - full.shape[0]), value=fill)
    return padded[tp.rank * rows:(tp.rank + 1) * rows]


def owned_rows(full: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's real (unpadded) rows of ``full``."""
    rows = -(-full.shape[0] // tp.size)
    return full[tp.rank * rows:(tp.rank + 1) * rows]


def boundary_ids(vocab: int, tp_size: int) -> torch.Tensor:
    """Ids on both sides of every shard boundary, plus the first and last id."""
    rows = -(-vocab // tp_size)
    edges = [r * rows + d for r in range(tp_size + 1) for d in (-1, 0)]
    return torch.tensor(sorted({i for i in edges + [0, vocab - 1] if 0 <= i < vocab}))


def make_vocab_layer(cls, vocab: int, tp: TPGroup, presliced: str | None = None, bias: bool = False, seed: int = 0):
    """Build ``cls`` (embedding or LM head) for ``tp``, NaN-poison it, load the seeded
    full table (``presliced``: "padded" -- with non-zero padding rows the loader must zero -- or
    "owned" loads this rank's slice instead).
    Returns ``(layer, full weight, full bias or None)``."""
    layer = cls(vocab, DIM, tp=tp) if cls is VocabParallelEmbedding else cls(vocab, DIM, bias=bias, tp=tp)
    with torch.no_grad():
        for p in layer.parameters():
            p.fill_(float("nan"))
    weight, bias_full = seeded(seed, vocab, DIM), seeded(seed + 1, vocab) if bias else None
    for param, full in ((layer.weight, weight), (getattr(layer, "bias", None), bias_full)):
        if full is not None:
            piece = {None: full, "padded": padded_shard(full, tp, fill=7.0), "owned": owned_rows(full, tp)}[presliced]
            param.weight_loader(param, piece, presliced=presliced is not None)
    return layer, weight, bias_full

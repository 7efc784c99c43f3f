"""Logits -> next token ids: greedy, temperature, min-p, top-k, top-p, per-request seeds.

Static shapes and no host sync (no ``.item()``, no branch on tensor values), so
the sampler can sit inside a captured CUDA graph. Randomness is a counter-based
hash of (seed, output index, token id) computed with tensor ops, so a request's tokens
depend only on its own logits, seed and output index, never on the rest of the batch.
Under TP only rank 0 samples; the other ranks receive its ids by broadcast.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.distributed import TPGroup, broadcast_tensor, get_tp_group

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in [0, 2**32) and ``c`` in [0, 2**32): the int64 product
    wraps modulo 2**64 on every backend (two's complement), which keeps its low 32 bits exact. (Split
    into 16-bit halves to stay below 2**63 it took three times the elementwise work: the sampler's
    noise over a batch's whole vocabulary was a third of a CPU sampling step.)"""
    return (x * c) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: a bijection on [0, 2**32) with full avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _uniform_noise(seeds: torch.Tensor, output_indices: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Float32 in the open interval (0, 1), a pure function of (seed, output index, token id),
    shaped like ``token_ids`` broadcast against ``[B, 1]``.

    seeds, output_indices: int64 ``[B]`` (seeds in [0, 2**63)); token_ids: int64 ``[V]`` or ``[B, K]``.
    """
    key = _mix32(_mix32(seeds >> 32) ^ (seeds & _MASK32))
    key = _mix32(key ^ (output_indices & _MASK32))[:, None]
    bits = _mix32(_mix32(token_ids ^ key) ^ key)
    # the top 24-bit value plus 0.5 rounds to 2**24 in float32: clamp to the largest float32 below 1,
    # else log(-log(1)) = -inf turns a masked (-inf) candidate's race into NaN, which argmax picks
    return (((bits >> 8).to(torch.float32) + 0.5) * 2.0**-24).clamp(max=1 - 2.0**-24)


class Sampler(nn.Module):
    """``forward(logits [B, V], temperatures [B] f32, top_ks [B] int, top_ps [B] f32,
    seeds [B] int64, output_indices [B] int64, min_ps [B] f32 = None) -> ids [B] int64`` (new tensor,
    inputs untouched).

    Rows with temperature 0 take the exact argmax. Other rows divide by the
    temperature, drop the tokens whose probability is below ``min_p`` times the row's most
    likely token's (0 or no ``min_ps`` = none), keep the ``top_k`` largest logits (0 or -1 = all), then the
    smallest set of those whose probability mass reaches ``top_p`` (1.0 = all),
    and draw from the renormalised distribution with the exponential race
    ``argmax(p / E)``, ``E = -log(u)``, ``u = _uniform_noise(seeds, output_indices, token)``:
    a row's output index is the position of the token it draws in its request's output, so a
    seed fixes the whole output.

    Without hints every row goes through one static-shape path (CUDA-graph safe).
    The runner, which knows every request's parameters on the host, passes hints
    that give the same tokens for less work: ``random_rows`` (int64 ``[S]``, the rows
    with temperature > 0; the others take only the argmax), ``max_top_k`` (the largest
    top_k among them when every one sets top_k > 0: only that many candidates are
    kept, by ``topk`` instead of a full sort), ``use_top_k`` (False when no random row
    sets top_k > 0) and ``use_top_p`` (False when no random row sets top_p < 1: no
    softmax/cumsum over the candidates) and ``use_min_p`` (False when no random row sets
    min_p > 0: no min-p pass). With neither top filter every token is a candidate and nothing
    is sorted.
    """

    def __init__(self, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp if tp is not None else get_tp_group()

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                top_ps: torch.Tensor, seeds: torch.Tensor, output_indices: torch.Tensor,
                min_ps: torch.Tensor | None = None, *, random_rows: torch.Tensor | None = None,
                max_top_k: int | None = None, use_top_k: bool = True, use_top_p: bool = True,
                use_min_p: bool = True) -> torch.Tensor:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        batch = logits.shape[0]
        if min_ps is None:
            min_ps, use_min_p = torch.zeros_like(top_ps), False
        for name, t in (("temperatures", temperatures), ("top_ks", top_ks), ("top_ps", top_ps),
                        ("seeds", seeds), ("output_indices", output_indices), ("min_ps", min_ps)):
            if t.shape != (batch,):
                raise ValueError(f"{name} must have shape [{batch}], got {tuple(t.shape)}")
        if self.tp.size > 1 and self.tp.rank != 0:
            ids = torch.empty(batch, dtype=torch.int64, device=logits.device)
        elif random_rows is None:
            drawn = self._sample(logits.float(), temperatures.float(), top_ks, top_ps.float(), seeds, output_indices,
                                 min_ps.float(), max_top_k, use_top_k, use_top_p, use_min_p)
            ids = torch.where(temperatures > 0, drawn, logits.argmax(dim=-1))
        else:
            ids = logits.argmax(dim=-1)
            if random_rows.numel():
                picked = [t.index_select(0, random_rows)
                          for t in (logits, temperatures, top_ks, top_ps, seeds, output_indices, min_ps)]
                ids[random_rows] = self._sample(picked[0].float(), picked[1].float(), picked[2], picked[3].float(),
                                                 picked[4], picked[5], picked[6].float(), max_top_k, use_top_k,
                                                 use_top_p, use_min_p)
        return broadcast_tensor(ids, src=0)

    @staticmethod
    def _sample(logits, temperatures, top_ks, top_ps, seeds, output_indices, min_ps, max_top_k=None,
                use_top_k=True, use_top_p=True, use_min_p=True) -> torch.Tensor:
        """Draw one token per row (every row treated as temperature > 0). ``forward`` calls it
        with every argument positional, through ``self._sample`` (the TP test wraps it with a
        ``lambda *a`` to count the ranks that draw)."""
        vocab_size = logits.shape[1]
        # below 1e-5 a temperature is a greedy pick anyway; clamping keeps logits / t finite
        scaled = logits / temperatures.clamp(min=1e-5)[:, None]
        if use_min_p:  # p < min_p * p_max  <=>  scaled < max(scaled) + log(min_p); log(0) = -inf drops none
            floor = scaled.max(dim=-1, keepdim=True).values + min_ps.log()[:, None]
            scaled = scaled.masked_fill(scaled < floor, float("-inf"))
        if not use_top_k and not use_top_p:
            candidates, token_ids = scaled, torch.arange(vocab_size, device=logits.device)
        else:
            num_candidates = vocab_size if max_top_k is None else min(max_top_k, vocab_size)
            candidates, token_ids = scaled.topk(num_candidates, dim=-1)  # sorted, largest first
            rank = torch.arange(num_candidates, device=logits.device)
            k = torch.where(top_ks > 0, top_ks.clamp(max=vocab_size), vocab_size)
            candidates = candidates.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
            if use_top_p:
                probs = candidates.softmax(dim=-1)
                mass_before = probs.cumsum(dim=-1) - probs
                candidates = candidates.masked_fill(mass_before >= top_ps[:, None], float("-inf"))
        # argmax(p / E) == argmax(logit - log E): the renormalising constant does not move the argmax
        race = candidates - torch.log(-torch.log(_uniform_noise(seeds, output_indices, token_ids)))
        choice = race.argmax(dim=-1, keepdim=True)
        return choice[:, 0] if token_ids.dim() == 1 else token_ids.gather(1, choice)[:, 0]

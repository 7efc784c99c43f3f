"""expert_gemv (MoE steps with few assignments) against float64 math written here."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from primitives_checks import assert_close, poisoned_allocations, rand, run_cases


def expert_gemv_truth(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """[T, J, Nout] float64: token t's row times the matrix of each of its J experts (-1: zeros)."""
    x64, w64 = x.cpu().double(), weights.cpu().double()
    zeros = torch.zeros(w64.shape[1], dtype=torch.float64)
    return torch.stack([torch.stack([w64[e] @ row if e >= 0 else zeros for e in ids])
                        for ids, row in zip(expert_ids.cpu().tolist(), x64)])


def test_expert_gemv_matches_float64(target):
    """Each token's row times each of its J experts' matrices, read in place from the stack:
    J = 1 (one expert per row, the down projection) and J > 1 (a token's k experts, the row
    never copied), repeated and unused experts, id -1 (another rank's expert) giving a zero row,
    widths that are not multiples of the kernel's blocks (K 1408-like tails), a strided
    activation view (a column slice of a wider buffer)."""
    def check(case):
        tokens, per_token, experts, n_out, k_dim, seed = case
        gen = torch.Generator().manual_seed(seed)
        wide = rand(gen, tokens, k_dim + 8, target=target)
        x = wide[:, 3:3 + k_dim]
        weights = rand(gen, experts, n_out, k_dim, target=target, scale=k_dim ** -0.5)
        ids = torch.randint(-1, experts, (tokens, per_token), generator=gen)
        with poisoned_allocations():
            out = target.ops.expert_gemv(x, weights, ids.to(target.device))
        assert out.shape == (tokens, per_token, n_out) and out.dtype == x.dtype
        foreign = ids < 0
        assert torch.equal(out.cpu()[foreign].float(), torch.zeros(int(foreign.sum()), n_out)), "id -1 row not zero"
        if not foreign.all():
            assert_close(out[~foreign.to(out.device)], expert_gemv_truth(x, weights, ids)[~foreign], target.tol,
                         f"expert_gemv tokens={tokens} ids={ids}")

    cases = st.tuples(st.integers(1, 6), st.sampled_from([1, 2, 6]), st.integers(1, 8), st.sampled_from([1, 40, 96]),
                      st.sampled_from([16, 88, 300]), st.integers(0, 2**16))
    run_cases(target, cases, check, must=[(1, 6, 4, 96, 300, 1), (1, 1, 1, 1, 16, 2), (6, 2, 2, 40, 88, 7),
                                          (12, 1, 8, 96, 88, 3)])

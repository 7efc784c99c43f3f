"""decode_gemv (the few rows of a decode step through a weight) against float64 math written here."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from primitives_checks import assert_close, poisoned_allocations, rand, run_cases


def gemv_truth(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
    """[M, N] float64: silu(gate) * up of x's halves (when ``silu_mul``), times weight.T, plus bias."""
    x64 = x.cpu().double()
    if silu_mul:
        gate, up = x64.chunk(2, dim=-1)
        x64 = F.silu(gate) * up
    out = x64 @ weight.cpu().double().T
    return out if bias is None else out + bias.cpu().double()


def run_gemv(target, rows, n_out, k_dim, with_bias, silu_mul, seed, weight_dtype=None, **config):
    gen = torch.Generator().manual_seed(seed)
    width = 2 * k_dim if silu_mul else k_dim
    wide = rand(gen, rows, width + 8, target=target)
    x = wide[:, 5:5 + width]  # a strided row view, as a column slice of a fused projection
    weight = rand(gen, n_out, k_dim, target=target, scale=k_dim ** -0.5)
    if weight_dtype is not None:
        weight = weight.to(weight_dtype)
    bias = rand(gen, n_out, target=target) if with_bias else None
    with poisoned_allocations():
        out = target.ops.decode_gemv(x, weight, bias, "silu_mul" if silu_mul else None, **config)
    assert out.shape == (rows, n_out) and out.dtype == torch.promote_types(x.dtype, weight.dtype)
    assert_close(out, gemv_truth(x, weight, bias, silu_mul), target.tol,
                 f"decode_gemv rows={rows} n={n_out} k={k_dim} bias={with_bias} silu_mul={silu_mul} {config}")


def test_decode_gemv_matches_float64(target):
    """1 to 8 rows (a decode step's batch), widths that are not multiples of the kernel's blocks,
    bias or none, the SiLU-and-mul prologue (x = gate | up) or none, strided rows."""
    def check(case):
        run_gemv(target, *case)

    cases = st.tuples(st.integers(1, 8), st.sampled_from([1, 17, 48, 100]), st.sampled_from([16, 40, 136, 300]),
                      st.booleans(), st.booleans(), st.integers(0, 2**16))
    run_cases(target, cases, check, must=[(1, 48, 136, False, True, 1), (8, 17, 300, True, False, 2),
                                          (3, 100, 40, True, True, 3)])


@pytest.mark.parametrize("split_k", [1, 2, 4, 8])
def test_decode_gemv_split_k_merges_every_split(target, split_k):
    """The Triton GEMV at every split count (the last split of a column block adds the others'
    partial sums): K = 300 in 128-wide chunks gives splits of 128, 128 and 44 columns, and at 4
    and 8 splits some splits are empty; two calls in a row (the arrival counters reset)."""
    if "triton" not in target.module:
        pytest.skip("the split count is a Triton-backend knob")
    from engine.model.kernels.triton.gemv import GemvConfig

    for seed in (split_k, split_k + 100):
        run_gemv(target, 5, 40, 300, True, split_k % 2 == 0, seed, config=GemvConfig(16, 128, split_k, 4))


@pytest.mark.parametrize("rows, split_k", [(1, 1), (3, 4), (4, 2)])
def test_decode_gemv_rows_only_tile_matches_float64(target, rows, split_k):
    """The Triton GEMV's tile of just the rows there are (``fma``: float32 FMAs, 1-4 rows padded to
    a power of two, not to 16), unsplit and split, with and without the SiLU-and-mul prologue and
    bias, against float64; more rows than it takes is an error naming the limit."""
    if "triton" not in target.module:
        pytest.skip("the tile is a Triton-backend knob")
    from engine.model.kernels.triton.gemv import FMA_MAX_ROWS, GemvConfig

    config = GemvConfig(16, 128, split_k, 4, fma=True)
    run_gemv(target, rows, 40, 300, rows % 2 == 1, split_k > 1, rows * 7 + split_k, config=config)
    with pytest.raises(ValueError, match=f"at most {FMA_MAX_ROWS}"):
        run_gemv(target, FMA_MAX_ROWS + 1, 40, 300, False, False, 0, config=config)


@pytest.mark.cuda
def test_decode_gemv_bf16_rows_against_a_float32_weight(target):
    """MoE's router: bf16 activations against its float32 weight give float32 logits, the rows
    upcast exactly (float32 products), never rounded to bf16."""
    run_gemv(target, 4, 64, 2048, False, False, 5, weight_dtype=torch.float32)

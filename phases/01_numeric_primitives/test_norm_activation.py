"""rms_norm, fused_add_rms_norm and silu_and_mul against float64 math, on every backend present."""
from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from phases.assertions import assert_close as check_close
from primitives_checks import assert_close, rand, run_cases

EPS = 1e-6
SEEDS = st.integers(0, 2**31 - 1)


def rows(target):
    """(tokens, hidden) with at most ~64K elements: CI's CPU time is shared, wide rows come with fewer tokens."""
    return st.sampled_from([64, 128, 200, 576, 1024, 4096]).flatmap(
        lambda hidden: st.tuples(st.integers(1, min(target.max_tokens, 65536 // hidden)), st.just(hidden)))


def rms_norm_truth(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x, weight = x.double().cpu(), weight.double().cpu()
    return x / (x.pow(2).sum(-1, keepdim=True) / x.shape[-1] + eps).sqrt() * weight


def test_rms_norm_matches_float64(target):
    def check(case):
        (tokens, hidden), seed = case
        gen = torch.Generator().manual_seed(seed)
        x = rand(gen, tokens, hidden, target=target, scale=3.0)
        weight = 1 + 0.1 * rand(gen, hidden, target=target)
        out = torch.full_like(x, float("nan"))
        target.ops.rms_norm(out, x, weight, EPS)
        assert_close(out, rms_norm_truth(x, weight, EPS), target.tol, "rms_norm")

    run_cases(target, st.tuples(rows(target), SEEDS), check)


def test_rms_norm_on_strided_per_head_view(target):
    """FM-002: the per-head Q/K norm input is a non-contiguous [T, H, D] view of the fused QKV output."""
    def check(case):
        tokens, heads, head_dim, seed = case
        gen = torch.Generator().manual_seed(seed)
        qkv = rand(gen, tokens, (heads + 2) * head_dim, target=target)
        q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
        assert not q.is_contiguous() or tokens == 1
        weight = 1 + 0.1 * rand(gen, head_dim, target=target)
        out = torch.full((tokens, heads, head_dim), float("nan"), dtype=target.dtype, device=target.device)
        target.ops.rms_norm(out, q, weight, EPS)
        assert_close(out, rms_norm_truth(q, weight, EPS), target.tol, "rms_norm on a strided view")

    run_cases(target, st.tuples(st.integers(1, target.max_tokens), st.sampled_from([1, 4, 8, 32]),
                                st.sampled_from([64, 128]), SEEDS), check)


def test_rms_norm_in_place_on_a_column_slice(target):
    """``out`` may be ``input`` itself: MLA normalises the latent's first ``kv_lora_rank`` columns
    in place inside the wider ``[T, rank + rope]`` projection, leaving the rope columns as they were."""
    def check(case):
        tokens, rank, rope, seed = case
        gen = torch.Generator().manual_seed(seed)
        latent = rand(gen, tokens, rank + rope, target=target, scale=3.0)
        before = latent.clone()
        weight = 1 + 0.1 * rand(gen, rank, target=target)
        target.ops.rms_norm(latent[:, :rank], latent[:, :rank], weight, EPS)
        assert_close(latent[:, :rank], rms_norm_truth(before[:, :rank], weight, EPS), target.tol, "rms_norm in place")
        assert torch.equal(latent[:, rank:], before[:, rank:]), "in-place rms_norm wrote past its columns"

    run_cases(target, st.tuples(st.integers(1, target.max_tokens), st.sampled_from([64, 512]),
                                st.sampled_from([16, 64]), SEEDS), check)


def test_fused_add_rms_norm_updates_both_in_place(target):
    def check(case):
        (tokens, hidden), seed = case
        gen = torch.Generator().manual_seed(seed)
        x = rand(gen, tokens, hidden, target=target)
        residual = rand(gen, tokens, hidden, target=target, scale=4.0)
        weight = 1 + 0.1 * rand(gen, hidden, target=target)
        summed = x.double().cpu() + residual.double().cpu()
        target.ops.fused_add_rms_norm(x, residual, weight, EPS)
        assert_close(residual, summed, target.tol / 4, "fused_add_rms_norm residual")
        assert_close(x, rms_norm_truth(summed, weight, EPS), target.tol, "fused_add_rms_norm output")

    run_cases(target, st.tuples(rows(target), SEEDS), check)


def test_silu_and_mul_matches_float64(target):
    def check(case):
        (tokens, half), seed = case
        gen = torch.Generator().manual_seed(seed)
        x = rand(gen, tokens, 2 * half, target=target, scale=2.0)
        out = torch.full((tokens, half), float("nan"), dtype=target.dtype, device=target.device)
        target.ops.silu_and_mul(out, x)
        gate, up = x.double().cpu()[:, :half], x.double().cpu()[:, half:]
        assert_close(out, gate / (1 + torch.exp(-gate)) * up, target.tol, "silu_and_mul")

    run_cases(target, st.tuples(rows(target), SEEDS), check)


def test_triton_rms_norm_refuses_a_non_unit_last_stride():
    """FM-002's fix: a view the Triton kernel cannot read (last stride != 1) is a ValueError,
    never a hidden copy. Checked on the kernel wrapper itself, so it runs without a GPU."""
    pytest.importorskip("triton")
    from engine.model.kernels.triton import norm

    x = torch.randn(4, 64)[:, ::2]
    with pytest.raises(ValueError, match="contiguous last dim"):
        norm.rms_norm(torch.empty(4, 32), x, torch.ones(32), EPS)


SCALES = (0.0, 1e-4, 1e-3, 3e-3, 1.0, 30.0)


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rms_norm_at_every_input_scale_including_zero_rows(target, eps):
    """FM-047: eps matters only when mean(x^2) is near it, so inputs of scale ~1 cannot tell a dropped or
    misplaced eps. Rows at scales 0 (all zero: the output must be exactly 0, not NaN) up to 30, through
    rms_norm and fused_add_rms_norm."""
    gen = torch.Generator().manual_seed(47)
    hidden, per_scale = 128, 3
    x = torch.cat([rand(gen, per_scale, hidden, target=target, scale=s) for s in SCALES])
    weight = 1 + 0.1 * rand(gen, hidden, target=target)
    truth = rms_norm_truth(x, weight, eps)
    out = torch.full_like(x, float("nan"))
    target.ops.rms_norm(out, x, weight, eps)
    half = x / 2
    fused_in, residual = half.clone(), x - half
    target.ops.fused_add_rms_norm(fused_in, residual, weight, eps)
    for i, scale in enumerate(SCALES):
        rows_ = slice(i * per_scale, (i + 1) * per_scale)
        where = f"input scale {scale:g}, eps {eps:g}"
        check_close(out[rows_], truth[rows_], target.tol, "rms_norm", where)
        check_close(fused_in[rows_], rms_norm_truth(residual[rows_], weight, eps), target.tol,
                    "fused_add_rms_norm", where)

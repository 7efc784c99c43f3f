"""qk_norm_rope_store (Qwen's attention prologue in one op) against float64 math written here."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from engine.model.kernels import get_cos_sin_cache
from primitives_checks import assert_close, rand, run_cases


def norm_rope_truth(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                    sin: torch.Tensor) -> torch.Tensor:
    """float64 per-head RMSNorm (if ``weight``) then neox rotation; ``cos``/``sin`` [T, D/2]."""
    x = x.cpu().double()
    if weight is not None:
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.cpu().double()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def test_qk_norm_rope_store_matches_float64(target):
    """q and k normed (Qwen3) or not (Qwen2) and rotated in place, strided views of one fused
    QKV row as the model passes them; rotated K and V land in their slots, slot -1 and every
    other slot stay bit-identical."""
    def check(case):
        tokens, heads, kv_heads, head_dim, with_norm, seed = case
        gen = torch.Generator().manual_seed(seed)
        block_size, num_blocks, eps = 16, tokens // 16 + 2, 1e-6
        qkv = rand(gen, tokens, (heads + 2 * kv_heads) * head_dim, target=target, scale=3.0)
        q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
        k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
        v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
        weights = [1 + 0.2 * rand(gen, head_dim, target=target) for _ in range(2)] if with_norm else [None, None]
        positions = torch.randint(0, 300, (tokens,), generator=gen)
        cache, _ = get_cos_sin_cache(300, head_dim, 1e6, device=target.device)
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
        slots[::3] = -1
        k_cache, v_cache = (rand(gen, num_blocks, block_size, kv_heads, head_dim, target=target) for _ in range(2))
        cos, sin = cache.cpu().double()[positions].chunk(2, dim=-1)
        want_q = norm_rope_truth(q, weights[0], eps, cos, sin)
        want_k = norm_rope_truth(k, weights[1], eps, cos, sin)
        want_v, k_before, v_before = v.cpu().clone(), k_cache.cpu().clone(), v_cache.cpu().clone()

        target.ops.qk_norm_rope_store(positions.to(target.device), q, k, v, *weights, eps, cache, k_cache, v_cache,
                                      slots.to(target.device))
        assert_close(q, want_q, target.tol, "q normed and rotated in place")
        assert_close(k, want_k, target.tol, "k normed and rotated in place")
        written = slots >= 0
        flat_k, flat_v = k_cache.cpu().flatten(0, 1), v_cache.cpu().flatten(0, 1)
        assert torch.equal(flat_k[slots[written]], k.cpu()[written]), "cached K is not the rotated K"
        assert torch.equal(flat_v[slots[written]], want_v[written]), "cached V is not V"
        untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
        untouched[slots[written]] = False
        assert torch.equal(flat_k[untouched], k_before.flatten(0, 1)[untouched]), "a K slot not in the step changed"
        assert torch.equal(flat_v[untouched], v_before.flatten(0, 1)[untouched]), "a V slot not in the step changed"

    must = [(5, 8, 2, 128, True, 1), (3, 4, 4, 64, False, 2)]
    run_cases(target, st.tuples(st.integers(1, min(target.max_tokens, 40)), st.sampled_from([2, 4, 16, 40]),
                                st.sampled_from([1, 2]), st.sampled_from([64, 128]), st.booleans(),
                                st.integers(0, 2**31 - 1)).filter(lambda c: c[1] % c[2] == 0), check, must)

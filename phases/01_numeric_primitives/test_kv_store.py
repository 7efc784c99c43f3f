"""store_kv_cache: rows land in their slots, slot -1 and every other slot stay untouched, bit for bit."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from primitives_checks import rand, run_cases


def test_store_kv_cache_writes_slots_and_skips_padding(target):
    def check(case):
        tokens, kv_heads, head_dim, block_size, with_value, padding_share, strided, seed = case
        gen = torch.Generator().manual_seed(seed)
        num_blocks = tokens // block_size + 2
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
        slots[torch.rand(tokens, generator=gen) < padding_share] = -1
        key = rand(gen, tokens, kv_heads, head_dim, target=target)
        if strided:  # K as a per-head view of a wider fused projection output (row stride > Hk * D)
            key = torch.cat([key.flatten(1), torch.zeros_like(key.flatten(1))], dim=1)[:, : kv_heads * head_dim]
            key = key.view(tokens, kv_heads, head_dim)
        value = rand(gen, tokens, kv_heads, head_dim // 2, target=target) if with_value else None
        k_cache = rand(gen, num_blocks, block_size, kv_heads, head_dim, target=target)  # random, never zeros
        v_cache = rand(gen, num_blocks, block_size, kv_heads, head_dim // 2, target=target) if with_value else None
        want = [(k_cache.cpu().clone(), key.cpu())] + ([(v_cache.cpu().clone(), value.cpu())] if with_value else [])
        for cache, rows in want:
            flat = cache.view(-1, *cache.shape[2:])
            for row, slot in enumerate(slots.tolist()):
                if slot >= 0:
                    flat[slot] = rows[row]
        target.ops.store_kv_cache(key, value, k_cache, v_cache, slots.to(target.device))
        assert torch.equal(k_cache.cpu(), want[0][0]), "k_cache differs (a row misplaced, or slot -1 written)"
        if with_value:
            assert torch.equal(v_cache.cpu(), want[1][0]), "v_cache differs (a row misplaced, or slot -1 written)"

    # a strided key with a value cache and some padding, and MLA's 576-wide latent row
    must = [(7, 2, 128, 16, True, 0.3, True, 3), (5, 1, 576, 16, False, 0.3, False, 4)]
    run_cases(target, st.tuples(st.integers(1, target.max_tokens), st.sampled_from([1, 2, 8]),
                                st.sampled_from([64, 128, 576]), st.sampled_from([16, 256]), st.booleans(),
                                st.sampled_from([0.0, 0.3, 1.0]), st.booleans(), st.integers(0, 2**31 - 1)),
              check, must)

"""An FP8 (e4m3) KV cache: the store ops write each value clamped to ±448 and rounded to e4m3
(scale 1), and the decode attention reads it as those values, against float64 math here."""
from __future__ import annotations

import pytest
import torch

from engine.model.kernels import get_cos_sin_cache
from primitives_checks import assert_close, rand
from test_attention import decode_truth, paged_case

E4M3 = torch.float8_e4m3fn


def e4m3_of(x: torch.Tensor) -> torch.Tensor:
    """The format's value of ``x``: saturated at ±448, then torch's round-to-nearest cast."""
    return x.cpu().float().clamp(-448.0, 448.0).to(E4M3)


def assert_e4m3_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal e4m3 values; at and below e4m3's smallest normal (2^-6) within one subnormal step
    (2^-9), the kernels' cast rounding there in float32 first."""
    got, want = got.cpu().float(), want.float()
    normal = want.abs() > 2.0 ** -6
    assert torch.equal(got[normal], want[normal]), f"{what}: e4m3 values differ"
    assert (got - want).abs().max() <= 2.0 ** -9, f"{what}: a subnormal off by more than one step"


@pytest.mark.parametrize("with_value", [True, False])
def test_store_into_an_fp8_cache_saturates_and_rounds(target, with_value):
    """Rows of the target dtype (magnitudes up to 10^3, past e4m3's ±448, and down to its
    subnormals) land in their slots as e4m3 of the row; slot -1 and every other slot keep
    their old bits; no NaN (an unclamped cast makes NaN of 464 and above)."""
    gen = torch.Generator().manual_seed(7 + with_value)
    tokens, heads, dim, block_size, num_blocks = 9, 2, 64, 16, 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[2] = -1
    magnitude = 10.0 ** torch.randint(-4, 4, (tokens, heads, 1), generator=gen)
    key = (rand(gen, tokens, heads, dim, target=target).cpu() * magnitude).to(target.dtype).to(target.device)
    value = (rand(gen, tokens, heads, dim, target=target) * 600).to(target.dtype) if with_value else None
    k_cache = e4m3_of(torch.randn(num_blocks, block_size, heads, dim, generator=gen)).to(target.device)
    v_cache = e4m3_of(torch.randn(num_blocks, block_size, heads, dim, generator=gen)).to(target.device) \
        if with_value else None
    want = [(k_cache.cpu().clone(), key)] + ([(v_cache.cpu().clone(), value)] if with_value else [])
    for cache, rows in want:
        flat = cache.view(-1, heads, dim)
        for row, slot in enumerate(slots.tolist()):
            if slot >= 0:
                flat[slot] = e4m3_of(rows[row])
    target.ops.store_kv_cache(key, value, k_cache, v_cache, slots.to(target.device))
    assert_e4m3_equal(k_cache, want[0][0], "k_cache")
    assert not k_cache.cpu().float().isnan().any()
    if with_value:
        assert_e4m3_equal(v_cache, want[1][0], "v_cache")


TRITON_KNOBS = [dict(block_n=64, num_stages=2), dict(block_n=16, num_stages=1), dict(fp16_dots=True),
                dict(fp16_dots=False, block_n=32), dict(block_n=128, num_stages=3, fp16_dots=True, max_registers=128),
                dict(block_n=128, num_stages=3, fp16_dots=True, chunks=4), dict(fp16_dots=False, chunks=2, block_n=16)]


@pytest.mark.parametrize("latent,knobs", [(False, {}), (True, {})] + [(False, k) for k in TRITON_KNOBS]
                         + [(True, dict(fp16_dots=True))])
def test_paged_decode_reads_an_fp8_cache(target, latent, knobs):
    """Decode attention over e4m3 caches (GQA 4, block size 16, contexts across blocks; MLA's one
    512 + 64 latent head with V its first 512 channels) equals float64 attention over the
    cache's e4m3 values, the query in the target dtype; on the Triton backend also with its other
    launches: key tiles (``block_n``, ``num_stages``) of 64 tokens (a bf16 cache's) and 16, one
    cache block per loop step (the default, 128, is wider than every context); dots in fp16
    (``fp16_dots``, the default under a bf16 query) and in the query's dtype; registers capped
    (``max_registers``: on the GPU a compile that spills); keys and values in 4 and 2 column
    chunks (``chunks``)."""
    if knobs and "triton" not in target.module:
        pytest.skip("the launch knobs are the Triton backend's")
    gen = torch.Generator().manual_seed(11 + latent)
    kv_heads, ratio, dim, v_dim = (1, 16, 576, 512) if latent else (2, 4, 128, 128)
    block_size, context_lens = 16, [1, 17, 40]
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 2
    q = rand(gen, len(context_lens), kv_heads * ratio, dim, target=target)
    k_cache = e4m3_of(torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen) * 4).to(target.device)
    v_cache = None if latent else e4m3_of(torch.randn(num_blocks, block_size, kv_heads, v_dim, generator=gen)) \
        .to(target.device)
    tables = paged_case(num_blocks, block_size, context_lens, gen)
    scale = dim ** -0.5
    out = target.ops.paged_decode_attention(q, k_cache, v_cache, tables.to(target.device),
                                            torch.tensor(context_lens, dtype=torch.int32, device=target.device),
                                            scale, v_dim if latent else None, **knobs)
    assert out.dtype == q.dtype
    want = decode_truth(q, k_cache.cpu().double(), None if latent else v_cache.cpu().double(), tables, context_lens,
                        scale, v_dim)
    # fp16 dots round q and the softmax weights to fp16 (2^-11 relative): bf16's tolerance, finer
    # than a float32 target's
    tol = max(target.tol, 2e-3) if knobs.get("fp16_dots") else target.tol
    assert_close(out, want, tol, f"paged decode over an e4m3 cache (latent={latent}, knobs={knobs})")


def test_qk_norm_rope_store_into_an_fp8_cache(target):
    """The fused prologue writes into e4m3 caches the e4m3 of the K / V rows it writes into caches
    of the key's dtype (rotated K rounded to the key's dtype first, as the unfused store would
    copy it), and leaves q and k as it does then."""
    gen = torch.Generator().manual_seed(3)
    tokens, q_heads, kv_heads, dim, block_size = 5, 4, 2, 64, 16
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(target.device)
    q, k, v = (rand(gen, tokens, heads, dim, target=target) * 30 for heads in (q_heads, kv_heads, kv_heads))
    q_weight, k_weight = (rand(gen, dim, target=target) for _ in range(2))
    cos_sin, _ = get_cos_sin_cache(64, dim, 1e6, device=target.device)
    slots = torch.tensor([3, 20, -1, 7, 40], device=target.device)
    results = {}
    for dtype in (target.dtype, E4M3):
        caches = [torch.zeros(3, block_size, kv_heads, dim, dtype=dtype, device=target.device) for _ in range(2)]
        qq, kk = q.clone(), k.clone()
        target.ops.qk_norm_rope_store(positions, qq, kk, v, q_weight, k_weight, 1e-6, cos_sin, *caches, slots)
        results[dtype] = qq, kk, caches
    (q_plain, k_plain, plain), (q_fp8, k_fp8, fp8) = results[target.dtype], results[E4M3]
    assert torch.equal(q_plain, q_fp8) and torch.equal(k_plain, k_fp8)
    for name, ours, reference in zip("kv", fp8, plain):
        assert_e4m3_equal(ours, e4m3_of(reference), f"{name}_cache")

"""Rotary embedding and its cos/sin cache: float64 math, then HF transformers' own code as a second oracle."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import strategies as st

from engine.model.kernels import get_cos_sin_cache
from primitives_checks import assert_close, rand, run_cases

BASE = 10000.0
MAX_POSITION = 4096
YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}
YARN_UNEVEN_MSCALE = {**YARN, "mscale": 1.0, "mscale_all_dim": 0.8}  # cos/sin carry a factor != 1 too
LLAMA3_1 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}  # Llama 3.1 as published (rope_theta 500000)
LLAMA3_OFF_DEFAULT = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                      "original_max_position_embeddings": 4096}


def test_cos_sin_cache_is_max_position_by_rotary_dim_cos_then_sin():
    """FM-004: [max_position, rotary_dim] (not [.., 2 * head_size]), cos half then sin half, float64-exact."""
    cache, attn_scale = get_cos_sin_cache(1000, 48, BASE)
    assert cache.shape == (1000, 48) and attn_scale == 1.0
    angles = torch.arange(1000, dtype=torch.float64)[:, None] * BASE ** (-torch.arange(24, dtype=torch.float64) / 24)
    assert_close(cache[:, :24], angles.cos(), 1e-6, "cos half")
    assert_close(cache[:, 24:], angles.sin(), 1e-6, "sin half")


def test_cos_sin_cache_registry_shares_one_tensor_per_parameter_set():
    """FM-004: 36 layers asking for the same table get one tensor; any differing parameter gets another."""
    first, _ = get_cos_sin_cache(512, 64, BASE)
    assert get_cos_sin_cache(512, 64, BASE)[0] is first
    others = [get_cos_sin_cache(512, 32, BASE)[0], get_cos_sin_cache(256, 64, BASE)[0],
              get_cos_sin_cache(512, 64, 5e5)[0], get_cos_sin_cache(512, 64, BASE, YARN)[0],
              get_cos_sin_cache(512, 64, BASE, dtype=torch.bfloat16)[0]]
    assert all(o is not first for o in others)


def test_cos_sin_cache_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rotary_dim"):
        get_cos_sin_cache(16, 7, BASE)
    with pytest.raises(ValueError, match="rope scaling"):
        get_cos_sin_cache(16, 8, BASE, {"rope_type": "longrope"})
    with pytest.raises(ValueError, match="llama3 lacks low_freq_factor"):
        get_cos_sin_cache(16, 8, BASE, {k: v for k, v in LLAMA3_1.items() if k != "low_freq_factor"})


def rotary_truth(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, is_neox: bool) -> torch.Tensor:
    """Each channel pair as a complex number times exp(i * position * base^(-2j / rotary_dim)), in float64."""
    x = x.double().cpu().clone()
    rot = x[..., :rotary_dim]
    if is_neox:
        pairs = torch.complex(rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:])
    else:
        pairs = torch.view_as_complex(rot.reshape(*rot.shape[:-1], rotary_dim // 2, 2).contiguous())
    freqs = BASE ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = positions.cpu().double()[:, None] * freqs
    turned = pairs * torch.polar(torch.ones((), dtype=torch.float64), angles)[:, None, :]
    if is_neox:
        x[..., :rotary_dim] = torch.cat([turned.real, turned.imag], dim=-1)
    else:
        x[..., :rotary_dim] = torch.view_as_real(turned).flatten(-2)
    return x


def test_rotary_both_styles_match_float64(target):
    """FM-007: neox (half split) and GPT-J (interleaved), partial rotary dims, GQA, strided views of fused QKV."""
    def check(case):
        tokens, kv_heads, ratio, head_size, partial, is_neox, with_key, seed = case
        gen = torch.Generator().manual_seed(seed)
        heads, rotary_dim = kv_heads * ratio, head_size // partial
        qkv = rand(gen, tokens, (heads + 2 * kv_heads) * head_size, target=target)
        query = qkv[:, : heads * head_size].view(tokens, heads, head_size)
        key = qkv[:, heads * head_size: (heads + kv_heads) * head_size].view(tokens, kv_heads, head_size)
        positions = torch.randint(0, MAX_POSITION, (tokens,), generator=gen).to(target.device)
        cache, _ = get_cos_sin_cache(MAX_POSITION, rotary_dim, BASE, dtype=target.dtype, device=target.device)
        want_q, want_k = (rotary_truth(t, positions, rotary_dim, is_neox) for t in (query, key))
        key_before, value_before = key.clone(), qkv[:, (heads + kv_heads) * head_size:].clone()
        target.ops.rotary_embedding(positions, query, key if with_key else None, head_size, cache, is_neox)
        assert_close(query, want_q, target.tol, "query")
        if with_key:
            assert_close(key, want_k, target.tol, "key")
        else:
            assert torch.equal(key, key_before), "key=None must leave the key columns alone"
        assert torch.equal(qkv[:, (heads + kv_heads) * head_size:], value_before), "rotary wrote outside q/k"

    def with_tokens(shape):  # at most ~128K elements in q/k/v
        kv_heads, ratio, head_size = shape
        width = (kv_heads * ratio + 2 * kv_heads) * head_size
        return st.integers(1, min(target.max_tokens, 131072 // width)).map(lambda t: (t, *shape))

    shapes = st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]), st.sampled_from([64, 128]))
    run_cases(target, st.tuples(shapes.flatmap(with_tokens), st.sampled_from([1, 2]), st.booleans(), st.booleans(),
                                st.integers(0, 2**31 - 1)).map(lambda c: (*c[0], *c[1:])), check)


def test_rotary_neox_matches_hf_qwen3(target):
    """Second oracle: transformers' Qwen3 rotary embedding + apply_rotary_pos_emb (neox)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    config = Qwen3Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                         max_position_embeddings=MAX_POSITION, rope_theta=1e6)
    gen = torch.Generator().manual_seed(1)
    tokens = min(target.max_tokens, 64)
    q, k = torch.randn(tokens, 4, 128, generator=gen), torch.randn(tokens, 2, 128, generator=gen)
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=gen)
    cos, sin = Qwen3RotaryEmbedding(config)(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)

    cache, _ = get_cos_sin_cache(MAX_POSITION, 128, 1e6, dtype=target.dtype, device=target.device)
    query, key = q.to(target.dtype).to(target.device), k.to(target.dtype).to(target.device)
    target.ops.rotary_embedding(positions.to(target.device), query, key, 128, cache, True)
    tol = max(target.tol, 1e-3)  # HF computes the angles in float32
    assert_close(query, want_q[0].transpose(0, 1), tol, "query vs HF Qwen3")
    assert_close(key, want_k[0].transpose(0, 1), tol, "key vs HF Qwen3")


@pytest.mark.parametrize("scaling", [YARN, YARN_UNEVEN_MSCALE], ids=["mscale-equal", "mscale-uneven"])
def test_rotary_gptj_yarn_matches_hf_deepseek_v2(target, scaling):
    """Second oracle: transformers' DeepSeek-V2 YaRN rotary (complex pairs = interleaved, is_neox=False)
    on q_pe / k_pe, and the softmax-scale correction its attention applies (mscale_all_dim squared)."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
        DeepseekV2Attention,
        DeepseekV2RotaryEmbedding,
        apply_rotary_emb,
    )

    max_position = 163840
    config = DeepseekV2Config(hidden_size=256, num_attention_heads=4, kv_lora_rank=64, q_lora_rank=None,
                              qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                              max_position_embeddings=max_position, rope_scaling=dict(scaling))
    gen = torch.Generator().manual_seed(2)
    tokens = min(target.max_tokens, 64)
    q_pe, k_pe = torch.randn(tokens, 4, 64, generator=gen), torch.randn(tokens, 1, 64, generator=gen)
    positions = torch.randint(0, 32768, (tokens,), generator=gen)
    freqs_cis = DeepseekV2RotaryEmbedding(config)(q_pe, positions[None])
    want_q, want_k = apply_rotary_emb(q_pe.transpose(0, 1)[None], k_pe.transpose(0, 1)[None], freqs_cis)

    cache, attn_scale = get_cos_sin_cache(max_position, 64, 10000.0, scaling, dtype=target.dtype,
                                          device=target.device)
    hf_scale = DeepseekV2Attention(config, layer_idx=0).scaling / (128 + 64) ** -0.5
    assert math.isclose(attn_scale, hf_scale, rel_tol=1e-12), (attn_scale, hf_scale)
    query, key = q_pe.to(target.dtype).to(target.device), k_pe.to(target.dtype).to(target.device)
    target.ops.rotary_embedding(positions.to(target.device), query, key, 64, cache, False)
    tol = max(target.tol, 1e-3)  # HF computes the angles in float32
    assert_close(query, want_q[0].transpose(0, 1), tol, "q_pe vs HF DeepSeek-V2")
    assert_close(key, want_k[0].transpose(0, 1), tol, "k_pe vs HF DeepSeek-V2")

    wrong_style = q_pe.to(target.dtype).to(target.device)
    target.ops.rotary_embedding(positions.to(target.device), wrong_style, None, 64, cache, True)
    err = (wrong_style.double().cpu() - want_q[0].transpose(0, 1).double()).norm() / want_q.double().norm()
    assert err > 0.1, "neox and GPT-J styles must not be interchangeable (FM-007)"


@pytest.mark.parametrize("scaling", [LLAMA3_1, LLAMA3_OFF_DEFAULT], ids=["llama3.1", "off-default-factors"])
def test_rotary_llama3_scaling_matches_hf_llama(target, scaling):
    """Second oracle: transformers' Llama rotary embedding with llama3 scaling (frequencies from
    ``_compute_llama3_parameters``: short wavelengths kept, long ones divided by ``factor``, the
    band between blended) and its q/k rotation at positions up to 4x (8x) past the original context.
    Linear scaling (every frequency divided by ``factor``) is far from HF's, so it fails here."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    max_position, base = 32768, 500000.0
    config = LlamaConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_position, rope_parameters={**scaling, "rope_theta": base})
    rotary = LlamaRotaryEmbedding(config)
    hf_freqs = rotary.inv_freq.double()
    table, attn_scale = get_cos_sin_cache(max_position, 128, base, scaling, dtype=torch.float64)
    assert attn_scale == 1.0 and rotary.attention_scaling == 1.0
    assert_close(torch.atan2(table[1, 64:], table[1, :64]), hf_freqs, 1e-6, "llama3 frequencies vs HF")
    linear = base ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128) / scaling["factor"]
    assert ((linear - hf_freqs).abs() / hf_freqs).max() > 0.5, "linear scaling must not pass for llama3"

    gen = torch.Generator().manual_seed(3)
    tokens = min(target.max_tokens, 64)
    q, k = torch.randn(tokens, 4, 128, generator=gen), torch.randn(tokens, 2, 128, generator=gen)
    positions = torch.randint(0, max_position, (tokens,), generator=gen)
    cos, sin = rotary(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cache, _ = get_cos_sin_cache(max_position, 128, base, scaling, dtype=target.dtype, device=target.device)
    query, key = q.to(target.dtype).to(target.device), k.to(target.dtype).to(target.device)
    target.ops.rotary_embedding(positions.to(target.device), query, key, 128, cache, True)
    tol = max(target.tol, 1e-3)  # HF computes the angles in float32
    assert_close(query, want_q[0].transpose(0, 1), tol, "query vs HF Llama (llama3 scaling)")
    assert_close(key, want_k[0].transpose(0, 1), tol, "key vs HF Llama (llama3 scaling)")

"""vllm / flash-attn backend: the kernel ops over ``vllm._custom_ops`` and ``flash_attn``.

Opt-in (``AGENT_INFER_KERNELS=vllm``; both packages must import). ``expert_gemv``,
``qk_norm_rope_store`` and ``decode_gemv`` have no vllm counterpart here and are Triton's. Cases those libraries do not
cover use the Triton kernels instead: MLA's single latent cache (``value`` /
``v_cache`` None), value head dims that differ from the query's, paged
blocks that are not a multiple of 256 (flash_attn_with_kvcache's minimum), an FP8 KV cache, and an
``rms_norm`` whose ``out`` is strided or is its input (MLA's in-place latent norm).
"""
from __future__ import annotations

import functools

import torch
import vllm._custom_ops as vllm_ops
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from engine.model.kernels import triton as triton_ops

_FLASH_PAGE_MULTIPLE = 256


@functools.cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    if not out.is_contiguous() or out.data_ptr() == input.data_ptr():  # vllm: contiguous, unaliased out
        triton_ops.rms_norm(out, input, weight, eps)
        return
    vllm_ops.rms_norm(out, input, weight, eps)


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    vllm_ops.fused_add_rms_norm(input, residual, weight, eps)


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    torch.ops._C.silu_and_mul(out, input)  # registered by importing vllm._custom_ops


_cos_sin_in_dtype: dict[tuple[int, torch.dtype], torch.Tensor] = {}


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """vllm's kernel reads the cache in the query's dtype: the float32 cache is cast once per
    (cache, dtype) and kept."""
    if cos_sin_cache.dtype != query.dtype:
        cast_key = (cos_sin_cache.data_ptr(), query.dtype)
        if cast_key not in _cos_sin_in_dtype:
            _cos_sin_in_dtype[cast_key] = cos_sin_cache.to(query.dtype)
        cos_sin_cache = _cos_sin_in_dtype[cast_key]
    vllm_ops.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


def store_kv_cache(key: torch.Tensor, value: torch.Tensor | None, k_cache: torch.Tensor,
                   v_cache: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
    if value is None or k_cache.dtype != key.dtype:  # MLA's latent, an FP8 cache: Triton's
        triton_ops.store_kv_cache(key, value, k_cache, v_cache, slot_mapping)
        return
    scale = _unit_scale(key.device)
    vllm_ops.reshape_and_cache_flash(key, value, k_cache, v_cache, slot_mapping, "auto", scale, scale)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     softmax_scale: float, causal: bool = True) -> torch.Tensor:
    if q.shape[2] != v.shape[2]:
        return triton_ops.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           softmax_scale, causal)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale=softmax_scale, causal=causal)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, softmax_scale: float,
                           v_head_dim: int | None = None, q_rope: torch.Tensor | None = None) -> torch.Tensor:
    if v_cache is None or q_rope is not None or k_cache.shape[1] % _FLASH_PAGE_MULTIPLE or k_cache.dtype != q.dtype:
        return triton_ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, softmax_scale,
                                                 v_head_dim, q_rope)
    out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens,
                                  block_table=block_tables, softmax_scale=softmax_scale, causal=True)
    return out.squeeze(1)


expert_gemv = triton_ops.expert_gemv
qk_norm_rope_store = triton_ops.qk_norm_rope_store
decode_gemv = triton_ops.decode_gemv

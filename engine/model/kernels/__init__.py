"""Numeric primitives behind one interface (blueprint/contracts.md, phase 01).

Every op picks its backend from its first tensor's device: CPU tensors use the
torch reference (``reference.py``); CUDA tensors use ``triton``.
``AGENT_INFER_KERNELS=torch|triton|vllm`` (``KernelSettings.backend``, ``settings.py``: read
once per process, or set by an engine's config) forces the CUDA backend (vllm is opt-in: it
needs ``vllm._custom_ops`` and ``flash_attn``); forcing one that cannot run here is an
error. Each backend module is the dispatch table: it defines the same ten functions.
The wrappers below check shapes only (never tensor values), so they add no host sync.
"""
from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Callable

import torch

from engine.model.kernels.rope import get_cos_sin_cache
from engine.model.kernels.settings import BACKEND_ENV, KernelSettings, configure, current, using

__all__ = ["backend", "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding",
           "get_cos_sin_cache", "store_kv_cache", "varlen_attention", "paged_decode_attention", "expert_gemv",
           "qk_norm_rope_store", "decode_gemv", "KernelSettings", "configure", "current", "using"]

FP8_DTYPE = torch.float8_e4m3fn  # e4m3: FP8 weights (phase 12) and an FP8 KV cache
FP8_MAX = 448.0                  # its largest finite value: every cast to it saturates there, never NaN
DECODE_GEMV_MAX_ROWS = 8
_MODULES = {"torch": "engine.model.kernels.reference", "triton": "engine.model.kernels.triton",
            "vllm": "engine.model.kernels.vllm_backend"}


def _unavailable_reason(name: str) -> str | None:
    """Why backend ``name`` cannot run CUDA tensors here, or None if it can."""
    if name == "torch":
        return None
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        importlib.import_module("triton")
        if name == "vllm":
            importlib.import_module("vllm._custom_ops")
            importlib.import_module("flash_attn")
    except Exception as exc:  # a broken install fails in many ways; any of them means "not here"
        return f"{type(exc).__name__}: {exc}"
    return None


@functools.cache
def _select(device_type: str, forced: str | None) -> str:
    """The backend for ``device_type`` with ``forced`` (a ``KernelSettings.backend``)."""
    if device_type == "cpu":
        return "torch"
    if device_type != "cuda":
        raise ValueError(f"no kernel backend for device type {device_type!r}")
    if forced is not None:
        reason = _unavailable_reason(forced)
        if reason is not None:
            raise ValueError(f"{BACKEND_ENV}={forced} but that backend cannot run here ({reason})")
        return forced
    return next(name for name in ("triton", "torch") if _unavailable_reason(name) is None)


def backend(device: torch.device | str = "cuda") -> str:
    """Name of the backend that runs ops on ``device``: "torch", "triton" or "vllm"."""
    return _select(torch.device(device).type, current().backend)


@functools.cache
def _module(name: str) -> ModuleType:
    return importlib.import_module(_MODULES[name])


def _ops(tensor: torch.Tensor) -> ModuleType:
    return _module(_select(tensor.device.type, current().backend))


def _require(ok: bool, message: Callable[[], str]) -> None:
    """Raise ValueError(message()) unless ``ok``; the message is only built on failure (these
    checks run on every kernel call of the eager decode path)."""
    if not ok:
        raise ValueError(message())


def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """``out = input * rsqrt(mean(input**2, -1) + eps) * weight`` in float32, written into ``out``
    (same shape as ``input``: [..., H]; ``weight`` [H]; ``out`` may be ``input`` itself)."""
    _require(out.shape == input.shape, lambda: f"rms_norm: out {tuple(out.shape)} != input {tuple(input.shape)}")
    _require(weight.shape == input.shape[-1:], lambda: f"rms_norm: weight {tuple(weight.shape)} != [{input.shape[-1]}]")
    _ops(input).rms_norm(out, input, weight, eps)


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual += input``, then ``input = rms_norm(residual) * weight``."""
    _require(residual.shape == input.shape,
             lambda: f"fused_add_rms_norm: residual {tuple(residual.shape)} != input {tuple(input.shape)}")
    _require(weight.shape == input.shape[-1:],
             lambda: f"fused_add_rms_norm: weight {tuple(weight.shape)} != [{input.shape[-1]}]")
    _ops(input).fused_add_rms_norm(input, residual, weight, eps)


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """``out [..., d] = silu(input[..., :d]) * input[..., d:]`` for ``input [..., 2d]``."""
    _require(input.shape[-1] % 2 == 0 and out.shape == (*input.shape[:-1], input.shape[-1] // 2),
             lambda: f"silu_and_mul: input {tuple(input.shape)} needs an even last dim and out [..., half] "
             f"(got out {tuple(out.shape)})")
    _ops(input).silu_and_mul(out, input)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """Rotate ``query [T, Hq, D]`` and ``key [T, Hk, D]`` (or ``[T, H * D]``; key may be None) in place.

    ``positions [T]`` index rows of ``cos_sin_cache [max_pos, rotary_dim]`` (cos half | sin
    half); the first ``rotary_dim`` channels of each head rotate, the rest pass through.
    ``is_neox``: pairs are (i, i + rotary_dim/2) (Qwen); else (2i, 2i + 1) (GPT-J, DeepSeek).
    """
    rotary_dim = cos_sin_cache.shape[1]
    _require(rotary_dim % 2 == 0 and rotary_dim <= head_size,
             lambda: f"rotary_embedding: rotary dim {rotary_dim} must be even and <= head_size {head_size}")
    for name, x in (("query", query), ("key", key)):
        _require(x is None or (x.shape[0] == positions.shape[0] and x.shape[-1] % head_size == 0),
                 lambda: f"rotary_embedding: {name} {tuple(x.shape) if x is not None else None} does not match "
                 f"{positions.shape[0]} positions and head_size {head_size}")
    _ops(query).rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


def store_kv_cache(key: torch.Tensor, value: torch.Tensor | None, k_cache: torch.Tensor,
                   v_cache: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
    """Write row ``i`` of ``key [T, Hk, D]`` / ``value [T, Hk, Dv]`` to flat slot ``slot_mapping[i]``
    (int64; slot = block * block_size + offset) of ``k_cache [num_blocks, block_size, Hk, D]`` /
    ``v_cache``; slot -1 is skipped. ``value`` and ``v_cache`` are both None for MLA's single cache.
    The caches hold the rows' dtype, or ``FP8_DTYPE`` (an FP8 KV cache: each value clamped to
    ±``FP8_MAX`` and rounded to e4m3, scale 1; the attention ops upcast it as they read)."""
    _require((value is None) == (v_cache is None),
             lambda: "store_kv_cache: value and v_cache must both be given or both None")
    _require(key.shape[0] == slot_mapping.shape[0],
             lambda: f"store_kv_cache: {key.shape[0]} key rows but {slot_mapping.shape[0]} slots")
    _ops(key).store_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                     causal: bool = True) -> torch.Tensor:
    """Ragged prefill attention; returns a new ``[Tq, Hq, Dv]`` tensor.

    ``q [Tq, Hq, D]``, ``k [Tk, Hk, D]``, ``v [Tk, Hk, Dv]``; ``cu_seqlens_*`` int32 ``[B + 1]``.
    Hq must be a multiple of Hk (GQA). Causal is bottom-right aligned: query i of a sequence
    with Lq queries and Lk >= Lq keys sees keys ``0 .. Lk - Lq + i`` (a cached prefix works).
    """
    _require(q.dim() == k.dim() == v.dim() == 3 and q.shape[2] == k.shape[2] and k.shape[:2] == v.shape[:2]
             and q.shape[1] % k.shape[1] == 0,
             lambda: f"varlen_attention: bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    return _ops(q).varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    softmax_scale, causal)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, softmax_scale: float,
                           v_head_dim: int | None = None, q_rope: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence against its paged cache; returns a new ``[B, Hq, Dv]`` tensor.

    ``q [B, Hq, D]``; caches ``[num_blocks, block_size, Hk, D]`` (``v_cache`` ``Dv``);
    ``block_tables [B, max_blocks]`` int32 (entries past a sequence's context are never read);
    ``context_lens [B]`` int32; a row with context 0 (graph padding) is all zeros, never NaN.
    ``v_cache=None`` means V is the first ``v_head_dim`` channels of ``k_cache`` (MLA: one
    512 + 64 latent head, V = first 512). ``q_rope [B, Hq, R]``: the query is ``cat(q, q_rope)``
    along the last dim (``D + R`` = the cache's head dim), read from both without concatenating
    them (MLA's latent and rotated halves).
    """
    q_dim = q.shape[-1] + (0 if q_rope is None else q_rope.shape[-1])
    _require(q.dim() == 3 and k_cache.dim() == 4 and q_dim == k_cache.shape[3]
             and q.shape[1] % k_cache.shape[2] == 0 and (q_rope is None or q_rope.shape[:2] == q.shape[:2]),
             lambda: f"paged_decode_attention: bad shapes q {tuple(q.shape)}, q_rope "
             f"{None if q_rope is None else tuple(q_rope.shape)}, k_cache {tuple(k_cache.shape)}")
    _require(v_cache is not None or (v_head_dim is not None and v_head_dim <= k_cache.shape[3]),
             lambda: "paged_decode_attention: v_cache=None needs v_head_dim <= the cache head dim")
    return _ops(q).paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, softmax_scale,
                                          v_head_dim, q_rope)


def expert_gemv(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """``out[t, j] = weights[expert_ids[t, j]] @ x[t]``: a new ``[T, J, Nout]`` tensor in ``x``'s
    dtype (float32 accumulation). ``x [T, K]`` (row stride free), ``weights [E, Nout, K]``
    (stacked expert matrices, read in place, never gathered), ``expert_ids [T, J]`` int64 in
    ``[0, E)``, or -1 for a zero row that reads no weights (an assignment to another rank's
    expert). For MoE steps with few (token, expert) assignments: each token's row meets each of
    its J experts without being copied J times, and no expert's weights are copied."""
    _require(x.dim() == 2 and weights.dim() == 3 and weights.shape[2] == x.shape[1]
             and expert_ids.dim() == 2 and expert_ids.shape[0] == x.shape[0],
             lambda: f"expert_gemv: bad shapes x {tuple(x.shape)}, weights {tuple(weights.shape)}, "
             f"expert_ids {tuple(expert_ids.shape)}")
    return _ops(x).expert_gemv(x, weights, expert_ids)


def qk_norm_rope_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                       cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Qwen's attention prologue, in place: ``q [T, Hq, D]`` and ``k [T, Hk, D]`` get per-head
    RMSNorm with ``q_weight`` / ``k_weight [D]`` (both None: no norm, Qwen2) and then neox RoPE
    by ``positions [T]`` over all D channels (``cos_sin_cache [max_pos, D]``); the rotated K
    and ``v [T, Hk, D]`` go to the caches ``[num_blocks, block_size, Hk, D]`` at
    ``slot_mapping [T]`` (int64; -1 skipped). Same result as ``rms_norm`` x2, ``rotary_embedding``
    and ``store_kv_cache`` in turn, in one launch on CUDA."""
    tokens, _, head_dim = q.shape
    _require(q.dim() == 3 and k.dim() == 3 and v.shape == k.shape and k.shape[0] == tokens == positions.shape[0]
             and k.shape[2] == head_dim and cos_sin_cache.shape[1] == head_dim
             and k_cache.shape[2:] == v_cache.shape[2:] == k.shape[1:] and slot_mapping.shape == (tokens,),
             lambda: f"qk_norm_rope_store: bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
             f"cos_sin_cache {tuple(cos_sin_cache.shape)}, k_cache {tuple(k_cache.shape)}")
    _require((q_weight is None) == (k_weight is None)
             and (q_weight is None or q_weight.shape == k_weight.shape == (head_dim,)),
             lambda: "qk_norm_rope_store: q_weight and k_weight are both [D] or both None")
    _ops(q).qk_norm_rope_store(positions, q, k, v, q_weight, k_weight, eps, cos_sin_cache, k_cache, v_cache,
                               slot_mapping)


def decode_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                activation: str | None = None) -> torch.Tensor:
    """``act(x) @ weight.T + bias``, a new ``[M, N]`` tensor in ``promote(x.dtype, weight.dtype)``
    (float32 accumulation): ``x [M, K]`` (any row stride), ``weight [N, K]``, ``bias [N]`` or None;
    ``activation`` None, or ``"silu_mul"``: x is ``[M, 2K]`` gate | up and ``act(x) = silu(gate) *
    up`` rounded to x's dtype (``silu_and_mul``), read in the GEMV's prologue. For the few rows of a
    decode step: one launch on CUDA (split-K, configured once per shape; cuBLAS where it measured
    faster), no activation tensor, no cast of a bf16 x for a float32 weight."""
    k_dim = x.shape[-1] // 2 if activation == "silu_mul" else x.shape[-1]
    _require(activation in (None, "silu_mul"),
             lambda: f"decode_gemv: activation must be None or 'silu_mul', got {activation!r}")
    _require(x.dim() == 2 and weight.dim() == 2 and weight.shape[1] == k_dim
             and (activation is None or x.shape[-1] % 2 == 0)
             and (bias is None or bias.shape == weight.shape[:1]),
             lambda: f"decode_gemv: bad shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
             f"bias {None if bias is None else tuple(bias.shape)} (activation {activation})")
    return _ops(x).decode_gemv(x, weight, bias, activation)


def decode_gemv_rows(device: torch.device | str) -> int:
    """The most rows (a decode step's few) that a linear layer built on ``device`` hands to
    ``decode_gemv``, the others going to cuBLAS: ``DECODE_GEMV_MAX_ROWS`` on CUDA with
    ``KernelSettings.decode_gemv`` (``AGENT_INFER_DECODE_GEMV=1``; off by default until the H200
    measures it faster than cuBLAS),
    else 0. A layer reads it once, when it is built; its forward then decides on shapes only
    (CUDA-graph safe)."""
    on = torch.device(device).type == "cuda" and current().decode_gemv
    return DECODE_GEMV_MAX_ROWS if on else 0

"""Rotary-embedding cos/sin caches: plain RoPE, DeepSeek-style YaRN and Llama 3.1's scaling.

One module-level registry holds each distinct cache once, so every layer of a
model shares one tensor (36 layers must not allocate 36 copies).
"""
from __future__ import annotations

import math

import torch

_CACHES: dict[tuple, tuple[torch.Tensor, float]] = {}


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_position: int) -> float:
    return dim * math.log(max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def _yarn_inv_freq(rotary_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN frequencies: extrapolated (high-frequency) dims blend linearly into
    interpolated (low-frequency, divided by ``factor``) ones."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    low = max(math.floor(_yarn_correction_dim(beta_fast, rotary_dim, base, original)), 0)
    high = min(math.ceil(_yarn_correction_dim(beta_slow, rotary_dim, base, original)), rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    return extrapolated / factor * ramp + extrapolated * (1 - ramp)


def _llama3_inv_freq(rotary_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequencies, by wavelength: shorter than ``original / high_freq_factor`` kept,
    longer than ``original / low_freq_factor`` divided by ``factor``, those between blended
    smoothly (never every frequency divided by ``factor``, as linear scaling would)."""
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
               if scaling.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling of type llama3 lacks {', '.join(missing)}")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    if not low < high:
        raise ValueError(f"rope_scaling llama3 needs low_freq_factor < high_freq_factor, got {low} and {high}")
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    wavelength = 2 * math.pi / inv_freq
    kept = ((scaling["original_max_position_embeddings"] / wavelength - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * (1 - kept) + inv_freq * kept


def _build(max_position: int, rotary_dim: int, base: float, scaling: dict | None,
           dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, float]:
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    cos_sin_factor, attn_scale = 1.0, 1.0
    if kind == "default":
        inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(rotary_dim, base, scaling)
        factor = scaling["factor"]
        mscale_all_dim = scaling.get("mscale_all_dim") or 0
        cos_sin_factor = (_yarn_mscale(factor, scaling.get("mscale") or 1)
                          / _yarn_mscale(factor, mscale_all_dim)
                          * (scaling.get("attention_factor") or 1.0))
        attn_scale = _yarn_mscale(factor, mscale_all_dim) ** 2
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(rotary_dim, base, scaling)
    else:
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, yarn, llama3)")
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * cos_sin_factor
    return cache.to(dtype=dtype, device=device), attn_scale


def get_cos_sin_cache(max_position: int, rotary_dim: int, base: float, rope_scaling: dict | None = None,
                      dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """Shared rotary table for positions ``0 .. max_position - 1``.

    Returns ``(cache, attn_scale)``: ``cache [max_position, rotary_dim]`` holds
    cos in its first half and sin in its second (computed in float64, stored in
    ``dtype``); ``attn_scale`` multiplies the softmax scale (1.0, or mscale**2
    for DeepSeek YaRN). ``rope_scaling`` is a HF-style dict whose ``rope_type``
    (or ``type``) is ``"default"``, ``"yarn"`` (keys ``factor``,
    ``original_max_position_embeddings``, optional ``beta_fast``, ``beta_slow``,
    ``mscale``, ``mscale_all_dim``, ``attention_factor``) or ``"llama3"`` (keys
    ``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``). Equal arguments return the same tensor object.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if max_position <= 0:
        raise ValueError(f"max_position must be positive, got {max_position}")
    device = torch.device(device)
    scaling_key = repr(sorted((rope_scaling or {}).items()))
    key = (max_position, rotary_dim, float(base), scaling_key, dtype, device)
    if key not in _CACHES:
        _CACHES[key] = _build(max_position, rotary_dim, float(base), rope_scaling, dtype, device)
    return _CACHES[key]

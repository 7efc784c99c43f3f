"""Triton backend (the CUDA default): one module per kernel family, same op names as the reference."""
from engine.model.kernels.triton.activation import silu_and_mul
from engine.model.kernels.triton.decode_attention import paged_decode_attention
from engine.model.kernels.triton.expert_gemv import expert_gemv
from engine.model.kernels.triton.gemv import decode_gemv
from engine.model.kernels.triton.kv_store import store_kv_cache
from engine.model.kernels.triton.norm import fused_add_rms_norm, rms_norm
from engine.model.kernels.triton.prefill_attention import varlen_attention
from engine.model.kernels.triton.qk_norm_rope_store import qk_norm_rope_store
from engine.model.kernels.triton.rotary import rotary_embedding

__all__ = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "store_kv_cache",
           "varlen_attention", "paged_decode_attention", "expert_gemv", "qk_norm_rope_store", "decode_gemv"]

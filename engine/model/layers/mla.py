"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache."""
from __future__ import annotations

import torch
from torch import nn

from engine.distributed import TPGroup
from engine.model import kernels
from engine.model.attention_context import eager_region, get_context
from engine.model.config import DeepseekConfig, ModelConfig
from engine.model.layers.attention import KVCacheSpec
from engine.model.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, divide
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import RotaryEmbedding

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepSeek's reference code fixes it, whatever rms_norm_eps says


class MultiHeadLatentAttention(nn.Module):
    """hidden [T, H] -> [T, H].

    Queries: ``q_proj`` (V2-Lite), or ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``; each
    head is ``qk_nope_head_dim`` channels without position and ``qk_rope_head_dim`` rotated.
    Keys and values come from one latent per token: ``kv_a_proj_with_mqa`` gives
    ``kv_lora_rank`` channels (normalised by ``kv_a_layernorm``) plus ``qk_rope_head_dim``
    rotated key channels shared by every head. That latent, ``kv_lora_rank + rope`` wide,
    is all the cache holds (one entry per token, ``kv_spec``); ``kv_b_proj`` expands it to
    each head's ``k_nope`` and ``v``.

    Prefill expands the latents (this step's, or every context token's read back from the
    cache when a prefix is cached) and runs ``varlen_attention`` with qk dim ``nope + rope``
    and v dim ``v_head_dim``; a mixed step's leading decode rows take the decode path.
    Decode absorbs ``kv_b_proj`` into the query and the output (``q_nope W_UK`` attends over
    the latent cache directly, the latent-space output goes through ``W_UV``), so the cache
    is never expanded. TP: heads split over ranks (``q_b_proj`` / ``q_proj`` / ``kv_b_proj``
    column-parallel, ``o_proj`` row-parallel); the ``a`` projections are replicated. Softmax
    scale ``qk_head_dim ** -0.5``, times YaRN's mscale² when YaRN is on.
    """

    def __init__(self, config: ModelConfig, ds: DeepseekConfig, tp: TPGroup):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads = divide(heads, tp.size, "num_attention_heads")
        self.nope_dim, self.rope_dim, self.v_dim = ds.qk_nope_head_dim, ds.qk_rope_head_dim, ds.v_head_dim
        self.kv_lora_rank = ds.kv_lora_rank
        qk_dim = ds.qk_head_dim
        self.q_lora_rank = ds.q_lora_rank
        if ds.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_dim, tp=tp)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, ds.q_lora_rank, bias=config.qkv_bias)
            self.q_a_layernorm = RMSNorm(ds.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(ds.q_lora_rank, heads * qk_dim, tp=tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope_dim, bias=config.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), tp=tp)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias=config.qkv_bias, tp=tp)
        self.rotary_emb = RotaryEmbedding(self.rope_dim, self.rope_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling, is_neox=not ds.rope_interleave)
        self.scale = qk_dim ** -0.5 * self.rotary_emb.attn_scale
        self.kv_spec = KVCacheSpec(num_heads=1, head_dim=self.kv_lora_rank + self.rope_dim, separate_v=False)
        self.k_cache = self.v_cache = None  # latent cache [num_blocks, block_size, 1, rank + rope], v_cache stays None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        if self.k_cache is None:
            raise RuntimeError("MLA layer has no latent cache bound; call engine.worker.kv_cache.bind_kv_cache first")
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))[0])
        q = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim)
        latent = self.kv_a_proj_with_mqa(hidden)  # [T, rank + rope]: compressed kv | k_pe (a new tensor)
        self.kv_a_layernorm.normalize_(latent[:, :self.kv_lora_rank])
        latent = latent[:, None]  # [T, 1, rank + rope]
        self.rotary_emb(positions, q[..., self.nope_dim:], latent[..., self.kv_lora_rank:])
        kernels.store_kv_cache(latent, None, self.k_cache, None, ctx.slot_mapping)
        if not ctx.has_prefill:
            out = self._decode(q, ctx)
        else:  # between two pieces when the step replays piecewise graphs
            out = eager_region(self._attend_with_prefill, q, latent, out_shape=(q.shape[0], self.num_heads, self.v_dim),
                               dtype=q.dtype)
        return self.o_proj(out.flatten(1))

    def _attend_with_prefill(self, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """A step's leading decode rows through the absorbed decode, its prefill chunks expanded."""
        ctx = get_context()
        d = ctx.num_decode_tokens
        out = self._prefill(q[d:], latent[d:], ctx)
        return torch.cat([self._decode(q[:d], ctx), out]) if d else out

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj``'s weight split per local head: W_UK ``[n, nope, rank]``, W_UV ``[n, v, rank]`` (views)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def _prefill(self, q: torch.Tensor, latent: torch.Tensor, ctx) -> torch.Tensor:
        if ctx.prefill_kv_slots is not None:  # a cached prefix: every context token's latent from the cache
            latent = self.k_cache.flatten(0, 1).index_select(0, ctx.prefill_kv_slots).to(q.dtype)
        kv_c, k_pe = latent[:, 0].split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(kv_c).view(-1, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, self.num_heads, -1)], dim=-1)
        return kernels.varlen_attention(q, k, v, ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                                        ctx.max_seqlen_q, ctx.max_seqlen_k, self.scale, causal=True)

    def _decode(self, q: torch.Tensor, ctx) -> torch.Tensor:
        w_uk, w_uv = self._w_uk_uv()
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, n, rank]
        o_latent = kernels.paged_decode_attention(q_latent, self.k_cache, None, ctx.block_tables, ctx.context_lens,
                                                  self.scale, v_head_dim=self.kv_lora_rank,
                                                  q_rope=q_pe)  # [B, n, rank]; latent | rope read in place
        out = o_latent.new_empty(o_latent.shape[0], self.num_heads, self.v_dim)  # [B, n, v], written per head
        torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
        return out

"""Multi-head latent attention (DeepSeek-V2 / V2-Lite / V3) over the paged latent cache
against HF transformers' attention with the same random weights (YaRN on): ragged
prefill, decode through the absorbed path, prefix-cached prefill, the one-entry cache
spec, heads split over TP ranks, and a decode step with no host sync."""
import pytest
import torch
from transformers.models.deepseek_v2 import modeling_deepseek_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3

from engine.distributed import TPGroup
from engine.model.config import DeepseekConfig
from engine.model.layers.mla import MultiHeadLatentAttention
from engine.worker.kv_cache import attention_layers, bind_kv_cache, kv_bytes_per_token
from phases.checkpoints import V2_LITE, randomize_weights
from phases.harness import causal_mask, engine_config, hf_config, load_from_hf, num_blocks_for, rel_err, run_paged

HF = {"DeepseekV2ForCausalLM": modeling_deepseek_v2, "DeepseekV3ForCausalLM": modeling_deepseek_v3}
VARIANTS = {"V2": ("DeepseekV2ForCausalLM", {}), "V2-Lite": ("DeepseekV2ForCausalLM", V2_LITE),
            "V3": ("DeepseekV3ForCausalLM", {})}


def hf_mla(variant, seed):
    arch, overrides = VARIANTS[variant]
    cfg = hf_config(arch, **overrides)
    mod = HF[arch]
    prefix = arch.replace("ForCausalLM", "")
    attn = getattr(mod, prefix + "Attention")(cfg, layer_idx=0).eval()
    randomize_weights(attn, seed)
    return cfg, attn, getattr(mod, prefix + "RotaryEmbedding")(cfg)


def hf_reference(attn, rotary, x):
    """Full causal forward of one sequence x [L, H] -> [L, H]."""
    pe = rotary(x[None], torch.arange(len(x))[None])
    return attn(hidden_states=x[None], attention_mask=causal_mask(len(x)), position_embeddings=pe)[0][0]


def engine_mla(variant, hf_attn, tp=TPGroup()):
    arch, overrides = VARIANTS[variant]
    config = engine_config(arch, **overrides)
    ours = MultiHeadLatentAttention(config, DeepseekConfig.from_model_config(config), tp)
    load_from_hf(ours, hf_attn, {})
    return ours


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("block_size", [16, 256])
def test_mla_prefill_then_decode_matches_hf(variant, block_size):
    torch.manual_seed(0)
    cfg, hf_attn, rotary = hf_mla(variant, seed=1)
    prompt_lens = [5, 17, 1, 40] if block_size == 16 else [5, 250, 1]
    lengths = [n + d for n, d in zip(prompt_lens, [9, 8, 12, 10])]
    inputs = [torch.randn(n, cfg.hidden_size) for n in lengths]
    ours = engine_mla(variant, hf_attn)
    bind_kv_cache(ours, num_blocks_for(lengths, block_size), block_size, torch.float32, "cpu")
    with torch.no_grad():
        got = run_paged(lambda x, pos: ours(pos, x), inputs, prompt_lens, block_size)
        want = [hf_reference(hf_attn, rotary, x) for x in inputs]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert rel_err(g, w) < 1e-4


def test_mla_prefix_cached_prefill_reads_latents_from_cache():
    torch.manual_seed(0)
    cfg, hf_attn, rotary = hf_mla("V2", seed=2)
    prompt_lens, cached = [20, 33, 7], [16, 32, 3]
    lengths = [n + 4 for n in prompt_lens]
    inputs = [torch.randn(n, cfg.hidden_size) for n in lengths]
    ours = engine_mla("V2", hf_attn)
    bind_kv_cache(ours, num_blocks_for(lengths, 16), 16, torch.float32, "cpu")
    with torch.no_grad():
        got = run_paged(lambda x, pos: ours(pos, x), inputs, prompt_lens, 16, cached_lens=cached)
        want = [hf_reference(hf_attn, rotary, x) for x in inputs]
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_caches_one_latent_entry_per_token(dtype):
    """The cache holds kv_lora_rank + rope channels per token once (no V cache, not per
    head), and what it holds is HF's normalised latent and rotated shared key."""
    from engine.model.attention_context import forward_context
    from phases.harness import prefill_context

    cfg, hf_attn, rotary = hf_mla("V2", seed=3)
    ours = engine_mla("V2", hf_attn, TPGroup(rank=1, size=2))
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert kv_bytes_per_token(ours, dtype) == width * torch.empty((), dtype=dtype).element_size()
    bind_kv_cache(ours, 2, 16, torch.float32, "cpu")
    assert attention_layers(ours) == [ours]
    assert ours.k_cache.shape == (2, 16, 1, width) and ours.v_cache is None
    n = 11
    torch.manual_seed(0)
    x = torch.randn(n, cfg.hidden_size)
    positions, ctx = prefill_context([n], [0], [[1]], 16, "cpu")
    with forward_context(ctx):
        with torch.no_grad():
            ours(positions, x)
            kv, k_pe = hf_attn.kv_a_proj_with_mqa(x[None]).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], -1)
            kv = hf_attn.kv_a_layernorm(kv)
            pe = rotary(x[None], torch.arange(n)[None])
            k_pe = modeling_deepseek_v2.apply_rotary_emb(k_pe[:, None], k_pe[:, None], pe)[1][:, 0]
    assert rel_err(ours.k_cache[1, :n, 0], torch.cat([kv, k_pe], -1)[0]) < 1e-5
    assert ours.k_cache[0].abs().sum() == 0


@pytest.mark.parametrize("size", [2, 4])
def test_mla_heads_split_over_tp_ranks(size):
    """Built as rank r of n in one process (collectives are identities there), each rank
    holds heads / n of q_b_proj, kv_b_proj and o_proj, and the ranks' partial outputs
    sum to HF's output."""
    torch.manual_seed(0)
    cfg, hf_attn, rotary = hf_mla("V2", seed=4)
    heads = cfg.num_attention_heads
    x = torch.randn(13, cfg.hidden_size)
    total = 0
    for rank in range(size):
        ours = engine_mla("V2", hf_attn, TPGroup(rank=rank, size=size))
        assert ours.q_b_proj.weight.shape[0] == heads // size * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        assert ours.kv_b_proj.weight.shape[0] == heads // size * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        assert ours.o_proj.weight.shape[1] == heads // size * cfg.v_head_dim
        assert ours.kv_a_proj_with_mqa.weight.shape[0] == cfg.kv_lora_rank + cfg.qk_rope_head_dim
        bind_kv_cache(ours, 2, 16, torch.float32, "cpu")
        with torch.no_grad():
            total = total + run_paged(lambda h, pos: ours(pos, h), [x], [9], 16)[0]
    with torch.no_grad():
        assert rel_err(total, hf_reference(hf_attn, rotary, x)) < 1e-4


def test_mla_decode_step_has_no_host_sync(monkeypatch):
    from engine.model.attention_context import forward_context
    from phases.harness import assert_no_host_sync_and_no_copies, count_step, decode_context, prefill_context

    cfg, hf_attn, _ = hf_mla("V2", seed=5)
    ours = engine_mla("V2", hf_attn)
    bind_kv_cache(ours, 2, 16, torch.float32, "cpu")
    positions, ctx = prefill_context([8, 4], [0, 0], [[0], [1]], 16, "cpu")
    with forward_context(ctx), torch.no_grad():
        ours(positions, torch.randn(12, cfg.hidden_size))
    positions, ctx = decode_context([9, 5], [[0], [1]], 16, "cpu")
    x = torch.randn(2, cfg.hidden_size)
    with forward_context(ctx):
        assert_no_host_sync_and_no_copies(count_step(lambda: ours(positions, x), monkeypatch))

"""QwenAttention over the paged KV cache against HF transformers' attention
with the same random weights: ragged prefill, decode steps, prefix-cached
prefill, block sizes 16 and 256."""
import pytest
import torch
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from phases.checkpoints import randomize_weights
from engine.distributed import TPGroup
from engine.kv_cache import bind_kv_cache
from engine.models.qwen import QwenAttention, QwenForCausalLM
from phases.harness import causal_mask, engine_config, hf_config, load_from_hf, num_blocks_for, rel_err, run_paged

HF = {"Qwen3ForCausalLM": modeling_qwen3, "Qwen2ForCausalLM": modeling_qwen2}


def hf_attention(arch, seed):
    cfg = hf_config(arch)
    mod = HF[arch]
    attn = getattr(mod, arch.replace("ForCausalLM", "Attention"))(cfg, layer_idx=0).eval()
    randomize_weights(attn, seed)
    rotary = getattr(mod, arch.replace("ForCausalLM", "RotaryEmbedding"))(cfg)
    return cfg, attn, rotary


def hf_attention_reference(attn, rotary, x):
    """Full causal forward of one sequence x [L, H] -> [L, H]."""
    pos = torch.arange(len(x))[None]
    cos_sin = rotary(x[None], pos)
    return attn(x[None], cos_sin, causal_mask(len(x)))[0][0]


def make_engine_attention(arch, cfg, hf_attn, block_size, lengths):
    ours = QwenAttention(engine_config(arch), TPGroup())
    load_from_hf(ours, hf_attn, QwenForCausalLM.packed_modules)
    bind_kv_cache(ours, num_blocks_for(lengths, block_size), block_size, torch.float32, "cpu")
    return ours


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM"])
@pytest.mark.parametrize("block_size", [16, 256])
def test_prefill_then_decode_matches_hf(arch, block_size):
    torch.manual_seed(0)
    cfg, hf_attn, rotary = hf_attention(arch, seed=1)
    prompt_lens = [5, 17, 1, 250] if block_size == 256 else [5, 17, 1, 40]
    lengths = [n + d for n, d in zip(prompt_lens, [9, 8, 12, 10])]  # crosses 16- and 256-blocks
    inputs = [torch.randn(n, cfg.hidden_size) for n in lengths]
    ours = make_engine_attention(arch, cfg, hf_attn, block_size, lengths)
    with torch.no_grad():
        got = run_paged(lambda x, pos: ours(pos, x), inputs, prompt_lens, block_size)
        want = [hf_attention_reference(hf_attn, rotary, x) for x in inputs]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert rel_err(g, w) < 1e-4


@pytest.mark.parametrize("block_size", [16, 256])
def test_prefix_cached_prefill_reads_prefix_from_cache(block_size):
    """Prefill a prefix, then the rest of the prompt in a second prefill whose
    attention must read the prefix's K/V back from the paged cache."""
    torch.manual_seed(0)
    arch = "Qwen3ForCausalLM"
    cfg, hf_attn, rotary = hf_attention(arch, seed=2)
    prompt_lens, cached = [20, 33, 7], [16, 32, 3]
    lengths = [n + 4 for n in prompt_lens]
    inputs = [torch.randn(n, cfg.hidden_size) for n in lengths]
    ours = make_engine_attention(arch, cfg, hf_attn, block_size, lengths)
    with torch.no_grad():
        got = run_paged(lambda x, pos: ours(pos, x), inputs, prompt_lens, block_size, cached_lens=cached)
        want = [hf_attention_reference(hf_attn, rotary, x) for x in inputs]
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-4


@pytest.mark.parametrize("rank,size", [(0, 1), (1, 2), (3, 4)])
def test_heads_per_rank_and_kv_replication(rank, size):
    """Q heads split evenly; KV heads split, or replicated (one per rank) when
    tp > num_kv_heads; K/V use the local KV-head count."""
    cfg = engine_config("Qwen3ForCausalLM")
    attn = QwenAttention(cfg, TPGroup(rank=rank, size=size))
    assert attn.attn.num_heads == cfg.num_attention_heads // size
    assert attn.attn.num_kv_heads == max(1, cfg.num_key_value_heads // size)
    q_out = attn.qkv_proj.weight.shape[0]
    assert q_out == (attn.attn.num_heads + 2 * attn.attn.num_kv_heads) * cfg.head_dim

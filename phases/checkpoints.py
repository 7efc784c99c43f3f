"""Tiny HF-format checkpoints with every weight random, for the oracle tests.

`make_tiny_checkpoint` writes config.json, safetensors (single or sharded with
an index), generation_config.json and a small word-level tokenizer; the root
conftest's `tiny_checkpoint` fixture wraps it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

# Tiny configs per architecture: small enough for CPU, shaped to catch bugs
# (head_dim != hidden/heads for Qwen3, GQA, QKV bias and tied embeddings for Qwen2;
# rope_theta and rms_norm_eps differ from every default, so a value not read from
# config.json shows up as a logits mismatch).
TINY_CONFIGS: dict[str, dict] = {
    "Qwen3ForCausalLM": dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=1024, rope_theta=50000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attention_bias=False,
    ),
    "Qwen2ForCausalLM": dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rope_theta=20000.0, rms_norm_eps=3e-6,
        tie_word_embeddings=True,
    ),
    # Llama 3.1: llama3 RoPE scaling whose three bands (wavelengths kept, blended, divided by factor) all
    # occur at head_dim 32, with factors off their defaults, and positions past its 64-token original
    # context; head_dim != hidden / heads. Llama 3.2 is the same with tie_word_embeddings=True.
    "LlamaForCausalLM": dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=1024, rope_theta=30000.0, rms_norm_eps=2e-5,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=8.0,
                          original_max_position_embeddings=64),
        tie_word_embeddings=False, attention_bias=False,
    ),
    # Mistral without a sliding window (v0.2 onward); GQA 4:1.
    "MistralForCausalLM": dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=1024, rope_theta=40000.0, rms_norm_eps=4e-6, sliding_window=None,
        tie_word_embeddings=False,
    ),
    # Qwen3-MoE: q/k norm, 8 experts top-2 renormalised; layer 0 dense through mlp_only_layers.
    "Qwen3MoeForCausalLM": dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
        max_position_embeddings=1024, rope_theta=50000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    # Qwen2-MoE: QKV bias, 8 experts top-3 not renormalised, a sigmoid-gated shared expert;
    # decoder_sparse_step 2 makes layers 1 and 3 MoE, 0 and 2 dense.
    "Qwen2MoeForCausalLM": dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[],
        max_position_embeddings=1024, rope_theta=20000.0, rms_norm_eps=3e-6, tie_word_embeddings=False,
    ),
    # DeepSeek-V2: MLA with q_lora_rank, v_head_dim != qk dims, YaRN; layer 0 dense, then MoE
    # with 8 routed experts in 4 groups, top-3 from the best 2 groups, routed_scaling_factor != 1.
    "DeepseekV2ForCausalLM": dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=1,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, norm_topk_prob=False,
        routed_scaling_factor=1.5, max_position_embeddings=1024, rope_theta=20000.0, rms_norm_eps=3e-6,
        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=256, mscale=0.707,
                          mscale_all_dim=0.707, beta_fast=32, beta_slow=1),
        tie_word_embeddings=False,
    ),
    # DeepSeek-V3 routing: sigmoid scores + e_score_correction_bias, groups scored by their two
    # best experts, weights renormalised, routed_scaling_factor 2.5; interleaved rope.
    "DeepseekV3ForCausalLM": dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
        max_position_embeddings=1024, rope_theta=30000.0, rms_norm_eps=2e-6,
        rope_scaling=dict(type="yarn", factor=8.0, original_max_position_embeddings=128, mscale=1.0,
                          mscale_all_dim=1.0, beta_fast=32, beta_slow=1),
        tie_word_embeddings=False,
    ),
}

# DeepSeek-V2-Lite differs from V2 in config only: one q_proj (no q LoRA) and plain greedy
# top-k over all experts with no scaling. make_tiny_checkpoint("DeepseekV2ForCausalLM", **V2_LITE).
V2_LITE = dict(q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0)

WORDS = ("the quick brown fox jumps over lazy dog a an of to in is it on and for with as "
         "that this by at from be are was were garden city river mountain light dark").split()



def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter with random values in place: norms 1 + 0.1*randn,
    everything else 0.02*randn (biases too), from ``seed``. DeepSeek-V3's
    ``e_score_correction_bias`` (a buffer in transformers, a tensor in checkpoints) too."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [*model.named_parameters(),
               *((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))]
    with torch.no_grad():
        for name, p in sorted(tensors, key=lambda item: item[0]):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.02 * noise)


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A small word-level tokenizer (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<|endoftext|>": 1}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>", "unk_token": "<unk>", "pad_token": "<|endoftext|>",
    }))


def tiny_hf_config(arch: str = "Qwen3ForCausalLM", **overrides):
    """The transformers config of the tiny ``arch``; ``overrides`` replace its entries."""
    import transformers

    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    return config_cls(**{**TINY_CONFIGS[arch], **overrides}, bos_token_id=1, eos_token_id=1)


def make_tiny_checkpoint(path: Path, arch: str = "Qwen3ForCausalLM", seed: int = 0,
                         sharded: bool = False, **overrides) -> Path:
    """Write an HF checkpoint for ``arch`` into ``path`` and return it.

    Every weight is random (see ``randomize_weights``); ``sharded`` splits the
    safetensors into several files with a ``model.safetensors.index.json``.
    ``overrides`` replace entries of the tiny config.
    """
    import transformers

    config = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).float()
    randomize_weights(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), max_shard_size="100KB" if sharded else "10GB")
    write_tokenizer(path, config.vocab_size)
    return path

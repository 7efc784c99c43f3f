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


# Tiny FP8 checkpoints: every quantized dimension a multiple of 128, also per rank at TP 2
# (head_dim 128 so the per-rank K/V are whole blocks; DeepSeek's shared experts 2 x 128).
FP8_CONFIGS: dict[str, dict] = {
    "Qwen3ForCausalLM": dict(hidden_size=128, intermediate_size=256, head_dim=128, num_attention_heads=4,
                             num_key_value_heads=2),
    "DeepseekV3ForCausalLM": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=64,
                                  qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, n_shared_experts=2),
}
FP8_MAX = 448.0


def fp8_block_quantize(weight: torch.Tensor, block_rows: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(e4m3 weight, float32 scales) of a [N, K] float weight, each block of ``block_rows`` x 128
    (the last ones may be smaller) first scaled by its own random factor in [1/8, 8] (so
    neighbouring blocks' scales differ a lot and a scale read from the wrong block shows), then
    divided by max|block| / 448. Block-wise scales are [ceil(N/128), ceil(K/128)]; per-channel
    ones (block_rows 1, one block of all K columns) are [N, 1]."""
    n, k = weight.shape
    cols = 128 if block_rows > 1 else k
    rows, groups = -(-n // block_rows), -(-k // cols)
    blocks = weight.new_zeros(rows * block_rows, groups * cols, dtype=torch.float64)
    blocks[:n, :k] = weight
    blocks = blocks.view(rows, block_rows, groups, cols)
    blocks = blocks * torch.exp2(torch.empty(rows, 1, groups, 1, dtype=torch.float64).uniform_(-3, 3, generator=gen))
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True) / FP8_MAX
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(rows * block_rows, groups * cols)
    return q[:n, :k].contiguous(), scale.reshape(rows, groups).float()


def make_tiny_fp8_checkpoint(path: Path, arch: str = "Qwen3ForCausalLM", seed: int = 0, per_channel: bool = False,
                             ignored: tuple[str, ...] = (), **overrides) -> Path:
    """A tiny HF checkpoint (``make_tiny_checkpoint`` with ``FP8_CONFIGS[arch]``) whose linear
    weights (``*_proj.weight`` other than ``ignored`` module names and Qwen2-MoE's
    ``shared_expert_gate``) are stored in FP8: block-wise (``quant_method: fp8``,
    ``weight_scale_inv`` per 128 x 128 block, ``ignored_layers``) or, ``per_channel``, as
    compressed-tensors FP8 dynamic (``weight_scale`` [N, 1], ``ignore``). Embeddings, norms,
    routers and the LM head stay as they are."""
    from safetensors.torch import load_file, save_file

    make_tiny_checkpoint(path, arch, seed, **{**FP8_CONFIGS.get(arch, {}), **overrides})
    gen = torch.Generator().manual_seed(seed + 1)
    scale_name = "weight_scale" if per_channel else "weight_scale_inv"
    tensors = {}
    for name, tensor in load_file(str(path / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if "_proj" not in module.rpartition(".")[2] or tensor.dim() != 2 or module in ignored:
            tensors[name] = tensor
            continue
        tensors[name], tensors[f"{module}.{scale_name}"] = fp8_block_quantize(tensor, 1 if per_channel else 128, gen)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if per_channel:
        quantization = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": list(ignored),
                        "config_groups": {"group_0": {
                            "targets": ["Linear"],
                            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False,
                                        "symmetric": True},
                            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                  "dynamic": True, "symmetric": True}}}}
    else:
        quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                        "weight_block_size": [128, 128], "ignored_layers": list(ignored)}
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}, indent=2))
    return path


def written_once(make):
    """``make()`` (writes a checkpoint, returns its path) in this process, or, under torchrun (a
    process group initialised), on rank 0 only, every rank getting the path after a barrier."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return make()
    path = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    dist.barrier()
    return path[0]

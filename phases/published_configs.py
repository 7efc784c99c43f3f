"""Published config.json files (external data, not produced by our code) and the transformers-5
form of a config, shared by the config tests (phase 05) and the model tests (phase 07)."""


# The published Qwen3-8B config.json (external data, not produced by our code).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 151936,
}
# Published config.json files (external data): Llama 3.1 8B, Llama 3.2 1B (tied), Mistral 7B v0.1
# (a sliding window) and v0.3 (none), Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B (Qwen2-MoE).
LLAMA3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
LLAMA3_2_1B = {
    **LLAMA3_1_8B, "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "tie_word_embeddings": True,
    "rope_scaling": {**LLAMA3_1_8B["rope_scaling"], "factor": 32.0},
}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}
MISTRAL_7B_V03 = {**MISTRAL_7B_V01, "rope_theta": 1000000.0, "sliding_window": None, "vocab_size": 32768}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}
QWEN1_5_MOE_A2_7B = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
    "moe_intermediate_size": 1408, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "shared_expert_intermediate_size": 5632, "sliding_window": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}


def transformers5(cfg: dict, **renames) -> dict:
    """The same config as transformers 5 writes it: rope_parameters (with rope_theta), dtype, and
    ``renames`` (old key -> new key, e.g. Qwen3-MoE's num_experts -> num_local_experts)."""
    out = {renames.get(k, k): v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    out["rope_parameters"] = {**(cfg.get("rope_scaling") or {"rope_type": "default"}), "rope_theta": cfg["rope_theta"]}
    out["dtype"] = cfg["torch_dtype"]
    return out


DEEPSEEK_V2 = {  # DeepSeek-V2's config.json as published (MoE/MLA keys)
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 60,
    "num_attention_heads": 128, "num_key_value_heads": 128, "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 160,
    "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3, "norm_topk_prob": False,
    "routed_scaling_factor": 16.0, "scoring_func": "softmax", "torch_dtype": "bfloat16",
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
}


def deepseek_transformers5(cfg: dict) -> dict:
    """A DeepSeek config as transformers 5 writes it: rope_parameters (its rope_type from the
    published "type"), dtype, no scoring_func."""
    out = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype", "scoring_func")}
    out["rope_parameters"] = {**cfg["rope_scaling"], "rope_type": cfg["rope_scaling"]["type"],
                              "rope_theta": cfg["rope_theta"]}
    out["dtype"] = cfg["torch_dtype"]
    return out

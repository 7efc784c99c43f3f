"""ModelConfig and DeepseekConfig read every dimension from config.json, in the published form and
in the one transformers 5 writes (rope_parameters, dtype, renamed keys), with each architecture's
defaults; a missing key or a bad model directory is an error naming it. Every layer from this phase
on is built from these configs; what a config can or cannot build is phase 07's."""
import json

import pytest
import torch

from engine.model.config import DeepseekConfig, ModelConfig, QwenMoeConfig
from phases.published_configs import (
    DEEPSEEK_V2,
    LLAMA3_1_8B,
    LLAMA3_2_1B,
    MISTRAL_7B_V01,
    MISTRAL_7B_V03,
    QWEN1_5_MOE_A2_7B,
    QWEN3_8B,
    QWEN3_30B_A3B,
    deepseek_transformers5,
    transformers5,
)


def test_published_qwen3_8b_config():
    c = ModelConfig.from_dict(QWEN3_8B)
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads) == (4096, 12288, 32, 8)
    assert (c.num_hidden_layers, c.head_dim, c.vocab_size, c.max_position_embeddings) == (36, 128, 151936, 40960)
    assert (c.rope_theta, c.rms_norm_eps, c.torch_dtype) == (1e6, 1e-6, torch.bfloat16)
    assert c.qk_norm and not c.qkv_bias and not c.tie_word_embeddings and c.rope_scaling is None
    assert c.eos_token_ids == (151645,)


def test_transformers5_form_reads_the_same():
    new = {k: v for k, v in QWEN3_8B.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    new.update(rope_parameters={"rope_theta": 1000000, "rope_type": "default"}, dtype="bfloat16")
    assert ModelConfig.from_dict(new) == ModelConfig.from_dict(QWEN3_8B)


def test_yarn_rope_parameters_become_rope_scaling():
    new = dict(QWEN3_8B, rope_parameters={"rope_theta": 10000, "rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 4096})
    del new["rope_theta"], new["rope_scaling"]
    c = ModelConfig.from_dict(new)
    assert c.rope_theta == 10000 and c.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 4096}


def test_head_dim_falls_back_to_hidden_over_heads_and_qwen2_has_qkv_bias():
    qwen2 = {k: v for k, v in QWEN3_8B.items() if k not in ("head_dim", "attention_bias")}
    qwen2.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, num_attention_heads=28)
    c = ModelConfig.from_dict(qwen2)
    assert c.head_dim == 128 and c.qkv_bias and not c.qk_norm


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size", "num_hidden_layers", "intermediate_size"])
def test_missing_dimension_is_an_error_naming_it(key):
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_dict({k: v for k, v in QWEN3_8B.items() if k != key})


def test_bad_model_dirs_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelConfig.from_model_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in QWEN3_8B.items() if k != "architectures"}))
    with pytest.raises(ValueError, match="architectures"):
        ModelConfig.from_model_dir(tmp_path)


@pytest.mark.parametrize("published,renames", [(LLAMA3_1_8B, {}), (MISTRAL_7B_V03, {}),
                                               (QWEN3_30B_A3B, {"num_experts": "num_local_experts"}),
                                               (QWEN1_5_MOE_A2_7B, {})], ids=["llama", "mistral", "qwen3-moe",
                                                                               "qwen2-moe"])
def test_new_architectures_read_the_same_in_the_transformers5_form(published, renames):
    a, b = ModelConfig.from_dict(published), ModelConfig.from_dict(transformers5(published, **renames))
    assert a == b
    if "num_experts" in published:
        assert QwenMoeConfig.from_model_config(a) == QwenMoeConfig.from_model_config(b)


@pytest.mark.parametrize("published", [LLAMA3_1_8B, LLAMA3_2_1B], ids=["3.1-8B", "3.2-1B"])
def test_published_llama3_config_values(published):
    """Llama 3.x: llama3 rope scaling read as such, head_dim from config.json or hidden / heads, no
    QKV bias, no q/k norm, no window, the tie flag as published."""
    c = ModelConfig.from_dict(published)
    assert c.rope_scaling == published["rope_scaling"] and c.rope_theta == 500000.0
    assert c.head_dim == published.get("head_dim", 128) and c.rms_norm_eps == 1e-5
    assert not (c.qkv_bias or c.qk_norm) and c.sliding_window is None
    assert c.tie_word_embeddings == published["tie_word_embeddings"]


def test_published_qwen_moe_config_values():
    """Qwen3-30B-A3B: 128 experts top-8 renormalised, every layer MoE, q/k norm, no shared expert;
    Qwen1.5-MoE: 60 experts top-4 not renormalised, a 5632-wide gated shared expert, QKV bias, and
    its sliding_window 32768 unused (use_sliding_window false)."""
    q3 = ModelConfig.from_dict(QWEN3_30B_A3B)
    moe = QwenMoeConfig.from_model_config(q3)
    assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (128, 8, 768)
    assert moe.norm_topk_prob and moe.shared_expert_intermediate_size == 0
    assert (moe.scoring_func, moe.topk_method, moe.routed_scaling_factor) == ("softmax", "greedy", 1.0)
    assert all(moe.is_moe_layer(i) for i in range(q3.num_hidden_layers))
    assert q3.qk_norm and not q3.qkv_bias and q3.sliding_window is None

    q2 = ModelConfig.from_dict(QWEN1_5_MOE_A2_7B)
    moe = QwenMoeConfig.from_model_config(q2)
    assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.shared_expert_intermediate_size) == (60, 4, 5632)
    assert not moe.norm_topk_prob and q2.qkv_bias and not q2.qk_norm and q2.sliding_window is None


@pytest.mark.parametrize("mlp_only,step", [([], 1), ([0, 3], 1), ([], 2), ([1, 2], 3)])
def test_qwen_moe_layers_follow_mlp_only_layers_and_the_sparse_step(mlp_only, step):
    """FM-052: layer i is MoE exactly when transformers' Qwen MoE decoder layer makes it one: experts
    exist, i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    config = ModelConfig.from_dict({**QWEN3_30B_A3B, "mlp_only_layers": mlp_only, "decoder_sparse_step": step})
    moe = QwenMoeConfig.from_model_config(config)
    want = [i not in mlp_only and (i + 1) % step == 0 for i in range(config.num_hidden_layers)]
    assert [moe.is_moe_layer(i) for i in range(config.num_hidden_layers)] == want


@pytest.mark.parametrize("published,window", [
    (MISTRAL_7B_V01, 4096),
    ({**QWEN1_5_MOE_A2_7B, "use_sliding_window": True, "sliding_window": 4096}, 4096),
    ({**QWEN3_8B, "use_sliding_window": True, "sliding_window": 4096}, 4096),
    (MISTRAL_7B_V03, None),                                             # null
    ({**MISTRAL_7B_V01, "sliding_window": 32768}, None),                # covers max_position_embeddings
    ({**QWEN3_8B, "use_sliding_window": False, "sliding_window": 4096}, None),  # Qwen's flag off
    (transformers5({**QWEN1_5_MOE_A2_7B, "sliding_window": 0}), None),  # transformers 5 writes 0 for "none"
], ids=["mistral-v0.1", "qwen2-moe-flag-on", "qwen3-flag-on", "null", "covers-context", "qwen-flag-off", "zero"])
def test_sliding_window_is_kept_only_where_it_can_bind(published, window):
    """FM-053: a window shorter than the model's context is kept (building refuses it, phase 07); one
    that never binds (null, 0, Qwen's use_sliding_window off, or covering max_position_embeddings)
    reads as None: full attention."""
    assert ModelConfig.from_dict(published).sliding_window == window


def test_published_deepseek_v2_config():
    config = ModelConfig.from_dict(DEEPSEEK_V2)
    ds = DeepseekConfig.from_model_config(config)
    assert (ds.q_lora_rank, ds.kv_lora_rank, ds.qk_nope_head_dim, ds.qk_rope_head_dim, ds.v_head_dim) == (
        1536, 512, 128, 64, 128)
    assert (ds.n_routed_experts, ds.num_experts_per_tok, ds.n_shared_experts, ds.moe_intermediate_size) == (
        160, 6, 2, 1536)
    assert (ds.scoring_func, ds.topk_method, ds.n_group, ds.topk_group) == ("softmax", "group_limited_greedy", 8, 3)
    assert ds.routed_scaling_factor == 16.0 and not ds.norm_topk_prob and ds.rope_interleave
    assert [ds.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert config.rope_scaling["factor"] == 40 and config.rope_theta == 10000


@pytest.mark.parametrize("arch,extra,want", [
    ("DeepseekV2ForCausalLM", {}, ("softmax", "group_limited_greedy")),
    ("DeepseekV3ForCausalLM", {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
                               "routed_scaling_factor": 2.5, "n_routed_experts": 256, "n_group": 8,
                               "topk_group": 4}, ("sigmoid", "noaux_tc")),
])
def test_deepseek_transformers5_form_reads_the_same(arch, extra, want):
    published = {**DEEPSEEK_V2, **extra, "architectures": [arch]}
    a, b = ModelConfig.from_dict(published), ModelConfig.from_dict(deepseek_transformers5(published))
    ds_a, ds_b = DeepseekConfig.from_model_config(a), DeepseekConfig.from_model_config(b)
    assert ds_a == ds_b and (ds_a.scoring_func, ds_a.topk_method) == want
    assert (a.rope_theta, a.torch_dtype) == (b.rope_theta, b.torch_dtype)
    assert {k: v for k, v in b.rope_scaling.items() if k != "rope_type"} == a.rope_scaling


def test_v3_without_routing_keys_defaults_to_sigmoid_noaux_tc():
    cfg = {k: v for k, v in DEEPSEEK_V2.items() if k not in ("topk_method", "scoring_func")}
    ds = DeepseekConfig.from_model_config(ModelConfig.from_dict({**cfg, "architectures": ["DeepseekV3ForCausalLM"]}))
    assert (ds.scoring_func, ds.topk_method) == ("sigmoid", "noaux_tc")


def test_a_multimodal_config_reads_its_text_model_from_text_config():
    """Qwen2-VL writes the language model's dimensions under text_config (transformers 5): they read
    as the same config written flat, the outer keys (architectures, model_type) kept."""
    text = {k: v for k, v in QWEN3_8B.items() if k != "architectures"}
    nested = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen2_vl", "text_config": text}
    assert ModelConfig.from_dict(nested) == ModelConfig.from_dict({**QWEN3_8B, "model_type": "qwen2_vl"})

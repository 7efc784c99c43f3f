"""ModelConfig reads every dimension from config.json, in both the published
and the transformers-5 form."""
import json

import pytest
import torch

from engine.config import ModelConfig
from engine.models.registry import build_model

# The published Qwen3-8B config.json (external data, not produced by our code).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 151936,
}


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


def test_unknown_architecture_is_an_error_naming_it():
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        build_model(ModelConfig.from_dict(dict(QWEN3_8B, architectures=["LlamaForCausalLM"])), "meta")


def test_model_is_built_in_its_final_dtype_without_a_float32_copy():
    """Every tensor created while building the full 8B shape (on meta: no memory) is
    bf16 but the small float32 RoPE table, and no parameter is converted afterwards
    (only the RoPE table, float64 -> float32, is under 0.1% of the parameters)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Created(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.float32_elements, self.converted_elements = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in ("_to_copy", "to"):
                self.converted_elements += out.numel()
            elif isinstance(out, torch.Tensor) and out.dtype == torch.float32:
                self.float32_elements += out.numel()
            return out

    c = ModelConfig.from_dict(QWEN3_8B)
    with Created() as created:
        model = build_model(c, "meta", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    total = sum(p.numel() for p in model.parameters())
    assert total == pytest.approx(8.19e9, rel=0.01)
    assert created.converted_elements < 0.001 * total and created.float32_elements < 0.001 * total
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM"])
def test_tiny_config_values_reach_the_config_and_every_norm(tiny_checkpoint, arch):
    """FM-033: the tiny checkpoints' rms_norm_eps and rope_theta differ from every default, but float32
    logits cannot tell eps 1e-5 from 1e-6 (the change is far below the 1e-4 tolerance), so the values are
    compared directly: in ModelConfig, in every RMSNorm of the built model and in the rotary table."""
    from pathlib import Path

    from engine import kernels
    from engine.layers.norm import RMSNorm

    model_dir = tiny_checkpoint(arch)
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    raw.setdefault("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta"))  # transformers-5 form
    config = ModelConfig.from_model_dir(model_dir)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta"):
        assert getattr(config, key) == raw[key], f"{key}: config has {getattr(config, key)}, config.json {raw[key]}"
    model = build_model(config, "cpu")
    norms = {name: m.eps for name, m in model.named_modules() if isinstance(m, RMSNorm)}
    assert norms and all(eps == raw["rms_norm_eps"] for eps in norms.values()), \
        f"RMSNorm eps differs from config.json's {raw['rms_norm_eps']}: {norms}"
    rotary = model.model.layers[0].self_attn.rotary_emb
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    table, _ = kernels.get_cos_sin_cache(raw["max_position_embeddings"], head_dim, raw["rope_theta"],
                                         config.rope_scaling)
    assert rotary.cos_sin_cache is table, "the rotary table is not the one for config.json's rope_theta"

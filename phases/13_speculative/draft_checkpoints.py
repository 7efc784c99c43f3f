"""Random-weight drafter checkpoints for the phase-13 tests, written in the layouts the ecosystem
publishes: an EAGLE-3 head (``LlamaForCausalLMEagle3``: ``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d``, as SGLang's and vLLM's loaders read them) for a given target, and
a DeepSeek-V3 checkpoint with one multi-token prediction layer (``num_nextn_predict_layers: 1``;
``model.layers.<L>.{enorm, hnorm, eh_proj, shared_head.*, embed_tokens}`` beside the layer's own
attention and MoE tensors). Every weight is random, norms included (1 + 0.1 x randn)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from phases.checkpoints import make_tiny_checkpoint, randomize_weights


def eagle3_reference_ids(draft_vocab: int, vocab: int, seed: int) -> torch.Tensor:
    """The target ids of a head's draft vocabulary: ``draft_vocab`` distinct ids, sorted."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab, generator=g)[:draft_vocab].sort().values


def make_eagle3_head(path: Path, target_dir: Path, seed: int = 0, draft_vocab: int | None = None,
                     layer_ids: list[int] | None = None, intermediate_size: int = 96) -> Path:
    """An EAGLE-3 head for the checkpoint in ``target_dir`` (its hidden size, heads and vocab):
    ``draft_vocab`` ids (default: half the vocab, a random subset) and ``layer_ids`` (default: none
    in config.json, so the (2, L // 2, L - 3) default applies)."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    h, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    d = target.get("head_dim") or h // heads
    draft_vocab = draft_vocab or vocab // 2
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": intermediate_size, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": d, "num_hidden_layers": 1, "max_position_embeddings": target["max_position_embeddings"],
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
              "target_hidden_size": h, "tie_word_embeddings": False, "torch_dtype": "float32"}
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids}
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale or shape[-1] ** -0.5)

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=g)

    ids = eagle3_reference_ids(draft_vocab, vocab, seed)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors = {"fc.weight": rand(h, 3 * h), "midlayer.input_layernorm.weight": norm(h),
               "midlayer.hidden_norm.weight": norm(h), "midlayer.post_attention_layernorm.weight": norm(h),
               "midlayer.self_attn.q_proj.weight": rand(heads * d, 2 * h),
               "midlayer.self_attn.k_proj.weight": rand(kv_heads * d, 2 * h),
               "midlayer.self_attn.v_proj.weight": rand(kv_heads * d, 2 * h),
               "midlayer.self_attn.o_proj.weight": rand(h, heads * d),
               "midlayer.mlp.gate_proj.weight": rand(intermediate_size, h),
               "midlayer.mlp.up_proj.weight": rand(intermediate_size, h),
               "midlayer.mlp.down_proj.weight": rand(h, intermediate_size),
               "norm.weight": norm(h), "lm_head.weight": rand(draft_vocab, h, scale=1.0),
               "d2t": ids - torch.arange(draft_vocab), "t2d": t2d}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def make_mtp_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny DeepSeek-V3 checkpoint (``phases.checkpoints``) with one MTP layer after its
    ``L`` layers: the tensors of a random DeepSeek-V3 decoder layer at index ``L`` (MoE there),
    ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], ``shared_head.norm``, and copies of the target's
    embedding and LM head as ``embed_tokens`` and ``shared_head.head``, all under
    ``model.layers.<L>.``; config.json gains ``num_nextn_predict_layers: 1``."""
    import transformers

    make_tiny_checkpoint(path, "DeepseekV3ForCausalLM", seed=seed, **overrides)
    config = json.loads((path / "config.json").read_text())
    num_layers, h = config["num_hidden_layers"], config["hidden_size"]
    hf_config = transformers.DeepseekV3Config(**{k: v for k, v in config.items() if k != "architectures"})
    hf_config.num_hidden_layers = num_layers + 1
    torch.manual_seed(seed + 1)
    layer = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(hf_config, num_layers).float()
    randomize_weights(layer, seed + 1)
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed + 2)
    mine = f"model.layers.{num_layers}."
    for name, value in layer.state_dict().items():
        if name == "mlp.experts.gate_up_proj":  # transformers' stacked [E, 2I, H] -> the checkpoints' per expert
            for e, (gate, up) in enumerate(expert.chunk(2, dim=0) for expert in value):
                tensors[f"{mine}mlp.experts.{e}.gate_proj.weight"] = gate.clone()
                tensors[f"{mine}mlp.experts.{e}.up_proj.weight"] = up.clone()
        elif name == "mlp.experts.down_proj":  # [E, H, I]
            for e, down in enumerate(value):
                tensors[f"{mine}mlp.experts.{e}.down_proj.weight"] = down.clone()
        else:
            tensors[mine + name] = value.detach().clone()
    tensors.update({mine + "enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                    mine + "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                    mine + "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                    mine + "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * (2 * h) ** -0.5,
                    mine + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                    mine + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path

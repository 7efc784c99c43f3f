"""Qwen2-VL checkpoints run text-only through the Qwen runner: the vision tower's tensors are
skipped, and M-RoPE on text positions is plain RoPE (checked against HF's own Qwen2-VL)."""
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.core.llm_engine import LLMEngine
from engine.model.models.qwen_vl import QwenVLTextForCausalLM
from engine.scheduling.sequence import SamplingParams
from engine_cases import assert_no_block_leaks, prompts_with_shared_prefix
from phases.checkpoints import randomize_weights, write_tokenizer

TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=3e-6, bos_token_id=1, eos_token_id=1,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 20000.0})
VISION = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
              in_channels=3, temporal_patch_size=2)


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    """A tiny Qwen2VLForConditionalGeneration (every weight random), saved as transformers saves it."""
    import transformers

    config = transformers.Qwen2VLConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=True,
                                        bos_token_id=1, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).float().eval()
    randomize_weights(model, seed=21)
    path = tmp_path_factory.mktemp("qwen2vl")
    model.save_pretrained(str(path))
    write_tokenizer(path, 512)
    return path, model


def test_qwen2_vl_text_only_greedy_matches_hf(vl_checkpoint, tmp_path, caplog):
    path, hf = vl_checkpoint
    assert any(k.startswith("visual.") for k in load_file(str(path / "model.safetensors")))
    with caplog.at_level(logging.INFO, logger="engine.model.weight_loading"):
        engine = LLMEngine(path, block_size=4, max_num_seqs=3, max_model_len=128)
    assert isinstance(engine.runner.model, QwenVLTextForCausalLM)
    assert any("visual." in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)
    prompts = prompts_with_shared_prefix(seed=8)[:6]
    ours = engine.generate_tokens(prompts, SamplingParams(temperature=0.0, max_tokens=10))
    with torch.no_grad():
        for prompt, tokens in zip(prompts, ours):
            ids = torch.tensor([prompt])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                              eos_token_id=1, pad_token_id=0)
            assert out[0, len(prompt):].tolist() == tokens
    assert_no_block_leaks(engine)

    # the transformers-5 key layout (model.language_model.*, model.visual.*) loads the same weights
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (renamed / f).write_text((path / f).read_text())
    tensors = load_file(str(path / "model.safetensors"))
    new_names = {k: ("model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1))
                 for k in tensors}
    save_file({new_names[k]: v for k, v in tensors.items()}, str(renamed / "model.safetensors"))
    config = json.loads((renamed / "config.json").read_text())
    assert "text_config" in config
    engine2 = LLMEngine(renamed, block_size=4, max_num_seqs=3, max_model_len=128)
    assert engine2.generate_tokens(prompts, SamplingParams(temperature=0.0, max_tokens=10)) == ours

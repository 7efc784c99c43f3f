"""``kv_cache_dtype="fp8"`` (``--kv-cache-dtype fp8``): the engine keeps K/V in e4m3, a quarter of
float32's bytes, and its greedy tokens are transformers' own when transformers' cache holds the
same e4m3 values (its prefill attending to the fresh K/V, as ours does; every later step
reading the rounded cache)."""
from __future__ import annotations

import pytest
import torch

from engine.core.llm_engine import LLMEngine
from engine.scheduling.sequence import SamplingParams
from engine_cases import VOCAB, assert_no_block_leaks, hf_greedy
from phases.checkpoints import make_tiny_checkpoint

MAX_NEW = 16
ENGINE_ARGS = dict(block_size=4, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=128)
E4M3 = torch.float8_e4m3fn


def hf_greedy_with_e4m3_cache(model_dir, prompts, monkeypatch) -> list[list[int]]:
    """``hf_greedy`` with transformers' cache layer storing each K/V value as e4m3 (saturated at
    ±448, rounded, read back in float32): a whole prompt attends to its fresh K/V, every decode
    step to the stored values."""
    from transformers.cache_utils import DynamicLayer

    update = DynamicLayer.update

    def update_rounded(self, key_states, value_states, *args, **kwargs):
        rounded = [s.clamp(-448.0, 448.0).to(E4M3).to(s.dtype) for s in (key_states, value_states)]
        keys, values = update(self, *rounded, *args, **kwargs)
        if keys.shape[-2] == key_states.shape[-2]:  # the prompt itself: nothing was cached before it
            return key_states, value_states
        return keys, values

    with monkeypatch.context() as patch:
        patch.setattr(DynamicLayer, "update", update_rounded)
        return hf_greedy(model_dir, prompts, MAX_NEW)


def test_fp8_kv_cache_matches_transformers_with_an_e4m3_cache(tmp_path, monkeypatch):
    """Tiny Qwen3 (q/k norms; the tiny Qwen2 repeats one token whatever its cache holds), six
    prompts (no shared prefix: a prefix hit would prefill from the rounded cache, which
    transformers' prompt pass does not) batched three at a time: the same tokens as transformers
    with an e4m3 cache, which differ from transformers' float32 cache on some prompt (the
    rounding is seen); the caches are e4m3 and a block takes a quarter of a float32 block."""
    model_dir = make_tiny_checkpoint(tmp_path / "qwen3", "Qwen3ForCausalLM", seed=11)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in (3, 9, 17, 24, 31, 40)]
    engine = LLMEngine(model_dir, kv_cache_dtype="fp8", **ENGINE_ARGS)
    assert {cache.dtype for cache in engine.runner.kv_caches} == {E4M3}
    plain = LLMEngine(model_dir, **ENGINE_ARGS)
    assert engine.runner.kv_cache_bytes * 4 == plain.runner.kv_cache_bytes
    ours = engine.generate_tokens(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    want = hf_greedy_with_e4m3_cache(model_dir, prompts, monkeypatch)
    assert ours == want
    assert want != hf_greedy(model_dir, prompts, MAX_NEW), "e4m3 rounding changed no token: the test cannot tell"
    assert_no_block_leaks(engine)


def test_kv_cache_dtype_is_checked_when_the_engine_is_built(tmp_path):
    """An unknown cache dtype, and FP8 for transformers' own model (the hf backend keeps its own
    cache), are ValueErrors naming the option, raised before any weight is read."""
    model_dir = make_tiny_checkpoint(tmp_path / "qwen3", "Qwen3ForCausalLM", seed=0)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        LLMEngine(model_dir, kv_cache_dtype="int8", **ENGINE_ARGS)
    with pytest.raises(ValueError, match="kv_cache_dtype=fp8 needs one of our model classes"):
        LLMEngine(model_dir, "hf", kv_cache_dtype="fp8", **ENGINE_ARGS)

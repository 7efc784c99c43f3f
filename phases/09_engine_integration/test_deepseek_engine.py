"""DeepSeek-V2 / V2-Lite / V3 checkpoints through LLMEngine exactly as Qwen ones: greedy tokens
equal transformers' generate (float32, CPU) with queued requests and prefix hits over the
latent paged cache."""
import pytest

from engine.core.llm_engine import LLMEngine
from engine.model.layers.mla import MultiHeadLatentAttention
from engine.scheduling.sequence import SamplingParams
from engine_cases import assert_no_block_leaks, hf_greedy, prompts_with_shared_prefix
from phases.checkpoints import V2_LITE, make_tiny_checkpoint

MAX_NEW = 10


@pytest.mark.parametrize("arch, overrides", [("DeepseekV2ForCausalLM", {}), ("DeepseekV2ForCausalLM", V2_LITE),
                                             ("DeepseekV3ForCausalLM", {})], ids=["v2", "v2-lite", "v3"])
def test_deepseek_greedy_matches_hf_generate(tmp_path, arch, overrides):
    path = make_tiny_checkpoint(tmp_path, arch, seed=13, **overrides)
    engine = LLMEngine(path, block_size=4, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=96)
    assert any(isinstance(m, MultiHeadLatentAttention) for m in engine.runner.model.modules())
    assert all(c.shape[0] != 2 for c in engine.runner.kv_caches), "MLA's latent must be stored once, not as K and V"
    prompts = prompts_with_shared_prefix(seed=7)
    ours = engine.generate_tokens(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    assert ours == hf_greedy(path, prompts, MAX_NEW)
    assert_no_block_leaks(engine)

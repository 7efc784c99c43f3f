"""Whole-model logits against HF transformers loaded from the same random
checkpoint: ragged prefill + decode steps through the paged cache."""
import pytest
import torch
import transformers

from engine.worker.kv_cache import bind_kv_cache
from phases.assertions import assert_steps_close
from phases.harness import all_logits_step, load_engine_model, num_blocks_for, run_paged

CASES = {16: [6, 17, 1, 33], 256: [6, 250, 1, 40]}  # sequences cross block boundaries while decoding


def hf_logits(model_dir, sequences):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(ids[None]).logits[0] for ids in sequences]


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM"])
@pytest.mark.parametrize("block_size", [16, 256])
def test_logits_match_hf_through_prefill_and_decode(tiny_checkpoint, arch, block_size):
    model_dir = tiny_checkpoint(arch, seed=5)
    model = load_engine_model(model_dir)
    prompt_lens = CASES[block_size]
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, model.config.vocab_size, (n + 10,), generator=gen) for n in prompt_lens]
    bind_kv_cache(model, num_blocks_for(map(len, sequences), block_size), block_size, torch.float32, "cpu")
    with torch.no_grad():
        got = run_paged(all_logits_step(model), sequences, prompt_lens, block_size)
    for i, (g, w, n) in enumerate(zip(got, hf_logits(model_dir, sequences), prompt_lens)):
        assert_steps_close(g, w, n, 1e-4, "logits", f"sequence {i} of {arch}, block size {block_size}")

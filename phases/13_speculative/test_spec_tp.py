"""Speculative decoding under torchrun (float32 on ``tp_device``): every rank drafts from the
same tokens and takes rank 0's sampled ids, so every rank gives transformers' greedy tokens
with drafts accepted, and the same seeded tokens as the plain engine."""
import pytest
import torch.distributed as dist

from engine.core.llm_engine import LLMEngine
from engine.scheduling.sequence import SamplingParams
from spec_cases import SPEC, VOCAB, assert_no_block_leaks, covering_prompt, hf_greedy, repeating_prompts

MAX_NEW = 12


@pytest.mark.torchrun
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "DeepseekV3ForCausalLM"])
def test_tp_speculation_gives_hf_greedy_tokens_on_every_rank(tp_group, tp_device, tiny_checkpoint, arch):
    assert tp_group.size > 1
    path = tiny_checkpoint(arch, seed=5, vocab_size=VOCAB)
    args = dict(block_size=4, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=96, device=tp_device,
                dtype="float32")
    engine = LLMEngine(path, **SPEC, **args)
    prompts = [covering_prompt(1), covering_prompt(2), *repeating_prompts(seed=3)[2:5]]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    ours = engine.generate_tokens(prompts, greedy)
    assert ours == hf_greedy(path, prompts, MAX_NEW, eos_token_id=None)
    assert engine.scheduler.num_accepted_tokens > 0
    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=MAX_NEW, seed=17, ignore_eos=True)
    spec = engine.generate_tokens(prompts, seeded)
    gathered = [None] * tp_group.size
    dist.all_gather_object(gathered, (spec, engine.scheduler.num_accepted_tokens))
    assert all(g == gathered[0] for g in gathered), "ranks disagree on sampled tokens or acceptances"
    assert spec == LLMEngine(path, overlap=False, **args).generate_tokens(prompts, seeded)
    assert_no_block_leaks(engine)

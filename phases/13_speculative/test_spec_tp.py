"""Speculative decoding under torchrun (float32 on ``tp_device``): every rank drafts from the
same tokens and takes rank 0's sampled ids, so every rank gives transformers' greedy tokens
with drafts accepted, and the same seeded tokens as the plain engine; the model drafters (draft
model, EAGLE-3, MTP) with their networks sharded as the target is."""
import pytest
import torch.distributed as dist

from draft_checkpoints import make_eagle3_head, make_mtp_checkpoint
from engine.core.llm_engine import LLMEngine
from engine.scheduling.sequence import SamplingParams
from phases.checkpoints import make_tiny_checkpoint, written_once
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


@pytest.mark.torchrun
@pytest.mark.parametrize("method", ["draft", "eagle3", "mtp"])
def test_tp_model_drafters_agree_on_every_rank_and_are_lossless(tp_group, tp_device, tmp_path_factory, method):
    """A model drafter under TP: its network sharded like the target's, every rank drafts the same
    tokens (gathered logits), and greedy and seeded tokens are plain decoding's."""
    assert tp_group.size > 1
    tmp = tmp_path_factory.mktemp(method)
    if method == "mtp":
        target = written_once(lambda: make_mtp_checkpoint(tmp / "mtp", seed=8))
        options = {}
    else:
        target = written_once(lambda: make_tiny_checkpoint(tmp / "qwen3", "Qwen3ForCausalLM", seed=5,
                                                           num_hidden_layers=4))
        draft = written_once(lambda: make_tiny_checkpoint(tmp / "draft", "Qwen3ForCausalLM", seed=6,
                                                          num_hidden_layers=1) if method == "draft"
                             else make_eagle3_head(tmp / "eagle3", target, seed=7, layer_ids=[0, 3, 2]))
        options = {"draft_model": str(draft)}
    args = dict(block_size=4, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=96, device=tp_device,
                dtype="float32")
    engine = LLMEngine(target, speculative=method, num_speculative_tokens=3, **options, **args)
    prompts = [covering_prompt(1)[:20], *repeating_prompts(seed=3)[1:4]]
    drafts = []
    propose = engine.scheduler.drafter.propose
    engine.scheduler.drafter.propose = lambda seqs, rooms: drafts.append(propose(seqs, rooms)) or drafts[-1]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=MAX_NEW, seed=17, ignore_eos=True)
    ours = engine.generate_tokens(prompts, greedy), engine.generate_tokens(prompts, seeded)
    gathered = [None] * tp_group.size
    dist.all_gather_object(gathered, (ours, drafts))
    assert all(g == gathered[0] for g in gathered), "ranks disagree on drafts or tokens"
    assert sum(len(d) for step in drafts for d in step) > 0
    plain = LLMEngine(target, overlap=False, **args)
    assert ours == (plain.generate_tokens(prompts, greedy), plain.generate_tokens(prompts, seeded))
    assert_no_block_leaks(engine)

"""LLMEngine under torchrun (float32 on ``tp_device``: the CPU with gloo, or ``cuda:LOCAL_RANK``
with NCCL, CUDA graphs and the custom all-reduce under ``GATES_TORCHRUN_DEVICE=cuda``): every
rank generates HF's greedy tokens; rank 0 samples."""
import pytest
import torch.distributed as dist

from engine.core.llm_engine import LLMEngine
from engine.model.layers.sampler import Sampler
from engine.scheduling.sequence import SamplingParams
from engine_cases import assert_no_block_leaks, hf_greedy, prompts_with_shared_prefix

MAX_NEW = 10


@pytest.mark.torchrun
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM", "DeepseekV3ForCausalLM", "LlamaForCausalLM",
                                  "Qwen2MoeForCausalLM"])
def test_tp_greedy_matches_single_process(tp_group, tp_device, tiny_checkpoint, arch, monkeypatch):
    """Greedy tokens at TP = world size equal transformers' (single process, float32) in every
    rank, with queued requests and prefix hits; only rank 0 runs the sampling math."""
    assert tp_group.size > 1
    path = tiny_checkpoint(arch, seed=11)
    engine = LLMEngine(path, block_size=4, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=96,
                       device=tp_device, dtype="float32")
    assert engine.tp.size == tp_group.size
    samples = []
    real = Sampler._sample
    monkeypatch.setattr(Sampler, "_sample", staticmethod(lambda *a: samples.append(1) or real(*a)))
    prompts = prompts_with_shared_prefix(seed=3)
    ours = engine.generate_tokens(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    assert ours == hf_greedy(path, prompts, MAX_NEW)
    seeded = engine.generate_tokens(prompts[:4], SamplingParams(temperature=1.0, max_tokens=MAX_NEW, seed=17))
    gathered = [None] * tp_group.size
    dist.all_gather_object(gathered, seeded)
    assert all(g == gathered[0] for g in gathered), "ranks disagree on sampled tokens"
    assert (len(samples) > 0) == (tp_group.rank == 0), f"rank {tp_group.rank} ran the sampler {len(samples)} times"
    assert_no_block_leaks(engine)


@pytest.mark.torchrun
def test_tp_overlapped_steps_match_synchronous(tp_group, tp_device, tiny_checkpoint):
    """With one step in flight (the default) every rank feeds rank 0's sampled ids to the next
    step and makes the same decisions: greedy and seeded tokens, stop strings and stop token
    ids equal the synchronous engine's, on every rank."""
    path = tiny_checkpoint("Qwen3ForCausalLM", seed=11)
    args = dict(block_size=4, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=96, device=tp_device,
                dtype="float32")
    prompts = prompts_with_shared_prefix(seed=4)
    results = {}
    for overlap in (False, True):
        engine = LLMEngine(path, overlap=overlap, **args)
        free = engine.generate_tokens(prompts[:3], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=[free[0][3]]),
                  SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop=[engine.tokenizer.decode(free[1][4:5])]),
                  SamplingParams(temperature=0.9, max_tokens=MAX_NEW, seed=5)]
        ids = [engine.add_request(p, params[i % 3]) for i, p in enumerate(prompts)]
        while engine.has_unfinished_requests():
            engine.step()
        results[overlap] = [engine.pop_request(rid).token_ids for rid in ids]
        assert_no_block_leaks(engine)
    assert results[True] == results[False]
    gathered = [None] * tp_group.size
    dist.all_gather_object(gathered, results[True])
    assert all(g == gathered[0] for g in gathered), "ranks disagree"


@pytest.mark.torchrun
def test_tp_prompt_logprobs_match_transformers(tp_group, tp_device, tiny_checkpoint):
    """Prompt logprobs at TP = world size, over chunked prefill: rank 0 reads them (equal to
    transformers' log-softmax of the prompt); every rank gives the same tokens."""
    import torch
    import transformers

    path = tiny_checkpoint("Qwen3ForCausalLM", seed=11)
    engine = LLMEngine(path, block_size=4, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=96,
                       device=tp_device, dtype="float32")
    prompt = prompts_with_shared_prefix(seed=5)[6]
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2))
    while engine.has_unfinished_requests():
        engine.step()
    out = engine.pop_request(rid)
    gathered = [None] * tp_group.size
    dist.all_gather_object(gathered, out.token_ids)
    assert all(g == gathered[0] for g in gathered), "ranks disagree"
    if tp_group.rank == 0:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for t in range(1, len(prompt)):
            token, chosen, top = got[t]
            assert token == prompt[t] and chosen == pytest.approx(float(expected[t - 1, token]), abs=1e-4)
            assert [i for i, _ in top] == expected[t - 1].topk(2).indices.tolist()
    assert_no_block_leaks(engine)

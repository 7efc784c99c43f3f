"""Prompt logprobs through LLMEngine (float32, CPU, overlapped steps) against the float64
log-softmax of transformers' logits over the same prompt, on a tiny random checkpoint."""
import pytest
import torch

from engine.core.llm_engine import LLMEngine
from engine.scheduling.sequence import SamplingParams
from engine_cases import assert_no_block_leaks, prompts_with_shared_prefix, shrink_kv_pool
from phases.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("q3"), "Qwen3ForCausalLM", seed=23)


@pytest.fixture(scope="module")
def hf(checkpoint):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def run(engine, requests: list[tuple[list[int], SamplingParams]]) -> list:
    ids = [engine.add_request(p, params) for p, params in requests]
    while engine.has_unfinished_requests():
        engine.step()
    return [engine.pop_request(rid) for rid in ids]


def assert_prompt_logprobs(hf, prompt: list[int], got: list, n: int) -> None:
    """Position 0 is None; position t holds prompt[t], its logprob given prompt[:t] and the n most
    likely tokens there (ids in order, values), as transformers' log-softmax gives them."""
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    assert len(got) == len(prompt) and got[0] is None
    for t in range(1, len(prompt)):
        token, chosen, top = got[t]
        assert token == prompt[t]
        assert chosen == pytest.approx(float(expected[t - 1, token]), abs=1e-4)
        values, best = expected[t - 1].topk(n)
        assert [i for i, _ in top] == best.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)


def test_prompt_logprobs_are_the_models_log_softmax(checkpoint, hf):
    """Every prompt position, from whole-prompt prefills batched with plain requests (whose
    tokens equal those they give alone) and with a request asking none."""
    engine = LLMEngine(checkpoint, block_size=4, max_num_seqs=4, max_model_len=96)
    prompts = prompts_with_shared_prefix(seed=7, count=6)[1:5]
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    alone = [out.token_ids for out in run(engine, [(p, greedy) for p in prompts[2:]])]
    asks = [SamplingParams(temperature=0.8, seed=1, max_tokens=3, prompt_logprobs=3),
            SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0, logprobs=2)]
    outs = run(engine, [(prompts[0], asks[0]), (prompts[1], asks[1]), (prompts[2], greedy), (prompts[3], greedy)])
    assert_prompt_logprobs(hf, prompts[0], outs[0].prompt_logprobs, 3)
    assert_prompt_logprobs(hf, prompts[1], outs[1].prompt_logprobs, 0)
    assert len(outs[1].logprobs) == 2
    assert [out.prompt_logprobs for out in outs[2:]] == [None, None]
    assert [out.token_ids for out in outs[2:]] == alone
    assert_no_block_leaks(engine)


@pytest.mark.parametrize("budget", [8, 2])
def test_prompt_logprobs_over_chunked_prefill(checkpoint, hf, budget):
    """A prompt prefilled in chunks (each chunk gives its positions) beside a decoding request:
    chunks of 7 in mixed steps, or (a budget of 2) one-token chunks in decode steps."""
    engine = LLMEngine(checkpoint, block_size=4, max_num_seqs=2, max_num_batched_tokens=budget, max_model_len=96)
    prompts = prompts_with_shared_prefix(seed=8, count=9)
    long, short = prompts[6], prompts[2]  # 40 and 9 tokens
    outs = run(engine, [(short, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
                        (long, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=5))])
    assert_prompt_logprobs(hf, long, outs[1].prompt_logprobs, 5)
    assert_no_block_leaks(engine)


def test_prompt_logprobs_ignore_the_prefix_cache(checkpoint, hf):
    """After the same prompt was cached by an earlier request, a request asking for prompt logprobs
    still computes its whole prompt (no cached token) and gets every position; one asking none
    after it still hits the cache."""
    engine = LLMEngine(checkpoint, block_size=4, max_num_seqs=2, max_model_len=96)
    prompt = prompts_with_shared_prefix(seed=9, count=9)[5]  # 31 tokens
    first = run(engine, [(prompt, SamplingParams(temperature=0.0, max_tokens=2))])[0]
    again = run(engine, [(prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))])[0]
    assert again.num_cached_tokens == 0 and again.token_ids == first.token_ids[:1]
    assert_prompt_logprobs(hf, prompt, again.prompt_logprobs, 2)
    assert run(engine, [(prompt, SamplingParams(temperature=0.0, max_tokens=1))])[0].num_cached_tokens == 28
    assert_no_block_leaks(engine)


def test_prompt_logprobs_of_preempted_requests(checkpoint, hf):
    """A pool too small for every request: preempted requests (some mid-prefill, in chunks) are
    recomputed, and each still holds exactly one logprob per prompt position, transformers'."""
    engine = LLMEngine(checkpoint, block_size=4, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=96)
    shrink_kv_pool(engine, 16)
    prompts = prompts_with_shared_prefix(seed=10, count=9)[3:7]  # 17, 23, 31 and 40 tokens
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    outs = run(engine, [(p, params) for p in prompts])
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert_prompt_logprobs(hf, prompt, out.prompt_logprobs, 1)
    assert_no_block_leaks(engine)


def test_a_recomputed_prompt_keeps_one_logprob_per_position(checkpoint):
    """The output keeps the targets past those it holds: a recomputed prompt's chunks, cut
    elsewhere than the first pass's, neither repeat a position nor leave one out."""
    engine = LLMEngine(checkpoint, block_size=4, max_num_seqs=2, max_model_len=96)
    rid = engine.add_request(list(range(10, 20)), SamplingParams(max_tokens=1, prompt_logprobs=0))

    def chunk(first, count):  # fake targets: token = position, logprob = -position
        return {rid: (first, [(t, -float(t), []) for t in range(first, first + count)])}
    for first, count in [(1, 4), (1, 2), (3, 5), (8, 1), (10, 3)]:  # a pass to 4, then one cut at 2 and 7
        engine.outputs.add_prompt_logprobs(chunk(first, count))
    got = engine.request_output(rid).prompt_logprobs
    assert got[0] is None and [t for t, _, _ in got[1:]] == list(range(1, 9))
    engine.abort_request(rid)
    engine.pop_request(rid)


def test_hf_backend_refuses_prompt_logprobs(checkpoint):
    engine = LLMEngine(checkpoint, inference_backend="hf", block_size=4, max_num_seqs=2, max_model_len=64)
    with pytest.raises(ValueError, match="prompt logprobs"):
        engine.add_request([3, 4, 5], SamplingParams(prompt_logprobs=1))

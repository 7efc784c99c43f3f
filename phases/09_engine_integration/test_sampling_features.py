"""Penalties, min_tokens and logprobs through LLMEngine (overlapped steps, float32, CPU), each against
its definition computed here in float64 on transformers' logits of the same checkpoint."""
import pytest
import torch

from engine.core.llm_engine import LLMEngine
from engine.scheduling.sequence import SamplingParams
from engine_cases import assert_no_block_leaks, prompts_with_shared_prefix, shrink_kv_pool
from phases.checkpoints import make_tiny_checkpoint

MAX_NEW = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("q3"), "Qwen3ForCausalLM", seed=17)


@pytest.fixture(scope="module")
def hf(checkpoint):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def next_logits(hf, tokens: list[int]) -> torch.Tensor:
    """transformers' last-position logits for ``tokens``, float64."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].double()


def reference_greedy(hf, prompt: list[int], params: SamplingParams, eos: int | None = None) -> list[int]:
    """Greedy decoding by the definitions: repetition penalty on every token of prompt + output
    (positive logits divided, negative multiplied), then frequency (times the count in the
    output) and presence (once per token in the output) subtracted; EOS and stop ids banned
    before min_tokens; stop at a stop id or max_tokens."""
    out: list[int] = []
    stops = set(params.stop_token_ids) | ({eos} if eos is not None and not params.ignore_eos else set())
    while len(out) < params.max_tokens:
        logits = next_logits(hf, prompt + out)
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[prompt + out] = True
        rep = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=len(logits)).double()
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).double()
        if len(out) < params.min_tokens:
            logits[list(stops)] = float("-inf")
        out.append(int(logits.argmax()))
        if out[-1] in stops:
            break
    return out


def run(engine, prompts, params) -> list:
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return [engine.pop_request(rid) for rid in ids]


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.5), dict(frequency_penalty=0.9),
                                       dict(presence_penalty=1.2),
                                       dict(repetition_penalty=0.7, frequency_penalty=-0.5, presence_penalty=0.6)],
                         ids=["repetition", "frequency", "presence", "all"])
def test_penalties_follow_their_definitions(checkpoint, hf, penalties):
    """Greedy tokens under each penalty equal the float64 reference loop's, for concurrent
    requests over a pool small enough to preempt (a recomputed request's counts are rebuilt
    from its output), and differ from plain greedy (the penalty bites)."""
    engine = LLMEngine(checkpoint, block_size=4, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=96)
    shrink_kv_pool(engine, 16)
    prompts = prompts_with_shared_prefix(seed=2, count=5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **penalties)
    outs = run(engine, prompts, params)
    assert [o.token_ids for o in outs] == [reference_greedy(hf, p, params) for p in prompts]
    assert engine.scheduler.num_preemptions > 0
    plain = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain]
    assert_no_block_leaks(engine)


def test_min_tokens_bans_eos_and_stop_ids_until_reached(checkpoint, hf):
    """A stop token id the free run samples early cannot end the request before min_tokens."""
    engine = LLMEngine(checkpoint, block_size=4, max_num_seqs=3, max_model_len=96)
    prompt = [9, 10, 11, 12]
    free = run(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))[0].token_ids
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[free[1]],
                            min_tokens=5)
    out = run(engine, [prompt], params)[0]
    assert out.token_ids == reference_greedy(hf, prompt, params)
    assert len(out.token_ids) >= 5 and free[1] not in out.token_ids[:5]
    assert_no_block_leaks(engine)


def test_logprobs_are_the_models_log_softmax(checkpoint, hf):
    """Each output token's logprob and the top-N alternatives (ids and values, most likely first)
    equal the float64 log-softmax of transformers' logits at that position, under sampling at a
    temperature (logprobs are taken before temperature) and with requests that ask none beside."""
    engine = LLMEngine(checkpoint, block_size=4, max_num_seqs=4, max_model_len=96)
    prompts = prompts_with_shared_prefix(seed=5, count=4)
    ids = [engine.add_request(p, SamplingParams(temperature=0.8, seed=i, max_tokens=6, logprobs=[3, None, 0, 5][i]))
           for i, p in enumerate(prompts)]
    while engine.has_unfinished_requests():
        engine.step()
    outs = [engine.pop_request(rid) for rid in ids]
    assert outs[1].logprobs is None
    for out, prompt, n in zip(outs, prompts, [3, None, 0, 5]):
        if n is None:
            continue
        assert len(out.logprobs) == len(out.token_ids)
        for i, (token, (logprob_token, chosen, top)) in enumerate(zip(out.token_ids, out.logprobs)):
            assert logprob_token == token
            expected = next_logits(hf, prompt + out.token_ids[:i]).log_softmax(-1)
            assert chosen == pytest.approx(float(expected[token]), abs=1e-4)
            values, best = expected.topk(n)
            assert [t for t, _ in top] == best.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
    assert_no_block_leaks(engine)


def constrained_greedy(hf, prompt: list[int], steps: int, bias: dict[int, float], banned_after: dict[tuple, int],
                       allowed: list[int] | None) -> list[int]:
    """Greedy decoding by the definitions, float64: logit_bias added to the logits, the last token
    of a bad word banned where its other tokens end the text so far, only the allowed ids kept."""
    out: list[int] = []
    for _ in range(steps):
        logits = next_logits(hf, prompt + out)
        for token, b in bias.items():
            logits[token] += b
        for prefix, last in banned_after.items():
            if tuple(out[len(out) - len(prefix):]) == prefix or not prefix:
                logits[last] = float("-inf")
        if allowed is not None:
            keep = torch.full_like(logits, float("-inf"))
            keep[allowed] = logits[allowed]
            logits = keep
        out.append(int(logits.argmax()))
    return out


def test_logit_bias_bad_words_and_allowed_ids_steer_greedy_tokens(checkpoint, hf):
    """logit_bias is added to the logits (a +10 bias makes its token the greedy pick, a -10 one
    drops it), a bad word's last token is banned where its other tokens end the output (a
    one-token word always; a two-token word's second right after its first, which overlapped
    steps must wait for), allowed_token_ids keeps only those ids: each as the float64 reference
    loop decides, beside a plain request in the same steps."""
    engine = LLMEngine(checkpoint, block_size=4, max_num_seqs=4, max_model_len=96)
    prompt = [9, 10, 11, 12]
    free = run(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))[0].token_ids
    boosted, dropped = 7, free[0]
    cases = [
        (dict(logit_bias={boosted: 10.0, dropped: -10.0}), ({boosted: 10.0, dropped: -10.0}, {}, None)),
        (dict(bad_words_token_ids=[[free[0], free[1]], [free[5]]]), ({}, {(free[0],): free[1], (): free[5]}, None)),
        (dict(allowed_token_ids=[3, 5, 8, free[3]]), ({}, {}, [3, 5, 8, free[3]])),
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **kw) for kw, _ in cases]
    ids = [engine.add_request(prompt, p) for p in params]
    plain = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    outs = [engine.pop_request(rid).token_ids for rid in ids]
    assert engine.pop_request(plain).token_ids == free
    for out, (kw, (bias, bans, allowed)) in zip(outs, cases):
        assert out == constrained_greedy(hf, prompt, MAX_NEW, bias, bans, allowed), kw
        assert out != free, f"{kw} did not change the greedy tokens"
    assert outs[0][0] == boosted
    assert outs[1][0] == free[0] and outs[1][1] != free[1], "the two-token bad word was not banned after its first"
    assert set(outs[2]) <= {3, 5, 8, free[3]}
    assert_no_block_leaks(engine)

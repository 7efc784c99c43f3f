"""The overlapped engine step (the default): the engine launches step N+1 before it reads step N
back, feeding step N's sampled ids to step N+1 on the device. It must give exactly the tokens and
texts of the synchronous loop (``overlap=False``) — EOS / stop token ids landing at varied steps,
stop strings, ``max_tokens`` 1, seeded sampling, aborts mid-generation, preemption under a tiny KV
pool, prefix-cache hits, long prompts prefilled in chunks while others decode — for a Qwen3 and
a DeepSeek (MLA) checkpoint; and a mixed step's logits equal transformers' for the same
sequences run as a separate prefill and decode."""
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from engine.core.llm_engine import LLMEngine
from engine.scheduling.sequence import SamplingParams
from engine_cases import assert_no_block_leaks, prompts_with_shared_prefix, shrink_kv_pool
from phases.checkpoints import make_tiny_checkpoint

MAX_NEW = 20
ENGINE_ARGS = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128)
ARCHS = ["Qwen3ForCausalLM", "DeepseekV3ForCausalLM"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {arch: make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=31) for arch in ARCHS}


def workload(engine, prompts) -> list[SamplingParams]:
    """Per-prompt parameters that end requests at varied steps, chosen from a free greedy run:
    a stop token id first sampled at step 1 + i % 12, max_tokens 1, a stop string (a word of the
    free run's text), greedy to max_tokens, and seeded sampling."""
    free = engine.generate_tokens(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    params = []
    for i, tokens in enumerate(free):
        kind = i % 5
        if kind == 0:
            stop_at = 1 + i % 12
            params.append(SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=[tokens[stop_at]]))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.0, max_tokens=1))
        elif kind == 2:
            words = engine.tokenizer.decode(tokens).split()
            stop = [words[len(words) // 2]] if words else []
            params.append(SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop=stop, ignore_eos=True))
        elif kind == 3:
            params.append(SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, max_tokens=MAX_NEW, seed=100 + i))
    return params


def run(engine, prompts, params, abort_after: dict[int, int]) -> list[tuple]:
    """Submit every prompt, step until done, aborting prompt i once it has ``abort_after[i]``
    output tokens read back; (token ids, text, finish reason) per prompt."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished_requests():
        engine.step()
        for i, count in abort_after.items():
            out = engine.request_output(ids[i])
            produced, finished = len(out.token_ids), out.finished
            if produced >= count and not finished:
                assert produced == count, "a step read back two tokens of one request"
                assert engine.abort_request(ids[i])
    engine.step()
    outs = [engine.pop_request(rid) for rid in ids]
    return [(o.token_ids, o.text, o.finish_reason) for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("pool", [None, 18], ids=["roomy-pool", "tiny-pool"])
def test_overlapped_steps_give_the_synchronous_tokens_and_texts(checkpoints, arch, pool):
    """Same requests through an overlapped and a synchronous engine: identical tokens, texts and
    finish reasons; a tiny pool preempts (and recomputes) in both; no block or row leaks."""
    engines = {overlap: LLMEngine(checkpoints[arch], overlap=overlap, **ENGINE_ARGS) for overlap in (False, True)}
    prompts = prompts_with_shared_prefix(seed=13, count=10) + [list(range(2, 50))]  # the last one chunks
    params = workload(engines[False], prompts)
    results = {}
    for overlap, engine in engines.items():
        if pool is not None:
            shrink_kv_pool(engine, pool)
        results[overlap] = run(engine, prompts, params, abort_after={3: 2, 8: 4})
        assert_no_block_leaks(engine)
    assert results[True] == results[False]
    reasons = [reason for _, _, reason in results[True]]
    assert {"stop", "length", "abort"} <= set(reasons), reasons
    assert any(text for _, text, _ in results[True]) and len(results[True][1][0]) == 1
    if pool is not None:
        assert all(e.scheduler.num_preemptions > 0 for e in engines.values())


def test_a_finished_request_never_sees_the_token_computed_after_it(checkpoints):
    """A request that stops at step N had step N+1 launched for it before the engine read step N
    back: that token is computed, dropped, and reaches neither the output nor the text, and its
    blocks are released once step N+1 is read back."""
    engine = LLMEngine(checkpoints["Qwen3ForCausalLM"], **ENGINE_ARGS)
    prompt = [5, 6, 7, 8]
    free = engine.generate_tokens([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    stop_at = next(i for i, t in enumerate(free) if 2 <= i <= 5 and t not in free[:i])
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[free[stop_at]]))
    launched = []
    real_launch = engine.runner.launch
    engine.runner.launch = lambda batch, previous=None: launched.append(len(batch)) or real_launch(batch, previous)
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del engine.runner.launch
    out = engine.pop_request(rid)
    assert out.token_ids == free[:stop_at + 1] and out.finish_reason == "stop"
    assert len(launched) == stop_at + 2, "the step after the stop token was not launched (no overlap?)"
    assert_no_block_leaks(engine)


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_step_logits_equal_separate_prefill_and_decode(checkpoints, arch):
    """One step that decodes a running sequence and prefills a new prompt (with a cached-prefix
    chunk of a third): each entry's logits equal transformers' logits of that sequence run alone
    (a prefill of its prompt, a decode of its context), float32 on both sides (transformers'
    DeepSeek MoE has no float64 path)."""
    import transformers

    engine = LLMEngine(checkpoints[arch], overlap=False, **{**ENGINE_ARGS, "max_num_batched_tokens": 64})
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints[arch]), dtype=torch.float32).eval()
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    shared = list(range(40, 60))
    decoding = engine.add_request(list(range(2, 11)), greedy)
    engine.add_request(shared + [3], SamplingParams(temperature=0.0, max_tokens=1))
    engine.step()
    engine.step()  # both prefilled; the first has decoded once
    prefilling = engine.add_request(list(range(70, 83)), greedy)
    cached = engine.add_request(shared + [4, 5, 6], greedy)
    batch = engine.scheduler.schedule()
    seqs = [engine.sequence(r) for r in (decoding, prefilling, cached)]
    assert batch.seqs == seqs and batch.num_tokens == [1, 13, 3] and batch.starts[2] == 20
    runner = engine.runner
    with torch.inference_mode():
        logits = runner.forward(runner.prepare(batch))
    with torch.no_grad():
        contexts = [seqs[0].token_ids, seqs[1].prompt_token_ids, seqs[2].prompt_token_ids]
        expected = torch.stack([hf(torch.tensor([c])).logits[0, -1] for c in contexts])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    engine.postprocess(runner.launch(batch))
    for rid in (decoding, prefilling, cached):
        engine.abort_request(rid)
    engine.step()
    assert_no_block_leaks(engine)


MACHINE_PROMPTS = [list(range(2, 5)), list(range(7, 16)), list(range(30, 41)), [9, 9, 9, 9, 9, 9, 9, 9, 9]]


class OverlappedEngineMachine(RuleBasedStateMachine):
    """Random add / abort / step sequences on one overlapped engine over a tiny KV pool (so it
    preempts), against free greedy runs of each prompt: every request is reported finished by
    step() exactly once, and nothing after that; its tokens are a prefix of its free run, cut exactly where its stop
    token id first appears or at max_tokens (no token computed after it finished reaches the
    output); an idle engine holds every KV block and row free."""

    engine: LLMEngine | None = None  # one engine for every example (built on first use)
    free_runs: list[list[int]] = []

    @initialize()
    def setup(self):
        cls = type(self)
        if cls.engine is None:
            path = make_tiny_checkpoint(Path(tempfile.mkdtemp()), "Qwen3ForCausalLM", seed=41)
            sync = LLMEngine(path, overlap=False, block_size=4, max_num_seqs=3, max_num_batched_tokens=12,
                             max_model_len=64)
            cls.free_runs = sync.generate_tokens(MACHINE_PROMPTS, SamplingParams(temperature=0.0, max_tokens=8,
                                                                                ignore_eos=True))
            cls.engine = LLMEngine(path, block_size=4, max_num_seqs=3, max_num_batched_tokens=12, max_model_len=64)
            shrink_kv_pool(cls.engine, 10)
        assert_no_block_leaks(self.engine)
        self.requests: dict[str, tuple[int, SamplingParams]] = {}
        self.reported: set[str] = set()

    @rule(prompt=st.integers(0, len(MACHINE_PROMPTS) - 1), max_tokens=st.integers(1, 8),
          stop_at=st.one_of(st.none(), st.integers(0, 7)))
    def add(self, prompt, max_tokens, stop_at):
        stop = [] if stop_at is None else [self.free_runs[prompt][stop_at]]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop)
        self.requests[self.engine.add_request(MACHINE_PROMPTS[prompt], params)] = (prompt, params)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data):
        """Abort the n-th request added, unless already reported. What is drawn depends only on the
        rules run so far, never on which requests the overlapped engine has finished by now (a
        draw from the unreported ones would differ between Hypothesis's replays of one case)."""
        rid = list(self.requests)[data.draw(st.integers(0, len(self.requests) - 1))]
        if rid not in self.reported:
            self.engine.abort_request(rid)

    @rule()
    def step(self):
        for out in self.engine.step():
            assert out.request_id not in self.reported, "a request reported after its finish"
            if out.finished:
                self.reported.add(out.request_id)
                self.check(self.engine.pop_request(out.request_id))

    def check(self, out):
        prompt, params = self.requests[out.request_id]
        free, tokens = self.free_runs[prompt], out.token_ids
        assert tokens == free[:len(tokens)], "tokens differ from the free greedy run"
        stop = next((i + 1 for i, t in enumerate(free) if t in params.stop_token_ids), None)
        end = min(params.max_tokens, stop or params.max_tokens)
        if out.finish_reason == "abort":
            assert len(tokens) <= end
        else:
            assert len(tokens) == end, f"{out.finish_reason}: {len(tokens)} tokens, expected {end}"
            assert out.finish_reason == ("stop" if stop is not None and stop <= params.max_tokens else "length")

    def teardown(self):
        if self.engine is None:
            return
        while self.engine.has_unfinished_requests():
            self.step()
        self.step()
        assert self.reported == set(self.requests), "a request was never reported finished"
        assert_no_block_leaks(self.engine)


OverlappedEngineMachine.TestCase.settings = settings(max_examples=15, stateful_step_count=25, deadline=None,
                                                     suppress_health_check=[HealthCheck.too_slow])
test_overlapped_engine_state_machine = OverlappedEngineMachine.TestCase

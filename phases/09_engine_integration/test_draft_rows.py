"""The engine's draft rows (speculative decoding's verify entries: phase 13 brings the n-gram
drafter; here a drafter that knows plain decoding's tokens stands in, and spoils some of its
drafts): steps whose decodes carry drafted tokens give exactly plain decoding's tokens, greedy and
seeded, each drafted position at its own position and context, each sampled row drawing with the
request's seed at its own output index, block tables rewritten where rejected drafts freed blocks
(a pool small enough that a freed block soon holds another sequence's K/V, and preempts)."""
import pytest

from engine.core.llm_engine import LLMEngine
from engine.scheduling.sequence import SamplingParams
from engine_cases import assert_no_block_leaks, prompts_with_shared_prefix, shrink_kv_pool
from phases.checkpoints import make_tiny_checkpoint

ENGINE_ARGS = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128)
SPEC = dict(speculative="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


class KnowingDrafter:
    """Proposes the tokens plain decoding gave after a sequence's output so far (``plain``: prompt ->
    its plain output); every third proposal has one token changed, so it is rejected there."""

    def __init__(self, plain: dict[tuple, list[int]], vocab_size: int, k: int = 4):
        self.plain, self.vocab_size, self.num_speculative_tokens, self.calls = plain, vocab_size, k, 0

    def propose(self, seqs, rooms: list[int]) -> list[list[int]]:
        drafts = []
        for seq, room in zip(seqs, rooms):
            done = len(seq.output_token_ids)
            draft = list(self.plain[tuple(seq.prompt_token_ids)][done:done + min(self.num_speculative_tokens, room)])
            self.calls += 1
            if draft and self.calls % 3 == 0:
                j = self.calls % len(draft)
                draft[j] = (draft[j] + 1) % self.vocab_size
            drafts.append(draft)
        return drafts


def run(engine: LLMEngine, prompts, params) -> list[list[int]]:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished_requests():
        engine.step()
    return [engine.pop_request(rid).token_ids for rid in ids]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("q3"), "Qwen3ForCausalLM", seed=23)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_drafted_rows_give_plain_decodings_tokens(checkpoint, sampling):
    prompts = prompts_with_shared_prefix(seed=6, count=6)
    if sampling == "greedy":
        params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * len(prompts)
    else:
        params = [SamplingParams(temperature=t, top_p=p, top_k=k, max_tokens=20, seed=70 + i, ignore_eos=True)
                  for i, (t, p, k) in enumerate([(0.6, 1.0, 0), (0.9, 0.9, 0), (0.8, 1.0, 8)] * 2)]
    plain = run(LLMEngine(checkpoint, **ENGINE_ARGS), prompts, params)
    engine = LLMEngine(checkpoint, **SPEC, **ENGINE_ARGS)
    shrink_kv_pool(engine, 20)  # freed blocks are soon another sequence's: a stale table entry shows
    drafter = KnowingDrafter({tuple(p): out for p, out in zip(prompts, plain)}, engine.runner.model.config.vocab_size)
    engine.scheduler.drafter = drafter
    assert run(engine, prompts, params) == plain
    sched = engine.scheduler
    assert 0 < sched.num_accepted_tokens < sched.num_draft_tokens, "no draft was accepted, or none rejected"
    assert sched.num_preemptions > 0
    assert_no_block_leaks(engine)

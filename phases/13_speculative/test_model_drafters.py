"""Model drafters (a draft model, an EAGLE-3 head in the published layout, DeepSeek-V3's MTP layer)
through LLMEngine on random-weight checkpoints and on the demo model's shipped drafters: every
draft is the greedy token of an independent float64 reference (``drafter_reference``) for the
tokens and drafts before it; the target hands out the layers a head names; decoding is lossless
(greedy and seeded tokens of plain decoding, under preemption too); and the shipped drafters
pay on continuations of held-out code."""
from __future__ import annotations

import random

import pytest
import torch

from draft_checkpoints import make_eagle3_head, make_mtp_checkpoint
from drafter_reference import DraftModelReference, Eagle3Reference, MTPReference, target_model
from engine.core.engine_config import DEFAULT_MODEL_DIR
from engine.core.llm_engine import LLMEngine
from engine.entrypoints.bench.spec import plain_workload
from engine.scheduling.sequence import SamplingParams
from phases.checkpoints import make_tiny_checkpoint
from spec_cases import assert_no_block_leaks, shrink_kv_pool

ENGINE_ARGS = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128)
MAX_NEW = 16
EAGLE_LAYERS = [0, 3, 2]  # the embedding, then two layers out of order


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    """Case -> (target checkpoint, LLMEngine speculative options, reference factory)."""
    tmp = tmp_path_factory.mktemp("drafters")
    qwen = make_tiny_checkpoint(tmp / "qwen3", "Qwen3ForCausalLM", seed=5, num_hidden_layers=4)
    draft = make_tiny_checkpoint(tmp / "draft", "Qwen3ForCausalLM", seed=6, num_hidden_layers=1)
    head = make_eagle3_head(tmp / "eagle3", qwen, seed=7, layer_ids=EAGLE_LAYERS)
    mtp = make_mtp_checkpoint(tmp / "mtp", seed=8)
    return {
        "draft": (qwen, dict(speculative="draft", draft_model=str(draft)), lambda: DraftModelReference(draft)),
        # the target as its own draft model: every draft accepted, long catch-ups
        "draft-self": (qwen, dict(speculative="draft", draft_model=str(qwen)), lambda: DraftModelReference(qwen)),
        "eagle3": (qwen, dict(speculative="eagle3", draft_model=str(head)), lambda: Eagle3Reference(qwen, head)),
        "mtp": (mtp, dict(speculative="mtp"), lambda: MTPReference(mtp)),
        "draft-demo": (DEFAULT_MODEL_DIR, dict(speculative="draft"),
                       lambda: DraftModelReference(DEFAULT_MODEL_DIR / "draft")),
        "eagle3-demo": (DEFAULT_MODEL_DIR, dict(speculative="eagle3"),
                        lambda: Eagle3Reference(DEFAULT_MODEL_DIR, DEFAULT_MODEL_DIR / "eagle3")),
    }


def prompts_for(engine: LLMEngine, seed: int) -> list[list[int]]:
    """Random prompts of 1..30 tokens, two sharing a prefix of 12 (a prefix hit on drafted blocks);
    on the demo model, openings of held-out functions."""
    if engine.config.vocab_size > 1000:
        return [engine.tokenizer.encode(p, add_special_tokens=False) for p, _ in plain_workload()[:4]]
    rng = random.Random(seed)

    def words(n):
        return [rng.randrange(2, engine.config.vocab_size) for _ in range(n)]

    prefix = words(12)
    return [words(1), words(9), prefix + words(5), words(30), prefix + words(2)]


def spy_on_drafts(engine: LLMEngine) -> list[tuple[list[int], list[int]]]:
    """Record (the sequence's known tokens, its drafts) of every non-empty draft the engine makes."""
    drafter, calls = engine.scheduler.drafter, []
    propose = drafter.propose

    def recorded(seqs, rooms):
        drafts = propose(seqs, rooms)
        calls.extend((list(seq.token_ids), d) for seq, d in zip(seqs, drafts) if d)
        return drafts

    drafter.propose = recorded
    return calls


def replay_padded_inputs_eagerly(engine: LLMEngine) -> None:
    """Draft as the CUDA graphs do, eagerly on the CPU: every draft step from the static inputs a
    graph replays (the first step padded to ``catch_up`` tokens a sequence, the batch padded to 2
    or 4 sequences), the graph's replay replaced by a call of the function it captures."""
    drafter = engine.runner.drafter
    drafter.allocate_static(4)
    drafter.graphs = {2: None, 4: None}

    def replay(size, inputs, features):
        drafter.load_static(inputs, features)
        return drafter._from_static(size)

    drafter._replay = replay


@pytest.mark.parametrize("case", ["draft", "draft-self", "eagle3", "mtp", "draft-demo", "eagle3-demo",
                                  "draft-self-padded", "eagle3-padded", "mtp-padded"])
def test_every_draft_is_the_references_greedy_token_and_decoding_is_lossless(drafters, case):
    """Also with the padded inputs of the CUDA graphs (``-padded``)."""
    target, options, make_reference = drafters[case.removesuffix("-padded")]
    args = ENGINE_ARGS if "demo" not in case else dict(ENGINE_ARGS, max_num_batched_tokens=64, max_model_len=1024)
    engine = LLMEngine(target, num_speculative_tokens=3, **options, **args)
    if case.endswith("-padded"):
        replay_padded_inputs_eagerly(engine)
    calls = spy_on_drafts(engine)
    prompts = prompts_for(engine, seed=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    ours = engine.generate_tokens(prompts, greedy)
    assert ours == LLMEngine(target, **args).generate_tokens(prompts, greedy)
    assert_no_block_leaks(engine)
    drafted, accepted = engine.scheduler.num_draft_tokens, engine.scheduler.num_accepted_tokens
    if case == "draft-self":  # the target drafting for itself: (almost) every draft accepted
        assert accepted >= 0.9 * drafted
    elif "demo" in case:  # trained drafters: often accepted
        assert accepted > drafted / 5

    reference = make_reference()
    checked = 0
    for tokens, drafts in calls[:24]:
        for j, token in enumerate(drafts):
            logits = reference.logits(tokens, drafts[:j])
            i = reference.draft_id(token)
            tolerance = 1e-4 * float(logits.abs().max())
            assert i >= 0 and logits[i] >= logits.max() - tolerance, (
                f"draft {j} after {len(tokens)} tokens is {token}; the reference's greedy token is "
                f"{int(logits.argmax())} ({float(logits.max()):.5f} against {float(logits[i]):.5f})")
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize("case", ["eagle3", "mtp"])
def test_target_hands_out_the_hidden_states_the_head_reads(drafters, case):
    """After a prefill step the target's features are, per prompt token, transformers' hidden
    states of the layers the head names (EAGLE-3: the residual stream entering layers 0, 3, 2, in
    that order; MTP: the final normed hidden state)."""
    target, options, _ = drafters[case]
    engine = LLMEngine(target, **options, **dict(ENGINE_ARGS, max_num_batched_tokens=64))
    prompt = prompts_for(engine, seed=2)[3]
    engine.generate_tokens([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    features = engine.runner.model.model.features.double()
    with torch.no_grad():
        hf = target_model(target)
        out = hf.model(torch.tensor([prompt]), output_hidden_states=True)
    if case == "eagle3":
        expected = torch.cat([out.hidden_states[i][0] for i in EAGLE_LAYERS], -1)
    else:
        expected = out.last_hidden_state[0]
    assert features.shape == expected.shape
    torch.testing.assert_close(features, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["draft", "eagle3", "mtp"])
def test_seeded_sampling_and_preemption_give_plain_decodings_tokens(drafters, case):
    """Seeded sampling (temperature 0.9, top-p 0.9) gives the tokens plain decoding gives, with a
    pool so small that sequences are preempted and recomputed, their draft KV with them."""
    target, options, _ = drafters[case]
    prompts = prompts_for(LLMEngine(target, **ENGINE_ARGS), seed=3)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=MAX_NEW, seed=11, ignore_eos=True)
    plain = LLMEngine(target, **ENGINE_ARGS).generate_tokens(prompts, seeded)
    engine = LLMEngine(target, num_speculative_tokens=4, **options, **ENGINE_ARGS)
    shrink_kv_pool(engine, 14)
    assert engine.generate_tokens(prompts, seeded) == plain
    assert engine.scheduler.num_preemptions > 0
    assert_no_block_leaks(engine)


def test_shipped_drafters_pay_on_held_out_continuations():
    """The demo model's shipped drafters on the openings of held-out functions (nothing to copy),
    k = 4, greedy: the EAGLE-3 head gives at least 2.0 tokens per target forward, the draft model
    at least 1.6, both the tokens of plain decoding."""
    items = plain_workload()[:8]
    results = {}
    for method in (None, "draft", "eagle3"):
        engine = LLMEngine(speculative=method, num_speculative_tokens=4, max_num_seqs=1)
        tokens, steps = [], 0
        for prompt, answer in items:
            ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
            before = engine.num_steps
            tokens.append(engine.generate_tokens([ids], SamplingParams(temperature=0.0, max_tokens=64))[0])
            steps += engine.num_steps - before
        results[method] = (tokens, sum(map(len, tokens)) / steps)
    assert results["draft"][0] == results[None][0] and results["eagle3"][0] == results[None][0]
    assert results["eagle3"][1] >= 2.0, results["eagle3"][1]
    assert results["draft"][1] >= 1.6, results["draft"][1]


def test_draft_options_are_checked_where_they_enter(drafters, tmp_path):
    """A draft checkpoint is needed by draft and eagle3 (the demo model's shipped ones by default),
    read by nothing else; a draft model of another vocabulary, a head reading a layer the target
    lacks and an MTP run on a checkpoint without MTP layers are errors naming what is wrong."""
    qwen, options, _ = drafters["eagle3"]
    with pytest.raises(ValueError, match="draft_model"):
        LLMEngine(qwen, speculative="eagle3", **ENGINE_ARGS)
    with pytest.raises(ValueError, match="draft_model"):
        LLMEngine(qwen, speculative="ngram", draft_model=options["draft_model"], **ENGINE_ARGS)
    other = make_tiny_checkpoint(tmp_path / "other-vocab", "Qwen3ForCausalLM", seed=9, vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size"):
        LLMEngine(qwen, speculative="draft", draft_model=str(other), **ENGINE_ARGS)
    far = make_eagle3_head(tmp_path / "far", qwen, layer_ids=[0, 1, 4])
    with pytest.raises(ValueError, match=r"3 target layers in \[0, 4\)"):
        LLMEngine(qwen, speculative="eagle3", draft_model=str(far), **ENGINE_ARGS)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        LLMEngine(qwen, speculative="mtp", **ENGINE_ARGS)

"""SamplingParams validation, Sequence bookkeeping, and the shell staying pure Python."""
import subprocess
import sys

import pytest

from engine.scheduling.sequence import SamplingParams, Sequence, SequenceStatus


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("inf")), ("temperature", float("nan")), ("temperature", True),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")), ("top_k", -2), ("top_k", 2.5), ("top_k", 10**20),
    ("max_tokens", 0), ("max_tokens", True), ("max_tokens", 2**63), ("stop", [""]), ("stop", [3]),
    ("stop", ["s"] * 17), ("stop", ["x" * 257]), ("stop_token_ids", [-1]), ("stop_token_ids", [2**40]),
    ("stop_token_ids", list(range(65))), ("ignore_eos", 1), ("seed", -1), ("seed", 2**63), ("seed", 1.0),
    ("min_tokens", -1), ("min_tokens", 17), ("presence_penalty", 2.5), ("frequency_penalty", float("-inf")),
    ("repetition_penalty", 0.0), ("repetition_penalty", 11), ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.0),
    ("logit_bias", {3: 100.5}), ("logit_bias", {-1: 1.0}), ("logit_bias", [(3, 1.0), (3, 2.0)]),
    ("logit_bias", {3: float("nan")}), ("logit_bias", {2.0: 1.0}),
])
def test_bad_sampling_params_name_the_field(field, value):
    """Every field is bounded where the request enters: a value the step could not hold (an int
    past int64 or int32, a non-finite float, unbounded stop strings) is refused here, naming it."""
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**{field: value})


def test_good_sampling_params_are_kept():
    params = SamplingParams(temperature=0.0, top_p=0.5, top_k=-1, max_tokens=3, stop="end",
                            stop_token_ids=[2, 7], ignore_eos=True, seed=2**63 - 1, min_tokens=3,
                            presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.5, logprobs=20)
    assert params.stop == ("end",) and params.stop_token_ids == (2, 7) and params.seed == 2**63 - 1
    assert SamplingParams(seed=0).seed == 0 and SamplingParams(stop_token_ids=[0]).stop_token_ids == (0,)
    assert SamplingParams(logprobs=0).logprobs == 0 and SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    assert SamplingParams(logit_bias={0: 1.0}).logit_bias == ((0, 1.0),)  # token id 0 is a token
    assert SamplingParams(allowed_token_ids=[0]).allowed_token_ids == (0,)
    assert SamplingParams(bad_words_token_ids=[[0]]).bad_words_token_ids == ((0,),)
    # any one penalty alone changes the logits (the runner penalizes exactly the rows whose params say so)
    assert all(SamplingParams(**{name: value}).penalized for name, value in
               [("presence_penalty", 0.5), ("frequency_penalty", -0.5), ("repetition_penalty", 1.2)])
    assert params.penalized and not SamplingParams().penalized and SamplingParams(top_k=2**31 - 1).top_k
    # any one constraint alone changes the logits; only a grammar or a bad word of several tokens reads the output
    alone = [dict(logit_bias={3: 1.0}), dict(allowed_token_ids=[3]), dict(bad_words_token_ids=[[3]]),
             dict(bad_words_token_ids=[[3, 4]])]
    assert all(SamplingParams(**kw).constrained for kw in alone) and not SamplingParams().constrained
    assert [SamplingParams(**kw).reads_output for kw in alone] == [False, False, False, True]


def test_logit_bias_is_kept_as_pairs_sorted_by_token_id():
    """logit_bias is given as a dict {token id: bias} (what the APIs send) or as (id, bias) pairs,
    in any order, and kept as a tuple of pairs sorted by token id: equal biases make equal
    params, and the server's and the step's readers see one order."""
    as_dict = SamplingParams(logit_bias={17: -100, 5: 2.5, 9: 0})
    as_pairs = SamplingParams(logit_bias=[(9, 0.0), (17, -100.0), (5, 2.5)])
    assert as_dict.logit_bias == as_pairs.logit_bias == ((5, 2.5), (9, 0), (17, -100))
    assert as_dict == as_pairs and SamplingParams().logit_bias == ()


def test_sequence_bookkeeping():
    seq = Sequence([5, 6, 7], SamplingParams(seed=9), request_id="a", arrival_time=1.5)
    assert (seq.request_id, seq.arrival_time, seq.seed) == ("a", 1.5, 9)
    assert seq.status is SequenceStatus.WAITING and seq.finish_reason is None and seq.reject_reason is None
    assert seq.block_table == [] and seq.num_cached_tokens == 0 and seq.num_cached_prompt_tokens is None
    assert (seq.num_computed_tokens, seq.num_in_flight, seq.num_pending_tokens) == (0, 0, 0)
    assert (seq.num_draft_tokens, seq.num_accepted_tokens) == (0, 0)  # phase 13's counters start empty
    assert seq.last_token_id == 7 and seq.num_known_tokens == 3
    seq.output_token_ids += [8, 9]
    assert seq.token_ids == [5, 6, 7, 8, 9] and seq.prompt_token_ids == [5, 6, 7]
    assert seq.last_token_id == 9 and seq.num_known_tokens == 5  # the runner feeds the newest known token
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (5, 3, 2)


def test_request_ids_and_seeds_are_drawn_per_request():
    params = SamplingParams()
    seqs = [Sequence([1], params) for _ in range(100)]
    assert len({s.request_id for s in seqs}) == 100
    assert len({s.seed for s in seqs}) == 100 and all(0 <= s.seed < 2**63 for s in seqs)
    assert params.seed is None  # the shared params are never mutated


@pytest.mark.parametrize("prompt", [[], [1, -2], [1, 2.0]])
def test_bad_prompts_raise(prompt):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Sequence(prompt)


def test_shell_is_pure_python():
    """Sequence, BlockManager and Scheduler never build tensors, so they cannot hand a
    host tensor to a device forward: the runner creates every step tensor on its device."""
    code = ("import sys, engine.scheduling.sequence, engine.scheduling.block_manager, engine.scheduling.scheduler; "
            "assert 'torch' not in sys.modules, 'the shell imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)

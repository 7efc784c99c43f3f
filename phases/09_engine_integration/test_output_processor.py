"""OutputProcessor alone, on the shipped model's byte-level tokenizer: the text a running request
pushes stops short only of what could still become a stop string, and a stop string completed
inside a run of tokens one step appended (accepted drafts) ends the output at that token."""
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import engine
from engine.core.output_processor import OutputProcessor
from engine.scheduling.sequence import SamplingParams, Sequence, SequenceStatus
from engine.scheduling.step import SequenceOutput

TEXT = "The quick brown fox jumps over the lazy dog, again and again, until the sun goes down."


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(Path(engine.__file__).parent / "default_model")


def appended(proc: OutputProcessor, seq: Sequence, ids: list[int], finish: str | None = None):
    """What the scheduler does for one step: the tokens join the output (and end it), then the
    processor takes the step's output; returns the requests it asks the engine to end."""
    seq.output_token_ids += ids
    if finish is not None:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, finish
    return proc.process_outputs([SequenceOutput(seq, ids, finish)], {})


@pytest.mark.parametrize("stop", [[], ["@@@@"], ["zz", "#####"]])
def test_streamed_text_is_held_back_only_by_what_could_become_a_stop_string(tokenizer, stop):
    """After each step the text pushed so far is the whole text but its last len(longest stop
    string) - 1 characters (all of it without stop strings); at the finish, all of it.
    num_generation_tokens (the server's generation-token counter) counts the tokens that reached
    the output, from 0."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    hold = max(map(len, stop), default=1) - 1
    proc = OutputProcessor(tokenizer)
    assert proc.num_generation_tokens == 0
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=len(ids), stop=stop), request_id="r")
    proc.add(seq)
    pushed = ""
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        assert appended(proc, seq, [token], "length" if last else None) == []
        pushed += "".join(o.text for o in proc.take_outputs())
        so_far = tokenizer.decode(ids[:i + 1])
        assert pushed == (so_far if last else so_far[:max(0, len(so_far) - hold)]), f"after token {i}"
    assert pushed == TEXT == proc.output("r").text
    assert proc.num_generation_tokens == len(ids)


def test_a_stop_string_inside_a_run_of_appended_tokens_ends_the_output_at_its_token(tokenizer):
    """One step appends several tokens (accepted drafts); the stop string completes at the third:
    the output keeps those three tokens, its text ends before the stop string, and the processor
    asks the engine to end the request with "stop"."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stop = "brown"
    k = next(i for i in range(len(ids)) if stop in tokenizer.decode(ids[:i + 1]))
    proc = OutputProcessor(tokenizer)
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=100, stop=[stop]), request_id="r")
    proc.add(seq)
    assert appended(proc, seq, ids[:k - 1]) == []
    assert appended(proc, seq, ids[k - 1:k + 4]) == [("r", "stop")]
    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "stop"   # the engine ends it in the scheduler
    out = proc.output("r")
    assert out.token_ids == ids[:k + 1]
    assert out.text == TEXT[:TEXT.index(stop)] and out.stop_reason == stop

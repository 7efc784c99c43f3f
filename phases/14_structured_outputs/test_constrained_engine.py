"""Constraints on the next token through LLMEngine (CPU, float32, a tiny Qwen3 checkpoint with
every weight random and the demo model's byte-level tokenizer): grammars (JSON schemas, regex,
choice), logit_bias, allowed_token_ids and bad words. Each output is judged independently of the
engine (``json`` + ``jsonschema``, ``re.fullmatch``, membership, the ids themselves), and the
unconstrained requests of a mixed batch must give exactly the tokens they give alone."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from constrained_cases import EOS, VOCAB, demo_tokenizer_checkpoint, prompts, reference_greedy, run
from engine.core.llm_engine import LLMEngine
from engine.scheduling.sequence import SamplingParams
from engine.scheduling.structured.spec import StructuredSpec, spec_from_request
from test_grammar import SCHEMAS

DIGIT_7 = 23  # the demo tokenizer's "7"
ARGS = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=24, max_model_len=160)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return demo_tokenizer_checkpoint(tmp_path_factory.mktemp("constrained"), seed=29)


@pytest.fixture(scope="module")
def engine(checkpoint):
    return LLMEngine(checkpoint, **ARGS)


def schema_spec(schema: dict) -> StructuredSpec:
    return spec_from_request({"structured_outputs": {"json": schema}})


def assert_grammars_released(engine) -> None:
    assert not engine._grammars.request_ids, "a finished request kept its grammar"


@pytest.mark.parametrize("overlap", [True, False])
def test_json_outputs_validate_and_plain_requests_are_untouched(checkpoint, overlap):
    """Every JSON-schema request (greedy and seeded sampling) that finishes "stop" parses and
    validates with jsonschema, almost all finish so, and the unconstrained greedy requests of the
    same batch give exactly their tokens alone."""
    engine = LLMEngine(checkpoint, overlap=overlap, **ARGS)
    plain = [(p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)) for p in prompts(3, seed=1)]
    alone = [out.token_ids for out in run(engine, plain)]
    constrained = []
    for i, schema in enumerate(SCHEMAS.values()):
        spec = schema_spec(schema)
        constrained += [(p, SamplingParams(temperature=t, seed=i, max_tokens=120, structured=spec))
                        for p, t in zip(prompts(2, seed=10 + i), (0.0, 1.0))]
    outs = run(engine, constrained[:8] + plain + constrained[8:])
    assert [out.token_ids for out in outs[8:11]] == alone
    grammar_outs = outs[:8] + outs[11:]
    schemas = [s for s in SCHEMAS.values() for _ in range(2)]
    finished = 0
    for out, schema in zip(grammar_outs, schemas):
        assert out.finish_reason in ("stop", "length"), out
        if out.finish_reason == "stop":
            finished += 1
            assert out.token_ids[-1] == EOS
            jsonschema.validate(json.loads(out.text), schema)
    assert finished >= 0.8 * len(grammar_outs), f"only {finished} of {len(grammar_outs)} grammars completed"
    assert_grammars_released(engine)


def constrained_requests() -> list[tuple[list[int], SamplingParams]]:
    """Greedy requests under each kind of constraint (prompts longer than the step budget)."""
    kinds = [dict(structured=schema_spec(SCHEMAS["nested objects"])),
             dict(structured=StructuredSpec("regex", r"[a-z]{2,5}-\d{3}"), ignore_eos=True),
             dict(structured=schema_spec(SCHEMAS["anyOf"]), logit_bias={17: 5.0}),
             dict(logit_bias={4321: 3.0, 100: -50.0}, bad_words_token_ids=[[4321, 4321], [55]]),
             dict(allowed_token_ids=[17, 300, 301, 2048, 5000], ignore_eos=True),
             dict(structured=StructuredSpec("regex", "[a-z]{3}"), allowed_token_ids=[DIGIT_7], ignore_eos=True),
             dict()]
    return [(p, SamplingParams(temperature=0.0, max_tokens=40, **kind)) for p, kind in zip(prompts(7, seed=2), kinds)]


def test_constrained_greedy_equals_the_definitions_on_transformers_logits(checkpoint, engine):
    """Greedy outputs under grammars, biases, allowed ids and bad words, batched, equal greedy
    decoding by the definitions on transformers' logits of the same checkpoint."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    requests = constrained_requests()
    outs = run(engine, requests)
    compiler = engine.grammar_compiler
    assert [out.token_ids for out in outs] == [reference_greedy(hf, compiler, p, params) for p, params in requests]
    assert [out.finish_reason for out in outs] == ["stop", "stop", "stop", "length", "length", "error", "length"]


def test_regex_and_choice(engine):
    """Regex outputs fullmatch the pattern, choice outputs are one of the choices (greedy and
    sampled, many seeds)."""
    regex, choices = r"[a-z]{2,5}-\d{3}", ["alpha", "beta gamma", "δέλτα", "x"]
    requests = []
    for seed in range(6):
        temperature = 0.0 if seed == 0 else 1.0
        requests += [(p, SamplingParams(temperature=temperature, seed=seed, max_tokens=40,
                                        structured=StructuredSpec("regex", regex)))
                     for p in prompts(1, seed=seed)]
        requests += [(p, SamplingParams(temperature=temperature, seed=seed, max_tokens=40,
                                        structured=StructuredSpec("choice", json.dumps(choices))))
                     for p in prompts(1, seed=100 + seed)]
    outs = run(engine, requests)
    for out, (_, params) in zip(outs, requests):
        assert out.finish_reason == "stop", out
        if params.structured.kind == "regex":
            assert re.fullmatch(regex, out.text), out.text
        else:
            assert out.text in choices
    assert len({out.text for out in outs[1::2]}) > 1, "sampled choices all alike"
    assert_grammars_released(engine)


def test_a_complete_grammar_finishes_the_request_with_stop(engine):
    """With ignore_eos the scheduler does not end the request at EOS: the grammar, complete once
    it accepted EOS, does ("stop"), with EOS as the last token."""
    spec = StructuredSpec("choice", json.dumps(["yes", "no"]))
    out, = run(engine, [(prompts(1, seed=3)[0], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True,
                                                               structured=spec))])
    assert out.finish_reason == "stop" and out.text in ("yes", "no") and out.token_ids[-1] == EOS
    assert_grammars_released(engine)


def test_a_refused_token_fails_that_request_alone(engine):
    """allowed_token_ids disjoint from what the grammar allows leaves no token: what is sampled
    is refused by the grammar, and that request alone fails ("error" with a message) while the
    others of the batch go on to their own tokens."""
    assert engine.tokenizer.decode([DIGIT_7]) == "7"
    bad = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, allowed_token_ids=[DIGIT_7],
                         structured=StructuredSpec("regex", "[a-z]{3}"))
    plain = [(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) for p in prompts(2, seed=4)]
    alone = [out.token_ids for out in run(engine, plain)]
    outs = run(engine, [plain[0], (prompts(1, seed=5)[0], bad), plain[1]])
    assert outs[1].finish_reason == "error" and "grammar refuses" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == alone
    assert_grammars_released(engine)


def test_an_aborted_grammar_request_releases_its_grammar(engine):
    rid = engine.add_request(prompts(1, seed=6)[0], SamplingParams(
        temperature=0.0, max_tokens=60, structured=schema_spec(SCHEMAS["nested objects"])))
    engine.step()
    engine.step()
    assert engine.abort_request(rid)
    engine.step()  # reads back the step in flight that holds it: then its blocks and grammar go
    assert engine.pop_request(rid).finish_reason == "abort"
    assert_grammars_released(engine)


def test_logit_bias_plus_100_makes_greedy_emit_the_token(engine):
    target = 4321
    outs = run(engine, [(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                           logit_bias={target: 100.0})) for p in prompts(2, seed=7)])
    assert all(out.token_ids == [target] * 8 for out in outs)
    free = run(engine, [(prompts(1, seed=7)[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))])
    first = free[0].token_ids[0]
    banned, = run(engine, [(prompts(1, seed=7)[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                                  logit_bias={first: -100.0}))])
    assert banned.token_ids[0] != first


def test_allowed_token_ids_restrict_every_sampled_token(engine):
    allowed = [17, 300, 301, 2048, 5000, 8191]
    requests = [(p, SamplingParams(temperature=1.5, seed=seed, max_tokens=10, ignore_eos=True,
                                   allowed_token_ids=allowed)) for seed, p in enumerate(prompts(8, seed=8))]
    outs = run(engine, requests)
    drawn = {t for out in outs for t in out.token_ids}
    assert drawn <= set(allowed) and len(drawn) > 2


@pytest.mark.parametrize("overlap", [True, False])
def test_bad_words_never_appear(checkpoint, overlap):
    """A one-token bad word never appears; a two-token word's second token never follows its
    first (greedy and sampled), while the free outputs have both."""
    engine = LLMEngine(checkpoint, overlap=overlap, **ARGS)
    ps = prompts(4, seed=9)
    free = run(engine, [(p, SamplingParams(temperature=t, seed=i, max_tokens=16, ignore_eos=True))
                        for i, (p, t) in enumerate(zip(ps, (0.0, 0.0, 0.8, 0.8)))])
    one = free[0].token_ids[1]
    first, second = free[1].token_ids[2:4]
    pairs = [(a, b) for out in free for a, b in zip(out.token_ids, out.token_ids[1:])]
    assert (first, second) in pairs
    outs = run(engine, [(p, SamplingParams(temperature=t, seed=i, max_tokens=16, ignore_eos=True,
                                           bad_words_token_ids=[[one], [first, second]]))
                        for i, (p, t) in enumerate(zip(ps, (0.0, 0.0, 0.8, 0.8)))])
    for out in outs:
        assert one not in out.token_ids
        assert (first, second) not in list(zip(out.token_ids, out.token_ids[1:]))
    assert outs[1].token_ids[:3] == free[1].token_ids[:3], "the ban took effect before the word's first token"


def test_speculative_grammar_requests_take_no_drafts(checkpoint):
    engine = LLMEngine(checkpoint, speculative="ngram", **ARGS)
    spec = schema_spec(SCHEMAS["array bounds"])
    outs = run(engine, [(p, SamplingParams(temperature=0.0, max_tokens=60, structured=spec)) for p in prompts(2, 11)]
               + [([5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(temperature=0.0, max_tokens=12))])
    assert outs[2].num_draft_tokens > 0, "the plain request drafted nothing: speculation is off"
    for out in outs[:2]:
        assert out.num_draft_tokens == 0
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMAS["array bounds"])


def test_bad_constraint_ids_and_specs_are_value_errors(checkpoint, engine):
    for field, value in (("logit_bias", {VOCAB: 1.0}), ("allowed_token_ids", [1, VOCAB]),
                         ("bad_words_token_ids", [[3, VOCAB + 5]])):
        with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
            engine.add_request([5, 6], SamplingParams(**{field: value}))
    with pytest.raises(ValueError, match="cannot be compiled"):
        engine.add_request([5, 6], SamplingParams(structured=StructuredSpec("regex", "(unclosed")))
    hf = LLMEngine(checkpoint, inference_backend="hf", **ARGS)
    with pytest.raises(ValueError, match="constraints"):
        hf.add_request([5, 6], SamplingParams(logit_bias={3: 1.0}))
    assert not engine.has_unfinished_requests()


@pytest.mark.cuda
def test_cuda_graphed_constrained_decoding(checkpoint):
    """On the GPU, with CUDA graphs and overlapped steps (the grammar mask is xgrammar's kernel,
    in place on a graph's output logits): JSON outputs (greedy and seeded) validate, allowed ids
    hold, a +100 bias wins every step and bad words never appear, in one batch."""
    engine = LLMEngine(checkpoint, dtype="float32", **ARGS)
    assert engine.device.type == "cuda" and engine.runner.graphs
    allowed, target, word = [17, 300, 301, 2048, 5000], 4321, [55]
    plain = [(prompts(1, seed=1)[0], SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                                                    allowed_token_ids=allowed)),
             (prompts(1, seed=2)[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                    logit_bias={target: 100.0})),
             (prompts(1, seed=3)[0], SamplingParams(temperature=0.8, seed=4, max_tokens=12, ignore_eos=True,
                                                    bad_words_token_ids=[word]))]
    constrained = [(p, SamplingParams(temperature=t, seed=i, max_tokens=120, structured=schema_spec(schema)))
                   for i, schema in enumerate(SCHEMAS.values()) for p, t in zip(prompts(2, seed=10 + i), (0.0, 1.0))]
    outs = run(engine, constrained[:5] + plain + constrained[5:])
    assert engine.runner.graph_replays > 0
    assert set(outs[5].token_ids) <= set(allowed)
    assert outs[6].token_ids == [target] * 12
    assert word[0] not in outs[7].token_ids
    grammar_outs = outs[:5] + outs[8:]
    for out, (_, params) in zip(grammar_outs, constrained):
        assert out.finish_reason in ("stop", "length"), out
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), json.loads(params.structured.value))
    assert sum(out.finish_reason == "stop" for out in grammar_outs) >= 0.8 * len(grammar_outs)
    assert_grammars_released(engine)
    torch.cuda.synchronize()

"""Speculative decoding through LLMEngine on tiny Qwen3 and DeepSeek-V3 (MLA) checkpoints: the
tokens, texts and finish reasons of plain decoding, greedy and seeded, with EOS, stop token ids,
stop strings and max_tokens landing inside accepted runs, preemption under a tiny pool, aborts,
chunked prompts and prefix hits on a speculative request's blocks; as many tokens per step as
the acceptance rule gives; each verify row's logits equal to transformers' for its prefix."""
import json
import logging
import shutil

import pytest
import torch

import spec_cases as cases
from engine.core.engine_args import EngineArgs
from engine.core.engine_config import DEFAULT_MODEL_DIR
from engine.core.llm_engine import LLMEngine
from engine.entrypoints.bench.spec import edit_workload
from engine.scheduling.sequence import SamplingParams
from phases.checkpoints import make_tiny_checkpoint
from spec_cases import SPEC, VOCAB, assert_no_block_leaks, expected_runs, repeating_prompts, run, shrink_kv_pool

ARCHS = ["Qwen3ForCausalLM", "DeepseekV3ForCausalLM"]
ENGINE_ARGS = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128)
MAX_NEW = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {arch: make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=5, vocab_size=VOCAB)
            for arch in ARCHS}


def inside_a_run(runs: list[int]) -> list[int]:
    """Output indexes of a step's run of several tokens followed by more tokens of that run (a
    token that ends the output there cuts the run)."""
    starts = [sum(runs[:i]) for i in range(len(runs))]
    return [start + j for start, n in zip(starts, runs) for j in range(n - 1)]


def stop_params(engine: LLMEngine, free: list[int], runs: list[int], kind: str,
                inside_only: bool) -> tuple[SamplingParams, int] | None:
    """Parameters that end a request at a token of its free greedy run (inside an accepted run
    when ``inside_only``): the token's first occurrence as a stop token id or as the checkpoint's
    EOS (``eos``: the caller makes it one), a stop string it first completes, or max_tokens.
    Returns them and that output index (None: no token fits)."""
    greedy = dict(temperature=0.0, max_tokens=MAX_NEW)

    def decode(ids):  # as the engine's output text: special tokens skipped
        return engine.tokenizer.decode(ids, skip_special_tokens=True)

    texts = [decode(free[:m + 1]) for m in range(len(free))]
    inside = inside_a_run(runs)
    for j in inside if inside_only else range(1, len(free) - 1):
        if kind == "eos" and free[j] not in free[:j]:
            return SamplingParams(**greedy), j
        if kind == "stop_id" and free[j] not in free[:j]:
            return SamplingParams(**greedy, stop_token_ids=[free[j]], ignore_eos=True), j
        if kind == "stop_string":
            stop = decode(free[j - 1:j + 1]).strip()
            if stop and stop in texts[j] and not any(stop in t for t in texts[:j]):
                return SamplingParams(**greedy, stop=[stop], ignore_eos=True), j
        if kind == "max_tokens":
            return SamplingParams(**{**greedy, "max_tokens": j + 1}, ignore_eos=True), j
    return None


def with_eos(path, token_id: int, tmp_path):
    """A copy of the checkpoint whose generation_config.json names ``token_id`` an EOS too."""
    copy = shutil.copytree(path, tmp_path / "eos")
    config = json.loads((copy / "generation_config.json").read_text())
    eos = config.get("eos_token_id")
    config["eos_token_id"] = (eos if isinstance(eos, list) else [] if eos is None else [eos]) + [token_id]
    (copy / "generation_config.json").write_text(json.dumps(config))
    return copy


def code_prompts(tokenizer, count: int = 6, longest: int = 150) -> list[list[int]]:
    """The bench's first ``count`` code-editing prompts (a held-out function, then the start of it
    again) of at most ``longest`` tokens (so that a pool one of them fills runs two at once)."""
    prompts = [tokenizer.encode(prompt, add_special_tokens=False) for prompt, _ in edit_workload()]
    return [p for p in prompts if len(p) <= longest][:count]


@pytest.mark.parametrize("model", ["demo", *ARCHS])
def test_greedy_speculation_gives_the_tokens_and_texts_of_plain_decoding(checkpoints, model, tmp_path):
    """The same requests through a speculative and a plain (synchronous) engine: EOS, a stop token
    id, a stop string and max_tokens each landing inside an accepted run of the free speculative
    run where one fits (on the trained demo model, which copies code, they do: the run is cut), greedy
    runs, an abort between steps, prompts prefilled in chunks and prompts sharing a prefix; then
    prompts continuing each request's output (prefix hits on the blocks speculation wrote); over
    a roomy pool and over a tiny one that preempts. Identical tokens, texts and finish reasons;
    drafts accepted; no block leaks. Tiny random checkpoints (Qwen3, DeepSeek-V3 MLA) fall into
    loops, where a first occurrence rarely lands inside a run."""
    path = DEFAULT_MODEL_DIR if model == "demo" else checkpoints[model]
    args = {**ENGINE_ARGS, "max_num_batched_tokens": 64, "max_model_len": 512} if model == "demo" else ENGINE_ARGS
    probe = LLMEngine(path, **SPEC, **args)
    prompts = code_prompts(probe.tokenizer, 7) if model == "demo" else repeating_prompts(seed=3)
    prompts.sort(key=len, reverse=True)  # the two longest first: run free, the tiny pool preempts one
    free_outs, free_runs, _ = run(probe, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                                                  ignore_eos=True))
    assert probe.scheduler.num_accepted_tokens > 0
    aborted = len(prompts) - 1
    chosen = {}  # kind -> (prompt, params, output index)
    for kind in ("eos", "stop_id", "stop_string", "max_tokens"):
        chosen[kind] = next((i, *found) for inside_only in (True, False) for i in range(2, aborted)
                            if i not in {c[0] for c in chosen.values()}
                            and (found := stop_params(probe, free_outs[i][0], free_runs[i], kind, inside_only)))
    path = with_eos(path, free_outs[chosen["eos"][0]][0][chosen["eos"][2]], tmp_path)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)] * len(prompts)
    for i, sampling, _ in chosen.values():
        params[i] = sampling
    blocks = [-(-n // args["block_size"]) for n in map(len, prompts)]
    # the first two prompts fit together (and the watermark), not their outputs; the longest request fits alone.
    # Both prefill in the first step (else the first one's drafts hold the blocks the second one waits for)
    tiny_pool = max(-(-(max(map(len, prompts)) + MAX_NEW) // args["block_size"]), blocks[0] + blocks[1] + 2)
    tiny_args = {**args, "max_num_batched_tokens": len(prompts[0]) + len(prompts[1])}
    results = {}
    for pool in (None, tiny_pool):
        for name, extra in (("plain", dict(overlap=False)), ("spec", SPEC)):
            engine = LLMEngine(path, **extra, **(args if pool is None else tiny_args))
            if pool is not None:
                shrink_kv_pool(engine, pool)
            outs, runs, requests = run(engine, prompts, params, abort_after={aborted: 2})
            cut = outs.pop(aborted)  # aborted after two steps gave it tokens: as many as they gave
            continued = [p + out for p, (out, _, _) in zip(prompts[:aborted] + prompts[aborted + 1:], outs)]
            hits = engine.block_manager.num_prefix_hits
            outs2, _, _ = run(engine, continued, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
            assert pool is not None or engine.block_manager.num_prefix_hits > hits  # (a tiny pool evicts them)
            results[name, pool] = (outs, outs2, runs, requests, engine.scheduler, cut)
            assert_no_block_leaks(engine)
        assert results["spec", pool][:2] == results["plain", pool][:2]
        assert results["spec", pool][4].num_accepted_tokens > 0
        (spec_cut, _, spec_reason), (plain_cut, _, plain_reason) = results["spec", pool][5], results["plain", pool][5]
        assert spec_reason == plain_reason == "abort" and plain_cut == spec_cut[:len(plain_cut)] and plain_cut
    outs, _, runs, requests, _, _ = results["spec", None]
    outs.insert(aborted, None)
    assert results["spec", tiny_pool][4].num_preemptions > 0
    for kind, (i, _, j) in chosen.items():
        assert len(outs[i][0]) == j + 1 and outs[i][2] == ("length" if kind == "max_tokens" else "stop"), kind
        if model == "demo" and kind != "max_tokens":  # (max_tokens cuts the drafts to its room instead)
            kept = len(outs[i][0]) - len(runs[i])  # accepted drafts kept in the output
            assert requests[i].num_accepted_tokens > kept, f"{kind} did not cut an accepted run"


@pytest.mark.parametrize("arch", ARCHS)
def test_tokens_per_step_follow_the_acceptance_rule(checkpoints, arch):
    """Greedy with room for every draft: each step gives each request exactly the drafts the
    prompt-lookup rule proposes that equal plain greedy decoding's tokens, plus one; near
    max_model_len the drafts shrink to the room left."""
    prompts = repeating_prompts(seed=4)
    args = {**ENGINE_ARGS, "max_num_batched_tokens": 256, "max_model_len": 48}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    plain, _, _ = run(LLMEngine(checkpoints[arch], overlap=False, **args), prompts, params)
    spec = LLMEngine(checkpoints[arch], **SPEC, **args)
    outs, runs, _ = run(spec, prompts, params)
    assert outs == plain
    for prompt, (tokens, _, _), got in zip(prompts, plain, runs):
        assert got == expected_runs(prompt, tokens, MAX_NEW, 48), (prompt, tokens)
    assert max(max(r) for r in runs) == 5 and any(len(p) + MAX_NEW > 48 for p in prompts)
    assert_no_block_leaks(spec)


@pytest.mark.parametrize("arch", ARCHS)
def test_seeded_sampling_gives_the_tokens_of_plain_decoding(checkpoints, arch):
    """Each sampled row draws with the request's seed at its own output index, exactly as plain
    decoding draws that token: the same tokens for the same seeds, with top-k and top-p."""
    prompts = repeating_prompts(seed=5)
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, max_tokens=16, seed=40 + i, ignore_eos=True)
              for i, (t, p, k) in enumerate([(0.5, 1.0, 0), (0.9, 0.9, 0), (0.7, 1.0, 8), (1.2, 0.8, 20)] * 2)]
    prompts = (prompts * 2)[:len(params)]
    plain, _, _ = run(LLMEngine(checkpoints[arch], overlap=False, **ENGINE_ARGS), prompts, params)
    spec = LLMEngine(checkpoints[arch], **SPEC, **ENGINE_ARGS)
    outs, _, requests = run(spec, prompts, params)
    assert outs == plain
    assert sum(r.num_accepted_tokens for r in requests) > 0
    assert all(0 <= r.num_accepted_tokens <= r.num_draft_tokens for r in requests)
    assert_no_block_leaks(spec)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mixed", [False, True], ids=["verify-only", "beside-a-prefill"])
def test_verify_rows_logits_equal_transformers(checkpoints, arch, mixed):
    """A verify step's logits: the row of the last token and of each drafted token equal
    transformers' last logits for the sequence's tokens up to that position (so each row attends
    to its own prefix and to no later draft, at its own position), on the decode path (the step
    CUDA graphs replay) and in a mixed step beside a prompt's prefill chunk."""
    import transformers

    engine = LLMEngine(checkpoints[arch], **SPEC, **{**ENGINE_ARGS, "max_num_batched_tokens": 128})
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints[arch]), dtype=torch.float32).eval()
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for seed in (6, 7):
        engine.add_request(cases.covering_prompt(seed), greedy)
    engine.step()  # both prefilled
    if mixed:
        engine.add_request(repeating_prompts(seed=6)[0], greedy)
    batch = engine.scheduler.schedule()
    assert all(batch.drafts[:2]) and batch.is_decode != mixed
    runner = engine.runner
    with torch.inference_mode():
        logits = runner.forward(runner.prepare(batch))
    contexts = [seq.token_ids for seq in batch.seqs]
    contexts += [batch.seqs[i].token_ids + batch.drafts[i][:j + 1] for i, draft in enumerate(batch.drafts)
                 for j in range(len(draft))]
    with torch.no_grad():
        expected = torch.stack([hf(torch.tensor([c])).logits[0, -1] for c in contexts])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    engine.postprocess(runner.launch(batch))
    for rid in engine.request_ids():
        engine.abort_request(rid)
    assert_no_block_leaks(engine)


def test_options_are_checked_where_they_enter_and_overlap_is_turned_off(checkpoints, caplog):
    path = checkpoints["Qwen3ForCausalLM"]
    for kwargs, field in ((dict(speculative="eagle"), "speculative"),
                          (dict(speculative="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
                          (dict(speculative="ngram", prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_max"),
                          (dict(speculative="ngram", inference_backend="hf"), "hf backend")):
        with pytest.raises(ValueError, match=field):
            LLMEngine(path, **kwargs, **ENGINE_ARGS)
    with caplog.at_level(logging.INFO, logger="engine.core.llm_engine"):
        engine = LLMEngine(path, speculative="ngram", overlap=True, **ENGINE_ARGS)
    assert not engine.overlap and "overlap is off" in caplog.text and "n-gram speculation" in engine.summary()
    args = EngineArgs(model=str(path), speculative="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    flags = args.to_cli_args()
    assert flags[flags.index("--speculative") + 1] == "ngram" and "--num-speculative-tokens" in flags
    built = LLMEngine(args.create_engine_config())
    assert built.scheduler.drafter.num_speculative_tokens == 3 and built.scheduler.drafter.prompt_lookup_min == 1
    assert LLMEngine(path, **ENGINE_ARGS).scheduler.drafter is None  # off by default

"""Scheduling for throughput, end to end against HF transformers' greedy generate (float32, CPU):
preemption by recompute under watermark admission, chunked prefill, and the reserve policy."""
import argparse

import pytest
import torch

from engine.core.engine_args import EngineArgs
from engine.core.engine_config import DEFAULT_PREFILL_TOKENS_BESIDE_DECODES, _prefill_tokens_beside_decodes
from engine.core.llm_engine import LLMEngine
from engine.scheduling.sequence import SamplingParams
from engine_cases import assert_no_block_leaks, hf_greedy, prompts_with_shared_prefix, shrink_kv_pool
from phases.checkpoints import make_tiny_checkpoint

MAX_NEW = 12
ENGINE_ARGS = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
SMALL_POOL = 16  # blocks: the longest prompt + MAX_NEW needs 15, all nine together 118


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """{arch: (checkpoint, prompts, HF's greedy tokens)} for a Qwen3 and a DeepSeek-V3 (MLA) checkpoint."""
    out = {}
    for arch in ("Qwen3ForCausalLM", "DeepseekV3ForCausalLM"):
        path = make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=21)
        prompts = prompts_with_shared_prefix(seed=8)
        out[arch] = (path, prompts, hf_greedy(path, prompts, MAX_NEW))
    return out


def run(engine, prompts, steps=None):
    """Greedy outputs of ``prompts`` submitted together; with ``steps`` given, appends the
    request ids of the prefill chunks (entries of more than one token) of every step the runner
    ran. What every request streamed to its detokenizer is checked against its tokens (a prefill
    chunk that samples nothing adds none; the tiny tokenizer decodes most ids to "", so the text
    alone would not show it)."""
    if steps is not None:
        real_launch = engine.runner.launch

        def recording_launch(batch, previous=None):
            steps.append([s.request_id for s, n in zip(batch.seqs, batch.num_tokens) if n > 1])
            return real_launch(batch, previous)
        engine.runner.launch = recording_launch
    try:
        ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=MAX_NEW)) for p in prompts]
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        if steps is not None:
            del engine.runner.launch
    for rid in ids:
        assert engine.outputs.streamed_token_ids(rid) == engine.sequence(rid).output_token_ids, \
            "a token streamed twice"
    return [engine.pop_request(rid).token_ids for rid in ids]


def prefill_steps(steps, num_requests: int) -> list[int]:
    """How many prefill chunks each request (ids "0", "1", ... of a fresh engine) ran."""
    return [sum(str(i) in ids for ids in steps) for i in range(num_requests)]


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "DeepseekV3ForCausalLM"])
def test_preempted_sequences_recompute_hf_greedy(cases, arch):
    """A pool far smaller than the requests' worst cases: watermark admission starts them on
    their prompts, decode preempts the newest when blocks run out, and every recomputed
    sequence still yields exactly HF's greedy tokens; no block or block-table row leaks."""
    path, prompts, expected = cases[arch]
    engine = LLMEngine(path, **ENGINE_ARGS)
    shrink_kv_pool(engine, SMALL_POOL)
    steps = []
    assert run(engine, prompts, steps) == expected
    assert engine.scheduler.num_preemptions > 0
    assert max(prefill_steps(steps, len(prompts))) >= 2, "no request was prefilled again (recomputed)"
    assert_no_block_leaks(engine)


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "DeepseekV3ForCausalLM"])
def test_chunked_prefill_matches_hf_greedy(cases, arch):
    """max_num_batched_tokens below most prompt lengths: long prompts are prefilled over several
    steps (chunks attend to the K/V of the earlier ones and of prefix-cache hits) and the
    tokens are HF's."""
    path, prompts, expected = cases[arch]
    engine = LLMEngine(path, **{**ENGINE_ARGS, "max_num_batched_tokens": 8})
    steps = []
    assert run(engine, prompts, steps) == expected
    counts = prefill_steps(steps, len(prompts))
    assert max(counts) >= 6, f"prompts of up to 47 tokens in chunks of at most 8: {counts}"
    assert_no_block_leaks(engine)


def test_chunked_prefill_and_preemption_on_the_hf_backend(cases):
    """The hf backend (transformers' own per-sequence caches) runs prefill chunks on top of a
    sequence's cache and restarts a preempted sequence from its first token."""
    path, prompts, _ = cases["Qwen3ForCausalLM"]
    engine = LLMEngine(path, inference_backend="hf", **{**ENGINE_ARGS, "max_num_batched_tokens": 16})
    shrink_kv_pool(engine, SMALL_POOL)
    assert run(engine, prompts[:6]) == cases["Qwen3ForCausalLM"][2][:6]
    assert engine.scheduler.num_preemptions > 0
    assert_no_block_leaks(engine)
    assert not engine.runner.held


def test_reserve_admission_from_the_command_line(cases):
    """``--admission reserve`` reaches the scheduler: on the same small pool requests wait for
    their worst case instead, nothing is preempted, and the tokens are HF's."""
    path, prompts, expected = cases["Qwen3ForCausalLM"]
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", str(path), "--device", "cpu", "--admission", "reserve", "--block-size", "4",
                              "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "128"])
    engine = LLMEngine(EngineArgs.from_cli_args(args).create_engine_config())
    assert engine.scheduler.admission == "reserve"
    shrink_kv_pool(engine, SMALL_POOL)
    assert run(engine, prompts) == expected
    assert engine.scheduler.num_preemptions == 0
    assert_no_block_leaks(engine)


def test_prompt_tokens_beside_decodes_from_the_command_line(cases):
    """``--prefill-tokens-beside-decodes 5`` reaches the scheduler: no step that decodes carries
    more than 5 prompt tokens while steps without decodes take up to the budget, and the tokens
    are HF's. The default caps only a serving engine on CUDA (offline work keeps its throughput),
    so it is 0 here; a negative cap is refused where it enters."""
    path, prompts, expected = cases["Qwen3ForCausalLM"]
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    flags = ["--model", str(path), "--device", "cpu", "--block-size", "4", "--max-num-seqs", "4",
             "--max-num-batched-tokens", "64", "--max-model-len", "128"]
    serving = EngineArgs.from_cli_args(parser.parse_args(flags))
    serving.serving = True
    assert serving.create_engine_config().scheduler.prefill_tokens_beside_decodes == 0
    assert [_prefill_tokens_beside_decodes(None, torch.device("cuda"), flag) for flag in (True, False)] == \
        [DEFAULT_PREFILL_TOKENS_BESIDE_DECODES, 0]
    with pytest.raises(ValueError, match="prefill_tokens_beside_decodes must be >= 0"):
        EngineArgs.from_cli_args(parser.parse_args([*flags, "--prefill-tokens-beside-decodes", "-1"])) \
            .create_engine_config()
    capped = EngineArgs.from_cli_args(parser.parse_args([*flags, "--prefill-tokens-beside-decodes", "5"]))
    engine = LLMEngine(capped.create_engine_config())
    assert "at most 5 prompt tokens beside decodes" in engine.summary()  # the start line says so
    steps = []  # (decodes, prompt tokens) of every step launched
    real_launch = engine.runner.launch

    def recording_launch(batch, previous=None):
        decodes = sum(start >= seq.num_prompt_tokens for seq, start in zip(batch.seqs, batch.starts))
        steps.append((decodes, batch.total_tokens - decodes))
        return real_launch(batch, previous)
    engine.runner.launch = recording_launch
    assert run(engine, prompts) == expected
    assert all(prompt <= 5 for decodes, prompt in steps if decodes), steps
    assert max(prompt for decodes, prompt in steps if not decodes) > 5, steps
    assert_no_block_leaks(engine)

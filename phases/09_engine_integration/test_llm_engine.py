"""LLMEngine end to end on tiny random checkpoints, against HF transformers' generate (float32, CPU)."""
import dataclasses
import json
import shutil

import pytest
import torch
import torch.distributed as dist

from engine.core.engine_args import EngineArgs
from engine.core.llm_engine import LLMEngine
from engine.model.models.dense import DenseForCausalLM
from engine.scheduling.sequence import SamplingParams
from engine_cases import assert_no_block_leaks, hf_greedy, prompts_with_shared_prefix
from phases.checkpoints import make_tiny_checkpoint

MAX_NEW = 12
ENGINE_ARGS = dict(block_size=4, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=128)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny Qwen3 (untied, q/k norm) and Qwen2 (tied, QKV bias) checkpoints, every weight random."""
    return {arch: make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=3 + i)
            for i, arch in enumerate(("Qwen3ForCausalLM", "Qwen2ForCausalLM"))}


@pytest.fixture(scope="module")
def engines(checkpoints):
    return {arch: LLMEngine(path, **ENGINE_ARGS) for arch, path in checkpoints.items()}


@pytest.fixture
def greedy():
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM"])
def test_greedy_matches_hf_generate(arch, checkpoints, engines, greedy, monkeypatch):
    """9 prompts submitted together with max_num_seqs=3: requests queue and batches change
    while others decode; three share a 40-token prefix and must hit the prefix cache."""
    engine, prompts = engines[arch], prompts_with_shared_prefix(seed=1)
    cached = []
    real_allocate = engine.block_manager.allocate

    def allocate(seq):
        real_allocate(seq)
        cached.append(seq.num_cached_tokens)
    monkeypatch.setattr(engine.block_manager, "allocate", allocate)
    steps_before = engine.num_steps
    ours = engine.generate_tokens(prompts, greedy)
    assert ours == hf_greedy(checkpoints[arch], prompts, MAX_NEW)
    assert sum(c > 0 for c in cached) >= 2, f"no prefix-cache hits for the shared prefix: {cached}"
    assert engine.num_steps - steps_before < sum(map(len, ours)), "requests were not batched"
    assert_no_block_leaks(engine)


def test_batched_matches_one_at_a_time(engines, greedy):
    engine = engines["Qwen3ForCausalLM"]
    prompts = prompts_with_shared_prefix(seed=2)
    alone = [engine.generate_tokens([p], greedy)[0] for p in prompts]
    assert engine.generate_tokens(prompts, greedy) == alone
    assert_no_block_leaks(engine)


def test_step_api_matches_generate(engines, greedy):
    """begin_generation / step / has_unfinished_requests / get_generation_outputs drive the
    same tokens as generate, and step() reports each request once, when it finishes."""
    engine = engines["Qwen2ForCausalLM"]
    words = ["the quick brown fox", "a garden of light", "river city mountain dark and lazy dog"]
    expected = engine.generate(words, max_new_tokens=MAX_NEW)
    ids = engine.begin_generation(words, greedy)
    reported = []
    while engine.has_unfinished_requests():
        reported += [out.request_id for out in engine.step() if out.finished]
    assert sorted(reported) == sorted(ids)
    assert engine.get_generation_outputs() == expected
    assert [engine.pop_request(i).token_ids for i in ids] == engine.generate_tokens(
        [engine.tokenizer.encode(w, add_special_tokens=False) for w in words], greedy)
    assert_no_block_leaks(engine)


def test_single_process_start_needs_no_process_group(checkpoints, monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    engine = LLMEngine(checkpoints["Qwen3ForCausalLM"], **ENGINE_ARGS)
    assert engine.tp.size == 1 and not dist.is_initialized()


def test_routes_by_architecture(checkpoints, engines, tmp_path):
    """Qwen2 / Qwen3 (and the Qwen2-VL names) go to the Qwen runner with the right features;
    unknown architectures, broken directories and impossible lengths are clear errors."""
    q3, q2 = engines["Qwen3ForCausalLM"].runner.model, engines["Qwen2ForCausalLM"].runner.model
    assert isinstance(q3, DenseForCausalLM) and isinstance(q2, DenseForCausalLM)
    assert q3.model.layers[0].self_attn.q_norm is not None and q2.model.layers[0].self_attn.q_norm is None
    assert q2.model.layers[0].self_attn.qkv_proj.bias is not None

    def variant(name, edit):
        path = tmp_path / name
        shutil.copytree(checkpoints["Qwen3ForCausalLM"], path)
        edit(path)
        return path

    def set_arch(arch):
        def edit(path):
            cfg = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps({**cfg, "architectures": [arch]}))
        return edit

    with pytest.raises(ValueError, match="unsupported architecture 'GPTNeoXForCausalLM'.*Qwen3ForCausalLM"):
        LLMEngine(variant("neox", set_arch("GPTNeoXForCausalLM")), **ENGINE_ARGS)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLMEngine(tmp_path / "nowhere", **ENGINE_ARGS)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLMEngine(variant("noconfig", lambda p: (p / "config.json").unlink()), **ENGINE_ARGS)
    with pytest.raises(ValueError, match="not valid JSON"):
        LLMEngine(variant("badjson", lambda p: (p / "config.json").write_text("{")), **ENGINE_ARGS)
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        LLMEngine(variant("notok", lambda p: [(p / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json")]),
                  **ENGINE_ARGS)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        LLMEngine(variant("noweights", lambda p: (p / "model.safetensors").unlink()), **ENGINE_ARGS)
    with pytest.raises(ValueError, match="max_model_len=5000 must be in \\[1, 1024\\]"):
        LLMEngine(checkpoints["Qwen3ForCausalLM"], **{**ENGINE_ARGS, "max_model_len": 5000})
    with pytest.raises(ValueError, match="inference_backend"):
        LLMEngine(checkpoints["Qwen3ForCausalLM"], inference_backend="vllm", **ENGINE_ARGS)


def test_overlong_prompt_is_rejected(engines, greedy):
    """A prompt over max_model_len is REJECTED with its reason while the others complete."""
    engine = engines["Qwen3ForCausalLM"]
    ok = [[5, 6, 7], [8, 9, 10, 11]]
    too_long = list(range(2, 2 + ENGINE_ARGS["max_model_len"] + 1))
    ids = [engine.add_request(p, greedy) for p in (ok[0], too_long, ok[1])]
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished[ids[1]].finish_reason == "rejected" and "max_model_len" in finished[ids[1]].reject_reason
    assert [engine.pop_request(i).token_ids for i in (ids[0], ids[2])] == engine.generate_tokens(ok, greedy)
    assert engine.generate(["the", "lazy " * 200]) [1] == ""
    assert_no_block_leaks(engine)


def test_generate_terminates_when_nothing_can_run(engines, greedy):
    """A request the idle engine cannot schedule is rejected, never left waiting forever."""
    engine = engines["Qwen3ForCausalLM"]
    rid = engine.add_request([3, 4, 5], greedy)
    seq = engine.sequence(rid)
    engine.scheduler.max_num_seqs = 0  # now it can never be admitted
    try:
        out = [o for o in engine.step() if o.request_id == rid]
    finally:
        engine.scheduler.max_num_seqs = ENGINE_ARGS["max_num_seqs"]
    assert out and out[0].finish_reason == "rejected" and seq.is_finished
    assert not engine.has_unfinished_requests()
    assert_no_block_leaks(engine)


def test_stops_at_eos_and_max_tokens(checkpoints, tmp_path, greedy):
    """EOS from generation_config.json ends a sequence at (and including) that token unless
    ignore_eos; stop_token_ids likewise; max_tokens ends it with "length"."""
    prompt = [7, 8, 9, 10]
    base = LLMEngine(checkpoints["Qwen3ForCausalLM"], **ENGINE_ARGS)
    free_run = base.generate_tokens([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    stop_at = next(i for i, t in enumerate(free_run) if t not in free_run[:i] and t != 1 and i >= 2)
    eos = free_run[stop_at]

    path = tmp_path / "eos"
    shutil.copytree(checkpoints["Qwen3ForCausalLM"], path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 1]}))
    engine = LLMEngine(path, **ENGINE_ARGS)
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=10))
    while engine.has_unfinished_requests():
        engine.step()
    out = engine.pop_request(rid)
    assert out.token_ids == free_run[:stop_at + 1] and out.finish_reason == "stop"
    assert engine.generate_tokens([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0] == \
        free_run
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    out = engine.pop_request(rid)
    assert out.token_ids == free_run[:3] and out.finish_reason == "length"
    rid = base.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[eos],
                                                  ignore_eos=True))
    while base.has_unfinished_requests():
        base.step()
    assert base.pop_request(rid).token_ids == free_run[:stop_at + 1]
    assert_no_block_leaks(engine)
    assert_no_block_leaks(base)


def test_stop_strings_cut_the_text_and_end_the_request(engines):
    engine = engines["Qwen2ForCausalLM"]
    free = engine.generate("the quick brown fox", max_new_tokens=MAX_NEW, ignore_eos=True)
    words = free.split()
    assert len(words) >= 3
    stop = " " + words[2]
    rid = engine.add_request("the quick brown fox", SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                                                    ignore_eos=True, stop=[stop]))
    while engine.has_unfinished_requests():
        engine.step()
    out = engine.pop_request(rid)
    assert out.finish_reason == "stop" and out.text == free[:free.index(stop)]
    assert len(out.token_ids) < MAX_NEW
    assert_no_block_leaks(engine)


def test_abort_frees_every_block(engines, greedy):
    """Aborting waiting and running requests, mid-generation: all blocks free once idle."""
    engine = engines["Qwen3ForCausalLM"]
    prompts = prompts_with_shared_prefix(seed=4)
    ids = [engine.add_request(p, greedy) for p in prompts]
    engine.step()
    engine.step()
    assert engine.abort_request(ids[0]) and engine.abort_request(ids[-1])
    assert not engine.abort_request(ids[0]) and not engine.abort_request("nope")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs[ids[0]].finish_reason == "abort" and outs[ids[-1]].finish_reason == "abort"
    assert all(outs[i].finish_reason in ("stop", "length") for i in ids[1:-1])
    assert_no_block_leaks(engine)


def test_dtype_applies_to_the_whole_model_and_cache(checkpoints):
    engine = LLMEngine(checkpoints["Qwen3ForCausalLM"], dtype="bfloat16", **ENGINE_ARGS)
    assert {p.dtype for p in engine.runner.model.parameters()} == {torch.bfloat16}
    assert {c.dtype for c in engine.runner.kv_caches} == {torch.bfloat16}
    assert len(engine.generate_tokens([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=4))[0]) >= 1


def test_every_checkpoint_tensor_is_loaded(checkpoints, engines):
    """q_norm / k_norm (and every other tensor) hold exactly the checkpoint's values."""
    from safetensors.torch import load_file

    tensors = load_file(str(checkpoints["Qwen3ForCausalLM"] / "model.safetensors"))
    params = dict(engines["Qwen3ForCausalLM"].runner.model.named_parameters())
    for name in ("model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight",
                 "model.norm.weight", "lm_head.weight"):
        assert torch.equal(params[name], tensors[name]), name
    assert not torch.allclose(tensors["model.layers.1.self_attn.q_norm.weight"], torch.ones(1))


def test_kv_pool_is_sized_from_the_workload(engines):
    """On CPU, with the host's memory to spare, the pool is max_num_seqs x ceil(max_model_len /
    block_size) blocks, and the one BlockManager owns exactly those blocks."""
    engine = engines["Qwen3ForCausalLM"]
    a = ENGINE_ARGS
    expected = a["max_num_seqs"] * -(-a["max_model_len"] // a["block_size"])
    assert engine.runner.num_blocks == expected == engine.block_manager.num_blocks
    assert all(c.shape[1] == expected for c in engine.runner.kv_caches)


def test_kv_pool_is_bounded_by_memory_on_the_host_too(checkpoints, monkeypatch):
    """On CPU the pool is capped as on a GPU: by --kv-cache-memory when given, else by
    --mem-utilization of the host's free memory (here a host with 1 MiB left after the reserve);
    a pool that cannot hold one max_model_len sequence is an error naming the flags, before any
    cache is allocated."""
    from engine.worker import model_runner

    a = ENGINE_ARGS
    probe = LLMEngine(checkpoints["Qwen3ForCausalLM"], **a)
    block_bytes = probe.runner.kv_cache_bytes // probe.runner.num_blocks
    budget_blocks = 3 * -(-a["max_model_len"] // a["block_size"])  # three sequences' worth
    many = {**a, "max_num_seqs": 256, "max_num_batched_tokens": 256}
    capped = LLMEngine(checkpoints["Qwen3ForCausalLM"], **many, kv_cache_memory=budget_blocks * block_bytes / 2**30)
    assert capped.runner.num_blocks == budget_blocks == capped.block_manager.num_blocks
    reserve = 2 << 30
    monkeypatch.setattr(model_runner, "free_memory_bytes", lambda device: reserve + (1 << 20))
    host = LLMEngine(checkpoints["Qwen3ForCausalLM"], **many)
    assert host.runner.num_blocks == int((1 << 20) * 0.9) // block_bytes < many["max_num_seqs"] * -(
        -a["max_model_len"] // a["block_size"])
    monkeypatch.setattr(model_runner, "free_memory_bytes", lambda device: reserve + block_bytes)
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        LLMEngine(checkpoints["Qwen3ForCausalLM"], **a)


def test_bad_requests_are_clear_errors(engines):
    engine = engines["Qwen3ForCausalLM"]
    with pytest.raises(ValueError, match=r"token ids must be ints in \[0, 512\)"):
        engine.add_request([3, 512])
    with pytest.raises(TypeError, match="str or a list"):
        engine.add_request(42)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate("the", temperature=-1.0)
    assert not engine.has_unfinished_requests()


def test_hf_backend_gives_the_same_greedy_tokens(checkpoints, engines, greedy):
    prompts = prompts_with_shared_prefix(seed=5)[:5]
    hf_engine = LLMEngine(checkpoints["Qwen2ForCausalLM"], inference_backend="hf", **ENGINE_ARGS)
    assert hf_engine.generate_tokens(prompts, greedy) == engines["Qwen2ForCausalLM"].generate_tokens(prompts, greedy)
    assert_no_block_leaks(hf_engine)


def test_seeded_sampling_is_reproducible_and_batch_independent(engines):
    engine = engines["Qwen3ForCausalLM"]
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=MAX_NEW, seed=1234)
    prompts = prompts_with_shared_prefix(seed=6)
    alone = engine.generate_tokens([prompts[3]], params)[0]
    together = engine.generate_tokens(prompts, params)
    assert together[3] == alone
    assert engine.generate_tokens([prompts[3]], SamplingParams(temperature=0.8, max_tokens=MAX_NEW, seed=99))[0] \
        != alone


def test_top_k_holds_beside_requests_without_it(engines):
    """top_k=1 draws the argmax whatever the temperature, also when the batch holds a request
    that sets no top_k and no request sets top_p (the runner's sampling hints must keep the
    top-k filter)."""
    engine = engines["Qwen3ForCausalLM"]
    prompts = prompts_with_shared_prefix(seed=9)[:4]
    greedy_tokens = engine.generate_tokens(prompts[:2], SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    ids = [engine.add_request(p, SamplingParams(temperature=1.5, top_k=1, max_tokens=MAX_NEW, seed=3))
           for p in prompts[:2]]
    ids += [engine.add_request(p, SamplingParams(temperature=1.5, max_tokens=MAX_NEW, seed=4)) for p in prompts[2:]]
    while engine.has_unfinished_requests():
        engine.step()
    assert [engine.pop_request(i).token_ids for i in ids[:2]] == greedy_tokens
    for rid in ids[2:]:
        engine.pop_request(rid)
    assert_no_block_leaks(engine)


def test_forced_backend_builds_that_family(checkpoints, engines, tmp_path, greedy):
    """inference_backend="qwen_tp" runs the Qwen model on an architecture name the router does not
    know (and "tp" refuses it); the tokens are those of the routed engine."""
    path = tmp_path / "renamed"
    shutil.copytree(checkpoints["Qwen3ForCausalLM"], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForCausalLMExperimental"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'Qwen3ForCausalLMExperimental'"):
        LLMEngine(path, **ENGINE_ARGS)
    forced = LLMEngine(path, inference_backend="qwen_tp", **ENGINE_ARGS)
    assert type(forced.runner.model) is DenseForCausalLM
    prompts = prompts_with_shared_prefix(seed=10)[:3]
    assert forced.generate_tokens(prompts, greedy) == engines["Qwen3ForCausalLM"].generate_tokens(prompts, greedy)


def test_request_progress_follows_the_output(engines, greedy):
    """The deltas step() pushes (one per request whose output gained anything: its new tokens,
    text and logprobs) add up to request_output at every step, a stop string's hold-back
    included; a request pushes nothing in a step that gave it nothing, and its finish once."""
    engine = engines["Qwen2ForCausalLM"]
    params = dataclasses.replace(greedy, max_tokens=MAX_NEW, stop=("zzz-never",), logprobs=2)
    ids = [engine.add_request(p, params) for p in ("the quick brown fox", "a garden of light")]
    got = {rid: ("", [], []) for rid in ids}
    finishes = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.token_ids or delta.finished, delta
            text, tokens, logprobs = got[delta.request_id]
            got[delta.request_id] = (text + delta.text, tokens + delta.token_ids, logprobs + delta.logprobs)
            finishes += [delta.request_id] * delta.finished
        for rid in ids:
            out = engine.request_output(rid)
            assert got[rid] == (out.text, out.token_ids, out.logprobs)
    assert sorted(finishes) == sorted(ids) and engine.step() == []
    for rid in ids:
        engine.pop_request(rid)
    assert_no_block_leaks(engine)


def test_a_request_whose_text_fails_fails_alone(engines, monkeypatch):
    """When the tokenizer raises on one request's tokens, that request ends with "error" and the
    requests detokenised in the same steps keep their full text (the engine can blame it)."""
    engine = engines["Qwen2ForCausalLM"]
    words = ["the quick brown fox", "a garden of light", "river city mountain dark"]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    free = engine.generate_tokens([engine.tokenizer.encode(w, add_special_tokens=False) for w in words], params)
    texts = engine.generate(words, max_new_tokens=MAX_NEW, ignore_eos=True)
    poison = next(t for t in free[1] if t not in free[0] + free[2])
    real = engine.outputs.decode

    def decode(id_lists):
        if any(poison in ids for ids in id_lists):
            raise RuntimeError("the tokenizer failed")
        return real(id_lists)
    monkeypatch.setattr(engine.outputs, "decode", decode)
    ids = [engine.add_request(w, params) for w in words]
    while engine.has_unfinished_requests():
        engine.step()
    outs = [engine.pop_request(rid) for rid in ids]
    assert outs[1].finish_reason == "error" and poison in outs[1].token_ids
    assert [outs[0].text, outs[2].text] == [texts[0], texts[2]]
    assert outs[0].finish_reason == outs[2].finish_reason == "length"
    assert_no_block_leaks(engine)


def test_cached_tokens_of_a_one_token_request(engines):
    """A request whose first output token also finishes it (max_tokens=1) reports the prompt
    tokens the prefix cache gave it, though its blocks are freed before its output is read."""
    engine = engines["Qwen3ForCausalLM"]
    prompt = list(range(30, 43))  # 13 tokens: three full blocks of 4 can be shared
    first = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.pop_request(first).num_cached_tokens == 0
    again = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    out = engine.pop_request(again)
    assert len(out.token_ids) == 1 and out.num_cached_tokens == 12
    assert_no_block_leaks(engine)


def test_the_kernel_switches_are_read_once_into_the_config_and_set_by_the_engine(checkpoints, monkeypatch):
    """The kernels' environment variables are read when the config is resolved (an unknown value a
    ValueError naming its variable, before any weight is read); the engine configures the process
    with its config's settings, whatever the environment says afterwards."""
    from engine.core.engine_args import EngineArgs
    from engine.model import kernels

    path = checkpoints["Qwen3ForCausalLM"]
    with kernels.using():  # the process's settings now, restored after
        monkeypatch.setenv("AGENT_INFER_KERNELS", "torch")
        monkeypatch.setenv("AGENT_INFER_DECODE_GEMV", "1")
        config = EngineArgs(model=str(path), device="cpu", **ENGINE_ARGS).create_engine_config()
        assert config.kernels == kernels.KernelSettings(backend="torch", decode_gemv=True)
        monkeypatch.setenv("AGENT_INFER_FP8_GEMM", "cublas")
        with pytest.raises(ValueError, match="AGENT_INFER_FP8_GEMM='cublas'"):
            EngineArgs(model=str(path), device="cpu", **ENGINE_ARGS).create_engine_config()
        monkeypatch.setenv("AGENT_INFER_KERNELS", "cudnn")  # read by nothing from here on
        LLMEngine(config)
        assert kernels.current() == config.kernels


def test_prefill_graph_tokens_needs_cuda_graphs(tmp_path):
    """EngineConfig's prefill_graph_tokens (phase 11's piecewise graphs read it) is 0 by default
    without CUDA graphs (here: the CPU); asking for piecewise graphs there, or for a negative
    size, is a ValueError naming it."""
    model_dir = make_tiny_checkpoint(tmp_path / "qwen3", "Qwen3ForCausalLM", seed=0)
    assert EngineArgs(model=str(model_dir), device="cpu").create_engine_config().parallel.prefill_graph_tokens == 0
    for bad, message in ((64, "prefill_graph_tokens=64 needs CUDA graphs"), (-1, "prefill_graph_tokens must be")):
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=str(model_dir), device="cpu", prefill_graph_tokens=bad).create_engine_config()


def test_what_the_engine_says_start_line_failed_steps_and_refusals(checkpoints, capfd, caplog, monkeypatch):
    """The words a user (and the server, the CLI) reads: the start line on stderr; a failed step's
    error naming the exception; the speculative log line and summary; the vocabulary and hf-backend
    refusals naming the field and the backend; the attributes the server and benchmarks read."""
    import logging

    path = checkpoints["Qwen3ForCausalLM"]
    with caplog.at_level(logging.INFO, logger="engine.core.llm_engine"):
        spec = LLMEngine(path, speculative="ngram", num_speculative_tokens=3, **ENGINE_ARGS)
    assert any("overlap is off" in r.getMessage() for r in caplog.records if r.name == "engine.core.llm_engine")
    assert spec.summary() in capfd.readouterr().err  # printed at the start
    assert "n-gram speculation (k=3" in spec.summary() and "synchronous steps" in spec.summary()
    assert (spec.model_dir, spec.overlap, spec.max_model_len) == (spec.engine_config.model.model_dir, False, 128)
    assert spec.dtype is not None and isinstance(spec.generation_config, dict) and spec.num_prompt_tokens == 0
    vocab = spec.config.vocab_size
    for field, value in (("logit_bias", {vocab: 1.0}), ("allowed_token_ids", [vocab]),
                         ("bad_words_token_ids", [[vocab]]), ("stop_token_ids", [vocab])):
        with pytest.raises(ValueError, match=rf"^SamplingParams\.{field} must hold token ids in \[0, {vocab}\)"):
            spec.add_request([1, 2, 3], SamplingParams(**{field: value}))
    hf = LLMEngine(path, inference_backend="hf", **ENGINE_ARGS)
    with pytest.raises(ValueError, match="the hf backend does not apply penalties, min_tokens or constraints"):
        hf.add_request([1, 2, 3], SamplingParams(logit_bias={5: 1.0}))
    with pytest.raises(ValueError, match="hf backend"):
        LLMEngine(path, inference_backend="hf", speculative="ngram", **ENGINE_ARGS)

    engine = LLMEngine(path, **ENGINE_ARGS)
    rid = engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    monkeypatch.setattr(engine.runner, "launch", lambda *a: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    out = engine.pop_request(rid)
    assert out.finished and out.error == "the engine failed on this request: RuntimeError: device lost"
    assert_no_block_leaks(engine)

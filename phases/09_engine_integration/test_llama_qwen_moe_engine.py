"""Llama 3.1, Mistral, Qwen3-MoE and Qwen2-MoE checkpoints through LLMEngine exactly as Qwen
ones: greedy tokens equal transformers' generate (float32, CPU) with queued requests, prefix hits,
and a prompt longer than a step's token budget (chunked prefill) that runs past the tiny Llama's
64-token original context; the decode forward of each reads nothing on the host."""
import pytest
import torch

from engine.core.llm_engine import LLMEngine
from engine.model.models.registry import MODEL_CLASSES
from engine.scheduling.sequence import SamplingParams
from engine_cases import VOCAB, assert_no_block_leaks, hf_greedy, prompts_with_shared_prefix
from phases.checkpoints import make_tiny_checkpoint
from phases.harness import assert_no_host_sync_and_no_copies
from test_model_runner import BLOCK, decode_forward_ops

MAX_NEW = 10


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen3MoeForCausalLM",
                                  "Qwen2MoeForCausalLM"])
def test_greedy_matches_hf_generate(tmp_path, arch):
    path = make_tiny_checkpoint(tmp_path, arch, seed=13)
    engine = LLMEngine(path, block_size=4, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=128)
    assert type(engine.runner.model) is MODEL_CLASSES[arch]
    long_prompt = torch.randint(2, VOCAB, (80,), generator=torch.Generator().manual_seed(5)).tolist()
    prompts = prompts_with_shared_prefix(seed=7) + [long_prompt]
    ours = engine.generate_tokens(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    assert ours == hf_greedy(path, prompts, MAX_NEW)
    assert_no_block_leaks(engine)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"])
def test_decode_forward_has_no_host_sync_or_copy(tmp_path, monkeypatch, arch):
    """FM-009 for the new models: a decode step of the runner's model (Qwen MoE: routed experts on
    the gathered path, dense layers, the gated shared expert) reads no device value on the host
    and copies nothing, so it can be captured in a CUDA graph."""
    path = make_tiny_checkpoint(tmp_path, arch, seed=7)
    engine = LLMEngine(path, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=96,
                       overlap=False)  # decode_forward_ops drives the scheduler and runner by hand
    assert_no_host_sync_and_no_copies(decode_forward_ops(engine, monkeypatch))

"""CUDA-graph decode (the GPU default) against eager decode, on the H200."""
import pytest
import torch

from engine.core.llm_engine import LLMEngine
from engine.scheduling.sequence import SamplingParams
from engine.worker.model_runner import graph_batch_sizes
from phases.checkpoints import make_tiny_checkpoint

STEPS = 64
ENGINE_ARGS = dict(device="cuda", dtype="float32", block_size=16, max_num_seqs=8, max_model_len=512)


@pytest.fixture(scope="module", params=["Qwen3ForCausalLM", "DeepseekV2ForCausalLM"])
def engines(tmp_path_factory, request):
    """(eager, graphed) engines on one tiny checkpoint: dense Qwen3, and DeepSeek-V2 (MLA over the
    latent cache, MoE decode paths without a host read)."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=5)
    return LLMEngine(path, enforce_eager=True, **ENGINE_ARGS), LLMEngine(path, **ENGINE_ARGS)


def prompts(count: int, seed: int, shared_prefix: bool = True) -> list[list[int]]:
    """``count`` random prompts of 5 + 7 i tokens, the odd ones after a common 40-token prefix
    unless ``shared_prefix`` is False."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(2, 512, (40,), generator=gen).tolist() if shared_prefix else []
    return [(shared if i % 2 else []) + torch.randint(2, 512, (5 + 7 * i,), generator=gen).tolist()
            for i in range(count)]


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_graph_decode_matches_eager(engines, batch):
    """64 greedy steps at batch 1, 3 (padded to 4) and the largest captured size (8), half of the
    prompts sharing a prefix so prefix-cache hits sit in the batch: identical tokens (float32)."""
    eager, graphed = engines
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    batch_prompts = prompts(batch, seed=batch)
    assert graphed.generate_tokens(batch_prompts, params) == eager.generate_tokens(batch_prompts, params)


@pytest.mark.cuda
def test_graphs_are_replayed(engines):
    """Every captured size is replayed (not skipped) by a decode batch of that size or padded to it.
    No prompt shares a prefix, so all are admitted in the first step (one waiting for a prefix
    another is still writing would be prefilled beside decodes, in a mixed step) and the three
    decode steps after it are all full."""
    _, graphed = engines
    runner = graphed.runner
    assert sorted(runner.graphs) == graph_batch_sizes(8) == [1, 2, 4, 8]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for batch in (1, 2, 3, 5, 8):
        before = runner.graph_replays
        graphed.generate_tokens(prompts(batch, seed=10 + batch, shared_prefix=False), params)
        assert runner.graph_replays - before == 3, f"batch {batch}: {runner.graph_replays - before} replays"


@pytest.mark.cuda
def test_steady_decode_does_not_allocate(engines):
    """100 graph-replayed decode steps after a warm-up take no new device memory (no cudaMalloc:
    reserved bytes and segment count unchanged)."""
    _, graphed = engines
    ids = [graphed.add_request(p, SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
           for p in prompts(4, seed=3)]
    for _ in range(10):
        graphed.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    for _ in range(100):
        graphed.step()
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
    assert after["segment.all.allocated"] == before["segment.all.allocated"]
    for rid in ids:
        graphed.abort_request(rid)
    graphed.step()

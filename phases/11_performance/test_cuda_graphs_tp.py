"""CUDA-graph decode under tensor parallelism (torchrun on CUDA, NCCL): every rank captures the
same batch sizes, and the all-reduce captured inside the layers is the custom one (symmetric
memory; the engine's default on CUDA, which the H200s here support)."""
import pytest
import torch
import torch.distributed as dist

from engine.core.llm_engine import LLMEngine
from engine.distributed import all_reduce_path
from engine.scheduling.sequence import SamplingParams

pytestmark = [pytest.mark.torchrun, pytest.mark.cuda]

STEPS = 32
ENGINE_ARGS = dict(dtype="float32", block_size=16, max_num_seqs=8, max_model_len=256)


def prompts(count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (3 + 9 * i,), generator=gen).tolist() for i in range(count)]


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "DeepseekV2ForCausalLM"])
def test_tp_graph_decode_matches_eager(tp_group, tiny_checkpoint, arch):
    """Graph replay at TP = world size gives the eager engine's greedy tokens at batch 1, 3 and 8,
    the same on every rank, and the graphs are really replayed."""
    assert tp_group.size > 1
    path = tiny_checkpoint(arch, seed=21)
    eager = LLMEngine(path, enforce_eager=True, **ENGINE_ARGS)
    graphed = LLMEngine(path, **ENGINE_ARGS)
    assert graphed.runner.graphs, "no graphs captured under TP"
    assert all_reduce_path() in ("symmetric memory", "vllm custom"), \
        f"the custom all-reduce did not start ({all_reduce_path()}): the graphs captured NCCL's"
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    for batch in (1, 3, 8):
        before = graphed.runner.graph_replays
        got = graphed.generate_tokens(prompts(batch, seed=batch), params)
        assert got == eager.generate_tokens(prompts(batch, seed=batch), params), f"batch {batch}"
        assert graphed.runner.graph_replays - before == STEPS - 1, f"batch {batch}: not replayed"
        gathered = [None] * tp_group.size
        dist.all_gather_object(gathered, got)
        assert all(g == got for g in gathered), f"batch {batch}: ranks disagree"

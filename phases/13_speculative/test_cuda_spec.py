"""Speculative decoding on the GPU: the demo model (float32, so a verify row's GEMM of several
rows rounds as a one-row decode does) through CUDA graphs captured per row count: greedy
speculation gives plain decoding's tokens on the code-editing prompts, and verify steps replay
graphs of more than one row per sequence."""
import pytest
import torch

from engine.core.llm_engine import LLMEngine
from engine.entrypoints.bench.spec import edit_workload, plain_workload
from engine.scheduling.sequence import SamplingParams


@pytest.mark.cuda
def test_graphed_verify_steps_give_the_tokens_of_plain_decoding():
    engines = {name: LLMEngine(dtype="float32", max_num_seqs=4, max_model_len=1024, **extra)
               for name, extra in (("plain", {}), ("spec", dict(speculative="ngram", num_speculative_tokens=4)))}
    assert max(engines["spec"].runner.graphs) == 4 * (1 + 4)  # every row count up to max_num_seqs x (1 + k)
    prompts = [engines["plain"].tokenizer.encode(p, add_special_tokens=False) for p, _ in edit_workload()[:8]]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = {name: engine.generate_tokens(prompts, params) for name, engine in engines.items()}
    replays = engines["spec"].runner.graph_replays
    assert outs["spec"] == outs["plain"]
    assert engines["spec"].scheduler.num_accepted_tokens > 0 and replays > 0
    assert engines["spec"].num_steps < engines["plain"].num_steps
    torch.cuda.synchronize()


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_model_drafters_under_graphs_give_the_tokens_of_plain_decoding(method):
    """The demo model's shipped drafters on the GPU: the target's decode steps replay graphs whose
    captured features the head reads, every draft (its catch-up step included) replays a graph of
    its own; greedy speculation gives plain decoding's tokens."""
    args = dict(dtype="float32", max_num_seqs=4, max_model_len=1024)
    plain, spec = LLMEngine(**args), LLMEngine(speculative=method, num_speculative_tokens=4, **args)
    prompts = [plain.tokenizer.encode(p, add_special_tokens=False) for p, _ in plain_workload()[:8]]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    assert spec.generate_tokens(prompts, params) == plain.generate_tokens(prompts, params)
    assert spec.scheduler.num_accepted_tokens > spec.scheduler.num_draft_tokens / 4
    assert spec.runner.graph_replays > 0 and spec.runner.drafter.graph_replays > 0
    torch.cuda.synchronize()

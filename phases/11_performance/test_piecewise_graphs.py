"""Piecewise CUDA graphs for steps that carry prefill chunks (``engine.worker.piecewise_graphs``): the
size ladder, the static inputs' padding, the eager regions' rows, the option; on a GPU, token
for token against eager with no eager forward left while serving."""
import pytest
import torch

from engine.core.llm_engine import LLMEngine
from engine.scheduling.sequence import SamplingParams
from engine.worker.piecewise_graphs import PiecewiseGraphs, Region, prefill_graph_sizes
from phases.checkpoints import make_tiny_checkpoint


@pytest.mark.parametrize("limit", [1, 16, 100, 512, 2048, 3000])
def test_every_step_is_padded_by_little(limit):
    """Sizes rise to ``limit`` itself; a step of any T <= limit replays the smallest size holding
    it, padded by fewer than 32 rows up to 512 tokens and by less than T / 8 beyond."""
    sizes = prefill_graph_sizes(limit)
    assert sizes == sorted(set(sizes)) and sizes[-1] == limit and sizes[0] == min(16, limit)
    graphs = PiecewiseGraphs(sizes, torch.device("cpu"))
    for tokens in range(1, limit + 1):
        pad = graphs.size_for(tokens) - tokens
        assert 0 <= pad and (pad < 32 if tokens <= 512 else pad < tokens / 8), (tokens, pad)
    assert graphs.size_for(limit + 1) is None
    assert prefill_graph_sizes(0) == []


def test_padding_rows_write_no_kv():
    """A step staged after a longer one: its rows are the step's, and every padding row of its size
    has slot -1 (a stale slot would write another sequence's cached K/V)."""
    graphs = PiecewiseGraphs([16, 32], torch.device("cpu"))
    for tokens, size in ((20, 32), (5, 16), (16, 16), (1, 32)):
        ids, positions = torch.randint(0, 500, (2, tokens))
        slots = torch.randperm(1000)[:tokens]
        graphs.stage(ids, positions, slots, size)
        assert torch.equal(graphs.input_ids[:tokens], ids) and torch.equal(graphs.positions[:tokens], positions)
        assert torch.equal(graphs.slot_mapping[:tokens], slots)
        assert (graphs.slot_mapping[tokens:size] == -1).all()


def test_an_eager_region_reads_and_writes_the_real_rows_only():
    """At replay a region's function sees the step's T rows of each input and its result lands in
    the output's first T rows; the padding rows of the output are left alone."""
    q, k = torch.randn(2, 32, 4, 8)
    out = torch.full((32, 4, 8), 7.0)
    seen = []

    def attend(q_rows, k_rows):
        seen.append((q_rows.shape[0], k_rows.shape[0]))
        return q_rows * k_rows

    Region(attend, (q, k), out).run(20)
    assert seen == [(20, 20)]
    assert torch.equal(out[:20], q[:20] * k[:20]) and (out[20:] == 7.0).all()


ENGINE_ARGS = dict(device="cuda", dtype="float32", block_size=16, max_num_seqs=8, max_model_len=512,
                   max_num_batched_tokens=64)


@pytest.fixture(scope="module", params=["Qwen3ForCausalLM", "DeepseekV2ForCausalLM"])
def engines(tmp_path_factory, request):
    """(eager, graphed) engines on one tiny checkpoint, 64 tokens a step (sizes 16, 32, 64)."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=7)
    return LLMEngine(path, enforce_eager=True, **ENGINE_ARGS), LLMEngine(path, **ENGINE_ARGS)


def staggered_run(engine: LLMEngine) -> list[list[int]]:
    """Three requests, then four more arriving while those decode (two sharing a prefix with the
    first: cached-prefix prefill), prompts of 9-150 tokens in chunks of a 64-token step beside
    the decodes; greedy. The output tokens of every request, in arrival order."""
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(2, 512, (48,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = lambda n: torch.randint(2, 512, (n,), generator=gen).tolist()  # noqa: E731
    first = [shared + tokens(9), tokens(150), tokens(30)]
    later = [shared + tokens(5), shared + tokens(70), tokens(17), tokens(100)]
    ids = [engine.add_request(p, params, detokenize=False) for p in first]
    for _ in range(6):
        engine.step()
    ids += [engine.add_request(p, params, detokenize=False) for p in later]
    while engine.has_unfinished_requests():
        engine.step()
    return [engine.pop_request(rid).token_ids for rid in ids]


@pytest.mark.cuda
def test_prefill_steps_replay_piecewise_graphs_with_eager_tokens(engines):
    """Every step of a staggered run replays a graph (prefill and mixed steps their pieces, decode
    steps theirs): the model never runs eagerly, and the tokens are eager's (float32; chunked
    prefill beside decodes, cached prefixes, steps padded to 16, 32 and 64 tokens)."""
    eager, graphed = engines
    runner = graphed.runner
    assert graphed.engine_config.parallel.prefill_graph_tokens == 64
    assert sorted(runner.prefill_graphs.graphs) == [16, 32, 64]
    eager_forwards = []
    forward = runner.model.forward
    runner.model.forward = lambda *args: eager_forwards.append(args) or forward(*args)
    try:
        before = runner.prefill_graphs.replays
        tokens = staggered_run(graphed)
    finally:
        del runner.model.forward
    assert eager_forwards == []
    assert runner.prefill_graphs.replays - before >= 5
    assert tokens == staggered_run(eager)


@pytest.mark.cuda
def test_a_size_that_syncs_with_the_host_runs_eagerly(tmp_path, caplog):
    """A float32 MoE past 64 tokens takes the grouped GEMM, which reads its group ends on the host
    outside bf16 on sm90: those sizes cannot be captured, so they are dropped with a warning and
    their steps run eagerly; the sizes up to 64 are captured."""
    path = make_tiny_checkpoint(tmp_path / "deepseek", "DeepseekV2ForCausalLM", seed=7)
    with caplog.at_level("WARNING", logger="engine.worker.piecewise_graphs"):
        engine = LLMEngine(path, **{**ENGINE_ARGS, "max_num_batched_tokens": 128})
    assert engine.runner.prefill_graphs.sizes == [16, 32, 64]
    assert "2 of 5 sizes sync with the host" in caplog.text

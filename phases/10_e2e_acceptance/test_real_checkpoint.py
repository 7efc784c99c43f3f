"""On the GPU, a real trained checkpoint (the shipped demo Qwen3) through the engine in bf16,
against transformers in bf16 on the same file; and the eager path really is eager."""
import pytest
import torch

from engine.core.engine_config import DEFAULT_MODEL_DIR
from engine.core.llm_engine import LLMEngine
from engine.scheduling.sequence import SamplingParams

CODE_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):", "for i in range("]


@pytest.mark.cuda
def test_qwen3_greedy_matches_hf():
    """Greedy code completions equal transformers' bf16 greedy tokens until, at most, a near-tie
    (a bf16 rounding can flip two logits within 0.1 of each other)."""
    import transformers

    engine = LLMEngine(max_num_seqs=4, max_model_len=1024, enforce_eager=True)
    tok = engine.tokenizer
    prompts = [tok.encode(p, add_special_tokens=False) for p in CODE_PROMPTS]
    ours = engine.generate_tokens(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR), dtype=torch.bfloat16).cuda()
    exact = 0
    with torch.no_grad():
        for prompt, mine in zip(prompts, ours):
            ids = torch.tensor([prompt], device="cuda")
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
            if at is None:
                exact += 1
                continue
            logits = hf(torch.tensor([prompt + theirs[:at]], device="cuda")).logits[0, -1].float()
            gap = float(logits[theirs[at]] - logits[mine[at]])
            assert abs(gap) < 0.1, f"{CODE_PROMPTS[prompts.index(prompt)]!r}: diverged at {at}, logit gap {gap}"
    assert exact >= 2, f"only {exact} of {len(prompts)} completions equal transformers' token for token"


@pytest.mark.cuda
def test_enforce_eager_uses_no_graphs():
    """enforce_eager: no graph is captured, and a profiled decode step launches no CUDA graph and
    runs no compiled function; without it the decode replays graphs."""
    eager = LLMEngine(max_num_seqs=4, max_model_len=256, enforce_eager=True)
    assert eager.runner.graphs == {}
    rid = eager.add_request("def f(x):", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    eager.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        eager.step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert not any("cudaGraphLaunch" in n or "CompiledFunction" in n or "Torch-Compiled" in n for n in names)
    assert any("decode_split" in n for n in names), "the profiled step ran no decode kernel"
    eager.abort_request(rid)

    graphed = LLMEngine(max_num_seqs=4, max_model_len=256)
    assert graphed.runner.graphs
    graphed.generate("def f(x):", max_new_tokens=4)
    assert graphed.runner.graph_replays > 0

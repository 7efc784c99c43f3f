"""The shipped default model (engine/default_model, a tiny Qwen3 trained on the CPython standard
library by scripts/train_demo_model.py): our engine follows transformers exactly on it. Trained
weights make a sharper oracle than random ones: their logits are far from flat."""
import importlib.util
from pathlib import Path

import pytest
import torch

from engine.core.engine_config import DEFAULT_MODEL_DIR
from engine.core.llm_engine import LLMEngine
from engine.scheduling.sequence import SamplingParams
from engine_cases import assert_no_block_leaks, hf_greedy

CODE_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):", "for i in range(",
                "    def __repr__(self):\n        return", "# Copyright"]
REPO = Path(__file__).resolve().parents[2]


def held_out_text(max_chars: int = 6000) -> str:
    """Text the model never trained on: this interpreter's stdlib files in the script's test split."""
    spec = importlib.util.spec_from_file_location("train_demo_model", REPO / "scripts" / "train_demo_model.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return "\n".join(script.stdlib_sources()["test"])[:max_chars]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(max_num_seqs=4, max_model_len=1024)


def test_default_model_is_shipped_and_small():
    files = sorted(p.name for p in DEFAULT_MODEL_DIR.iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    assert sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir()) <= 25 * 2**20


def test_greedy_code_completions_equal_transformers(engine):
    tok = engine.tokenizer
    prompts = [tok.encode(p, add_special_tokens=False) for p in CODE_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    ours = engine.generate_tokens(prompts, params)
    assert ours == hf_greedy(DEFAULT_MODEL_DIR, prompts, 32, eos_token_id=tok.eos_token_id)
    assert_no_block_leaks(engine)


def test_held_out_loss_matches_transformers(engine):
    """Mean next-token cross-entropy on held-out stdlib code, from our logits (one prefill over
    the paged cache) and from transformers' (float32): equal within 1e-4, and far below a
    uniform guess (the model learnt something)."""
    import transformers

    ids = engine.tokenizer.encode(held_out_text(), add_special_tokens=False)[:1000]
    assert len(ids) == 1000
    logits = engine_prefill_logits(engine, ids)
    targets = torch.tensor(ids[1:])
    ours = torch.nn.functional.cross_entropy(logits[:-1].double(), targets).item()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = torch.nn.functional.cross_entropy(hf(torch.tensor([ids])).logits[0, :-1].double(), targets).item()
    assert abs(ours - theirs) < 1e-4, (ours, theirs)
    assert ours < 0.6 * torch.log(torch.tensor(float(engine.config.vocab_size))).item()


def engine_prefill_logits(engine, ids: list[int]) -> torch.Tensor:
    """Logits of every position of one prompt, through the runner's own prefill path."""
    from engine.scheduling.scheduler import ScheduledBatch
    from engine.scheduling.sequence import Sequence

    runner, seq = engine.runner, Sequence(ids, SamplingParams(max_tokens=1), request_id="held-out")
    engine.block_manager.allocate(seq)
    batch = ScheduledBatch([seq], [0], [len(ids)], [True])  # the whole prompt in one chunk
    try:
        with torch.inference_mode():
            step = runner.prepare(batch)
            step.logits_indices = None  # every position's logits, not only the last token's
            return runner.forward(step)
    finally:
        runner.release(seq)
        engine.block_manager.free(seq)


def test_sampling_defaults_come_from_generation_config(engine, tmp_path):
    """The demo checkpoint recommends sampling (greedy loops on a model this small); a checkpoint
    whose generation_config.json does not sample gives greedy defaults."""
    assert engine.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 0, "min_p": 0.0,
                                        "repetition_penalty": 1.0}
    from phases.checkpoints import make_tiny_checkpoint

    tiny = LLMEngine(make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", seed=1), max_num_seqs=2, max_model_len=64)
    assert tiny.sampling_defaults == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                      "repetition_penalty": 1.0}

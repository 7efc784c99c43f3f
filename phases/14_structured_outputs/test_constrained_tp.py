"""Constrained decoding under torchrun (float32 on ``tp_device``): only rank 0 holds grammars and
samples, every rank takes its ids and its grammars' finishes, so every rank gives the greedy
tokens of the definitions on transformers' logits (what the single-process engine gives, phase
14's test_constrained_engine), with overlapped steps."""
import pytest
import torch
import torch.distributed as dist

from constrained_cases import demo_tokenizer_checkpoint, reference_greedy, run
from engine.core.llm_engine import LLMEngine
from engine.scheduling.structured.compiler import GrammarCompiler
from test_constrained_engine import ARGS, constrained_requests


@pytest.mark.torchrun
def test_tp_constrained_greedy_equals_single_process(tp_group, tp_device, tmp_path_factory):
    assert tp_group.size > 1
    path = demo_tokenizer_checkpoint(tmp_path_factory.mktemp("constrained-tp"), seed=29)
    engine = LLMEngine(path, device=tp_device, dtype="float32", **ARGS)
    assert (engine.grammar_compiler is None) == (tp_group.rank != 0)
    requests = constrained_requests()
    outs = [(out.token_ids, out.finish_reason) for out in run(engine, requests)]
    gathered = [None] * tp_group.size
    dist.all_gather_object(gathered, outs)
    assert all(g == gathered[0] for g in gathered), "ranks disagree on tokens or finishes"
    if tp_group.rank == 0:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        compiler = GrammarCompiler(engine.tokenizer, engine.config.vocab_size, engine.eos_token_ids)
        assert [ids for ids, _ in outs] == [reference_greedy(hf, compiler, p, params) for p, params in requests]
    assert engine._grammars is None or not engine._grammars.request_ids

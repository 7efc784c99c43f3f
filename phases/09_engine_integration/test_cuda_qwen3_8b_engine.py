"""Qwen3-8B-shaped random bf16 model through LLMEngine on the GPU, against transformers (bf16,
same weights): greedy tokens, the first divergence and the logit gap there, and the engine
loop's B=1 eager decode speed beside the bare model forward's (printed; run with -s)."""
import json
import time

import pytest
import torch

from phases.checkpoints import write_tokenizer
from phases.harness import QWEN3_8B

PROMPTS, NEW_TOKENS, TIMED_TOKENS = 4, 64, 128


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


@pytest.mark.cuda
def test_qwen3_8b_engine_follows_transformers_and_reports_decode_speed(tmp_path):
    import transformers

    from engine.core.llm_engine import LLMEngine
    from engine.model.models.registry import creating_in
    from engine.scheduling.sequence import SamplingParams

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**QWEN3_8B)
    with creating_in(torch.bfloat16, "cuda"):
        hf = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p, dtype=torch.float32))
    hf.save_pretrained(str(tmp_path))
    write_tokenizer(tmp_path, QWEN3_8B["vocab_size"])
    engine = LLMEngine(tmp_path, max_num_seqs=PROMPTS, max_model_len=1024)

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, QWEN3_8B["vocab_size"], (16 + 16 * i,), generator=gen).tolist()
               for i in range(PROMPTS)]
    ours = engine.generate_tokens(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    report = []
    with torch.no_grad():
        for prompt, mine in zip(prompts, ours):
            ids = torch.tensor([prompt], device="cuda")
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            at = first_divergence(mine, theirs)
            gap = None
            if at is not None:  # HF's logits at the divergence: how far apart are the two picks?
                context = torch.tensor([prompt + theirs[:at]], device="cuda")
                logits = hf(context).logits[0, -1].float()
                gap = float(logits[theirs[at]] - logits[mine[at]])
                assert abs(gap) < 0.5, f"diverged at step {at} on a logit gap of {gap:.3f}: not a near-tie"
            report.append({"prompt_len": len(prompt), "first_divergence": at, "logit_gap": gap})

    # B=1 eager decode: the whole engine loop against the bare model forward on the same step inputs
    params = SamplingParams(temperature=0.0, max_tokens=TIMED_TOKENS + 1, ignore_eos=True)
    rid = engine.add_request(prompts[0], params)
    engine.step()  # prefill
    torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    loop_tok_s = TIMED_TOKENS / (time.perf_counter() - start)
    engine.pop_request(rid)

    runner = engine.runner
    rid = engine.add_request(prompts[0], params)
    engine.step()  # prefill
    engine.step()  # a decode step: its inputs stay in the runner's static buffers
    from engine.model.attention_context import forward_context
    with torch.inference_mode():
        input_ids, positions, ctx = runner.decode_context(1, runner.max_blocks_per_seq)
        with forward_context(ctx):
            for _ in range(3):
                runner.model.compute_logits(runner.model(input_ids, positions)).argmax(-1)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(TIMED_TOKENS):
                runner.model.compute_logits(runner.model(input_ids, positions)).argmax(-1)
            torch.cuda.synchronize()
            bare_tok_s = TIMED_TOKENS / (time.perf_counter() - start)
    engine.abort_request(rid)
    engine.step()
    print("QWEN3_8B_ENGINE " + json.dumps({"divergence": report, "engine_loop_b1_tok_s": round(loop_tok_s, 1),
                                           "bare_forward_b1_tok_s": round(bare_tok_s, 1),
                                           "loop_overhead": round(bare_tok_s / loop_tok_s - 1, 3)}))

"""Qwen3-8B-shaped model (full config, random bf16 weights built on the GPU)
against HF transformers with the same weights: prefill + 32 teacher-forced
decode steps through the paged cache. Runs on the lent H200.

The truth is HF's model in float32 on the same weights. A random-weight model
has nearly flat logits (top-2 gaps of ~0.2 logit standard deviations over
151936 tokens), so bf16 rounding alone flips the top-1 token often: HF's own
bf16 run agrees with its float32 run on only ~83% of steps here. The check
is therefore relative: our bf16 engine must be at least as close to the
float32 truth as HF transformers in bf16 — in logits error and in top-1
agreement — and the figures (including top-1 agreement with HF bf16) are
printed for the record."""
import json

import pytest
import torch

from engine.model import kernels
from engine.worker.kv_cache import bind_kv_cache
from phases.harness import all_logits_step, num_blocks_for, random_qwen3_8b_pair, rel_err, run_paged

pytestmark = [pytest.mark.cuda, pytest.mark.slow]


def test_qwen3_8b_shape_matches_hf_with_teacher_forcing():
    hf, ours = random_qwen3_8b_pair()
    config = ours.config

    steps, block_size, prompt_lens = 32, 256, [200, 37, 300, 5]
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, config.vocab_size, (n + steps,), generator=gen).cuda() for n in prompt_lens]

    def run_ours(backend):
        bind_kv_cache(ours, num_blocks_for(map(len, seqs), block_size), block_size, torch.bfloat16, "cuda")
        with torch.no_grad(), kernels.using(backend=backend):
            return run_paged(all_logits_step(ours), seqs, prompt_lens, block_size)

    logits = {"ours_triton": run_ours("triton"), "ours_torch_reference": run_ours("torch")}
    with torch.no_grad():
        logits["hf_bf16"] = [hf(s[None]).logits[0] for s in seqs]
        hf.float()
        truth = [hf(s[None]).logits[0] for s in seqs]

    def prefill(xs):
        return torch.cat([x[:n - 1] for x, n in zip(xs, prompt_lens)]).float()

    def decode(xs):  # the last prompt token and the decode steps
        return torch.cat([x[n - 1:] for x, n in zip(xs, prompt_lens)]).float()

    figures = {"decode_rows": decode(truth).shape[0],
               "top1_ours_triton_vs_hf_bf16": (decode(logits["ours_triton"]).argmax(-1)
                                               == decode(logits["hf_bf16"]).argmax(-1)).float().mean().item()}
    for name, xs in logits.items():
        figures[name] = {
            "top1_vs_hf_fp32": (decode(xs).argmax(-1) == decode(truth).argmax(-1)).float().mean().item(),
            "rel_err_prefill_rows": rel_err(prefill(xs), prefill(truth)),
            "rel_err_decode_rows": rel_err(decode(xs), decode(truth)),
        }
    print("QWEN3_8B_FIGURES " + json.dumps(figures))
    ours_fig, hf_fig = figures["ours_triton"], figures["hf_bf16"]
    for rows in ("rel_err_prefill_rows", "rel_err_decode_rows"):
        assert ours_fig[rows] <= 1.05 * hf_fig[rows]
    assert ours_fig["top1_vs_hf_fp32"] >= hf_fig["top1_vs_hf_fp32"] - 0.03

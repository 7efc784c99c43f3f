"""Qwen3-8B-shaped model (full config, random bf16 weights built on the GPU)
against HF transformers with the same weights: prefill + 32 teacher-forced
decode steps through the paged cache. Runs on the lent H200."""
import json

import pytest
import torch

from engine.config import ModelConfig
from engine.kv_cache import bind_kv_cache
from engine.loader import load_weights
from engine.models.registry import build_model
from phases.harness import all_logits_step, num_blocks_for, rel_err, run_paged

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

QWEN3_8B = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
)


def test_qwen3_8b_shape_matches_hf_with_teacher_forcing():
    import transformers

    torch.manual_seed(0)
    hf_cfg = transformers.Qwen3Config(**QWEN3_8B)
    with torch.device("cuda"):
        hf = transformers.Qwen3ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p, dtype=torch.float32))
    config = ModelConfig.from_dict({**hf_cfg.to_dict(), "architectures": ["Qwen3ForCausalLM"]})
    ours = build_model(config, "cuda", torch.bfloat16)
    load_weights(ours, ((n, p.detach()) for n, p in hf.named_parameters()), progress=False)

    steps, block_size, prompt_lens = 32, 256, [200, 37, 300, 5]
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, config.vocab_size, (n + steps,), generator=gen).cuda() for n in prompt_lens]
    bind_kv_cache(ours, num_blocks_for(map(len, seqs), block_size), block_size, torch.bfloat16, "cuda")
    with torch.no_grad():
        got = run_paged(all_logits_step(ours), seqs, prompt_lens, block_size)
        ref_bf16 = [hf(s[None]).logits[0].float() for s in seqs]
        hf.float()
        ref_fp32 = [hf(s[None]).logits[0] for s in seqs]

    def decode_rows(xs):  # the last prompt position and every decode step
        return torch.cat([x[n - 1:] for x, n in zip(xs, prompt_lens)]).float()

    ours_d, bf16_d, fp32_d = decode_rows(got), decode_rows(ref_bf16), decode_rows(ref_fp32)
    agree = lambda a, b: (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    figures = {
        "steps": ours_d.shape[0],
        "top1_ours_vs_hf_fp32": agree(ours_d, fp32_d),
        "top1_ours_vs_hf_bf16": agree(ours_d, bf16_d),
        "top1_hf_bf16_vs_hf_fp32": agree(bf16_d, fp32_d),
        "rel_err_ours_vs_hf_fp32": rel_err(ours_d, fp32_d),
        "rel_err_hf_bf16_vs_hf_fp32": rel_err(bf16_d, fp32_d),
    }
    print("QWEN3_8B_FIGURES " + json.dumps(figures))
    assert figures["top1_ours_vs_hf_fp32"] >= 0.95
    assert figures["rel_err_ours_vs_hf_fp32"] < 0.05

"""DeepSeek on the GPU (runs on the lent H200): MLA decode through the Triton latent
kernel, and a DeepSeek-V2-Lite-shaped model (every width of the published config,
4 of its 27 layers) with random bf16 weights against HF transformers.

The checks are relative, as for Qwen3-8B (test_cuda_qwen3_8b.py): bf16 rounding
alone moves random-weight logits and flips near-tied expert choices, so our bf16
run must be at least as close to a higher-precision truth (float64 for the layer,
HF float32 for the model) as HF transformers' own bf16 run; figures are printed."""
import json

import pytest
import torch
import transformers
from torch import nn
from transformers.models.deepseek_v2 import modeling_deepseek_v2

from engine.distributed import TPGroup
from engine.model import kernels
from engine.model.config import DeepseekConfig, ModelConfig
from engine.model.layers.mla import MultiHeadLatentAttention
from engine.model.models.deepseek_v2 import DeepseekV2ForCausalLM
from engine.model.models.registry import creating_in
from engine.model.weight_loading import load_weights
from engine.worker.kv_cache import bind_kv_cache
from phases.harness import all_logits_step, causal_mask, num_blocks_for, rel_err, run_paged

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

V2_LITE_SHAPE = dict(  # DeepSeek-V2-Lite's published config.json, 4 layers instead of 27
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
    num_experts_per_tok=6, first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1,
    norm_topk_prob=False, routed_scaling_factor=1.0, max_position_embeddings=163840, rope_theta=10000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, mscale=0.707,
                      mscale_all_dim=0.707, beta_fast=32, beta_slow=1),
)


def published_tensors(named):
    """(name, tensor) with HF's stacked expert weights split into the published per-expert names."""
    for name, t in named:
        t = t.detach()
        if name.endswith("experts.gate_up_proj"):
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                yield name.replace("gate_up_proj", f"{e}.gate_proj.weight"), gate
                yield name.replace("gate_up_proj", f"{e}.up_proj.weight"), up
        elif name.endswith("experts.down_proj"):
            for e, w in enumerate(t):
                yield name.replace("down_proj", f"{e}.down_proj.weight"), w
        else:
            yield name, t


def hf_config(**overrides):
    cfg = transformers.DeepseekV2Config(**{**V2_LITE_SHAPE, **overrides}, bos_token_id=1, eos_token_id=1)
    cfg._attn_implementation = "eager"
    return cfg


def randomize_norms(module: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))


@pytest.fixture
def triton_kernels():
    """The Triton backend forced for one test (``KernelSettings.backend``)."""
    with kernels.using(backend="triton"):
        yield


def test_mla_decode_through_triton_matches_float64(triton_kernels):
    """One V2-Lite-shaped MLA layer, bf16 on the GPU (Triton kernels: varlen prefill,
    the latent paged decode with v_head_dim 512), against HF's attention in float64."""
    torch.manual_seed(0)
    cfg = hf_config()
    with creating_in(torch.float32, "cuda"):
        hf = modeling_deepseek_v2.DeepseekV2Attention(cfg, layer_idx=0).eval()
        rotary = modeling_deepseek_v2.DeepseekV2RotaryEmbedding(cfg)
    for p in hf.parameters():
        nn.init.normal_(p, std=0.02)
    randomize_norms(hf, seed=1)
    config = ModelConfig.from_dict({**cfg.to_dict(), "architectures": ["DeepseekV2ForCausalLM"]})
    with creating_in(torch.bfloat16, "cuda"):
        ours = MultiHeadLatentAttention(config, DeepseekConfig.from_model_config(config), TPGroup())
    holder = nn.Module()
    holder.m = ours
    load_weights(holder, (("m." + n, p.detach()) for n, p in hf.named_parameters()), progress=False)
    steps, block_size, prompt_lens = 16, 64, [300, 37, 5]
    xs = [torch.randn(n + steps, cfg.hidden_size, device="cuda") for n in prompt_lens]
    bind_kv_cache(ours, num_blocks_for(map(len, xs), block_size), block_size, torch.bfloat16, "cuda")

    def hf_run(module, dtype):
        with torch.no_grad():
            return [module(hidden_states=x[None].to(dtype), attention_mask=causal_mask(len(x)).to("cuda", dtype),
                           position_embeddings=rotary(x[None], torch.arange(len(x), device="cuda")[None]))[0][0]
                    for x in xs]

    with torch.no_grad():
        got = run_paged(lambda x, pos: ours(pos, x.bfloat16()), xs, prompt_lens, block_size)
    truth = hf_run(hf.double(), torch.float64)  # from the float32 weights, before they are rounded
    hf_bf16 = hf_run(hf.to(torch.bfloat16), torch.bfloat16)
    def rows(outs, part):  # prompt rows or decode rows of every sequence
        return torch.cat([o[:n] if part == "prefill" else o[n:] for o, n in zip(outs, prompt_lens)])

    figures = {f"{part}_{who}": rel_err(rows(outs, part), rows(truth, part)) for part in ("prefill", "decode")
               for who, outs in (("ours", got), ("hf_bf16", hf_bf16))}
    print("MLA_LAYER_FIGURES " + json.dumps(figures))
    for part in ("prefill", "decode"):
        assert figures[f"{part}_ours"] <= max(1.05 * figures[f"{part}_hf_bf16"], 1e-2)


def test_deepseek_v2_lite_shape_matches_hf_with_teacher_forcing(triton_kernels):
    torch.manual_seed(0)
    cfg = hf_config()
    with creating_in(torch.bfloat16, "cuda"):
        hf = transformers.DeepseekV2ForCausalLM(cfg).eval()
    randomize_norms(hf, seed=2)
    config = ModelConfig.from_dict({**cfg.to_dict(), "architectures": ["DeepseekV2ForCausalLM"]})
    with creating_in(torch.bfloat16, "cuda"):
        ours = DeepseekV2ForCausalLM(config)
    load_weights(ours, published_tensors(hf.named_parameters()), progress=False)

    steps, block_size, prompt_lens = 32, 64, [200, 37, 5]
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (n + steps,), generator=gen).cuda() for n in prompt_lens]
    bind_kv_cache(ours, num_blocks_for(map(len, seqs), block_size), block_size, torch.bfloat16, "cuda")
    with torch.no_grad():
        logits = {"ours_triton": run_paged(all_logits_step(ours), seqs, prompt_lens, block_size)}
        del ours
        logits["hf_bf16"] = [hf(s[None]).logits[0] for s in seqs]
        hf.float()
        truth = [hf(s[None]).logits[0] for s in seqs]

    def decode(xs):  # the last prompt token and the decode steps
        return torch.cat([x[n - 1:] for x, n in zip(xs, prompt_lens)]).float()

    def prefill(xs):
        return torch.cat([x[:n - 1] for x, n in zip(xs, prompt_lens)]).float()

    figures = {"decode_rows": decode(truth).shape[0],
               "top1_ours_vs_hf_bf16": (decode(logits["ours_triton"]).argmax(-1)
                                        == decode(logits["hf_bf16"]).argmax(-1)).float().mean().item()}
    for name, xs in logits.items():
        figures[name] = {
            "top1_vs_hf_fp32": (decode(xs).argmax(-1) == decode(truth).argmax(-1)).float().mean().item(),
            "rel_err_prefill_rows": rel_err(prefill(xs), prefill(truth)),
            "rel_err_decode_rows": rel_err(decode(xs), decode(truth)),
        }
    print("DEEPSEEK_V2_LITE_FIGURES " + json.dumps(figures))
    ours_fig, hf_fig = figures["ours_triton"], figures["hf_bf16"]
    for rows in ("rel_err_prefill_rows", "rel_err_decode_rows"):
        assert ours_fig[rows] <= 1.05 * hf_fig[rows]
    assert ours_fig["top1_vs_hf_fp32"] >= hf_fig["top1_vs_hf_fp32"] - 0.03

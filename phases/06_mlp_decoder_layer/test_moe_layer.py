"""Mixtures of experts against HF transformers' DeepseekV2/V3 MoE and Qwen3-MoE / Qwen2-MoE
sparse blocks with the same random weights: the experts chosen per token and their weights
(softmax + greedy, softmax + group-limited, sigmoid + e_score_correction_bias + noaux_tc,
norm_topk_prob on and off, routed_scaling_factor), the layer output through each expert path
(gathered, dense, grouped), Qwen2-MoE's sigmoid-gated shared expert, routed experts split over
EP ranks, and a decode step with no host sync."""
import pytest
import torch
from torch import nn
from transformers.models.deepseek_v2 import modeling_deepseek_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.qwen2_moe import modeling_qwen2_moe
from transformers.models.qwen3_moe import modeling_qwen3_moe

from engine.distributed import TPGroup
from engine.model.config import DeepseekConfig, QwenMoeConfig
from engine.model.layers import moe as moe_module
from engine.model.layers.moe import EXPERT_PARAMS, GatedSharedExpertMoE, MoE
from engine.model.models.deepseek_v2 import DeepseekV2ForCausalLM
from engine.model.weight_loading import load_weights
from phases.checkpoints import V2_LITE, randomize_weights
from phases.harness import engine_config, hf_config, rel_err

VARIANTS = {
    "V2": ("DeepseekV2ForCausalLM", {}),
    "V2-Lite": ("DeepseekV2ForCausalLM", V2_LITE),
    "V3": ("DeepseekV3ForCausalLM", {}),
    "V3-unnormalised": ("DeepseekV3ForCausalLM", dict(norm_topk_prob=False)),
    "Qwen3-MoE": ("Qwen3MoeForCausalLM", {}),                                   # norm_topk_prob on
    "Qwen2-MoE": ("Qwen2MoeForCausalLM", {}),                                   # off, gated shared expert
    "Qwen2-MoE-normalised": ("Qwen2MoeForCausalLM", dict(norm_topk_prob=True)),
}
HF_MOE = {"DeepseekV2ForCausalLM": modeling_deepseek_v2.DeepseekV2Moe,
          "DeepseekV3ForCausalLM": modeling_deepseek_v3.DeepseekV3MoE,
          "Qwen3MoeForCausalLM": modeling_qwen3_moe.Qwen3MoeSparseMoeBlock,
          "Qwen2MoeForCausalLM": modeling_qwen2_moe.Qwen2MoeSparseMoeBlock}
# our block and its config per family (the decoder layers' choice is checked in phase 07)
OURS = {"DeepseekV2ForCausalLM": (MoE, DeepseekConfig), "DeepseekV3ForCausalLM": (MoE, DeepseekConfig),
        "Qwen3MoeForCausalLM": (MoE, QwenMoeConfig), "Qwen2MoeForCausalLM": (GatedSharedExpertMoE, QwenMoeConfig)}


def hf_moe(variant, seed):
    arch, overrides = VARIANTS[variant]
    cfg = hf_config(arch, **overrides)
    moe = HF_MOE[arch](cfg).eval()
    randomize_weights(moe, seed)
    with torch.no_grad():  # routers with a real spread of scores, so the choice is not a near-tie
        moe.gate.weight.mul_(20)
    return cfg, moe


def published_tensors(hf: nn.Module):
    """HF's module tensors under the names published checkpoints use: its stacked expert
    weights split into experts.<e>.{gate,up,down}_proj.weight, the router bias included."""
    tensors = dict(hf.named_parameters())
    tensors.update((n, b) for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    for name, t in tensors.items():
        t = t.detach()
        if name == "experts.gate_up_proj":
            for e, (gate, up) in enumerate(w.chunk(2, dim=0) for w in t):
                yield f"experts.{e}.gate_proj.weight", gate
                yield f"experts.{e}.up_proj.weight", up
        elif name == "experts.down_proj":
            for e, down in enumerate(t):
                yield f"experts.{e}.down_proj.weight", down
        else:
            yield name, t


def engine_moe(variant, hf, ep=TPGroup(name="ep"), tp=TPGroup()):
    arch, overrides = VARIANTS[variant]
    config = engine_config(arch, **overrides)
    block, moe_config = OURS[arch]
    ours = block(config.hidden_size, moe_config.from_model_config(config), tp, ep)
    holder = nn.Module()
    holder.packed_modules = DeepseekV2ForCausalLM.packed_modules
    holder.expert_params = EXPERT_PARAMS
    holder.m = ours
    load_weights(holder, (("m." + n, t) for n, t in published_tensors(hf)), progress=False)
    return ours


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_router_picks_hfs_experts_with_hfs_weights(variant):
    torch.manual_seed(0)
    cfg, hf = hf_moe(variant, seed=1)
    ours = engine_moe(variant, hf)
    x = torch.randn(64, cfg.hidden_size)
    with torch.no_grad():
        weights, ids = ours.gate(x)
        _, hf_weights, hf_ids = hf.gate(x)
    assert ids.shape == (64, cfg.num_experts_per_tok)
    ids, order = ids.sort(dim=-1)
    hf_ids, hf_order = hf_ids.sort(dim=-1)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=1e-5, atol=1e-6)
    ds = ours.gate.ds
    if ds.norm_topk_prob:  # renormalised weights sum to routed_scaling_factor
        torch.testing.assert_close(weights.sum(-1), torch.full((64,), ds.routed_scaling_factor))
    if ds.topk_method != "greedy":  # every token's experts come from at most topk_group groups
        groups = ids // (cfg.n_routed_experts // cfg.n_group)
        assert all(len(set(g)) <= cfg.topk_group for g in groups.tolist())


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("tokens", [2, 20, 100])  # gathered (T * k <= E), dense, grouped
def test_moe_layer_matches_hf(variant, tokens):
    torch.manual_seed(0)
    cfg, hf = hf_moe(variant, seed=2)
    ours = engine_moe(variant, hf)
    x = torch.randn(tokens, cfg.hidden_size)
    with torch.no_grad():
        assert rel_err(ours(x), hf(x[None])[0]) < 1e-5


def test_qwen2_moe_shared_expert_is_gated_per_token_by_a_sigmoid():
    """With the routed experts silenced (zero down projections), Qwen2-MoE's block is HF's shared
    expert times sigmoid(x . shared_expert_gate) per token, in float64 here: the gate is neither
    missing (a factor of 1) nor another squashing, and it differs between tokens."""
    torch.manual_seed(0)
    cfg, hf = hf_moe("Qwen2-MoE", seed=5)
    with torch.no_grad():
        hf.shared_expert_gate.weight.mul_(20)  # gate logits of order 1: sigmoid far from 0.5 and 1
    ours = engine_moe("Qwen2-MoE", hf)
    x = torch.randn(20, cfg.hidden_size)
    with torch.no_grad():
        ours.experts.down_proj.zero_()
        gate = torch.sigmoid(x.double() @ hf.shared_expert_gate.weight.double().T)     # [T, 1]
        want = gate * hf.shared_expert(x).double()
        got = ours(x)
    assert gate.min() < 0.3 and gate.max() > 0.7, "the test's gate values must spread"
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("variant", ["V2", "V3", "Qwen3-MoE", "Qwen2-MoE"])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("tokens", [2, 20, 100])
def test_routed_experts_split_over_ep_ranks(variant, size, tokens):
    """Built as EP rank r of n in one process (collectives are identities there): rank r
    holds experts [r E / n, (r + 1) E / n) only, and the ranks' routed outputs sum to HF's."""
    torch.manual_seed(0)
    cfg, hf = hf_moe(variant, seed=3)
    x = torch.randn(tokens, cfg.hidden_size)
    routed = 0
    for rank in range(size):
        ours = engine_moe(variant, hf, ep=TPGroup(rank=rank, size=size, name="ep"))
        local = hf.experts.gate_up_proj.shape[0] // size
        assert ours.experts.gate_up_proj.shape == (local, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
        assert ours.experts.expert_start == rank * local
        torch.testing.assert_close(ours.experts.down_proj[0], hf.experts.down_proj[rank * local].detach())
        with torch.no_grad():
            routed = routed + ours.experts(x, *ours.gate(x))
    with torch.no_grad():
        _, weights, ids = hf.gate(x)
        want = hf.experts(x, ids, weights)
    assert rel_err(routed, want) < 1e-5


@pytest.mark.parametrize("variant", ["V3", "Qwen3-MoE", "Qwen2-MoE"])
@pytest.mark.parametrize("tokens", [2, 20, 100])  # gathered, dense, grouped
def test_moe_has_no_host_sync_at_any_step_size(monkeypatch, variant, tokens):
    """No host read of a device value and no copy, on each of the three expert paths (the
    grouped one finds its group ends on the device: a decode batch past DENSE_MAX_TOKENS or a
    prefill does not stall the host), Qwen2-MoE's gated shared expert included."""
    from phases.harness import assert_no_host_sync_and_no_copies, count_step

    cfg, hf = hf_moe(variant, seed=4)
    ours = engine_moe(variant, hf)
    torch.manual_seed(0)
    x = torch.randn(tokens, cfg.hidden_size)
    assert_no_host_sync_and_no_copies(count_step(lambda: ours(x), monkeypatch))


def test_one_ep_rank_maps_no_ids_and_copies_no_rows(monkeypatch):
    """With every expert local, the routed experts of a decode token neither map nor mask ids
    and never copy the token's row per expert; V2-Lite's plain top-k router (scale 1) neither
    gathers the values topk returned nor multiplies by 1: each such op is a GPU launch."""
    from phases.harness import count_step

    cfg, hf = hf_moe("V2-Lite", seed=4)
    ours = engine_moe("V2-Lite", hf)
    x = torch.randn(1, cfg.hidden_size)
    router_ops = count_step(lambda: ours.gate(x), monkeypatch).model_ops
    assert not {"gather", "mul"} & set(router_ops), sorted(router_ops)
    weights, ids = ours.gate(x)
    ops = count_step(lambda: ours.experts(x, weights, ids), monkeypatch).model_ops
    needless = {"sub", "ge", "lt", "bitwise_or", "bitwise_and", "masked_fill", "where", "arange", "index",
                "floor_divide", "gather"}
    assert not needless & set(ops), sorted(needless & set(ops))


def test_expert_sizes_must_suit_the_grouped_gemm():
    """Expert weights whose rows are not 16-byte multiples are refused when the layer is built
    (the grouped GEMM would fail at the first prefill)."""
    with pytest.raises(ValueError, match="multiples of 8"):
        moe_module.RoutedExperts(64, 20, 4, TPGroup(name="ep"))

"""load_weights' name mapping and its checks on toy modules (the attention layer's own load is in
test_qwen_attention): stacked experts' names, a tied parameter given twice, and what it refuses."""
import pytest
import torch
from torch import nn

from engine.model.weight_loading import load_weights


class Recorded(nn.Module):
    """One stacked-expert parameter (``experts.gate_up_proj``, two parts of four experts) and one
    packed parameter; each load records (parameter, shard id) and copies where the shard goes."""

    expert_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}

    def __init__(self):
        super().__init__()
        self.calls = []
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(4, 2, 3))
        self.experts.gate_up_proj.expected_shards = {(e, p) for e in range(4) for p in range(2)}
        self.experts.gate_up_proj.weight_loader = self._expert_loader
        self.attn = nn.Module()
        self.attn.qkv_proj = nn.Parameter(torch.zeros(3, 3))
        self.attn.qkv_proj.weight_loader = self._qkv_loader

    def _expert_loader(self, param, loaded, shard_id):
        self.calls.append(("experts.gate_up_proj", shard_id))
        expert, part = shard_id
        param.data[expert, part].copy_(loaded)

    def _qkv_loader(self, param, loaded, shard_id):
        self.calls.append(("attn.qkv_proj", shard_id))
        param.data["qkv".index(shard_id)].copy_(loaded)


def test_expert_and_packed_names_reach_their_parameter_with_their_shard():
    model = Recorded()
    tensors = [(f"experts.{e}.{name}.weight", torch.full((3,), 10.0 * e + part))
               for e in range(4) for part, name in enumerate(("gate_proj", "up_proj"))]
    tensors += [(f"attn.{p}_proj", torch.full((3,), float(i))) for i, p in enumerate("qkv")]
    load_weights(model, tensors, progress=False)
    assert sorted(model.calls) == sorted([("experts.gate_up_proj", (e, p)) for e in range(4) for p in range(2)]
                                         + [("attn.qkv_proj", s) for s in "qkv"])
    assert torch.equal(model.experts.gate_up_proj[3, 1], torch.full((3,), 31.0))
    missing = r"no tensor for parameter\(s\): experts.gate_up_proj \(shards \['\(0, 0\)'\]\)$"
    with pytest.raises(ValueError, match=missing):
        load_weights(Recorded(), tensors[1:], progress=False)


def test_a_tied_parameter_given_twice_must_agree():
    """Two checkpoint names of one shared parameter (a tied LM head): the same tensor loads once; a
    different one is a ValueError naming the tensor that filled it first."""
    model = nn.Module()
    model.embed = nn.Linear(3, 4, bias=False)
    model.head = nn.Linear(3, 4, bias=False)
    model.head.weight = model.embed.weight
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    load_weights(model, [("embed.weight", w), ("head.weight", w.clone())], progress=False)
    assert torch.equal(model.embed.weight, w)
    with pytest.raises(ValueError, match=r"'head.weight': differs from 'embed.weight'"):
        load_weights(model, [("embed.weight", w), ("head.weight", w + 1)], progress=False)

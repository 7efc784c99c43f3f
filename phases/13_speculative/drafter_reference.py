"""The truth the model drafters are checked against: each method's draft logits, in float64, for
a sequence's known tokens and the drafts before the one checked (teacher-forced on the engine's
own drafts, so every draft position is checked on its own).

- "draft": transformers' model of the draft checkpoint on the tokens and the drafts so far.
- "eagle3": the EAGLE-3 head's math written here from its published layout (``fc``, the
  ``midlayer``'s norms, Llama attention over [embedding | hidden] with neox RoPE, SwiGLU MLP,
  ``norm``, ``lm_head``, ``d2t``) over transformers' hidden states of the target
  (``output_hidden_states[i]`` for the head's layer ids); logits over the draft vocabulary and the
  target id of each draft id.
- "mtp": DeepSeek-V3's MTP layer: ``eh_proj([enorm(embedding) | hnorm(hidden)])`` into
  transformers' own DeepSeek-V3 decoder layer (the checkpoint's ``model.layers.<L>`` weights in a
  one-layer transformers model, MoE at index 0), ``shared_head.norm``, the target's LM head; the
  first hidden state is the target's final normed one.

A head at pseudo-position ``t`` reads token ``t + 1`` and the hidden state of ``t``: the target's
(projected) for ``t <= n - 2``, then, drafting on, its own pre-norm output of the position before.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def target_model(target_dir: Path):
    """transformers' model of ``target_dir`` in float64 (MoE experts in eager loops: the grouped
    GEMM takes no float64)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float64,
                                                             experts_implementation="eager").eval()


class DraftModelReference:
    def __init__(self, draft_dir: Path):
        self.model = target_model(draft_dir)

    @torch.no_grad()
    def logits(self, tokens: list[int], drafts: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([tokens + drafts])).logits[0, -1]

    def draft_id(self, token: int) -> int:
        return token


class HeadReference:
    """Shared by EAGLE-3 and MTP: the pseudo-sequence of (token after, hidden) rows run through
    the head, all at once, causal."""

    def __init__(self, target_dir: Path):
        self.target = target_model(target_dir)
        self.embed = self.target.get_input_embeddings().weight

    @torch.no_grad()
    def logits(self, tokens: list[int], drafts: list[int]) -> torch.Tensor:
        n = len(tokens)
        hidden = self.first_hidden(tokens)  # [n - 1, H]: positions 0 .. n - 2
        ids = tokens[1:]
        for d in drafts:  # each draft extends the pseudo-sequence with its own pre-norm output
            prenorm, _ = self.run(ids, hidden)
            ids, hidden = ids + [d], torch.cat([hidden, prenorm[-1:]])
        _, normed = self.run(ids, hidden)
        assert len(ids) == n - 1 + len(drafts)
        return self.head_logits(normed[-1])


class Eagle3Reference(HeadReference):
    def __init__(self, target_dir: Path, head_dir: Path):
        super().__init__(target_dir)
        self.config = json.loads((Path(head_dir) / "config.json").read_text())
        self.w = {k: v.double() if v.is_floating_point() else v for k, v in
                  load_file(str(Path(head_dir) / "model.safetensors")).items()}
        layers = self.target.config.num_hidden_layers
        c = self.config
        self.layer_ids = ((c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                          or [2, layers // 2, layers - 3])
        self.target_ids = torch.arange(len(self.w["d2t"])) + self.w["d2t"]

    def first_hidden(self, tokens: list[int]) -> torch.Tensor:
        hs = self.target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        features = torch.cat([hs[i][0, :-1] for i in self.layer_ids], -1)
        return features @ self.w["fc.weight"].T

    def run(self, ids: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, w, eps = self.config, self.w, self.config["rms_norm_eps"]
        heads, kv_heads, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        x = torch.cat([rms(self.embed[ids], w["midlayer.input_layernorm.weight"], eps),
                       rms(hidden, w["midlayer.hidden_norm.weight"], eps)], -1)
        t = len(ids)
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, heads, d)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, kv_heads, d)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, kv_heads, d)
        q, k = rope(q, c["rope_theta"]), rope(k, c["rope_theta"])
        k, v = (z.repeat_interleave(heads // kv_heads, dim=1) for z in (k, v))
        att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        residual = hidden + att.transpose(0, 1).reshape(t, heads * d) @ w["midlayer.self_attn.o_proj.weight"].T
        y = rms(residual, w["midlayer.post_attention_layernorm.weight"], eps)
        y = (F.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (y @ w["midlayer.mlp.up_proj.weight"].T)
             ) @ w["midlayer.mlp.down_proj.weight"].T
        prenorm = residual + y
        return prenorm, rms(prenorm, w["norm.weight"], eps)

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return normed @ self.w["lm_head.weight"].T

    def draft_id(self, token: int) -> int:
        """The draft id of target id ``token`` (-1: outside the draft vocabulary)."""
        hits = (self.target_ids == token).nonzero()
        return int(hits[0, 0]) if len(hits) else -1


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox RoPE of [T, heads, d] at positions 0 .. T - 1."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + half * sin


class MTPReference(HeadReference):
    def __init__(self, checkpoint_dir: Path):
        import transformers

        super().__init__(checkpoint_dir)
        config = self.target.config
        layers = config.num_hidden_layers
        mine = f"model.layers.{layers}."
        tensors = {k[len(mine):]: v.double() for k, v in load_file(str(Path(checkpoint_dir) / "model.safetensors")
                                                                  ).items() if k.startswith(mine)}
        self.eps = config.rms_norm_eps
        self.own = {k: tensors.pop(k) for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                               "shared_head.norm.weight", "shared_head.head.weight",
                                               "embed_tokens.weight")}
        one = transformers.DeepseekV3Config(**{**config.to_dict(), "num_hidden_layers": 1,
                                               "first_k_dense_replace": 0})
        one._experts_implementation = "eager"
        self.block = transformers.DeepseekV3Model(one).double().eval()
        state = self.block.state_dict()
        state.update(convert_experts({f"layers.0.{k}": v for k, v in tensors.items()}, state))
        self.block.load_state_dict(state)

    def first_hidden(self, tokens: list[int]) -> torch.Tensor:
        return self.target.model(torch.tensor([tokens])).last_hidden_state[0, :-1]

    def run(self, ids: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([rms(self.embed[ids], self.own["enorm.weight"], self.eps),
                       rms(hidden, self.own["hnorm.weight"], self.eps)], -1) @ self.own["eh_proj.weight"].T
        out = {}
        hook = self.block.layers[0].register_forward_hook(lambda m, a, o: out.setdefault("y", o))
        try:
            self.block(inputs_embeds=x[None])
        finally:
            hook.remove()
        prenorm = (out["y"][0] if isinstance(out["y"], tuple) else out["y"])[0]
        return prenorm, rms(prenorm, self.own["shared_head.norm.weight"], self.eps)

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return normed @ self.target.lm_head.weight.T

    def draft_id(self, token: int) -> int:
        return token


def convert_experts(tensors: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (``mlp.experts.<e>.{gate,up,down}_proj.weight``) into
    transformers' stacked ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""
    out, experts = {}, {}
    for name, value in tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            experts.setdefault(".".join(parts[:i + 1]), {})[(int(parts[i + 1]), parts[i + 2])] = value
        else:
            out[name] = value
    for prefix, parts in experts.items():
        num = 1 + max(e for e, _ in parts)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]])
                                                     for e in range(num)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(num)])
        assert out[f"{prefix}.gate_up_proj"].shape == state[f"{prefix}.gate_up_proj"].shape
    return out

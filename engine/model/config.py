"""ModelConfig: every model dimension, read from a checkpoint's config.json.

Nothing here is hard-coded per model size. Both config forms are accepted:
the published checkpoints' (`rope_theta`, `rope_scaling`, `torch_dtype`) and
the one transformers 5 writes (`rope_parameters`, `dtype`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool             # Qwen2 always has a QKV bias; others say so in attention_bias (Qwen2-MoE: qkv_bias)
    qk_norm: bool              # Qwen3 normalises q and k per head
    sliding_window: int | None  # attention window (Mistral, Qwen with use_sliding_window); None: full causal
    torch_dtype: torch.dtype | None
    eos_token_ids: tuple[int, ...]
    raw: dict = field(repr=False, compare=False)  # the whole config.json, for family-specific keys
    # How the linear weights are stored: config.json's quantization_config, or, when asked to quantize a
    # checkpoint that has none (quantization="fp8"), {"quant_method": "fp8", "online": True}; None: unquantized.
    # Its fields are checked when the model is built (engine.model.quantization), before any weight is read.
    quantization: dict | None = None

    @classmethod
    def from_dict(cls, cfg: dict, quantization: str | None = None) -> "ModelConfig":
        """``quantization``: None, or "fp8" to quantize the weights at load (a checkpoint that is
        already quantized keeps its own format)."""
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization={quantization!r}: the supported method is 'fp8' (or None)")
        archs = cfg.get("architectures") or []
        if isinstance(cfg.get("text_config"), dict):  # multimodal (Qwen2-VL): the language model's dims live here
            cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if k != "text_config"}}
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot tell which model to build")

        def need(key):
            if key not in cfg:
                raise ValueError(f"config.json is missing required key {key!r}")
            return cfg[key]

        rope = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type")) == "mrope":
            rope_scaling = None  # M-RoPE on text-only positions (all three ids equal) is plain RoPE
        dtype_name = cfg.get("torch_dtype", cfg.get("dtype"))
        if dtype_name is not None and dtype_name not in _DTYPES:
            raise ValueError(f"config.json has unsupported dtype {dtype_name!r}; expected one of {sorted(_DTYPES)}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        max_positions = need("max_position_embeddings")
        window = (cfg.get("sliding_window") or None) if cfg.get("use_sliding_window", True) else None
        return cls(
            architecture=archs[0],
            model_type=cfg.get("model_type", ""),
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            max_position_embeddings=max_positions,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", archs[0].startswith("Qwen2")))),
            qk_norm=archs[0].startswith("Qwen3"),
            sliding_window=window if window is not None and window < max_positions else None,  # else it never binds
            torch_dtype=_DTYPES.get(dtype_name),
            eos_token_ids=eos_ids,
            raw=cfg,
            quantization=cfg.get("quantization_config") or (
                {"quant_method": "fp8", "online": True} if quantization else None),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, quantization: str | None = None) -> "ModelConfig":
        path = Path(model_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{str(path)!r} has no config.json; is it a Hugging Face checkpoint directory?")
        try:
            cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file} is not valid JSON: {e}") from e
        return cls.from_dict(cfg, quantization)


@dataclass(frozen=True)
class MoEConfig:
    """What a mixture-of-experts layer (``engine.model.layers.moe``) needs: expert sizes and routing
    rules. Each MoE family's config extends it with where its MoE layers are."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int          # shared experts run as one TP MLP of n_shared_experts x moe_intermediate_size
    scoring_func: str              # "softmax" (V2, Qwen) or "sigmoid" (V3)
    topk_method: str               # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3)
    n_group: int                   # expert groups (1: no group limit)
    topk_group: int                # groups a token may pick experts from
    norm_topk_prob: bool           # renormalise the top-k weights to sum to 1
    routed_scaling_factor: float   # multiplies the routed experts' weights


@dataclass(frozen=True)
class DeepseekConfig(MoEConfig):
    """The MLA and MoE dimensions and routing rules of DeepSeek-V2 / V2-Lite / V3, read from
    ``ModelConfig.raw`` (kept apart so ModelConfig stays the dense models' shape).

    Routing defaults follow the architecture when config.json leaves them out (the
    transformers-5 form drops ``topk_method`` / ``scoring_func`` for V3): V2 scores by
    softmax and picks greedily, V3 by sigmoid plus ``e_score_correction_bias`` with
    group-limited selection (``noaux_tc``). ``rope_interleave`` (V3 form, default True):
    the rope channels rotate in GPT-J interleaved pairs, else neox halves.
    """

    q_lora_rank: int | None        # None: one q_proj (V2-Lite); else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    first_k_dense_replace: int     # layers before this one are dense
    moe_layer_freq: int            # after that, every moe_layer_freq-th layer is MoE
    rope_interleave: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)

    @classmethod
    def from_model_config(cls, config: ModelConfig) -> "DeepseekConfig":
        raw = config.raw
        v3 = config.architecture == "DeepseekV3ForCausalLM"
        scoring = raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")
        topk_method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported scoring_func {scoring!r} (supported: softmax, sigmoid)")
        if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"unsupported topk_method {topk_method!r} "
                             "(supported: greedy, group_limited_greedy, noaux_tc)")
        n_group = raw.get("n_group") or 1
        experts = raw.get("n_routed_experts") or 0
        if experts % n_group:
            raise ValueError(f"n_routed_experts = {experts} is not divisible by n_group = {n_group}")
        return cls(
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=raw["qk_nope_head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            v_head_dim=raw["v_head_dim"],
            n_routed_experts=experts,
            num_experts_per_tok=raw.get("num_experts_per_tok") or 0,
            moe_intermediate_size=raw.get("moe_intermediate_size") or 0,
            n_shared_experts=raw.get("n_shared_experts") or 0,
            first_k_dense_replace=raw.get("first_k_dense_replace") or 0,
            moe_layer_freq=raw.get("moe_layer_freq") or 1,
            scoring_func=scoring,
            topk_method=topk_method,
            n_group=n_group,
            topk_group=raw.get("topk_group") or n_group,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            rope_interleave=bool(raw.get("rope_interleave", True)),
        )


@dataclass(frozen=True)
class QwenMoeConfig(MoEConfig):
    """Qwen3-MoE / Qwen2-MoE experts, read from ``ModelConfig.raw``: softmax routing, plain
    top-k over all experts, ``norm_topk_prob`` as config.json says, no scaling. Layer ``i`` is
    MoE unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (then a
    dense MLP of ``intermediate_size``). Qwen2-MoE adds one shared expert of
    ``shared_expert_intermediate_size`` gated per token by a sigmoid; Qwen3-MoE has none. The
    expert count is ``num_experts`` (published) or ``num_local_experts`` (transformers 5)."""

    shared_expert_intermediate_size: int   # 0: no shared expert (Qwen3-MoE)
    decoder_sparse_step: int
    mlp_only_layers: frozenset[int]

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.n_routed_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_model_config(cls, config: ModelConfig) -> "QwenMoeConfig":
        raw = config.raw

        def need(*keys):
            value = next((raw[k] for k in keys if raw.get(k) is not None), None)
            if value is None:
                raise ValueError(f"config.json of {config.architecture} is missing required key {keys[0]!r}")
            return value

        experts, per_token = need("num_experts", "num_local_experts"), need("num_experts_per_tok")
        step = raw.get("decoder_sparse_step") or 1
        if not 1 <= per_token <= experts:
            raise ValueError(f"num_experts_per_tok = {per_token} must be between 1 and num_experts = {experts}")
        if step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
        return cls(
            n_routed_experts=experts,
            num_experts_per_tok=per_token,
            moe_intermediate_size=need("moe_intermediate_size"),
            n_shared_experts=0,
            scoring_func="softmax",
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            routed_scaling_factor=1.0,
            shared_expert_intermediate_size=(need("shared_expert_intermediate_size")
                                             if config.architecture == "Qwen2MoeForCausalLM" else 0),
            decoder_sparse_step=step,
            mlp_only_layers=frozenset(raw.get("mlp_only_layers") or ()),
        )

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
    qkv_bias: bool             # Qwen2 always has a QKV bias; others say so in attention_bias
    qk_norm: bool              # Qwen3 normalises q and k per head
    torch_dtype: torch.dtype | None
    eos_token_ids: tuple[int, ...]
    raw: dict = field(repr=False, compare=False)  # the whole config.json, for family-specific keys

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
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
        dtype_name = cfg.get("torch_dtype", cfg.get("dtype"))
        if dtype_name is not None and dtype_name not in _DTYPES:
            raise ValueError(f"config.json has unsupported dtype {dtype_name!r}; expected one of {sorted(_DTYPES)}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        heads = need("num_attention_heads")
        hidden = need("hidden_size")
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
            max_position_embeddings=need("max_position_embeddings"),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", archs[0].startswith("Qwen2"))),
            qk_norm=archs[0].startswith("Qwen3"),
            torch_dtype=_DTYPES.get(dtype_name),
            eos_token_ids=eos_ids,
            raw=cfg,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ModelConfig":
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
        return cls.from_dict(cfg)

"""Architecture routing: config.json `architectures[0]` -> model class, and
building a model directly in its final dtype and device."""
from __future__ import annotations

import importlib
from contextlib import contextmanager

import torch
from torch import nn

from engine.distributed import TPGroup
from engine.model.config import ModelConfig
from engine.model.models.deepseek_v2 import DeepseekV2ForCausalLM
from engine.model.models.dense import DenseForCausalLM
from engine.model.models.qwen_moe import QwenMoeForCausalLM
from engine.model.models.qwen_vl import QwenVLTextForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "Qwen2ForCausalLM": DenseForCausalLM,
    "Qwen3ForCausalLM": DenseForCausalLM,
    "LlamaForCausalLM": DenseForCausalLM,
    "MistralForCausalLM": DenseForCausalLM,
    "Qwen2MoeForCausalLM": QwenMoeForCausalLM,
    "Qwen3MoeForCausalLM": QwenMoeForCausalLM,
    **dict.fromkeys(("Qwen2VLForCausalLM", "Qwen2_5_VLForCausalLM", "Qwen2VLForConditionalGeneration",
                     "Qwen2_5_VLForConditionalGeneration"), QwenVLTextForCausalLM),
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV2ForCausalLM,
}


# Builds a model whose linear weights are quantized (config.quantization set); imported only then.
QUANTIZED_BUILDER = "engine.model.quantization.build"


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[config.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {config.architecture!r}; "
                         f"supported: {', '.join(sorted(MODEL_CLASSES))}") from None


def default_dtype(config: ModelConfig, device: torch.device) -> torch.dtype:
    """float32 on CPU; on GPU the checkpoint's half dtype, else bfloat16."""
    if device.type == "cpu":
        return torch.float32
    return config.torch_dtype if config.torch_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


@contextmanager
def creating_in(dtype: torch.dtype, device: torch.device | str):
    """Tensors created inside (parameters included) default to ``dtype`` on ``device``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_model(config: ModelConfig, device: torch.device | str, dtype: torch.dtype | None = None,
                tp: TPGroup | None = None, cls: type[nn.Module] | None = None) -> nn.Module:
    """Instantiate ``cls`` (default: the class routed from `config`) with uninitialised
    parameters created directly in `dtype` on `device` (never a float32 copy first). A quantized
    config (``config.quantization``) is built by ``QUANTIZED_BUILDER``: its linear weights in
    their stored form, everything else in `dtype`."""
    device = torch.device(device)
    dtype = dtype or default_dtype(config, device)
    if config.quantization is not None:
        builder = importlib.import_module(QUANTIZED_BUILDER)
        return builder.build_quantized_model(cls or model_class(config), config, device, dtype, tp)
    with creating_in(dtype, device):
        return (cls or model_class(config))(config, tp)

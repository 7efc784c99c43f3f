"""Qwen2-VL's and Qwen2.5-VL's language model, text only: the dense family's model under the
multimodal checkpoint's names."""
from __future__ import annotations

from engine.model.models.dense import DenseForCausalLM


class QwenVLTextForCausalLM(DenseForCausalLM):
    """The language model of Qwen2-VL / Qwen2.5-VL, text only: the vision tower's tensors are
    skipped, and a checkpoint's ``model.language_model.*`` names (transformers 5) load like
    ``model.*``. With text-only input all three M-RoPE position ids are equal, so M-RoPE is
    plain RoPE."""

    checkpoint_prefixes = {"visual.": None, "model.visual.": None, "model.language_model.": "model."}

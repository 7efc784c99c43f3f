"""FP8 models under tensor parallelism (torchrun: gloo on the CPU, NCCL with
``GATES_TORCHRUN_DEVICE=cuda``): every rank's logits at TP (and EP) 2 equal one rank's, each rank
holding only its shards of the FP8 weights and their scale blocks (DeepSeek: its own experts)."""
from __future__ import annotations

import pytest
import torch

from engine.distributed import TPGroup
from engine.model.config import ModelConfig
from engine.model.loader import load_checkpoint
from engine.model.models.registry import build_model
from fp8_oracle import engine_logits
from phases.checkpoints import FP8_CONFIGS

pytestmark = pytest.mark.torchrun

PROMPT_LENS = [5, 70, 1]  # 70 prompt tokens: the GEMM's quantize kernel (> 64 rows) and many expert tiles
# The all-reduce sums the row-parallel products in another order than one rank's GEMM: float32 noise that
# tips an occasional e4m3 rounding of a later activation, which attention carries to the sequence's later
# tokens (measured: rows up to 4e-2, 2e-2 over all). A rank with another rank's scale blocks is off by ~1.
FLIP_TOLERANCE = 0.05


def fp8_model(model_dir, quantization, tp, device):
    model = build_model(ModelConfig.from_model_dir(model_dir, quantization), device, torch.float32, tp)
    load_checkpoint(model, model_dir, progress=False)
    return model


@pytest.mark.parametrize("arch, online", [("Qwen3ForCausalLM", False), ("DeepseekV3ForCausalLM", False),
                                          ("Qwen3ForCausalLM", True)])
def test_tp_fp8_logits_equal_one_rank(tp_group, tp_device, tiny_fp8_checkpoint, tiny_checkpoint, arch, online):
    model_dir = (tiny_checkpoint(arch, seed=6, **FP8_CONFIGS[arch]) if online
                 else tiny_fp8_checkpoint(arch, seed=6))
    quantization = "fp8" if online else None
    sharded = fp8_model(model_dir, quantization, tp_group, tp_device)
    assert sharded.model.layers[1].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 512, (n + 4,), generator=gen) for n in PROMPT_LENS]
    got = engine_logits(sharded, sequences, PROMPT_LENS, tp_device)
    want = engine_logits(fp8_model(model_dir, quantization, TPGroup(), "cpu"), sequences, PROMPT_LENS)
    error = float((torch.cat(got) - torch.cat(want)).norm() / torch.cat(want).norm())
    assert error < FLIP_TOLERANCE, (f"rank {tp_group.rank} of {tp_group.size}, {arch}{' online' if online else ''}: "
                                    f"logits {error:.2e} (relative) from one rank's")

"""Model-level oracles for FP8 checkpoints, built from transformers:

- the dequantized model: the checkpoint's FP8 weights dequantized by transformers' own FP8
  reader (``Fp8Dequantize``, what ``from_pretrained`` runs for an FP8 checkpoint on a machine
  without an FP8 GPU) and loaded by ``from_pretrained`` into HF's float32 model;
- W8A8: that model with the input of every quantized projection quantized per token group
  (``fp8_truth.quantize_groups``), and, for online quantization, its weights quantized in
  128 x 128 blocks by ``fp8_truth`` too: what our engine must compute, up to the rare e4m3
  rounding that float32 noise tips the other way.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from torch.overrides import TorchFunctionMode
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from engine.worker.kv_cache import bind_kv_cache
from fp8_truth import dequantize, quantize_groups
from phases.harness import all_logits_step, num_blocks_for, run_paged


def dequantized_checkpoint(model_dir: Path) -> Path:
    """A copy of an FP8 checkpoint with every FP8 weight dequantized by transformers' reader."""
    out_dir = Path(tempfile.mkdtemp(prefix="fp8-dequantized-"))
    tensors = load_file(str(model_dir / "model.safetensors"))
    reader = Fp8Dequantize(None)
    plain = {}
    for name, tensor in tensors.items():
        if name.endswith(("weight_scale_inv", "weight_scale")):
            continue
        scale = tensors.get(f"{name}_scale_inv", tensors.get(f"{name}_scale"))
        plain[name] = tensor if scale is None else reader._dequantize_one(tensor, scale, torch.float32)
    save_file(plain, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def hf_model(model_dir: Path):
    """HF's float32 model of a plain checkpoint, routed experts in eager (per-expert F.linear)."""
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                             experts_implementation="eager").eval()


def quantized_weights(hf, skipped: tuple[str, ...] = ()) -> set[int]:
    """Storage pointers of HF's projection weights (experts' stacks included) but MLA's
    ``kv_b_proj`` (our engine dequantizes it: its weight is absorbed into the decode query) and
    the module names in ``skipped`` (the checkpoint's unquantized layers)."""
    return {p.untyped_storage().data_ptr() for name, p in hf.named_parameters()
            if ("proj" in name.split(".")[-2] or name.endswith(("experts.gate_up_proj", "experts.down_proj")))
            and "kv_b_proj" not in name and name.removesuffix(".weight") not in skipped}


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    q, scales = quantize_groups(x.reshape(-1, x.shape[-1]))
    return dequantize(q, scales).to(x.dtype).reshape(x.shape)


def fake_quantize_weight(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` quantized and dequantized in 128 x 128 blocks (online quantization's values)."""
    n, k = w.shape
    padded = w.new_zeros(-(-n // 128) * 128, -(-k // 128) * 128)
    padded[:n, :k] = w
    blocks = padded.view(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
    scales = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-10) / 448
    q = (blocks / scales).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scales.double()
    return q.view(padded.shape)[:n, :k].to(w.dtype)


class W8A8(TorchFunctionMode):
    """Inside, ``F.linear`` on a weight whose storage is in ``weights`` gets its input quantized
    per token group (and, with ``quantize_weights``, the weight in 128 x 128 blocks)."""

    def __init__(self, weights: set[int], quantize_weights: bool = False):
        super().__init__()
        self.weights, self.quantize_weights, self.quantized = weights, quantize_weights, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear and args[1].untyped_storage().data_ptr() in self.weights:
            weight = args[1]
            if self.quantize_weights:  # each weight (an expert: its slice of the stack) quantized once
                key = (weight.data_ptr(), tuple(weight.shape))
                if key not in self.quantized:
                    self.quantized[key] = fake_quantize_weight(weight)
                weight = self.quantized[key]
            args = (fake_quantize(args[0]), weight, *args[2:])
        return func(*args, **(kwargs or {}))


def engine_logits(model, sequences: list[torch.Tensor], prompt_lens: list[int], device="cpu") -> list[torch.Tensor]:
    """Every token's logits through a ragged paged prefill and decode steps (block size 16)."""
    bind_kv_cache(model, num_blocks_for(map(len, sequences), 16), 16, torch.float32, device)
    with torch.no_grad():
        return [t.cpu() for t in run_paged(all_logits_step(model), [s.to(device) for s in sequences], prompt_lens, 16)]


def row_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> torch.Tensor:
    """Relative error of every token's logits row, all sequences."""
    return torch.cat([(g.double() - w.double()).norm(dim=-1) / w.double().norm(dim=-1) for g, w in zip(got, want)])


def assert_w8a8_rows(got, want, what: str) -> None:
    """FP8 logits against the W8A8 oracle: at least 90 % of the token rows within 1e-3 (float32
    noise only) and none off by more than 0.25 (a few rows after an e4m3 rounding that the noise
    tipped the other way); a wrong scale, block or group puts every row far off."""
    errors = row_errors(got, want)
    close = float((errors <= 1e-3).double().mean())
    assert close >= 0.9 and errors.max() <= 0.25, (
        f"{what}: {close:.0%} of {len(errors)} token rows within 1e-3 of the W8A8 oracle (need 90 %), "
        f"worst row {errors.max():.2e} (need <= 0.25)")

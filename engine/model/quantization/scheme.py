"""Which FP8 format a model's weights are in, read from ``ModelConfig.quantization`` (config.json's
``quantization_config``, or the online request) and checked before any weight is read.

Formats:

- ``quant_method: fp8`` (Qwen3-*-FP8, DeepSeek-V3): e4m3 weights, float32 ``weight_scale_inv``
  per 128 x 128 block, dynamic activations; ``ignored_layers`` / ``modules_to_not_convert``
  name the linear layers stored unquantized.
- ``quant_method: compressed-tensors`` (llm-compressor): one config group of 8-bit float
  weights, per output channel (``weight_scale [N, 1]``) or in 128 x 128 blocks, with dynamic
  activations (per token, or per group of 128); ``ignore`` names the unquantized layers
  (``re:`` entries are regular expressions).
- online (``quantization="fp8"`` on an unquantized checkpoint): every linear layer quantized at
  load into 128 x 128 blocks.

Activations are quantized per token and group of 128 in every format (``engine.model.kernels.fp8``):
for per-token checkpoints that is finer than the format asks, never coarser.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

BLOCK = 128


def _fail(field: str, value, expected: str):
    raise ValueError(f"quantization_config.{field} = {value!r} is not supported (expected {expected})")


def matches(name: str, entry: str) -> bool:
    """Whether an ignore-list ``entry`` names module ``name``: ``re:<regex>`` matches the whole
    name; any other entry matches as transformers' ``should_convert_module`` reads it (a regular
    expression from the start up to a module boundary, or a suffix of the name)."""
    if entry.startswith("re:"):
        return re.fullmatch(entry[3:], name) is not None
    return re.match(rf"(?:{entry})(?:(?<=\.)|(?=\.|$))", name) is not None or name.endswith(entry)


@dataclass(frozen=True)
class Fp8Scheme:
    """An FP8 weight format: ``block_rows`` weight rows per scale row (128: block-wise, 1: per
    output channel; 128 columns per scale column either way), ``scale_name`` the checkpoint's
    name for the scales (``weight_scale_inv`` or ``weight_scale``; both multiply the stored
    weight back), ``ignored`` the unquantized layers, ``online`` quantize at load."""

    block_rows: int = BLOCK
    scale_name: str = "weight_scale_inv"
    ignored: tuple[str, ...] = ()
    online: bool = False

    def ignores(self, name: str) -> bool:
        return any(matches(name, entry) for entry in self.ignored)

    @classmethod
    def from_config(cls, quantization: dict) -> "Fp8Scheme":
        method = quantization.get("quant_method")
        if quantization.get("online"):
            return cls(online=True)
        if method == "fp8":
            return cls._from_fp8(quantization)
        if method == "compressed-tensors":
            return cls._from_compressed_tensors(quantization)
        _fail("quant_method", method, "'fp8' or 'compressed-tensors'")

    @classmethod
    def _from_fp8(cls, q: dict) -> "Fp8Scheme":
        if q.get("fmt", "e4m3") != "e4m3":
            _fail("fmt", q["fmt"], "'e4m3'")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            _fail("activation_scheme", q["activation_scheme"], "'dynamic'")
        if list(q.get("weight_block_size") or ()) != [BLOCK, BLOCK]:
            _fail("weight_block_size", q.get("weight_block_size"), f"[{BLOCK}, {BLOCK}]")
        if q.get("scale_fmt") not in (None, "float"):
            _fail("scale_fmt", q["scale_fmt"], "float32 scales (no scale_fmt)")
        ignored = q.get("ignored_layers") or q.get("modules_to_not_convert") or ()
        return cls(ignored=tuple(ignored))

    @classmethod
    def _from_compressed_tensors(cls, q: dict) -> "Fp8Scheme":
        groups = q.get("config_groups") or {}
        if len(groups) != 1:
            _fail("config_groups", sorted(groups), "exactly one group")
        (name, group), = groups.items()
        where = f"config_groups.{name}"
        weights, acts = group.get("weights") or {}, group.get("input_activations")
        if (weights.get("type"), weights.get("num_bits"), weights.get("dynamic", False)) != ("float", 8, False):
            _fail(f"{where}.weights", weights, "static 8-bit float weights")
        strategy = weights.get("strategy")
        if strategy == "block" and list(weights.get("block_structure") or ()) != [BLOCK, BLOCK]:
            _fail(f"{where}.weights.block_structure", weights.get("block_structure"), f"[{BLOCK}, {BLOCK}]")
        if strategy not in ("channel", "block"):
            _fail(f"{where}.weights.strategy", strategy, "'channel' or 'block'")
        if not acts or (acts.get("type"), acts.get("num_bits"), acts.get("dynamic")) != ("float", 8, True):
            _fail(f"{where}.input_activations", acts, "dynamic 8-bit float activations")
        if acts.get("strategy") not in ("token", "group") or (
                acts.get("strategy") == "group" and acts.get("group_size") != BLOCK):
            _fail(f"{where}.input_activations.strategy", acts.get("strategy"), f"'token' or 'group' of {BLOCK}")
        if group.get("targets") != ["Linear"]:
            _fail(f"{where}.targets", group.get("targets"), "['Linear']")
        return cls(block_rows=BLOCK if strategy == "block" else 1, scale_name="weight_scale",
                   ignored=tuple(q.get("ignore") or ()))

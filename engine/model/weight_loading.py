"""Named checkpoint tensors into a model, TP-sharded: each tensor to the parameter it names
(through the model's merged and stacked-expert names) by that parameter's ``weight_loader``.

Every checkpoint tensor must map to a parameter and every parameter must be filled: anything else
is an error naming the key. The one exception is explicit: a tensor whose parameter says it is not
this rank's shard (``param.owns_shard(shard_id)`` false: another rank's routed expert) is skipped
unread. Tensors may be lazy (``engine.model.loader.LazyTensor``: read when a loader slices them).
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn
from tqdm import tqdm

log = logging.getLogger(__name__)

# Checkpoint tensors with no parameter by design (recomputed buffers).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A per-expert checkpoint tensor's last name part -> the suffix of its stacked parameter's name
# (experts.<e>.gate_proj.weight_scale_inv -> experts.gate_up_proj_scale_inv).
EXPERT_TENSORS = {"weight": "", "weight_scale_inv": "_scale_inv"}


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """Replicated parameters (norms, routers): the shapes must match exactly."""
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"shape {tuple(loaded.shape)} does not match parameter shape {tuple(param.shape)}")
    param.data.copy_(loaded)


def _target(model: nn.Module, name: str) -> tuple[str, object]:
    """Checkpoint name -> (parameter name, shard id) via the model's `expert_params`
    (`experts.<e>.gate_proj.weight` -> (`experts.gate_up_proj`, (e, 0))) and
    `packed_modules` (a name component such as `q_proj` -> (`qkv_proj`, "q"))."""
    parts = name.split(".")
    experts = getattr(model, "expert_params", {})
    for i in range(len(parts) - 3):
        if (parts[i] == "experts" and parts[i + 1].isdigit() and parts[i + 2] in experts
                and parts[i + 3] in EXPERT_TENSORS):
            param, part = experts[parts[i + 2]]
            return (".".join(parts[:i + 1] + [param + EXPERT_TENSORS[parts[i + 3]]] + parts[i + 4:]),
                    (int(parts[i + 1]), part))
    for i, part in enumerate(parts):
        if part in getattr(model, "packed_modules", {}):
            packed, shard_id = model.packed_modules[part]
            return ".".join(parts[:i] + [packed] + parts[i + 1:]), shard_id
    return name, None


def _expected_shards(model: nn.Module, param_name: str, param: nn.Parameter) -> set:
    """Shard ids a parameter needs: its own `expected_shards` (stacked experts: (expert,
    part) for this rank's experts), a packed parameter's (e.g. q, k, v), else {None}."""
    if hasattr(param, "expected_shards"):
        return param.expected_shards
    parts = param_name.split(".")
    shards = {s for packed, s in getattr(model, "packed_modules", {}).values() if packed in parts}
    return shards or {None}


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                 total: int | None = None, progress: bool = True) -> None:
    """Load named checkpoint tensors into `model` through each parameter's
    `weight_loader(param, tensor, shard_id)`; tied parameters count once. The model's
    `checkpoint_prefixes` renames name prefixes, or (mapped to None) skips their tensors
    with one log line per prefix (a multimodal checkpoint's vision tower), and
    `checkpoint_suffixes` renames name endings (a quantized checkpoint's scale names). A tensor
    for a shard another rank owns (`param.owns_shard`) is skipped without being read. Once every
    parameter is filled, each layer's `quant_method.after_loading(layer)` runs (a weight kept in
    another form than the checkpoint's, e.g. dequantized)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    prefixes = getattr(model, "checkpoint_prefixes", {})
    suffixes = getattr(model, "checkpoint_suffixes", {})
    skipped: dict[str, int] = {}
    filled: dict[int, set] = {}
    first_source: dict[int, str] = {}  # parameter id -> the checkpoint tensor that filled it first
    for name, tensor in tqdm(tensors, total=total, desc="loading weights", unit="tensor", disable=not progress):
        if name.endswith(IGNORED_SUFFIXES):
            continue
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is not None and prefixes[prefix] is None:
            skipped[prefix] = skipped.get(prefix, 0) + 1
            continue
        if prefix is not None:
            name = prefixes[prefix] + name[len(prefix):]
        suffix = next((x for x in suffixes if name.endswith(x)), None)
        if suffix is not None:
            name = name[:-len(suffix)] + suffixes[suffix]
        param_name, shard_id = _target(model, name)
        param = params.get(param_name)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} matches no model parameter (looked for {param_name!r})")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if not getattr(param, "owns_shard", lambda _: True)(shard_id):
                continue
            if shard_id in filled.get(id(param), ()):  # a second tensor for a shared (tied) parameter
                again = param.detach().clone()
                loader(again, tensor, shard_id)
                if not torch.equal(again, param):
                    raise ValueError(f"differs from {first_source[id(param)]!r}, and both load into one shared "
                                     f"(tied) parameter; the checkpoint contradicts tie_word_embeddings")
            else:
                loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
        filled.setdefault(id(param), set()).add(shard_id)
        first_source.setdefault(id(param), name)
    for prefix, count in skipped.items():
        log.info("skipped %d checkpoint tensors under %r: this model does not use them", count, prefix)
    missing = []
    for n, p in params.items():
        lacking = _expected_shards(model, n, p) - filled.get(id(p), set())
        if lacking:
            missing.append(n if lacking == {None} else f"{n} (shards {sorted(map(str, lacking))})")
    if missing:
        raise ValueError(f"checkpoint has no tensor for parameter(s): {', '.join(sorted(missing))}")
    for module in model.modules():
        if getattr(module, "quant_method", None) is not None:
            module.quant_method.after_loading(module)

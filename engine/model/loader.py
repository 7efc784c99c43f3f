"""Safetensors checkpoint reading, lazy: a checkpoint's files and tensors, loaded into a model by
``engine.model.weight_loading.load_weights``.

Tensors are opened with `safe_open(...).get_slice`, so a rank reads only the
rows/columns its parameter's `weight_loader` asks for (``LazyTensor``); a tensor another rank
owns is skipped unread.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from engine.model.weight_loading import load_weights


class LazyTensor:
    """A checkpoint tensor not yet read. Slicing (`lazy[a:b]`, `lazy[:, a:b]`)
    and `narrow(dim, start, length)` read only that slice; any torch op given a
    LazyTensor (e.g. `param.copy_(lazy)`) reads it whole. Results are CPU tensors."""

    def __init__(self, tensor_slice):
        self._slice = tensor_slice
        self.shape = torch.Size(tensor_slice.get_shape())

    def __getitem__(self, index) -> torch.Tensor:
        return self._slice[index]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self[tuple(index)]

    def materialize(self) -> torch.Tensor:
        return self._slice[tuple(slice(None) for _ in self.shape)]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def read(a):
            return a.materialize() if isinstance(a, LazyTensor) else a
        return func(*map(read, args), **{k: read(v) for k, v in (kwargs or {}).items()})


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: those named by
    `model.safetensors.index.json`, else the single `model.safetensors`."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{str(model_dir)!r} has neither model.safetensors.index.json nor model.safetensors")


def checkpoint_tensors(model_dir: str | Path) -> Iterator[tuple[str, LazyTensor]]:
    """(name, LazyTensor) for every tensor of the checkpoint, file by file."""
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, LazyTensor(f.get_slice(name))


def load_checkpoint(model: nn.Module, model_dir: str | Path, progress: bool = True) -> None:
    """Load every tensor of the checkpoint in `model_dir` into `model`."""
    total = 0
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            total += len(list(f.keys()))
    load_weights(model, checkpoint_tensors(model_dir), total=total, progress=progress)

"""Tensor-parallel communication: the TP and EP groups, their collectives and the custom all-reduce.

``init_tp_distributed`` sets up the named groups: "tp" (dense layers) and "ep"
(routed experts; here the same ranks as "tp"). A collective takes the name of
the group it runs over (a custom op takes tensors and plain values only, never
a ProcessGroup) and is the identity for a group that was not initialised.
Layers are handed a ``TPGroup`` to decide their shard and pass its ``name`` to
the collectives; they never ask ``torch.distributed`` themselves, so a layer
can be built for "rank r of n" in a single process.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)

ONE_SHOT_MAX_BYTES = 256 << 10   # one-shot below this: each rank reads every peer
SYMM_BUFFER_BYTES = 8 << 20      # two-shot up to this; NCCL above


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a parallel group (tensor or expert parallel); ``group=None``
    means the world group; ``name`` is what collectives are given to run over it."""

    rank: int = 0
    size: int = 1
    group: ProcessGroup | None = None
    name: str = "tp"


_groups: dict[str, TPGroup] = {}   # the initialised groups by name: "tp", "ep"
_custom_all_reduce: Callable[[torch.Tensor], torch.Tensor | None] | None = None
_custom_all_reduce_name = ""   # which custom path init_custom_all_reduce chose, "" for none


def init_tp_distributed(timeout_s: float = 300.0) -> TPGroup:
    """Join the TP group described by RANK / WORLD_SIZE / LOCAL_RANK and return it.

    WORLD_SIZE unset or <= 1: returns ``TPGroup()`` at once, no process group (a
    single-process run must never wait for a master). Otherwise a host with a GPU
    for every local rank sets ``LOCAL_RANK`` as the device and creates one group
    (gloo for CPU tensors, NCCL for CUDA tensors); CPU-only hosts and hosts with
    fewer GPUs than local ranks (every rank decides the same) get gloo alone. The expert-parallel group
    ("ep", ``get_ep_group``) spans the same ranks. Idempotent.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1 or "tp" in _groups:
        return get_tp_group()
    if not dist.is_initialized():
        kwargs: dict[str, Any] = dict(backend="gloo", timeout=timedelta(seconds=timeout_s))
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
            kwargs.update(backend="cpu:gloo,cuda:nccl", device_id=device)
        dist.init_process_group(**kwargs)
        dist.barrier()
    for name in ("tp", "ep"):
        _groups[name] = TPGroup(rank=dist.get_rank(), size=dist.get_world_size(), name=name)
    return _groups["tp"]


def close_tp_distributed() -> None:
    """Leave the process group ``init_tp_distributed`` joined (``destroy_process_group``: its
    connections closed and its threads joined now, while the interpreter still runs, not in its
    teardown) and forget the named groups. For a rank that ended cleanly; a rank that failed may
    leave a peer inside a collective and should just exit. A no-op without a process group."""
    _groups.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tp_group() -> TPGroup:
    """The TP group set by ``init_tp_distributed``, or ``TPGroup()`` (rank 0 of 1)."""
    return _groups.get("tp", TPGroup())


def get_ep_group() -> TPGroup:
    """The expert-parallel group (routed experts are split over it), or rank 0 of 1."""
    return _groups.get("ep", TPGroup(name="ep"))


def _group(name: str) -> TPGroup:
    """The initialised group called ``name``; a group never initialised has one rank."""
    return _groups.get(name, TPGroup(name=name))


# all_reduce_sum is a registered op, so torch.compile treats it as opaque. It is defined through
# torch.library.Library rather than the torch.library.custom_op decorator: a custom_op's first call
# imports torch._dynamo (2-4 s of CPU in every process that runs a model, every torchrun rank), and
# each call goes through its Python wrappers.
_LIBRARY = torch.library.Library("agent_infer", "DEF")
_LIBRARY.define("all_reduce_sum(Tensor x, str group='tp') -> Tensor")


def _all_reduce_sum(x: torch.Tensor, group: str = "tp") -> torch.Tensor:
    g = _group(group)
    if g.size == 1:
        return x.clone(memory_format=torch.contiguous_format)
    if _custom_all_reduce is not None and group == "tp":
        out = _custom_all_reduce(x)
        if out is not None:
            return out
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=g.group)
    return out


_LIBRARY.impl("all_reduce_sum", _all_reduce_sum, "CompositeExplicitAutograd")


@torch.library.register_fake("agent_infer::all_reduce_sum", lib=_LIBRARY)
def _(x: torch.Tensor, group: str = "tp") -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


all_reduce_sum = torch.ops.agent_infer.all_reduce_sum
all_reduce_sum.__doc__ = """``all_reduce_sum(x, group="tp")``: the sum of ``x`` over the group named ``group`` ("tp" or
"ep"), as a new contiguous tensor (same shape, dtype, device). Uses the custom all-reduce (TP
group only) when initialised and the message fits, else NCCL/gloo."""


def all_gather_last_dim(x: torch.Tensor, group: str = "tp") -> torch.Tensor:
    """``[..., d] -> [..., d * size]``: every rank's ``x`` concatenated in rank order
    over the group named ``group``. Returns ``x`` itself when the group has one rank.
    """
    g = _group(group)
    if g.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(g.size)]
    dist.all_gather(parts, x, group=g.group)
    return torch.cat(parts, dim=-1)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every TP rank (over gloo, never NCCL)."""
    tp = get_tp_group()
    if tp.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=tp.group, group_src=src, device=torch.device("cpu"))
    return box[0]


def broadcast_tensor(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite ``t`` in place with TP rank ``src``'s ``t`` and return it."""
    tp = get_tp_group()
    if tp.size > 1:
        dist.broadcast(t, group=tp.group, group_src=src)
    return t


def init_custom_all_reduce(device: torch.device | str) -> None:
    """Try to give ``all_reduce_sum`` a faster path for small CUDA messages. Never raises.

    With tp > 1 on CUDA: torch symmetric memory (one-shot / two-shot, never
    multicast), else vllm's custom all-reduce when vllm imports. It is used only
    if every rank succeeded; otherwise the reason is logged once and
    ``all_reduce_sum`` keeps using NCCL. A no-op for tp = 1 or a CPU device.
    """
    global _custom_all_reduce, _custom_all_reduce_name
    device = torch.device(device)
    if get_tp_group().size == 1 or device.type != "cuda" or _custom_all_reduce is not None:
        return
    reasons = []
    for make in (_symmetric_memory_all_reduce, _vllm_all_reduce):
        try:
            handle = make(device)
        except Exception as e:  # any failure means "fall back", never a crash
            handle = None
            reasons.append(f"{make.__name__}: {e!r}")
        if _on_every_rank(handle is not None):
            _custom_all_reduce = handle
            _custom_all_reduce_name = "symmetric memory" if make is _symmetric_memory_all_reduce else "vllm custom"
            return
    log.warning("custom all-reduce unavailable, using NCCL (%s)", "; ".join(reasons) or "another rank failed")


def all_reduce_path() -> str:
    """What a small TP all-reduce runs on: "symmetric memory", "vllm custom", else the process
    group's backend ("nccl", "gloo"), or "none" for one rank."""
    if get_tp_group().size == 1:
        return "none"
    return _custom_all_reduce_name or dist.get_backend(get_tp_group().group)


def _on_every_rank(flag: bool) -> bool:
    """True when ``flag`` is true on every rank (keeps the ranks choosing the same path)."""
    votes = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=get_tp_group().group)
    return bool(votes.item())


def _symmetric_memory_all_reduce(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """An all-reduce over this rank's own symmetric-memory buffer, for bf16/fp32 sums that fit."""
    import torch.distributed._symmetric_memory as symm_mem

    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    group_name = (get_tp_group().group or dist.group.WORLD).group_name
    own_buffer = symm_mem.empty(SYMM_BUFFER_BYTES, dtype=torch.uint8, device=device)
    symm_mem.rendezvous(own_buffer, group_name)

    def all_reduce(x: torch.Tensor) -> torch.Tensor | None:
        nbytes = x.numel() * x.element_size()
        if x.dtype not in (torch.bfloat16, torch.float32) or nbytes > SYMM_BUFFER_BYTES or nbytes % 16:
            return None
        staging = own_buffer[:nbytes].view(x.dtype).view(x.shape)
        if nbytes <= ONE_SHOT_MAX_BYTES:
            return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x.contiguous(), "sum", group_name)
        staging.copy_(x)
        out = torch.empty_like(staging)
        return torch.ops.symm_mem.two_shot_all_reduce_out(staging, "sum", group_name, out)

    return all_reduce


def _vllm_all_reduce(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """vllm's custom all-reduce (it keeps one registered buffer per rank itself)."""
    from vllm.distributed.device_communicators.custom_all_reduce import CustomAllreduce

    gloo_group = dist.new_group(backend="gloo")  # its IPC-handle exchange needs object collectives
    custom = CustomAllreduce(gloo_group, device)
    if custom.disabled:
        raise RuntimeError("vllm disabled its custom all-reduce on this machine")
    return lambda x: custom.custom_all_reduce(x) if custom.should_custom_ar(x) else None

"""Test harness shared by the model phases (05-07, later 09+): attention contexts built on the
host sequence by sequence (``prefill_context``, ``decode_context``), a driver that runs a
model-like module through paged prefill/decode steps the way the engine does, and the HF
transformers oracle helpers.

Lives in phases/ (not the engine): it is test code.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from engine.model.config import ModelConfig
from phases.checkpoints import tiny_hf_config

if TYPE_CHECKING:
    from engine.model.attention_context import AttentionContext


def prefill_context(seq_lens: Sequence[int], cached_lens: Sequence[int],
                    block_tables: Sequence[Sequence[int]], block_size: int,
                    device: torch.device | str) -> tuple[torch.Tensor, AttentionContext]:
    """Positions [T] (int64) and the context for prefilling sequences of
    `seq_lens` tokens whose first `cached_lens` tokens are already in the cache.
    T = sum(seq_lens - cached_lens); the K/V of the new tokens go to their slots.
    Built on the host, then copied to `device` once per tensor (the runner builds the same
    layout vectorised on the device; the layer tests build it here, sequence by sequence).
    """
    from engine.model.attention_context import AttentionContext, cache_slots

    positions, slots, kv_slots = [], [], []
    for n, cached, table in zip(seq_lens, cached_lens, block_tables, strict=True):
        if not 0 <= cached < n:
            raise ValueError(f"cached tokens ({cached}) must be in [0, {n}) for a sequence of {n} tokens")
        if len(table) * block_size < n:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {n} tokens")
        every = torch.arange(n)
        positions.append(every[cached:])
        kv_slots.append(cache_slots(torch.tensor([table]), torch.zeros(n, dtype=torch.int64), every, block_size))
        slots.append(kv_slots[-1][cached:])
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    q_lens = seq_lens_t - torch.tensor(cached_lens, dtype=torch.int32)

    def cumsum(lens):
        return torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0, dtype=torch.int32)])

    ctx = AttentionContext(
        has_prefill=True,
        slot_mapping=torch.cat(slots).to(device),
        cu_seqlens_q=cumsum(q_lens).to(device),
        cu_seqlens_k=cumsum(seq_lens_t).to(device),
        max_seqlen_q=int(q_lens.max()),
        max_seqlen_k=int(seq_lens_t.max()),
        prefill_kv_slots=torch.cat(kv_slots).to(device) if any(cached_lens) else None,
    )
    return torch.cat(positions).to(device), ctx


def decode_context(context_lens: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int,
                   device: torch.device | str) -> tuple[torch.Tensor, AttentionContext]:
    """Positions [B] and the context for one decode token per sequence; the
    token of sequence i sits at position context_lens[i] - 1. Block tables are
    padded with block 0 to the widest (entries past a context are never read)."""
    from engine.model.attention_context import AttentionContext, cache_slots

    width = max(len(t) for t in block_tables)
    tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)
    lens = torch.tensor(context_lens, dtype=torch.int64)
    positions = lens - 1
    slots = cache_slots(tables, torch.arange(len(tables)), positions, block_size)
    ctx = AttentionContext(
        has_prefill=False,
        slot_mapping=slots.to(device),
        block_tables=tables.to(device=device, dtype=torch.int32),
        context_lens=lens.to(device=device, dtype=torch.int32),
    )
    return positions.to(device), ctx


def run_paged(step, inputs: list[torch.Tensor], prompt_lens: list[int], block_size: int,
              seed: int = 0, cached_lens: list[int] | None = None) -> list[torch.Tensor]:
    """Drive sequences through a model-like ``step(x, positions) -> out [T, ...]``
    the way the engine does: one ragged prefill of the first ``prompt_lens[i]``
    rows of every sequence, then decode steps of one row per sequence until each
    sequence's rows are used up (so the decode batch shrinks). Block tables are
    random, non-contiguous block ids. With ``cached_lens``, the first
    ``cached_lens[i]`` rows are prefilled in an earlier step, so the main prefill
    reads that prefix back from the cache. The module must already have its KV
    cache bound with enough blocks. Returns each sequence's outputs in position
    order.
    """
    from engine.model.attention_context import forward_context

    gen = torch.Generator().manual_seed(seed)
    need = [-(-len(x) // block_size) for x in inputs]
    ids = torch.randperm(sum(need), generator=gen).tolist()
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(inputs))]
    device = inputs[0].device
    outs: list[list[torch.Tensor]] = [[] for _ in inputs]

    def prefill(start: list[int], end: list[int], keep: bool):
        positions, ctx = prefill_context(end, start, tables, block_size, device)
        x = torch.cat([seq[a:b] for seq, a, b in zip(inputs, start, end)])
        with forward_context(ctx):
            y = step(x, positions)
        if keep:
            for i, part in enumerate(y.split([b - a for a, b in zip(start, end)])):
                outs[i].append(part)

    if cached_lens is not None:
        prefill([0] * len(inputs), cached_lens, keep=True)
        prefill(cached_lens, prompt_lens, keep=True)
    else:
        prefill([0] * len(inputs), prompt_lens, keep=True)
    lens = list(prompt_lens)
    while True:
        live = [i for i, x in enumerate(inputs) if lens[i] < len(x)]
        if not live:
            break
        positions, ctx = decode_context([lens[i] + 1 for i in live], [tables[i] for i in live], block_size, device)
        x = torch.stack([inputs[i][lens[i]] for i in live])
        with forward_context(ctx):
            y = step(x, positions)
        for row, i in enumerate(live):
            outs[i].append(y[row:row + 1])
            lens[i] += 1
    return [torch.cat(o) for o in outs]


def num_blocks_for(lengths, block_size: int) -> int:
    return sum(-(-n // block_size) for n in lengths)


def hf_config(arch: str = "Qwen3ForCausalLM", **overrides):
    """The transformers config of the tiny ``arch``, with eager attention (the
    layer tests pass their own causal masks)."""
    config = tiny_hf_config(arch, **overrides)
    config._attn_implementation = "eager"
    return config


def causal_mask(length: int) -> torch.Tensor:
    """Additive causal mask [1, 1, L, L] for HF eager attention."""
    return torch.full((length, length), float("-inf")).triu(1)[None, None]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref|| in float64."""
    ours, ref = ours.double(), ref.double()
    return ((ours - ref).norm() / ref.norm()).item()


def engine_config(arch: str = "Qwen3ForCausalLM", **overrides) -> ModelConfig:
    """Our ModelConfig for the tiny ``arch``, read from the dict HF would save."""
    return ModelConfig.from_dict({**hf_config(arch, **overrides).to_dict(), "architectures": [arch]})


def load_from_hf(ours: nn.Module, hf: nn.Module, packed_modules: dict) -> None:
    """Load an HF module's parameters into ``ours`` (same structure, merged
    projections named by ``packed_modules``) through the checkpoint loader."""
    from engine.model.weight_loading import load_weights

    holder = nn.Module()
    holder.packed_modules = packed_modules
    holder.m = ours
    load_weights(holder, (("m." + n, p.detach()) for n, p in hf.named_parameters()), progress=False)


def load_engine_model(model_dir, tp=None, device="cpu", dtype=None):
    """Our model for a checkpoint directory: config, build, load every tensor."""
    from engine.model.loader import load_checkpoint
    from engine.model.models.registry import build_model

    config = ModelConfig.from_model_dir(model_dir)
    model = build_model(config, device, dtype, tp)
    load_checkpoint(model, model_dir, progress=False)
    return model


def all_logits_step(model):
    """A ``run_paged`` step returning the logits of every token."""
    return lambda ids, positions: model.compute_logits(model(ids, positions))


QWEN3_8B = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
)


def random_qwen3_8b_pair(device="cuda", dtype=torch.bfloat16, seed: int = 0):
    """HF's Qwen3ForCausalLM at full Qwen3-8B size with random weights (HF's
    init, norms 1 + 0.1*randn), built on ``device``, and our model holding the
    same weights (loaded through the checkpoint loader).

    HF is built under ``dtype`` as the default dtype, as ``from_pretrained``
    does, never by ``.to(dtype)``: that would also round its rotary
    ``inv_freq`` buffer to bf16 (2% error in q/k after RoPE at position 5,
    growing with position) and make HF a wrong reference."""
    import transformers

    from engine.model.models.registry import build_model, creating_in
    from engine.model.weight_loading import load_weights

    torch.manual_seed(seed)
    hf_cfg = transformers.Qwen3Config(**QWEN3_8B)
    with creating_in(dtype, device):
        hf = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    assert hf.model.rotary_emb.inv_freq.dtype == torch.float32
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p, dtype=torch.float32))
    config = ModelConfig.from_dict({**hf_cfg.to_dict(), "architectures": ["Qwen3ForCausalLM"]})
    ours = build_model(config, device, dtype)
    load_weights(ours, ((n, p.detach()) for n, p in hf.named_parameters()), progress=False)
    return hf, ours


class OpCounter(TorchDispatchMode):
    """Counts what a step does: aten ops (``counts``), those dispatched by model
    code outside the kernel interface (``model_ops``; a CPU reference kernel may
    reshape freely), calls through that interface (``kernel_calls``, by name), and reads
    of tensor values on the host (``host_reads``: item / tolist / numpy / cpu, which no
    dispatch counter sees). Use with ``count_step``."""

    def __init__(self):
        super().__init__()
        self.counts, self.model_ops, self.kernel_calls, self.host_reads, self.in_kernel = {}, {}, {}, [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        if not self.in_kernel:
            self.model_ops[name] = self.model_ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def count_step(fn, monkeypatch) -> OpCounter:
    """Run ``fn()`` (no grad) under an OpCounter, with every public kernel call (``engine.model.kernels``
    and its FP8 ops, ``engine.model.kernels.fp8``) marked and every host read of a tensor recorded."""
    from engine.model import kernels
    from engine.model.kernels import fp8

    counter = OpCounter()
    for module, name in [(m, n) for m in (kernels, fp8) for n in m.__all__]:
        real = getattr(module, name)

        def inside(*args, _real=real, _name=name, **kwargs):
            counter.kernel_calls[_name] = counter.kernel_calls.get(_name, 0) + 1
            outer, counter.in_kernel = counter.in_kernel, True  # an op may call another (FP8 shape checks)
            try:
                return _real(*args, **kwargs)
            finally:
                counter.in_kernel = outer
        monkeypatch.setattr(module, name, inside)
    for method in ("item", "tolist", "numpy", "cpu"):
        real = getattr(torch.Tensor, method)

        def read(self, *args, _real=real, _method=method, **kwargs):
            counter.host_reads.append(_method)
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, method, read)
    with torch.no_grad(), counter:
        fn()
    return counter


def decode_step_ops(model, monkeypatch) -> OpCounter:
    """What one decode step of ``model`` does (``count_step``): two sequences prefilled (7 and 3
    tokens, block size 16, the KV cache bound here), then one decode token each."""
    from engine.model.attention_context import forward_context
    from engine.worker.kv_cache import bind_kv_cache

    bind_kv_cache(model, 4, 16, torch.float32, "cpu")
    positions, ctx = prefill_context([7, 3], [0, 0], [[0], [1]], 16, "cpu")
    with forward_context(ctx), torch.no_grad():
        model(torch.arange(2, 12), positions)
    positions, ctx = decode_context([8, 4], [[0], [1]], 16, "cpu")
    with forward_context(ctx):
        return count_step(lambda: model.compute_logits(model(torch.tensor([5, 6]), positions)), monkeypatch)


def assert_no_host_sync_and_no_copies(ops: OpCounter) -> None:
    """The decode-step eager gate: no host read of a device value anywhere
    (kernels included) and no clone or dtype/device copy in model code."""
    assert ops.host_reads == [], ops.host_reads
    for op in ("item", "_local_scalar_dense"):
        assert ops.counts.get(op, 0) == 0, (op, ops.counts)
    for op in ("clone", "_to_copy", "copy_"):
        assert ops.model_ops.get(op, 0) == 0, (op, ops.model_ops)


class HostOpRecorder(TorchDispatchMode):
    """Records the aten ops our wrappers issue; ops issued by Triton's interpreter while it copies
    data in and out of its CPU emulation are not the wrappers' and are left out."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and "triton/runtime/interpreter" not in frame.f_code.co_filename:
            frame = frame.f_back
        if frame is None:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

"""Eager-gate rules measured at run time over whole-model steps."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import kernels
from engine.attention_context import decode_context, prefill_context, reset_context, set_context
from engine.kv_cache import bind_kv_cache
from phases.harness import load_engine_model


class OpCounter(TorchDispatchMode):
    """Counts aten ops; ``model_ops`` counts only those dispatched by model
    code, outside the kernel interface (whose CPU reference may reshape freely)."""

    def __init__(self):
        super().__init__()
        self.counts, self.model_ops, self.in_kernel = {}, {}, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        if not self.in_kernel:
            self.model_ops[name] = self.model_ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def mark_kernel_calls(monkeypatch, counter: OpCounter) -> None:
    for name in kernels.__all__:
        real = getattr(kernels, name)

        def inside(*args, _real=real, **kwargs):
            counter.in_kernel = True
            try:
                return _real(*args, **kwargs)
            finally:
                counter.in_kernel = False
        monkeypatch.setattr(kernels, name, inside)


def model_and_prefill(tiny_checkpoint):
    model = load_engine_model(tiny_checkpoint("Qwen3ForCausalLM", seed=11))
    bind_kv_cache(model, 4, 16, torch.float32, "cpu")
    positions, ctx = prefill_context([7, 3], [0, 0], [[0], [1]], 16, "cpu")
    set_context(ctx)
    with torch.no_grad():
        model(torch.arange(2, 12), positions)
    reset_context()
    return model


def count_decode_ops(model, monkeypatch) -> OpCounter:
    """Aten ops dispatched by one decode step (inputs and context built before)."""
    positions, ctx = decode_context([8, 4], [[0], [1]], 16, "cpu")
    ids = torch.tensor([5, 6])
    counter = OpCounter()
    mark_kernel_calls(monkeypatch, counter)
    set_context(ctx)
    try:
        with torch.no_grad(), counter:
            model.compute_logits(model(ids, positions))
    finally:
        reset_context()
    return counter


def test_decode_step_has_no_host_sync_and_no_clone(tiny_checkpoint, monkeypatch):
    """No device-to-host read anywhere in a decode step (kernels included), and
    no clone or dtype/device copy in the model's own code."""
    ops = count_decode_ops(model_and_prefill(tiny_checkpoint), monkeypatch)
    for op in ("item", "_local_scalar_dense"):
        assert ops.counts.get(op, 0) == 0, (op, ops.counts)
    for op in ("clone", "_to_copy", "copy_"):
        assert ops.model_ops.get(op, 0) == 0, (op, ops.model_ops)


def test_one_gemm_each_for_qkv_o_gate_up_and_down(tiny_checkpoint, monkeypatch):
    """Per layer exactly four GEMMs (merged QKV, o_proj, merged gate-up,
    down_proj), plus one for the LM head."""
    model = model_and_prefill(tiny_checkpoint)
    counts = count_decode_ops(model, monkeypatch).model_ops
    assert counts.get("mm", 0) + counts.get("addmm", 0) == 4 * model.config.num_hidden_layers + 1, counts

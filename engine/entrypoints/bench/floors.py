"""Same-run references: what this device and this host can do with no model code, measured in the
process that measures the engine, so a figure can be stated as a ratio to them.

Device floors, for a preset's dense shapes (random weights, cuBLAS only):

- ``copy_gb_s``: ``dst.copy_(src)`` of a ``copy_bytes`` buffer, read + write bytes per second,
  timed eagerly with CUDA events (a copy captured in a CUDA graph becomes a memcpy node that
  may run on the copy engines, well below what a kernel reaches);
- ``matmul_chain_tok_s``: one B=1 token through a CUDA-graphed chain of plain matmuls over the
  preset's decoder linears (qkv, o, gate_up, down per layer) and its LM head: a decode step
  built from cuBLAS linears with no attention or norms;
- ``prefill_gemm_tok_s``: the same chain for a ``prefill_len``-token prompt (LM head on the
  last row only): prefill at the GEMM throughput cuBLAS reaches on these shapes.

Host reference (``host_ref_us``): host microseconds to dispatch one unit of a fixed mix of small
device ops (a cuBLAS GEMV, an elementwise op and, on CUDA, a trivial Triton kernel through
Triton's own launch path), the kind of work an eager decode step is made of. It is a property of
the host (CPU, Python, driver), not of our code.

On a CPU device the same code runs on small buffers with wall-clock timing, to check the path.
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

REFERENCE_FIGURES: dict[str, tuple[str, bool]] = {  # name: (unit, higher is better)
    "copy_gb_s": ("GB/s", True),
    "matmul_chain_tok_s": ("tok/s", True),
    "prefill_gemm_tok_s": ("tok/s", True),
    "host_ref_us": ("us", False),
}


def dense_linear_shapes(config: dict) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """([(out, in)] of one decoder layer's linears: qkv, o, gate_up, down), (vocab, hidden) of the LM head."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
             (hidden, inter)]
    return layer, (config["vocab_size"], hidden)


def elapsed_ms(fn: Callable[[], object], repeats: int, device: torch.device, graph: bool = True) -> float:
    """Median ms of one call of ``fn``: on CUDA a replay of it captured in a CUDA graph (or, with
    ``graph=False``, an eager call) between CUDA events; on a CPU, wall clock."""
    fn()  # warm-up (and, on CUDA, the allocations a capture must not make)
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)
    run = fn
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        run = captured.replay
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_gb_s(copy_bytes: int, repeats: int, device: torch.device) -> float:
    """Device copy bandwidth: (read + write bytes) / s of ``dst.copy_(src)``, ``copy_bytes`` each, eager."""
    src = torch.empty(copy_bytes // 8, dtype=torch.float64, device=device)
    dst = torch.empty_like(src)
    ms = elapsed_ms(lambda: dst.copy_(src), repeats, device, graph=False)
    return 2 * src.numel() * 8 / ms / 1e6


def device_floors(config: dict, prefill_len: int, copy_bytes: int, repeats: int, device: torch.device,
                  dtype: torch.dtype) -> dict:
    """The copy, decode-chain and prefill-GEMM floors of ``config``'s dense shapes on ``device``
    (random weights, freed on return), with what they were computed from."""
    bandwidth = copy_gb_s(copy_bytes, repeats, device)  # first: its buffers are freed before the weights exist
    layer, head = dense_linear_shapes(config)
    gen = torch.Generator(device).manual_seed(0)
    weights = [[torch.randn(shape, generator=gen, dtype=dtype, device=device) * 0.02 for shape in layer]
               for _ in range(config["num_hidden_layers"])]
    lm_head = torch.randn(head, generator=gen, dtype=dtype, device=device) * 0.02
    weight_bytes = (sum(w.numel() for ws in weights for w in ws) + lm_head.numel()) * lm_head.element_size()

    def chain(x: torch.Tensor) -> torch.Tensor:
        for qkv, o, gate_up, down in weights:
            h = F.linear(F.linear(x, qkv)[:, :o.shape[1]], o)
            x = F.linear(F.linear(h, gate_up)[:, :down.shape[1]], down)
        return F.linear(x[-1:], lm_head)

    decode_x = torch.randn(1, config["hidden_size"], generator=gen, dtype=dtype, device=device)
    prefill_x = torch.randn(prefill_len, config["hidden_size"], generator=gen, dtype=dtype, device=device)
    decode_ms = elapsed_ms(lambda: chain(decode_x), repeats, device)
    prefill_ms = elapsed_ms(lambda: chain(prefill_x), max(3, repeats // 4), device)
    flops = 2 * prefill_len * sum(o * i for o, i in layer) * config["num_hidden_layers"] + 2 * head[0] * head[1]
    return {"copy_gb_s": bandwidth, "copy_bytes": copy_bytes, "weight_bytes": weight_bytes,
            "copy_floor_tok_s": bandwidth * 1e9 / weight_bytes,
            "matmul_chain_ms": decode_ms, "matmul_chain_tok_s": 1e3 / decode_ms,
            "prefill_len": prefill_len, "prefill_gemm_ms": prefill_ms,
            "prefill_gemm_tok_s": prefill_len / prefill_ms * 1e3, "gemm_tflops": flops / prefill_ms / 1e9}


@functools.cache
def _triton_unit_kernel():
    """A trivial Triton kernel (``out = x + 1`` over one block), launched through Triton's JIT path."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) + 1, mask=offsets < n)

    return add_one


class HostReference:
    """The host reference: a fixed mix of small ops dispatched on ``device``, one unit being
    ``F.linear`` of a [1, 1024] row by a [1024, 1024] matrix (bf16; on a CPU [1, 64] by [64, 64]
    float32, so that dispatch, not arithmetic, is timed), an in-place add and, on CUDA, a trivial
    Triton kernel. ``run(seconds)`` dispatches units for about that long; ``us_per_unit`` is the
    mean host time per unit over every run so far (a mean, like the rates it is set against, so
    that time the host spends elsewhere, under another process's load, counts here as there).
    The time is dispatch only: nothing synchronises (each op takes the GPU a few µs, less than
    its dispatch, so the launch queue never fills), and a run beside an engine step still in
    flight on the GPU does not wait for it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        dtype, width = (torch.bfloat16, 1024) if self.cuda else (torch.float32, 64)
        self.x = torch.randn(1, width, dtype=dtype, device=device)
        self.w = torch.randn(width, width, dtype=dtype, device=device)
        self.y = torch.empty(1, width, dtype=dtype, device=device)
        self.kernel = _triton_unit_kernel() if self.cuda else None
        self.elapsed, self.units = 0.0, 0
        self._unit()  # compiles the Triton kernel, warms cuBLAS
        if self.cuda:
            torch.cuda.synchronize(device)

    def _unit(self) -> None:
        out = F.linear(self.x, self.w)
        out.add_(self.x)
        if self.kernel is not None:
            self.kernel[(1,)](self.x, self.y, self.x.shape[1], BLOCK=self.x.shape[1])

    def run(self, seconds: float) -> None:
        start = time.perf_counter()
        while True:
            for _ in range(10):
                self._unit()
            self.units += 10
            if time.perf_counter() - start >= seconds:
                break
        self.elapsed += time.perf_counter() - start

    @property
    def us_per_unit(self) -> float:
        return 1e6 * self.elapsed / self.units


def host_ref_us(device: torch.device, seconds: float = 1.0) -> float:
    """The host reference measured alone for about ``seconds``: µs per unit."""
    reference = HostReference(device)
    reference.run(seconds)
    return reference.us_per_unit

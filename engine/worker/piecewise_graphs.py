"""Piecewise CUDA graphs: a step that carries prefill chunks replays captured graphs around its
attention, instead of dispatching every op of the model from Python.

A decode step's attention has a fixed shape per batch size, so a whole decode forward is one
graph (``ModelRunner.capture_decode_graphs``). A step with prefill chunks attends over ragged
lengths (``cu_seqlens``, a cached prefix, decode rows beside the chunks), decided per step on the
host. So such a step is captured in pieces, per token count of a ladder (``prefill_graph_sizes``):
everything between two attentions (norms, projections, RoPE and the KV write, the MLP, the
all-reduces) is one graph, and each layer's attention runs eagerly between two replays, on the
step's own attention context (vLLM v1's piecewise design, without torch.compile: the model marks
its attention with ``attention_context.eager_region``). A step of T tokens replays the pieces
of the smallest captured size B >= T; its inputs go to static buffers whose rows T..B are padding
(some earlier step's token ids and positions, cache slot -1: written nowhere), and every eager
region reads and writes rows 0..T only. Rows past T are computed and dropped (each op of a piece
is row-wise, so they never reach a real row).

Memory: every piece of every size is captured on one stream into one private pool (the runner's,
shared with the decode graphs; the caching allocator reuses a freed block only on the stream it
was allocated on). What a replay needs kept across pieces (the attention's inputs, its output
buffer, the final hidden states) is held as a non-owning alias, so the pool takes the blocks
back once the capture's Python references are gone and later pieces and sizes reuse them. That
is safe because the pieces of a size replay in capture order on one stream and no two sizes'
replays interleave; an alias is read only between the replay that writes it and the next replay.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.model.attention_context import splitting_at_eager_regions

log = logging.getLogger(__name__)


def prefill_graph_sizes(limit: int) -> list[int]:
    """The token counts captured for steps with prefill chunks, up to ``limit``: 16, then every 32
    tokens to 512, every 64 to 1,024, every 128 to 2,048, every 256 beyond, and ``limit`` itself
    (empty for 0). A step is padded by fewer than 32 rows up to 512 tokens, where its GEMMs are
    bound by the weights' bytes and rows are nearly free, and by less than 1/8 of its rows beyond."""
    sizes, size = [], 16
    while size < limit:
        sizes.append(size)
        size += 16 if size < 32 else 32 if size < 512 else 64 if size < 1024 else 128 if size < 2048 else 256
    return sizes + [limit] if limit > 0 else []


class _Memory:
    """Memory described by the CUDA array interface (``alias``)."""

    def __init__(self, interface: dict):
        self.__cuda_array_interface__ = interface


def alias(t: torch.Tensor) -> torch.Tensor:
    """A view of CUDA tensor ``t``'s memory that does not keep it allocated (made through the CUDA
    array interface, as an integer tensor of ``t``'s element size viewed back as ``t.dtype``)."""
    itemsize = t.element_size()
    memory = _Memory({"shape": tuple(t.shape), "strides": tuple(s * itemsize for s in t.stride()),
                      "typestr": {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}[itemsize],
                      "data": (t.data_ptr(), False), "version": 3})
    return torch.as_tensor(memory, device=t.device).view(t.dtype)


@dataclass
class Region:
    """An eager region of a captured size: ``fn`` on ``args``' first T rows, its result copied to
    ``out``'s (aliases of the pool's buffers)."""

    fn: Callable[..., torch.Tensor]
    args: tuple[torch.Tensor, ...]
    out: torch.Tensor

    def run(self, num_tokens: int) -> None:
        self.out[:num_tokens].copy_(self.fn(*(a[:num_tokens] for a in self.args)))


@dataclass
class PiecewiseGraph:
    """One captured size: ``pieces[i]`` replays, then ``regions[i]`` runs, ...; the last piece
    leaves the model's output in ``hidden`` (an alias, [size, H])."""

    pieces: list[torch.cuda.CUDAGraph]
    regions: list[Region]
    hidden: torch.Tensor

    def replay(self, num_tokens: int) -> torch.Tensor:
        """The hidden states [num_tokens, H] of the step staged in the static inputs; run inside the
        step's attention context."""
        for piece, region in zip(self.pieces, self.regions):
            piece.replay()
            region.run(num_tokens)
        self.pieces[-1].replay()
        return self.hidden[:num_tokens]


class _Capture:
    """Splits one forward into pieces while it runs (``eager_region`` calls ``split``): the piece
    ends, ``fn`` is kept to run eagerly at every replay on the step's first T rows of ``args``
    (reading the step's attention context then), and an empty buffer, in the pool, is returned for
    the next piece to read, which ``fn``'s result is copied into at replay."""

    def __init__(self, pool):
        self.pool, self.pieces, self.regions = pool, [], []
        self._begin()

    def _begin(self) -> None:
        self.pieces.append(torch.cuda.CUDAGraph())
        self.pieces[-1].capture_begin(pool=self.pool)

    def split(self, fn, args, out_shape, dtype) -> torch.Tensor:
        self.pieces[-1].capture_end()
        self._begin()
        out = torch.empty(out_shape, dtype=dtype, device=args[0].device)  # in the pool, read by the new piece
        self.regions.append(Region(fn, tuple(alias(a) for a in args), alias(out)))
        return out


def _host_sync(run_model: Callable[[int], torch.Tensor], size: int) -> str | None:
    """Why ``run_model(size)`` cannot be captured: the first line of the error of a call that
    synchronizes with the host (``torch.cuda.set_sync_debug_mode("error")``, process-wide while it
    runs), or None. Running out of memory is no such reason: it raises."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_model(size)
        return None
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as error:
        return str(error).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class PiecewiseGraphs:
    """The piecewise graphs of a model on ``device``, one per size of ``sizes``, and their static
    inputs: token ids, positions and cache slots (int64 [max size])."""

    def __init__(self, sizes: list[int], device: torch.device):
        self.sizes = sorted(sizes)
        self.graphs: dict[int, PiecewiseGraph] = {}
        self.input_ids, self.positions, self.slot_mapping = torch.zeros(3, max(sizes), dtype=torch.int64,
                                                                        device=device)
        self.slot_mapping.fill_(-1)
        self.replays = 0
        self.capture_seconds = 0.0

    def size_for(self, num_tokens: int) -> int | None:
        """The size a step of ``num_tokens`` replays (the smallest that holds it), or None (eager)."""
        return next((s for s in self.sizes if s >= num_tokens), None)

    def capture(self, run_model: Callable[[int], torch.Tensor], pool) -> None:
        """Capture every size, largest first, into ``pool``. ``run_model(size) -> hidden [size, H]``
        runs the model on the static inputs' first ``size`` rows under an attention context whose
        ``slot_mapping`` is ``self.slot_mapping[:size]`` (the caller's); it runs once eagerly
        first (compiling kernels and settling per-shape choices outside the capture), then once
        more with CUDA's synchronizing calls made errors: a size whose forward syncs with the host
        (e.g. a float32 MoE's grouped GEMM past 64 tokens reads its group ends) cannot be captured
        and is dropped with a warning (its steps run eagerly). Any other capture failure raises."""
        device, start, failed = self.input_ids.device, time.perf_counter(), {}
        side = torch.cuda.Stream(device)  # one capture stream: each size reuses the blocks the last one freed
        for size in sorted(self.sizes, reverse=True):
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                run_model(size)
                torch.cuda.synchronize(device)
                failed[size] = _host_sync(run_model, size)
                if failed[size] is not None:
                    continue
                capture = _Capture(pool)
                try:
                    with splitting_at_eager_regions(capture.split):
                        hidden = run_model(size)
                    capture.pieces[-1].capture_end()
                except RuntimeError as error:
                    with contextlib.suppress(RuntimeError):  # leave capture mode before raising
                        capture.pieces[-1].capture_end()
                    raise RuntimeError(f"capturing the piecewise graphs of {size} tokens failed ({error}); "
                                       "--prefill-graph-tokens 0 runs steps with prefill chunks eagerly") from error
            torch.cuda.current_stream(device).wait_stream(side)
            self.graphs[size] = PiecewiseGraph(capture.pieces, capture.regions, alias(hidden))
        torch.cuda.synchronize(device)
        self.sizes = sorted(self.graphs)
        self.capture_seconds = time.perf_counter() - start
        failed = {size: reason for size, reason in failed.items() if reason is not None}
        if failed:
            size = max(failed)
            log.warning("piecewise graphs: %d of %d sizes sync with the host, their steps run eagerly (at %d tokens: "
                        "%s)", len(failed), len(failed) + len(self.graphs), size, failed[size])

    def run(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor,
            slot_mapping: torch.Tensor) -> torch.Tensor:
        """The hidden states [T, H] of a step of T = ``len(input_ids)`` tokens replayed at ``size``
        (``size_for(T)``): its inputs staged (padding rows write to slot -1), then the size's
        pieces replayed. Run inside the step's attention context."""
        num_tokens = input_ids.shape[0]
        self.stage(input_ids, positions, slot_mapping, size)
        self.replays += 1
        return self.graphs[size].replay(num_tokens)

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, size: int) -> None:
        """Rows 0..T of the static inputs from the step's (device copies, no host sync); rows T..size
        of ``slot_mapping`` -1, so the padding rows write no KV (their ids and positions are some
        earlier step's: valid values, computed and dropped)."""
        num_tokens = input_ids.shape[0]
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(slot_mapping)
        self.slot_mapping[num_tokens:size].fill_(-1)

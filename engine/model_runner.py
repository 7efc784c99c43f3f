"""ModelRunner: one scheduled batch of sequences -> one forward -> one sampled token each.

The runner owns the model, its KV pool and the step metadata on the device.
Each running sequence owns a row of a persistent device block table, written
only where its block table grew since the last step; decode inputs land in
static device buffers (the phase-11 CUDA graphs capture them). A step's host
inputs are built with a few vectorised torch ops and reach the device in one
copy (pinned, non-blocking on CUDA); no Python loop runs over tokens.
With ``cuda_graphs`` (CUDA; any TP size, every rank capturing the same sizes) decode steps replay CUDA graphs captured
once per batch size of a ladder up to ``max_num_seqs``: a batch is padded to the
next captured size with rows that attend to one token of block 0 (whatever it
holds; their output is dropped) and write nowhere (slot -1). Prefill stays eager; sampling runs after the replay.
Nothing above the runner sees a tensor; nothing below it sees a Sequence.
"""
from __future__ import annotations

import contextlib
import math
import time
from itertools import chain
from pathlib import Path

import torch
from torch import nn

from engine.attention_context import AttentionContext, reset_context, set_context
from engine.config import ModelConfig
from engine.distributed import TPGroup, broadcast_object
from engine.kv_cache import bind_kv_cache, kv_bytes_per_token, plan_num_blocks
from engine.layers.sampler import Sampler
from engine.loader import load_checkpoint
from engine.models.registry import build_model
from engine.sequence import Sequence


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One host -> device copy: pinned and non-blocking on CUDA (the caching host allocator
    keeps the pinned block alive until the copy has run)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def graph_batch_sizes(limit: int) -> list[int]:
    """The captured decode batch sizes: 1, 2, 4, 8, then every multiple of 16, up to ``limit``."""
    return sorted({b for b in (1, 2, 4, 8, *range(16, limit + 1, 16), limit) if b <= limit})


def unique_parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class ModelRunner:
    """Builds the model for ``config`` (``model_class``, default: routed by architecture) on
    ``device`` in ``dtype``, loads ``model_dir``'s weights
    (this rank's shards), then sizes the KV pool once from what memory is left
    (``plan_num_blocks``: ``max_num_seqs x max_model_len`` tokens, capped by
    ``mem_utilization`` of the free device memory minus ``reserve_bytes``) and binds it.

    ``run(seqs, is_prefill) -> list[int]``: one token per sequence, in order (from any thread:
    the runner makes its device current).
    ``release(seq)``: the sequence is finished or preempted; its block-table row is reused.
    """

    def __init__(self, model_dir: str | Path, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 tp: TPGroup, block_size: int, max_num_seqs: int, max_model_len: int,
                 mem_utilization: float = 0.9, reserve_bytes: int = 2 << 30, progress: bool = False,
                 cuda_graphs: bool = False, model_class: type[nn.Module] | None = None):
        self.device, self.dtype, self.tp = device, dtype, tp
        self.block_size = block_size
        start = time.perf_counter()
        self.model = build_model(config, device, dtype, tp, model_class)
        load_checkpoint(self.model, model_dir, progress=progress)
        self.model.eval()
        self.load_seconds = time.perf_counter() - start
        self.weight_bytes = unique_parameter_bytes(self.model)

        free_bytes = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            free_bytes = max(0, torch.cuda.mem_get_info(device)[0] - reserve_bytes)
        num_blocks = plan_num_blocks(kv_bytes_per_token(self.model, dtype), block_size, max_num_seqs, max_model_len,
                                     free_bytes, mem_utilization)
        self.num_blocks = broadcast_object(num_blocks)  # every rank holds the same pool
        self.kv_caches = bind_kv_cache(self.model, self.num_blocks, block_size, dtype, device)
        self.sampler = Sampler(tp)

        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        # one row per running sequence, plus the padding row (all block 0) graph padding reads
        self.pad_row = max_num_seqs
        self.block_tables = torch.zeros(max_num_seqs + 1, self.max_blocks_per_seq, dtype=torch.int32, device=device)
        self._row_of: dict[str, int] = {}
        self._blocks_on_device: dict[str, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        # static decode inputs: token ids, positions, block-table rows; and the gathered tables
        self.decode_inputs = torch.zeros(3, max_num_seqs, dtype=torch.int64, device=device)
        # their host staging buffer (pinned on CUDA) and the event of its last copy to the device
        self._decode_staging = torch.zeros(3, max_num_seqs, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._staging_copied = torch.cuda.Event() if device.type == "cuda" else None
        self.decode_tables = torch.zeros(max_num_seqs, self.max_blocks_per_seq, dtype=torch.int32, device=device)
        self._greedy = dict(
            temperatures=torch.zeros(max_num_seqs, device=device), top_ks=torch.zeros(max_num_seqs, dtype=torch.int64,
                                                                                      device=device),
            top_ps=torch.ones(max_num_seqs, device=device), seeds=torch.zeros(max_num_seqs, dtype=torch.int64,
                                                                               device=device),
            steps=torch.zeros(max_num_seqs, dtype=torch.int64, device=device))
        self._no_rows = torch.zeros(0, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # batch size -> (graph, logits)
        self.graph_replays = 0
        if cuda_graphs:
            if device.type != "cuda":
                raise ValueError("CUDA-graph decode needs a CUDA device")
            limit = min(max_num_seqs, getattr(self.model, "max_graph_batch", max_num_seqs))
            self.capture_decode_graphs(graph_batch_sizes(limit))

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.kv_caches)

    def _on_device(self):
        """Make this runner's GPU current for the caller's thread (a new thread starts on cuda:0)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        with self._on_device():
            return self._run(seqs, is_prefill)

    def _run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        self._sync_block_tables(seqs)
        if is_prefill:
            input_ids, positions, ctx, last = self.prepare_prefill(seqs)
            logits = self._forward(input_ids, positions, ctx, last)
        elif self.graphs and len(seqs) <= max(self.graphs):
            size = min(b for b in self.graphs if b >= len(seqs))
            self._stage_decode(seqs, size)
            graph, graph_logits = self.graphs[size]
            graph.replay()
            self.graph_replays += 1
            logits = graph_logits[:len(seqs)]
        else:
            logits = self._forward(*self.prepare_decode(seqs))
        return self.sample(logits, seqs).tolist()

    def _forward(self, input_ids, positions, ctx: AttentionContext, last: torch.Tensor | None = None):
        """Logits of the model under ``ctx`` (of the tokens at ``last`` when given, else every row)."""
        set_context(ctx)
        try:
            hidden = self.model(input_ids, positions)
        finally:
            reset_context()
        return self.model.compute_logits(hidden if last is None else hidden.index_select(0, last))

    def release(self, seq: Sequence) -> None:
        """Forget a finished or preempted sequence's block-table row (no-op if it holds none);
        a preempted sequence gets a fresh row, written from its new table, when it runs again."""
        row = self._row_of.pop(seq.request_id, None)
        if row is not None:
            self._free_rows.append(row)
            del self._blocks_on_device[seq.request_id]

    def _sync_block_tables(self, seqs: list[Sequence]) -> None:
        """Give new sequences a row and write every block appended since the last step
        into the device table: one copy of (row, column, block) triples, one index_put."""
        rows, cols, blocks = [], [], []
        for seq in seqs:
            rid = seq.request_id
            row = self._row_of.get(rid)
            if row is None:
                if not self._free_rows:
                    raise RuntimeError(f"more running sequences than block-table rows ({self.block_tables.shape[0]})")
                row = self._row_of[rid] = self._free_rows.pop()
                self._blocks_on_device[rid] = 0
            known, table = self._blocks_on_device[rid], seq.block_table
            if len(table) > known:
                rows.append([row] * (len(table) - known))
                cols.append(range(known, len(table)))
                blocks.append(table[known:])
                self._blocks_on_device[rid] = len(table)
        if rows:
            update = torch.tensor([list(chain.from_iterable(part)) for part in (rows, cols, blocks)], dtype=torch.int64)
            update = to_device(update, self.device)
            self.block_tables[update[0], update[1]] = update[2].to(torch.int32)

    def _slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat cache slots (int64) of tokens at ``positions`` of the sequences in table ``rows``."""
        blocks = self.block_tables[rows, positions // self.block_size].long()
        return blocks * self.block_size + positions % self.block_size

    def prepare_prefill(self, seqs: list[Sequence]):
        """(input_ids [T], positions [T], context, index of each sequence's last token [B]).

        Each sequence runs its scheduled chunk: ``num_scheduled_tokens`` tokens from
        ``num_computed_tokens`` on; the tokens before it (prefix-cache hits, earlier chunks)
        already have K/V. When any sequence has such a computed prefix, ``prefill_kv_slots``
        lists the cache slots of every context token up to the chunk's end."""
        computed = torch.tensor([s.num_computed_tokens for s in seqs], dtype=torch.int64)
        q_lens = torch.tensor([s.num_scheduled_tokens for s in seqs], dtype=torch.int64)
        lens = computed + q_lens
        rows = torch.tensor([self._row_of[s.request_id] for s in seqs], dtype=torch.int64)
        cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)])
        cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        num_tokens = int(cu_q[-1])
        ids = torch.tensor(list(chain.from_iterable(
            s.token_ids[s.num_computed_tokens:s.num_computed_tokens + s.num_scheduled_tokens] for s in seqs)),
            dtype=torch.int64)
        positions = torch.arange(num_tokens) - torch.repeat_interleave(cu_q[:-1] - computed, q_lens)
        token_rows = torch.repeat_interleave(rows, q_lens)
        parts = [ids, positions, token_rows, cu_q, cu_k]
        any_computed = bool(computed.any())
        if any_computed:
            context_positions = torch.arange(int(cu_k[-1])) - torch.repeat_interleave(cu_k[:-1], lens)
            parts += [context_positions, torch.repeat_interleave(rows, lens)]
        sizes = [p.numel() for p in parts]
        on_device = to_device(torch.cat(parts), self.device).split(sizes)
        ids_d, positions_d, rows_d, cu_q_d, cu_k_d = on_device[:5]
        ctx = AttentionContext(
            is_prefill=True,
            slot_mapping=self._slots(rows_d, positions_d),
            cu_seqlens_q=cu_q_d.to(torch.int32),
            cu_seqlens_k=cu_k_d.to(torch.int32),
            max_seqlen_q=int(q_lens.max()),
            max_seqlen_k=int(lens.max()),
            prefill_kv_slots=self._slots(on_device[6], on_device[5]) if any_computed else None,
        )
        return ids_d, positions_d, ctx, cu_q_d[1:] - 1

    def prepare_decode(self, seqs: list[Sequence]):
        """(input_ids [B], positions [B], context) in the static decode buffers, the block tables
        cut to the longest context (eager)."""
        self._stage_decode(seqs, len(seqs))
        width = -(-max(s.num_tokens for s in seqs) // self.block_size)
        return self._decode_inputs(len(seqs), width)

    def _stage_decode(self, seqs: list[Sequence], size: int) -> None:
        """Write the step's token ids, positions and table rows into the first ``size`` columns
        of the static ``decode_inputs`` (one host -> device copy); columns past ``len(seqs)``
        are padding: token 0 at position 0 of the padding row."""
        batch = len(seqs)
        if self._staging_copied is not None:
            self._staging_copied.synchronize()  # the previous step's copy has left the staging buffer
        host = self._decode_staging
        host[:2, batch:size] = 0
        host[2, batch:size] = self.pad_row
        host[:, :batch] = torch.tensor([[s.last_token_id for s in seqs], [s.num_tokens - 1 for s in seqs],
                                        [self._row_of[s.request_id] for s in seqs]], dtype=torch.int64)
        self.decode_inputs.copy_(host, non_blocking=True)  # whole buffer: a column slice is not contiguous
        if self._staging_copied is not None:
            self._staging_copied.record(torch.cuda.current_stream(self.device))

    def _decode_inputs(self, size: int, width: int):
        """Device ops only (what a graph captures): the step's context from the staged inputs.
        Padding rows (the padding row's table) write to slot -1 and attend to one token."""
        input_ids, positions, rows = self.decode_inputs[:, :size]
        tables = self.decode_tables[:size]
        torch.index_select(self.block_tables, 0, rows, out=tables)
        slots = torch.where(rows == self.pad_row, -1, self._slots(rows, positions))
        ctx = AttentionContext(is_prefill=False, slot_mapping=slots, block_tables=tables[:, :width],
                               context_lens=(positions + 1).to(torch.int32))
        return input_ids, positions, ctx

    def capture_decode_graphs(self, sizes: list[int]) -> None:
        """Capture one decode graph per batch size (largest first, one shared memory pool), each
        over the full block-table width so any context up to max_model_len replays it."""
        pool = None
        with torch.inference_mode(), self._on_device():
            self._stage_decode([], max(sizes))  # every column padding while capturing
            for size in sorted(sizes, reverse=True):
                def step(size=size):
                    return self._forward(*self._decode_inputs(size, self.max_blocks_per_seq))

                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    step()  # warm-up: compiles kernels, fills the allocator outside the capture
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = step()
                pool = graph.pool()
                self.graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.device)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Token ids [B] for the last-token ``logits`` [B, V] under each sequence's parameters.
        An all-greedy batch is one argmax; otherwise only the sampling rows draw, with the
        candidate count and top-p pass decided here from the host-side parameters."""
        batch = len(seqs)
        params = [s.sampling_params for s in seqs]
        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        if not sampled:
            columns = {name: t[:batch] for name, t in self._greedy.items()}
            return self.sampler(logits, **columns, sampled_rows=self._no_rows)
        floats = torch.tensor([[p.temperature for p in params], [p.top_p for p in params]], dtype=torch.float32)
        ints = torch.tensor([[p.top_k for p in params], [s.seed for s in seqs], [s.num_output_tokens for s in seqs],
                             [0] * batch], dtype=torch.int64)
        ints[3, :len(sampled)] = torch.tensor(sampled)
        floats, ints = to_device(floats, self.device), to_device(ints, self.device)
        top_ks = [params[i].top_k for i in sampled]
        return self.sampler(logits, floats[0], ints[0], floats[1], ints[1], ints[2],
                            sampled_rows=ints[3, :len(sampled)],
                            max_top_k=max(top_ks) if min(top_ks) > 0 else None,
                            use_top_k=max(top_ks) > 0, use_top_p=any(params[i].top_p < 1 for i in sampled))

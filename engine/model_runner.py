"""ModelRunner: one scheduled batch -> one forward -> one sampled token per sequence, launched
without waiting for the device.

The runner owns the model, its KV pool and the step metadata on the device.
Each running sequence owns a row of a persistent device block table (written
only where its block table grew since the last step) and of the sampling
columns (temperature, top-p, top-k, seed; written once when it gets the row).
A step's host inputs are built with a few vectorised torch ops and reach the
device in one copy (pinned, non-blocking on CUDA); no Python loop runs over
tokens. ``launch`` queues the forward and the sampling and returns a
``LaunchedStep`` whose ids reach the host through a non-blocking copy; a
token the previous step sampled (still pending on the host) is fed to this
step on the device, from that step's ids.

A step whose tokens are all decode rows is a decode: each sequence computes one
token, or, speculating, its last token and the tokens drafted after it (a verify
entry: one decode row per token, each at its own position and context length,
so row j attends to the positions up to its own and never to a later draft).
Its inputs land in static device buffers, and with ``cuda_graphs`` (CUDA; any TP
size, every rank capturing the same sizes) it replays a CUDA graph captured once
per row count of a ladder up to ``max_num_seqs x (1 + max_draft_tokens)`` (so one
graph serves every mix of batch size and draft lengths with that many rows): a
step is padded to the next captured size with rows that attend to one token of
block 0 (whatever it holds; their output is dropped) and write nowhere (slot -1).
Any other step is mixed and eager: decode rows first (paged decode attention),
then prefill chunks (varlen attention over any cached prefix). Sampling runs
after the forward, on one logits row per entry (its last token) and then one per
drafted token. Nothing above the runner sees a tensor; nothing below it sees a
Sequence.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
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
from engine.sampling_rows import SamplingPlan, SamplingRows, StepLogprobs
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.staging import to_device

# rows of the decode staging buffer and of ``decode_inputs`` (the graphs read the first three)
IDS, POSITIONS, ROWS, STEPS, MOVE_TO, MOVE_FROM, SAMPLED = range(7)


def graph_batch_sizes(limit: int) -> list[int]:
    """The captured decode batch sizes: 1, 2, 4, 8, then every multiple of 16, up to ``limit``."""
    return sorted({b for b in (1, 2, 4, 8, *range(16, limit + 1, 16), limit) if b <= limit})


def unique_parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class LaunchedStep:
    """A batch whose forward and sampling are queued on the device. ``sampled``: int64
    ``[batch.num_rows]`` on the device, one id per batch entry (meaningless for an entry that
    does not sample), then one per drafted token (the token sampled after it), and
    the logprobs of the entries that asked for them. On CUDA both start towards pinned host
    memory at once (non-blocking, an event records the copies); ``token_ids()`` and
    ``logprobs()`` wait for them."""

    def __init__(self, batch: ScheduledBatch, sampled: torch.Tensor, logprobs: StepLogprobs | None = None):
        self.batch, self.sampled, self._logprobs = batch, sampled, logprobs
        self._index_of: dict[str, int] | None = None
        self._host, self._copied = [sampled], None
        if logprobs is not None:
            self._host += [logprobs.chosen, logprobs.top_values, logprobs.top_ids]
        if sampled.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in self._host]
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(sampled.device))

    def _wait(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def token_ids(self) -> list[int]:
        """The sampled ids on the host (waits for the step and the copy)."""
        self._wait()
        return self._host[0].tolist()

    def logprobs(self) -> dict[str, tuple[float, list[tuple[int, float]]]]:
        """Request id -> (the sampled token's logprob, [(token id, logprob)] of the most likely
        tokens, most likely first), for the requests that asked."""
        if self._logprobs is None:
            return {}
        self._wait()
        chosen, values, ids = (t.tolist() for t in self._host[1:])
        seqs = [self.batch.seqs[entry] for entry in self._logprobs.entries]
        return {seq.request_id: (c, list(zip(i[:seq.sampling_params.logprobs], v[:seq.sampling_params.logprobs])))
                for seq, c, v, i in zip(seqs, chosen, values, ids)}

    @property
    def index_of(self) -> dict[str, int]:
        """Request id -> its entry in the batch."""
        if self._index_of is None:
            self._index_of = {seq.request_id: i for i, seq in enumerate(self.batch.seqs)}
        return self._index_of


@dataclass
class StepPlan:
    """The host side of a step, per sampled row (each entry, then each drafted token): its
    block-table / sampling ``rows``, its sampler ``steps`` (output index); the ``moves`` (entry,
    index into the previous step's ids) of pending input tokens, and the ``sampling`` decided
    from the rows' parameters."""

    rows: list[int]
    steps: list[int]
    moves: list[tuple[int, int]]
    sampling: SamplingPlan

    @property
    def sampled(self) -> list[int]:
        return self.sampling.sampled


class ModelRunner:
    """Builds the model for ``config`` (``model_class``, default: routed by architecture) on
    ``device`` in ``dtype``, loads ``model_dir``'s weights
    (this rank's shards), then sizes the KV pool once from what memory is left
    (``plan_num_blocks``: ``max_num_seqs x max_model_len`` tokens, capped by
    ``mem_utilization`` of the free device memory minus ``reserve_bytes``) and binds it.

    ``launch(batch, previous) -> LaunchedStep``: one token per batch entry and per drafted token,
    queued (from any thread: the runner makes its device current). ``max_draft_tokens``: the most
    tokens a verify entry drafts (speculative decoding; sizes the static decode buffers).
    ``release(seq)``: the sequence is finished or preempted and no step in flight holds it; its
    rows are reused.
    """

    def __init__(self, model_dir: str | Path, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 tp: TPGroup, block_size: int, max_num_seqs: int, max_model_len: int,
                 mem_utilization: float = 0.9, reserve_bytes: int = 2 << 30, progress: bool = False,
                 cuda_graphs: bool = False, model_class: type[nn.Module] | None = None, eos_token_ids=frozenset(),
                 max_draft_tokens: int = 0):
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

        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        # Rows of the block table and the sampling columns: a running sequence holds one until it is
        # released, which for a finished one waits for the step in flight, so up to twice
        # max_num_seqs are held; plus the padding row (all block 0) graph padding reads.
        self.pad_row = 2 * max_num_seqs
        self.block_tables = torch.zeros(self.pad_row + 1, self.max_blocks_per_seq, dtype=torch.int32, device=device)
        max_rows = max_num_seqs * (1 + max_draft_tokens)  # decode rows (and sampled rows) of a decode step
        self.sampling = SamplingRows(self.pad_row + 1, config.vocab_size, max_rows, device, Sampler(tp),
                                     eos_token_ids)
        self._row_of: dict[str, int] = {}
        self._tables_on_device: dict[str, list[int]] = {}  # request id -> its block ids written to its row
        # a verify step's blocks past the accepted tokens are freed and others taken later: the
        # last blocks one draft can reach are compared with the table each step
        self._retaken_blocks = -(-max_draft_tokens // block_size) + 1 if max_draft_tokens else 0
        self._free_rows = list(range(self.pad_row - 1, -1, -1))
        # static decode inputs (rows IDS..SAMPLED) and the gathered block tables
        self.decode_inputs = torch.zeros(SAMPLED + 1, max_rows, dtype=torch.int64, device=device)
        # two host staging buffers (pinned on CUDA), used in turn, and the events of their last copies
        cuda = device.type == "cuda"
        self._decode_staging = [torch.zeros(SAMPLED + 1, max_rows, dtype=torch.int64, pin_memory=cuda)
                                for _ in range(2)]
        self._staging_copied = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._staging_index = 0
        self.decode_tables = torch.zeros(max_rows, self.max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # decode rows -> (graph, logits)
        self.graph_replays = 0
        if cuda_graphs:
            if device.type != "cuda":
                raise ValueError("CUDA-graph decode needs a CUDA device")
            limit = min(max_rows, getattr(self.model, "max_graph_batch", max_rows))
            self.capture_decode_graphs(graph_batch_sizes(limit))

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.kv_caches)

    def _on_device(self):
        """Make this runner's GPU current for the caller's thread (a new thread starts on cuda:0)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue ``batch``'s forward and sampling without waiting for the device. ``previous``:
        the step launched before, whose sampled ids feed the tokens of ``batch`` the host does
        not know yet (required whenever ``batch`` holds such a token)."""
        with self._on_device():
            plan = self.plan(batch, previous)
            run = self._decode_step if batch.is_decode else self._mixed_step
            logits, rows, steps, sampled = run(batch, plan, previous)
            return LaunchedStep(batch, *self.sampling.sample(logits, batch, plan.sampling, rows, steps, sampled))

    def plan(self, batch: ScheduledBatch, previous: LaunchedStep | None) -> StepPlan:
        """The step's host-side inputs; gives new sequences their rows (``_sync_rows``)."""
        steps = [start + n - len(draft) - seq.num_prompt_tokens
                 for seq, start, n, draft in zip(batch.seqs, batch.starts, batch.num_tokens, batch.drafts)]
        rows = self._sync_rows(batch.seqs)
        for i, position in zip(batch.draft_entries, _draft_tokens(batch)[1]):
            rows.append(rows[i])  # a drafted token's row samples the token after it
            steps.append(position + 1 - batch.seqs[i].num_prompt_tokens)
        return StepPlan(rows, steps, self._pending_moves(batch, previous), self.sampling.plan(batch, steps))

    def _forward(self, input_ids, positions, ctx: AttentionContext, last: torch.Tensor | None = None):
        """Logits of the model under ``ctx`` (of the tokens at ``last`` when given, else every row)."""
        set_context(ctx)
        try:
            hidden = self.model(input_ids, positions)
        finally:
            reset_context()
        return self.model.compute_logits(hidden if last is None else hidden.index_select(0, last))

    def release(self, seq: Sequence) -> None:
        """Forget a finished or preempted sequence's rows (no-op if it holds none); a preempted
        sequence gets a fresh row, written from its new table, when it runs again."""
        row = self._row_of.pop(seq.request_id, None)
        if row is not None:
            self._free_rows.append(row)
            del self._tables_on_device[seq.request_id]

    def _sync_rows(self, seqs: list[Sequence]) -> list[int]:
        """Each sequence's row. A new sequence gets one, and its sampling parameters are written
        into the row's sampling columns; every block appended since the last step, or changed since
        (the blocks of rejected drafts are freed, and others taken for the next drafts), is written
        into the device table: one copy of (row, column, block) triples, one index_put."""
        rows, cols, blocks, new = [], [], [], []
        for seq in seqs:
            rid = seq.request_id
            row = self._row_of.get(rid)
            if row is None:
                if not self._free_rows:
                    raise RuntimeError(f"more sequences than block-table rows ({self.pad_row})")
                row = self._row_of[rid] = self._free_rows.pop()
                self._tables_on_device[rid] = []
                new.append((row, seq))
            written, table = self._tables_on_device[rid], seq.block_table
            same = min(len(written), len(table))
            for j in range(max(0, len(written) - self._retaken_blocks), same):
                if table[j] != written[j]:
                    same = j
                    break
            if len(table) > same:
                rows.append([row] * (len(table) - same))
                cols.append(range(same, len(table)))
                blocks.append(table[same:])
            written[same:] = table[same:]
        if rows:
            update = torch.tensor([list(chain.from_iterable(part)) for part in (rows, cols, blocks)], dtype=torch.int64)
            update = to_device(update, self.device)
            self.block_tables[update[0], update[1]] = update[2].to(torch.int32)
        if new:
            self.sampling.write(new)
        return [self._row_of[s.request_id] for s in seqs]

    @staticmethod
    def _pending_moves(batch: ScheduledBatch, previous: LaunchedStep | None) -> list[tuple[int, int]]:
        """(entry, index into ``previous.sampled``) for every entry whose input token is pending
        on the host: ``previous`` sampled it, so it is read from ``previous``'s ids on the device
        (a pending token is always a one-token entry's input)."""
        moves = [i for i, (seq, start) in enumerate(zip(batch.seqs, batch.starts)) if start >= seq.num_known_tokens]
        if not moves:
            return []
        if previous is None:
            raise RuntimeError("the batch feeds tokens the host does not know, but no previous step was given")
        index = previous.index_of
        return [(i, index[batch.seqs[i].request_id]) for i in moves]

    def _slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat cache slots (int64) of tokens at ``positions`` of the sequences in table ``rows``."""
        blocks = self.block_tables[rows, positions // self.block_size].long()
        return blocks * self.block_size + positions % self.block_size

    def _decode_step(self, batch: ScheduledBatch, plan: StepPlan, previous: LaunchedStep | None):
        """A decode step through the static buffers: the graph of the next captured size, else the
        eager forward with the block tables cut to the longest context. Returns (logits [R, V] of
        its R decode rows, which are its sampled rows, rows, steps, sampled rows) on the device."""
        n = size = len(plan.rows)
        graph = None
        if self.graphs and n <= max(self.graphs):
            size = min(b for b in self.graphs if b >= n)
            graph, graph_logits = self.graphs[size]
        self._stage_decode(batch, plan, size, previous)
        if graph is not None:
            graph.replay()
            self.graph_replays += 1
            logits = graph_logits[:n]
        else:
            longest = max(start + num for start, num in zip(batch.starts, batch.num_tokens))
            logits = self._forward(*self._decode_inputs(n, -(-longest // self.block_size)))
        staged = self.decode_inputs
        return logits, staged[ROWS, :n], staged[STEPS, :n], staged[SAMPLED, :len(plan.sampled)]

    def _stage_decode(self, batch: ScheduledBatch, plan: StepPlan, size: int, previous: LaunchedStep | None) -> None:
        """Write the step into ``decode_inputs`` with one host -> device copy (from the staging
        buffer not used by the previous step): token ids, positions, table rows and sampling steps
        of its decode rows (each entry's last token, then its drafted tokens) in the first ``size``
        columns (columns past the rows are padding: token 0 at position 0 of the padding row), the
        pending-token moves and the sampled rows. Then the pending tokens are read from
        ``previous``'s ids, on the device."""
        n = len(plan.rows)
        self._staging_index ^= 1
        host, copied = self._decode_staging[self._staging_index], self._staging_copied[self._staging_index]
        if copied is not None:
            copied.synchronize()  # this buffer's copy of two steps ago has left it
        moves, sampled = plan.moves, plan.sampled
        moved = {entry for entry, _ in moves}
        host[IDS:ROWS, n:size] = 0
        host[ROWS, n:size] = self.pad_row
        draft_ids, draft_positions = _draft_tokens(batch)
        ids = [0 if i in moved else _token_at(seq, start) for i, (seq, start) in enumerate(zip(batch.seqs,
                                                                                             batch.starts))]
        host[IDS:MOVE_TO, :n] = torch.tensor([ids + draft_ids, batch.starts + draft_positions, plan.rows, plan.steps],
                                             dtype=torch.int64).view(4, n)
        if moves:
            host[MOVE_TO:SAMPLED, :len(moves)] = torch.tensor(moves, dtype=torch.int64).T
        if sampled:
            host[SAMPLED, :len(sampled)] = torch.tensor(sampled, dtype=torch.int64)
        self.decode_inputs.copy_(host, non_blocking=True)  # whole buffer: a column slice is not contiguous
        if copied is not None:
            copied.record(torch.cuda.current_stream(self.device))
        if moves:
            staged = self.decode_inputs
            staged[IDS].index_put_((staged[MOVE_TO, :len(moves)],),
                                   previous.sampled.index_select(0, staged[MOVE_FROM, :len(moves)]))

    def _decode_inputs(self, size: int, width: int):
        """Device ops only (what a graph captures): the step's context from the staged inputs.
        Padding rows (the padding row's table) write to slot -1 and attend to one token."""
        input_ids, positions, rows = self.decode_inputs[:ROWS + 1, :size]
        tables = self.decode_tables[:size]
        torch.index_select(self.block_tables, 0, rows, out=tables)
        slots = torch.where(rows == self.pad_row, -1, self._slots(rows, positions))
        ctx = AttentionContext(is_prefill=False, slot_mapping=slots, block_tables=tables[:, :width],
                               context_lens=(positions + 1).to(torch.int32))
        return input_ids, positions, ctx

    def _mixed_step(self, batch: ScheduledBatch, plan: StepPlan, previous: LaunchedStep | None):
        """A step with prefill chunks: (logits [R, V] of its sampled rows, rows, steps, sampled
        rows) on the device, the forward eager over ``prepare_mixed``'s inputs."""
        input_ids, positions, ctx, last, rows, steps, sampled = self.prepare_mixed(batch, plan, previous)
        return self._forward(input_ids, positions, ctx, last), rows, steps, sampled

    def prepare_mixed(self, batch: ScheduledBatch, plan: StepPlan, previous: LaunchedStep | None):
        """The device inputs of a mixed step, from one host -> device copy: (input_ids [T],
        positions [T], context, the token of each sampled row [R], rows [R], steps [R], sampled
        rows [S]).

        Entry i runs ``num_tokens[i]`` tokens from ``starts[i]`` on. The leading entries whose
        tokens are all sampled (decodes; speculating, their drafted tokens too) are the context's
        decode rows (paged decode over their block-table rows): each entry's last token, then the
        drafted tokens. The rest are prefill chunks (varlen attention; when any chunk has a
        computed prefix, ``prefill_kv_slots`` lists the cache slots of every context token of
        every chunk). The sampled rows are each entry's last token (in entry order), then each
        drafted token. Pending input tokens are read from ``previous``'s ids on the device."""
        seqs, starts, nums, moves = batch.seqs, batch.starts, batch.num_tokens, plan.moves
        num_decode = next((i for i, (n, d) in enumerate(zip(nums, batch.drafts)) if n != 1 + len(d)), len(nums))
        draft_ids, draft_positions = _draft_tokens(batch)
        num_rows = num_decode + len(draft_ids)  # decode rows
        moved = {entry for entry, _ in moves}
        decode_ids = [0 if i in moved else _token_at(seq, start)
                      for i, (seq, start) in enumerate(zip(seqs[:num_decode], starts))]
        prefill_ids = chain.from_iterable(_known_tokens(seq, start, n) for seq, start, n in
                                          zip(seqs[num_decode:], starts[num_decode:], nums[num_decode:]))
        ids = torch.tensor(decode_ids + draft_ids + list(prefill_ids), dtype=torch.int64)
        starts_p = torch.tensor(starts[num_decode:], dtype=torch.int64)
        q_lens = torch.tensor(nums[num_decode:], dtype=torch.int64)
        cu_pq = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)])
        positions = torch.cat([torch.tensor(starts[:num_decode] + draft_positions, dtype=torch.int64),
                               torch.arange(int(cu_pq[-1])) - torch.repeat_interleave(cu_pq[:-1] - starts_p, q_lens)])
        rows_t = torch.tensor(plan.rows, dtype=torch.int64)  # per sampled row: entries, then drafted tokens
        decode_rows = torch.cat([rows_t[:num_decode], rows_t[len(batch):]])
        token_rows = torch.cat([decode_rows, torch.repeat_interleave(rows_t[num_decode:len(batch)], q_lens)])
        last = torch.cat([torch.arange(num_decode), num_rows + cu_pq[1:] - 1,
                          torch.arange(num_decode, num_rows)])
        prefill_lens = starts_p + q_lens
        cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), prefill_lens.cumsum(0)])
        move_to = torch.tensor([entry for entry, _ in moves], dtype=torch.int64)  # a decode's row is its entry
        move_from = torch.tensor([src for _, src in moves], dtype=torch.int64)
        steps, sampled = torch.tensor(plan.steps, dtype=torch.int64), torch.tensor(plan.sampled, dtype=torch.int64)
        parts = [ids, positions, token_rows, last, rows_t, steps, sampled, cu_pq, cu_k, move_to, move_from]
        any_computed = bool(starts_p.any())
        if any_computed:
            parts += [torch.arange(int(cu_k[-1])) - torch.repeat_interleave(cu_k[:-1], prefill_lens),
                      torch.repeat_interleave(rows_t[num_decode:len(batch)], prefill_lens)]
        on_device = to_device(torch.cat(parts), self.device).split([p.numel() for p in parts])
        ids_d, positions_d, token_rows_d, last_d, rows_d, steps_d, sampled_d, cu_pq_d, cu_k_d = on_device[:9]
        to_d, from_d = on_device[9:11]
        if moves:
            ids_d.index_put_((to_d,), previous.sampled.index_select(0, from_d))
        width = -(-max((start + n for start, n in zip(starts[:num_decode], nums[:num_decode])), default=0)
                  // self.block_size)  # blocks of the longest decode context
        ctx = AttentionContext(
            is_prefill=True,
            num_decode_tokens=num_rows,
            slot_mapping=self._slots(token_rows_d, positions_d),
            cu_seqlens_q=cu_pq_d.to(torch.int32),
            cu_seqlens_k=cu_k_d.to(torch.int32),
            max_seqlen_q=int(q_lens.max()),
            max_seqlen_k=int(prefill_lens.max()),
            prefill_kv_slots=self._slots(on_device[12], on_device[11]) if any_computed else None,
            block_tables=self.block_tables.index_select(0, token_rows_d[:num_rows])[:, :width] if num_rows else None,
            context_lens=(positions_d[:num_rows] + 1).to(torch.int32) if num_rows else None,
        )
        return ids_d, positions_d, ctx, last_d, rows_d, steps_d, sampled_d

    def capture_decode_graphs(self, sizes: list[int]) -> None:
        """Capture one decode graph per batch size (largest first, one shared memory pool), each
        over the full block-table width so any context up to max_model_len replays it."""
        pool = None
        with torch.inference_mode(), self._on_device():
            self._stage_decode(ScheduledBatch(), StepPlan([], [], [], SamplingPlan([], [], [], [], 0)), max(sizes),
                               None)  # every column padding
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


def _draft_tokens(batch: ScheduledBatch) -> tuple[list[int], list[int]]:
    """The batch's drafted tokens and their positions, in entry order (entry i's draft j sits at
    ``starts[i] + 1 + j``, after the entry's last token)."""
    ids = [token for draft in batch.drafts for token in draft]
    positions = [start + 1 + j for start, draft in zip(batch.starts, batch.drafts) for j in range(len(draft))]
    return ids, positions


def _token_at(seq: Sequence, position: int) -> int:
    """``seq``'s known token at ``position`` (a decode row's input: its newest token, or a
    one-token prefill chunk's)."""
    if position == seq.num_known_tokens - 1:
        return seq.last_token_id
    prompt = seq.prompt_token_ids
    return prompt[position] if position < len(prompt) else seq.output_token_ids[position - len(prompt)]


def _known_tokens(seq: Sequence, start: int, num: int) -> list[int]:
    """``seq``'s tokens ``[start, start + num)``, all known on the host (a prefill chunk's)."""
    prompt = seq.prompt_token_ids
    return prompt[start:start + num] if start + num <= len(prompt) else seq.token_ids[start:start + num]

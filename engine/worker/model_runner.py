"""ModelRunner: one scheduled batch -> one forward -> one sampled token per logits row, launched
without waiting for the device.

The runner owns the model, its KV pool and the step metadata on the device. Each running
sequence holds a row of the persistent input batch (``InputBatch``: its block table, written only
where the table changed since the last step, and its sampling state, written once, when it gets
the row): its ``table_row``. A step is built once,
by ``prepare``, into a ``ForwardBatch`` (named device tensors) with a few vectorised torch ops
and one host -> device copy (pinned, non-blocking on CUDA); no Python loop runs over tokens.
``forward`` runs it; ``launch`` queues both and the sampling and returns a ``LaunchedStep`` whose
ids reach the host through a non-blocking copy. A token the previous step sampled (still pending
on the host) is fed to this step on the device, from that step's ids.

A step whose tokens are all decode tokens is a decode: each sequence computes one token, or,
speculating, its last token and the tokens drafted after it (a verify entry: one decode token
per position, each with its own context length, so the token of draft j attends to the
positions up to its own and never to a later draft). Its inputs land in static device buffers
(``DecodeInputs``), and with ``cuda_graphs`` (CUDA; any TP size, every rank capturing the same
sizes) it replays a CUDA graph captured once per decode-token count of a ladder up to
``max_num_seqs x (1 + max_draft_tokens)`` (one graph serves every mix of batch size and draft
lengths with that many tokens): a step is padded to the next captured size with tokens that
attend to one token of block 0 (whatever it holds; their output is dropped) and write nowhere
(slot -1). Any other step is mixed: decode tokens first (paged decode attention), then prefill
chunks (varlen attention over any cached prefix); with ``prefill_graph_tokens`` (CUDA) a mixed
step of up to that many tokens replays the piecewise graphs of the next captured token count
(``engine.worker.piecewise_graphs``: everything but the attention captured, the attention run eagerly
between the pieces), a longer one runs eagerly. Sampling runs after the forward, on one
logits row per entry (its last token) and then one per drafted token. Requests asking for
prompt logprobs get them from their chunks' other tokens (``engine.worker.prompt_logprobs``: a mixed
step computes logits rows for those tokens after the sampled ones; in a decode step they are
one-token chunks, whose row is their entry's). Nothing above the runner sees a tensor; nothing
below it sees a Sequence.
"""
from __future__ import annotations

import contextlib
import math
import time
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.distributed import TPGroup, broadcast_object
from engine.model.attention_context import AttentionContext, forward_context
from engine.model.layers.sampler import Sampler
from engine.model.loader import load_checkpoint
from engine.model.models.registry import build_model
from engine.scheduling.sequence import Sequence
from engine.scheduling.step import ScheduledBatch
from engine.worker.device_copy import to_device_packed
from engine.worker.drafting import MODEL_METHODS, ModelDrafter
from engine.worker.forward_batch import DecodeInputs, ForwardBatch, SamplingPlan
from engine.worker.input_batch import InputBatch
from engine.worker.kv_cache import bind_kv_cache, free_memory_bytes, kv_bytes_per_token, plan_num_blocks
from engine.worker.piecewise_graphs import PiecewiseGraphs, prefill_graph_sizes
from engine.worker.prompt_logprobs import (
    gather_prompt_logprobs,
    plan_prompt_logprobs,
)
from engine.worker.runner import LaunchedStep, unique_parameter_bytes
from engine.worker.sampling import BatchSampler

if TYPE_CHECKING:
    from engine.core.engine_config import EngineConfig


def graph_batch_sizes(limit: int) -> list[int]:
    """The captured decode batch sizes: 1, 2, 4, 8, then every multiple of 16, up to ``limit``,
    and ``limit`` itself (a batch of ``max_num_seqs`` replays a graph of its own size)."""
    return sorted({b for b in (1, 2, 4, 8, *range(16, limit + 1, 16), limit) if b <= limit})


class ModelRunner:
    """Built from the resolved ``EngineConfig`` (``config``; ``tp`` this rank's group,
    ``eos_token_ids`` the sampler's stop tokens): builds ``config.model.model_class`` on
    ``config.parallel.device`` in ``config.model.dtype``, loads ``config.model.model_dir``'s weights
    (this rank's shards), then sizes the KV pool once from what memory is left
    (``plan_num_blocks``: ``max_num_seqs x max_model_len`` tokens, capped by ``config.cache.budget_bytes``,
    else by ``config.cache.mem_utilization`` of the memory free after loading, the device's or on CPU the
    host's, minus ``reserve_bytes``) and binds it,
    in ``config.cache.dtype`` (None: the model's dtype; e4m3 for an FP8 KV cache).

    ``launch(batch, previous) -> LaunchedStep``: one token per batch entry and per drafted token,
    queued (from any thread: the runner makes its device current); ``prepare(batch, previous) ->
    ForwardBatch`` and ``forward(step) -> logits`` are its two halves.
    ``config.speculative.max_draft_tokens``: the most tokens a verify entry drafts (speculative
    decoding; sizes the static decode buffers).
    ``release(seq)``: the sequence is finished or preempted and no step in flight holds it; its
    rows are reused. Decode steps replay CUDA graphs with ``config.parallel.cuda_graphs``; steps
    with prefill chunks of up to ``config.parallel.prefill_graph_tokens`` tokens replay piecewise
    CUDA graphs (0: none); every graph is captured into one memory pool (``graph_pool``);
    ``graph_replays`` counts the decode steps that replayed one. The persistent ``input_batch``
    has 2 x ``max_num_seqs`` rows: with overlapped steps a finished sequence keeps its row until
    the step in flight that holds it is read back, while as many new ones take rows.
    ``drafter``: with a model drafter (``config.speculative.method`` in ``MODEL_METHODS``) its
    ``ModelDrafter``, built beside the target (the pool is sized for both networks' caches, with one
    block count) and given every forward (``extend``); the scheduler drafts through it. Its head
    reads the target's captured features, so such a runner captures no piecewise prefill graphs.
    """

    def __init__(self, config: EngineConfig, tp: TPGroup, eos_token_ids=frozenset()):
        device, dtype, kv_cache_dtype = config.parallel.device, config.model.dtype, config.cache.dtype
        block_size, max_draft_tokens = config.cache.block_size, config.speculative.max_draft_tokens
        max_num_seqs, max_model_len = config.scheduler.max_num_seqs, config.scheduler.max_model_len
        cuda_graphs, prefill_graph_tokens = config.parallel.cuda_graphs, config.parallel.prefill_graph_tokens
        self.device, self.dtype, self.tp = device, dtype, tp
        self.block_size = block_size
        start = time.perf_counter()
        self.model = build_model(config.model.config, device, dtype, tp, config.model.model_class)
        load_checkpoint(self.model, config.model.model_dir, progress=config.progress)
        self.model.eval()
        self.load_seconds = time.perf_counter() - start
        self.weight_bytes = unique_parameter_bytes(self.model)

        self.drafter = None
        if config.speculative.method in MODEL_METHODS:
            self.drafter = ModelDrafter(config, self)
            prefill_graph_tokens = prefill_graph_tokens if not self.drafter.reads_features else 0

        if config.cache.budget_bytes is not None:
            free_bytes, utilization = config.cache.budget_bytes, 1.0
        else:
            free_bytes = max(0, free_memory_bytes(device) - config.cache.reserve_bytes)
            utilization = config.cache.mem_utilization
        self.kv_cache_dtype = kv_cache_dtype or dtype
        bytes_per_token = kv_bytes_per_token(self.model, self.kv_cache_dtype)
        if self.drafter is not None:  # the draft network's caches share the pool's blocks
            bytes_per_token += self.drafter.kv_bytes_per_token(self.kv_cache_dtype)
        num_blocks = plan_num_blocks(bytes_per_token, block_size, max_num_seqs, max_model_len, free_bytes, utilization)
        self.num_blocks = broadcast_object(num_blocks)  # every rank holds the same pool
        self.kv_caches = bind_kv_cache(self.model, self.num_blocks, block_size, self.kv_cache_dtype, device)
        if self.drafter is not None:
            self.drafter.bind()

        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        # A running sequence holds a row until it is released, which for a finished one waits for the
        # step in flight, so up to twice max_num_seqs rows are held.
        self.input_batch = InputBatch(2 * max_num_seqs, self.max_blocks_per_seq, block_size,
                                      config.model.config.vocab_size, device, max_draft_tokens)
        max_rows = max_num_seqs * (1 + max_draft_tokens)  # decode tokens (and logits rows) of a decode step
        self.sampling = BatchSampler(self.input_batch, max_rows, Sampler(tp), eos_token_ids)
        # the static decode inputs, two host staging copies (pinned on CUDA) used in turn with the events of
        # their last copies, and the gathered block tables of the decode tokens
        cuda = device.type == "cuda"
        self.decode_inputs = DecodeInputs.zeros(max_rows, device)
        self._decode_staging = [DecodeInputs.zeros(max_rows, pin_memory=cuda) for _ in range(2)]
        self._staging_copied = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._staging_index = 0
        self.decode_tables = torch.zeros(max_rows, self.max_blocks_per_seq, dtype=torch.int32, device=device)
        # decode tokens -> (graph, logits, the target's captured features: None unless a drafter reads them)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.graph_replays = 0
        self.prefill_graphs = None
        if (cuda_graphs or prefill_graph_tokens) and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.graph_pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None  # shared by every graph
        if cuda_graphs:
            limit = min(max_rows, getattr(self.model, "max_graph_batch", max_rows))
            self.capture_decode_graphs(graph_batch_sizes(limit))
        if prefill_graph_tokens:  # after the decode graphs, whose logits hold their blocks of the shared pool
            self.capture_prefill_graphs(prefill_graph_tokens)
        if cuda_graphs and self.drafter is not None:  # every draft step, a graph per number of sequences
            self.drafter.capture_graphs(graph_batch_sizes(min(max_num_seqs, limit)))

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.kv_caches)

    def on_device(self):
        """Make this runner's GPU current for the caller's thread (a new thread starts on cuda:0)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue ``batch``'s forward and sampling without waiting for the device. ``previous``:
        the step launched before, whose sampled ids feed the tokens of ``batch`` the host does
        not know yet (required whenever ``batch`` holds such a token)."""
        with self.on_device():
            step = self.prepare(batch, previous)
            logits = self.forward(step)
            if self.drafter is not None:
                self.drafter.extend(step)
            prompt = step.prompt_logprobs
            gathered = gather_prompt_logprobs(logits, prompt) if prompt is not None and self.tp.rank == 0 else None
            return LaunchedStep(batch, *self.sampling.sample(logits[:batch.num_logits_rows], step), prompt,
                                gathered)

    def release(self, seq: Sequence) -> None:
        """Forget a finished or preempted sequence's row (no-op if it holds none)."""
        self.input_batch.remove(seq)
        if self.drafter is not None:
            self.drafter.forget(seq)

    @property
    def held(self) -> list[str]:
        """The request ids holding runner state (an input-batch row)."""
        return self.input_batch.held

    def prepare(self, batch: ScheduledBatch, previous: LaunchedStep | None = None,
                decode_size: int | None = None) -> ForwardBatch:
        """The step's ``ForwardBatch``: new sequences get their input-batch rows (their sampling
        state written there), the host-side sampling plan is decided, and the inputs reach the
        device in one copy. A decode step is staged in the static decode buffers and replays the
        graph of the next captured size when there is one; ``decode_size`` runs it eagerly as such a
        graph does, padded to that many decode tokens over the whole table width."""
        output_indices = [start + n - len(draft) - seq.num_prompt_tokens
                          for seq, start, n, draft in zip(batch.seqs, batch.starts, batch.num_tokens, batch.drafts)]
        table_rows = self.input_batch.rows(batch.seqs)
        for i, position in zip(batch.draft_entries, _draft_tokens(batch)[1]):
            table_rows.append(table_rows[i])  # a drafted token's logits row samples the token after it
            output_indices.append(position + 1 - batch.seqs[i].num_prompt_tokens)
        moves = _pending_moves(batch, previous)
        sampling = self.sampling.plan(batch, output_indices)
        if batch.is_decode:
            step = self._prepare_decode(batch, table_rows, output_indices, moves, sampling, previous, decode_size)
            step.prompt_logprobs = prompt = plan_prompt_logprobs(batch, list(range(len(batch))))  # row = entry
            if prompt is not None:
                d = to_device_packed({"rows": torch.tensor(prompt.token_indices, dtype=torch.int64),
                                      "target_ids": torch.tensor(prompt.targets, dtype=torch.int64)}, self.device)
                prompt.rows, prompt.target_ids = d["rows"], d["target_ids"]
            return step
        return self._prepare_mixed(batch, table_rows, output_indices, moves, sampling, previous)

    def forward(self, step: ForwardBatch) -> torch.Tensor:
        """The logits [R, V] of the step's logits rows (a mixed step's prompt-logprob rows after
        them): its captured decode graph replayed; or, under the step's attention context, the
        piecewise graphs of a step with prefill chunks that has a captured size, else the model run
        eagerly (a padded ``decode_size`` step: every row; its last layer's MLP on the logits rows
        alone), and the LM head on the logits rows."""
        if step.graph_size is not None:
            graph, logits, features = self.graphs[step.graph_size]
            graph.replay()
            self.model.model.features = features
            self.graph_replays += 1
            return logits[:step.batch.num_logits_rows]
        with forward_context(step.attention):
            graphs = self.prefill_graphs
            size = graphs.size_for(len(step.input_ids)) if graphs is not None and step.attention.has_prefill else None
            if size is not None:
                hidden = graphs.run(size, step.input_ids, step.positions, step.attention.slot_mapping)
                if step.logits_indices is not None:
                    hidden = hidden.index_select(0, step.logits_indices)
            else:  # the last layer's MLP and the final norm on the logits rows alone
                hidden = self.model(step.input_ids, step.positions, step.logits_indices)
        return self.model.compute_logits(hidden)

    def _prepare_decode(self, batch: ScheduledBatch, table_rows: list[int], output_indices: list[int],
                        moves: list[tuple[int, int]], sampling: SamplingPlan, previous: LaunchedStep | None,
                        decode_size: int | None) -> ForwardBatch:
        """A decode step through the static buffers: the graph of the next captured size, else the
        eager forward with the block tables cut to the longest context (``decode_size``: padded,
        over the whole width)."""
        n = size = len(table_rows)
        graph_size = None
        if decode_size is not None:
            size = decode_size
        elif self.graphs and n <= max(self.graphs):
            size = graph_size = min(b for b in self.graphs if b >= n)
        self._stage_decode(batch, table_rows, output_indices, moves, sampling.random_rows, size, previous)
        staged = self.decode_inputs
        if graph_size is not None:
            input_ids, positions, attention = staged.input_ids[:size], staged.positions[:size], None
        else:
            longest = max(start + num for start, num in zip(batch.starts, batch.num_tokens))
            width = self.max_blocks_per_seq if decode_size is not None else math.ceil(longest / self.block_size)
            input_ids, positions, attention = self.decode_context(size, width)
        return ForwardBatch(batch, input_ids, positions, attention, None, staged.table_rows[:n],
                            staged.output_indices[:n], staged.random_rows[:len(sampling.random_rows)], sampling,
                            graph_size)

    def _stage_decode(self, batch: ScheduledBatch, table_rows: list[int], output_indices: list[int],
                      moves: list[tuple[int, int]], random_rows: list[int], size: int,
                      previous: LaunchedStep | None) -> None:
        """Write the step into ``decode_inputs`` with one host -> device copy (from the staging
        buffer not used by the previous step): token ids, positions, table rows and output indices
        of its decode tokens (each entry's last token, then its drafted tokens) in the first ``size``
        columns (columns past them are padding), the pending-token moves and the random rows. Then
        the pending tokens are read from ``previous``'s ids, on the device."""
        n = len(table_rows)
        self._staging_index ^= 1
        host, copied = self._decode_staging[self._staging_index], self._staging_copied[self._staging_index]
        if copied is not None:
            copied.synchronize()  # this buffer's copy of two steps ago has left it
        moved = {entry for entry, _ in moves}
        host.pad(n, size, self.input_batch.pad_row)
        draft_ids, draft_positions = _draft_tokens(batch)
        ids = [0 if i in moved else _token_at(seq, start) for i, (seq, start) in enumerate(zip(batch.seqs,
                                                                                             batch.starts))]
        host.write(n, input_ids=ids + draft_ids, positions=batch.starts + draft_positions, table_rows=table_rows,
                   output_indices=output_indices)
        if moves:
            host.write(len(moves), move_to=[entry for entry, _ in moves], move_from=[src for _, src in moves])
        if random_rows:
            host.write(len(random_rows), random_rows=random_rows)
        staged = self.decode_inputs
        staged.buffer.copy_(host.buffer, non_blocking=True)  # whole buffer: a column slice is not contiguous
        if copied is not None:
            copied.record(torch.cuda.current_stream(self.device))
        if moves:
            staged.input_ids.index_put_((staged.move_to[:len(moves)],),
                                        previous.sampled_ids.index_select(0, staged.move_from[:len(moves)]))

    def decode_context(self, size: int, width: int) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
        """Device ops only (what a graph captures): the first ``size`` staged decode tokens' ids,
        positions and attention context over ``width`` table columns, read from the static
        buffers the last decode step was staged in. Padding tokens (the padding row's table) write
        to slot -1 and attend to one token."""
        staged = self.decode_inputs
        input_ids, positions, table_rows = staged.input_ids[:size], staged.positions[:size], staged.table_rows[:size]
        tables = self.decode_tables[:size]
        torch.index_select(self.input_batch.block_tables, 0, table_rows, out=tables)
        slots = torch.where(table_rows == self.input_batch.pad_row, -1, self.input_batch.slots(table_rows, positions))
        attention = AttentionContext(has_prefill=False, slot_mapping=slots, block_tables=tables[:, :width],
                                     context_lens=(positions + 1).to(torch.int32))
        return input_ids, positions, attention

    def _prepare_mixed(self, batch: ScheduledBatch, table_rows: list[int], output_indices: list[int],
                       moves: list[tuple[int, int]], sampling: SamplingPlan,
                       previous: LaunchedStep | None) -> ForwardBatch:
        """A step with prefill chunks, from one host -> device copy. Entry i runs ``num_tokens[i]``
        tokens from ``starts[i]`` on. The leading entries whose tokens are all sampled (decodes;
        speculating, their drafted tokens too) give the context's decode tokens (paged decode over
        their table rows): each entry's last token, then the drafted tokens. The rest are prefill
        chunks (varlen attention; when any chunk has a computed prefix, ``prefill_kv_slots`` lists
        the cache slots of every context token of every chunk). The logits rows are each entry's
        last token (in entry order), then each drafted token, then the tokens whose logits give
        prompt logprobs. Pending input tokens are read from ``previous``'s ids on the device."""
        seqs, starts, nums = batch.seqs, batch.starts, batch.num_tokens
        num_decode = next((i for i, (n, d) in enumerate(zip(nums, batch.drafts)) if n != 1 + len(d)), len(nums))
        draft_ids, draft_positions = _draft_tokens(batch)
        num_decode_tokens = num_decode + len(draft_ids)
        moved = {entry for entry, _ in moves}
        decode_ids = [0 if i in moved else _token_at(seq, start)
                      for i, (seq, start) in enumerate(zip(seqs[:num_decode], starts))]
        prefill_ids = chain.from_iterable(_known_tokens(seq, start, n) for seq, start, n in
                                          zip(seqs[num_decode:], starts[num_decode:], nums[num_decode:]))
        prefill_starts = torch.tensor(starts[num_decode:], dtype=torch.int64)
        q_lens = torch.tensor(nums[num_decode:], dtype=torch.int64)
        cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)])
        rows = torch.tensor(table_rows, dtype=torch.int64)  # per logits row: entries, then drafted tokens
        prefill_rows = rows[num_decode:len(batch)]
        kv_lens = prefill_starts + q_lens
        cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), kv_lens.cumsum(0)])
        prompt = plan_prompt_logprobs(batch, list(range(num_decode)) + (num_decode_tokens + cu_q[:-1]).tolist())
        parts = {
            "input_ids": torch.tensor(decode_ids + draft_ids + list(prefill_ids), dtype=torch.int64),
            "positions": torch.cat([torch.tensor(starts[:num_decode] + draft_positions, dtype=torch.int64),
                                    torch.arange(int(cu_q[-1])) - _repeat(cu_q[:-1] - prefill_starts, q_lens)]),
            "token_table_rows": torch.cat([rows[:num_decode], rows[len(batch):],
                                           _repeat(prefill_rows, q_lens)]),
            "logits_indices": torch.cat([torch.arange(num_decode), num_decode_tokens + cu_q[1:] - 1,
                                         torch.arange(num_decode, num_decode_tokens),
                                         torch.tensor(prompt.token_indices if prompt else [], dtype=torch.int64)]),
            "table_rows": rows,
            "output_indices": torch.tensor(output_indices, dtype=torch.int64),
            "random_rows": torch.tensor(sampling.random_rows, dtype=torch.int64),
            "cu_seqlens_q": cu_q,
            "cu_seqlens_k": cu_k,
            "move_to": torch.tensor([entry for entry, _ in moves], dtype=torch.int64),  # a decode's token is its entry
            "move_from": torch.tensor([src for _, src in moves], dtype=torch.int64),
            "prompt_targets": torch.tensor(prompt.targets if prompt else [], dtype=torch.int64),
        }
        any_computed = bool(prefill_starts.any())
        if any_computed:  # every context token of every chunk, read back from the cache
            parts["kv_positions"] = torch.arange(int(cu_k[-1])) - _repeat(cu_k[:-1], kv_lens)
            parts["kv_table_rows"] = _repeat(prefill_rows, kv_lens)
        d = to_device_packed(parts, self.device)
        if moves:
            d["input_ids"].index_put_((d["move_to"],), previous.sampled_ids.index_select(0, d["move_from"]))
        decode_rows = d["token_table_rows"][:num_decode_tokens]
        width = math.ceil(max((start + n for start, n in zip(starts[:num_decode], nums[:num_decode])), default=0)
                          / self.block_size)  # blocks of the longest decode context
        input_batch = self.input_batch
        decode_tables = input_batch.block_tables.index_select(0, decode_rows)[:, :width] if num_decode_tokens else None
        attention = AttentionContext(
            has_prefill=True,
            num_decode_tokens=num_decode_tokens,
            slot_mapping=input_batch.slots(d["token_table_rows"], d["positions"]),
            cu_seqlens_q=d["cu_seqlens_q"].to(torch.int32),
            cu_seqlens_k=d["cu_seqlens_k"].to(torch.int32),
            max_seqlen_q=int(q_lens.max()),
            max_seqlen_k=int(kv_lens.max()),
            prefill_kv_slots=input_batch.slots(d["kv_table_rows"], d["kv_positions"]) if any_computed else None,
            block_tables=decode_tables,
            context_lens=(d["positions"][:num_decode_tokens] + 1).to(torch.int32) if num_decode_tokens else None,
        )
        if prompt is not None:
            prompt.rows = torch.arange(batch.num_logits_rows, batch.num_logits_rows + len(prompt.targets),
                                       device=self.device)
            prompt.target_ids = d["prompt_targets"]
        return ForwardBatch(batch, d["input_ids"], d["positions"], attention, d["logits_indices"], d["table_rows"],
                            d["output_indices"], d["random_rows"], sampling, prompt_logprobs=prompt)

    def capture_decode_graphs(self, sizes: list[int]) -> None:
        """Capture one decode graph per batch size (largest first, one shared memory pool), each
        over the full block-table width so any context up to max_model_len replays it."""
        pool = self.graph_pool
        with torch.inference_mode(), self.on_device():
            self._stage_decode(ScheduledBatch(), [], [], [], [], max(sizes), None)  # every column padding
            for size in sorted(sizes, reverse=True):
                def step(size=size):
                    input_ids, positions, attention = self.decode_context(size, self.max_blocks_per_seq)
                    with forward_context(attention):
                        return self.model.compute_logits(self.model(input_ids, positions))

                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    step()  # warm-up: compiles kernels, fills the allocator outside the capture
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = step()
                self.graphs[size] = (graph, logits, self.model.model.features)
        torch.cuda.synchronize(self.device)

    def capture_prefill_graphs(self, limit: int) -> None:
        """Capture the piecewise graphs of steps with prefill chunks of up to ``limit`` tokens
        (``prefill_graphs``), each size under a context of one prefill sequence of its length whose
        tokens write no KV (every static slot is -1 until the first replay): its warm-up runs that
        sequence's attention."""
        self.prefill_graphs = graphs = PiecewiseGraphs(prefill_graph_sizes(limit), self.device)
        contexts = {}
        for size in graphs.sizes:
            lens = torch.tensor([0, size], dtype=torch.int32, device=self.device)
            contexts[size] = AttentionContext(has_prefill=True, slot_mapping=graphs.slot_mapping[:size],
                                              cu_seqlens_q=lens, cu_seqlens_k=lens, max_seqlen_q=size,
                                              max_seqlen_k=size)

        def run_model(size: int) -> torch.Tensor:
            with forward_context(contexts[size]):
                return self.model(graphs.input_ids[:size], graphs.positions[:size])

        with torch.inference_mode(), self.on_device():
            graphs.capture(run_model, self.graph_pool)


def _pending_moves(batch: ScheduledBatch, previous: LaunchedStep | None) -> list[tuple[int, int]]:
    """(entry, index into ``previous.sampled_ids``) for every entry whose input token is pending
    on the host: ``previous`` sampled it, so it is read from ``previous``'s ids on the device
    (a pending token is always a one-token entry's input)."""
    moves = [i for i, (seq, start) in enumerate(zip(batch.seqs, batch.starts)) if start >= seq.num_known_tokens]
    if not moves:
        return []
    if previous is None:
        raise RuntimeError("the batch feeds tokens the host does not know, but no previous step was given")
    index = previous.index_of
    return [(i, index[batch.seqs[i].request_id]) for i in moves]


def _repeat(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``torch.repeat_interleave(values, counts)`` of int64 host tensors, through numpy: torch's CPU
    kernel took ~2.6 ms a call on the 16-core H200 host (cProfile of a mixed step: its largest host
    cost), against ~20 µs here on 2 cores."""
    return torch.from_numpy(np.repeat(values.numpy(), counts.numpy()))


def _draft_tokens(batch: ScheduledBatch) -> tuple[list[int], list[int]]:
    """The batch's drafted tokens and their positions, in entry order (entry i's draft j sits at
    ``starts[i] + 1 + j``, after the entry's last token)."""
    ids = [token for draft in batch.drafts for token in draft]
    positions = [start + 1 + j for start, draft in zip(batch.starts, batch.drafts) for j in range(len(draft))]
    return ids, positions


def _token_at(seq: Sequence, position: int) -> int:
    """``seq``'s known token at ``position`` (a decode token's input: its newest token, or a
    one-token prefill chunk's)."""
    if position == seq.num_known_tokens - 1:
        return seq.last_token_id
    prompt = seq.prompt_token_ids
    return prompt[position] if position < len(prompt) else seq.output_token_ids[position - len(prompt)]


def _known_tokens(seq: Sequence, start: int, num: int) -> list[int]:
    """``seq``'s tokens ``[start, start + num)``, all known on the host (a prefill chunk's)."""
    prompt = seq.prompt_token_ids
    return prompt[start:start + num] if start + num <= len(prompt) else seq.token_ids[start:start + num]

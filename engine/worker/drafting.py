"""Model-based drafters of speculative decoding: a smaller draft model ("draft"), an EAGLE-3 head
("eagle3") or DeepSeek-V3's MTP layer ("mtp"), drafting greedily on the device.

The draft network keeps its own KV caches in the target's pool: one cache per draft attention
layer with the target's ``num_blocks``, addressed by the target's block tables (the same block
ids, the same slots), so the scheduler's blocks hold both and nothing else is allocated per
sequence. The KV of a rejected draft sits where the target's does, and is overwritten the same way.

Two calls keep it in step with the target:

- ``extend(step)``, by the runner right after each target forward. A draft model runs over the
  step's tokens exactly as the target did (its KV at each position then holds the same token's,
  valid wherever the target's is). A head (EAGLE-3, MTP) needs, at position ``t``, token ``t + 1``
  and the target's features of ``t``: it runs over each entry's positions whose next token the
  host already knows (prefill chunks but a prompt's last token) and keeps the step's features
  for the rest (``kv_len``: positions of a request whose head KV holds target features).
- ``propose(seqs, rooms)``, by the scheduler before the verify step (every drafting sequence's
  slots taken for ``rooms`` drafts). The first draft step catches up (the head: positions
  ``[kv_len, n - 1)`` from the last step's features; the draft model: the newest token at
  ``n - 1``) and predicts the first draft; each further step runs one token per sequence (the
  head feeding its own ``prenorm``), greedy; one device -> host copy at the end.

All steps are decode tokens of the paged decode kernel (each with its own context length, as a
verify entry's), but ``extend``'s chunks, which run as prefill chunks over their cached prefix.
Every TP rank runs the same steps (the draft network is sharded like the target; its argmax is
over gathered logits), so drafts agree without a broadcast.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.model.attention_context import AttentionContext, forward_context
from engine.model.config import ModelConfig
from engine.model.loader import load_checkpoint
from engine.model.models.registry import build_model, creating_in
from engine.worker.device_copy import to_device_packed
from engine.worker.kv_cache import bind_kv_cache, kv_bytes_per_token

if TYPE_CHECKING:
    from engine.core.engine_config import EngineConfig
    from engine.distributed import TPGroup
    from engine.scheduling.sequence import Sequence
    from engine.scheduling.step import ScheduledBatch
    from engine.worker.forward_batch import ForwardBatch

MODEL_METHODS = ("draft", "eagle3", "mtp")


def build_draft_network(config: EngineConfig, target: nn.Module, tp: TPGroup) -> nn.Module:
    """The draft network of ``config.speculative.method`` on the target's device and dtype, its
    weights loaded: "draft" any model our registry builds from ``draft_model`` (the target's
    vocabulary, else ValueError), "eagle3" an ``Eagle3Head`` from ``draft_model``, "mtp" the target
    checkpoint's ``DeepseekMTPLayer``."""
    from engine.model.models.draft_heads import DeepseekMTPLayer, Eagle3Head  # phase 13's, the runner 09's

    spec, device, dtype = config.speculative, config.parallel.device, config.model.dtype
    if spec.method == "mtp":
        source, model_config = config.model.model_dir, config.model.config
    else:
        source = spec.draft_model
        model_config = ModelConfig.from_model_dir(source)
    if spec.method == "draft":
        if model_config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model's vocab_size {model_config.vocab_size} differs from the target's "
                             f"{target.config.vocab_size}: a draft model must share the target's tokenizer")
        network = build_model(model_config, device, dtype, tp)
    else:
        with creating_in(dtype, device):
            network = (Eagle3Head if spec.method == "eagle3" else DeepseekMTPLayer)(model_config, target, tp)
    load_checkpoint(network, source, progress=config.progress)
    return network.eval()


class ModelDrafter:
    """Up to ``config.speculative.num_speculative_tokens`` drafts per sequence for the scheduler
    (``propose``) by the draft network of ``config.speculative.method`` (one of ``MODEL_METHODS``;
    ``build_draft_network``) beside the target model of ``runner`` (the ``ModelRunner`` that builds
    it: its model built, its pool not yet; not annotated, the runner module imports this one);
    ``bind()`` once the pool is sized. ``reads_features``: the head methods, whose layers the
    target captures."""

    def __init__(self, config: EngineConfig, runner):
        method = config.speculative.method
        if method not in MODEL_METHODS:
            raise ValueError(f"a model drafter's method is one of {', '.join(MODEL_METHODS)}, not {method!r}")
        self.method, self.runner = method, runner
        self.network = network = build_draft_network(config, runner.model, runner.tp)
        self.num_speculative_tokens = config.speculative.num_speculative_tokens
        self.target = runner.model
        self.reads_features = method != "draft"
        if self.reads_features:
            self.target.model.capture_layers = network.capture_layers
        self.kv_len: dict[str, int] = {}
        self._last_features: torch.Tensor | None = None
        self._last_tokens: dict[str, tuple[int, list[int]]] = {}  # request id -> (first position, token rows)
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # batch size -> (graph, drafts)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return kv_bytes_per_token(self.network, dtype)

    def bind(self) -> None:
        """The draft network's caches: one per draft attention layer, the target pool's blocks."""
        r = self.runner
        self.kv_caches = bind_kv_cache(self.network, r.num_blocks, r.block_size, r.kv_cache_dtype, r.device)

    def forget(self, seq: Sequence) -> None:
        self.kv_len.pop(seq.request_id, None)

    # ---- after each target forward ----

    def extend(self, step: ForwardBatch) -> None:
        """Keep the draft KV in step with the target's after ``step``'s forward (device work only)."""
        batch = step.batch
        if not self.reads_features:
            attention = step.attention
            if attention is None:  # a replayed graph: the same context, rebuilt from the static inputs
                attention = self.runner.decode_context(step.graph_size, self.runner.max_blocks_per_seq)[2]
            with forward_context(attention):
                self.network(step.input_ids, step.positions)
            return
        tokens = entry_token_rows(batch)
        features = self.target.model.features
        self._last_features = features
        self._last_tokens = {seq.request_id: (start, rows)
                             for seq, start, rows in zip(batch.seqs, batch.starts, tokens)}
        chunks = []  # (seq, start, end): positions whose next token is known on the host
        for seq, start, num in zip(batch.seqs, batch.starts, batch.num_tokens):
            end = min(start + num, seq.num_known_tokens - 1)
            if end > start:
                chunks.append((seq, start, end))
                self.kv_len[seq.request_id] = end
        if not chunks:
            return
        index = {seq.request_id: i for i, seq in enumerate(batch.seqs)}
        rows = [r for seq, start, end in chunks for r in tokens[index[seq.request_id]][:end - start]]
        ids = [t for seq, start, end in chunks for t in seq.token_ids[start + 1:end + 1]]
        table_rows = self.runner.input_batch.rows([seq for seq, _, _ in chunks])
        positions, attention = self._chunk_context(table_rows, [s for _, s, _ in chunks],
                                                   [e - s for _, s, e in chunks])
        d = to_device_packed({"rows": torch.tensor(rows, dtype=torch.int64),
                              "ids": torch.tensor(ids, dtype=torch.int64)}, self.runner.device)
        hidden = self.network.project(features.index_select(0, d["rows"]))
        with forward_context(attention):
            self.network(positions, self.target.model.embed_tokens(d["ids"]), hidden)

    # ---- before the verify step ----

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        """Up to ``rooms[i]`` greedy drafts for ``seqs[i]`` (each holds the slots for them); a head
        drafts nothing for a sequence whose features of position ``n - 2`` it lacks (it did not run
        in the last step)."""
        with self.runner.on_device():
            return self._propose(seqs, rooms)

    def _propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        first = [self._first_step(seq) for seq in seqs]
        todo = [i for i, f in enumerate(first) if f is not None]
        if not todo:
            return drafts
        seqs, rooms, first = [seqs[i] for i in todo], [rooms[i] for i in todo], [first[i] for i in todo]
        table_rows = self.runner.input_batch.rows(seqs)
        # step 0: every sequence's catch-up tokens as decode tokens, each attending to its own context
        counts = [len(ids) for _, ids, _ in first]
        last = [sum(counts[:i + 1]) - 1 for i in range(len(counts))]
        positions = [p for start, ids, _ in first for p in range(start, start + len(ids))]
        token_rows = [row for row, n in zip(table_rows, counts) for _ in range(n)]
        host = {"ids": [t for _, ids, _ in first for t in ids], "positions": positions, "token_rows": token_rows,
                "last": last, "table_rows": table_rows}
        if self.reads_features:
            host["feature_rows"] = [r for _, _, rows in first for r in rows]
        d = to_device_packed({k: torch.tensor(v, dtype=torch.int64) for k, v in host.items()}, self.runner.device)
        hidden = None
        if self.reads_features:
            hidden = self.network.project(self._last_features.index_select(0, d["feature_rows"]))
        width = min(self.runner.max_blocks_per_seq, math.ceil((max(positions) + max(rooms)) / self.runner.block_size))
        next_ids, hidden = self._run(d["ids"], d["positions"], d["token_rows"], hidden, width, d["last"])
        # steps 1..: one token per sequence after its last, replayed from a graph when one fits
        position = d["positions"].index_select(0, d["last"])
        room = torch.tensor(rooms, dtype=torch.int64).to(self.runner.device, non_blocking=True)
        size = min((b for b in self.graphs if b >= len(seqs)), default=None)
        if size is None or max(rooms) == 1:
            later = self._later_steps(next_ids, position, d["table_rows"], hidden, room, width, max(rooms))
        else:
            later = self._replay(size, next_ids, position, d["table_rows"], hidden, room)[:len(seqs)]
        out = torch.cat([next_ids[:, None], later], 1).tolist()
        for i, r, k in zip(todo, out, rooms):
            drafts[i] = r[:k]
        for seq, (start, ids, _) in zip(seqs, first):
            if self.reads_features:
                self.kv_len[seq.request_id] = start + len(ids)
        return drafts

    def _later_steps(self, ids: torch.Tensor, position: torch.Tensor, table_rows: torch.Tensor,
                     hidden: torch.Tensor | None, room: torch.Tensor, width: int, steps: int) -> torch.Tensor:
        """Draft steps 1 .. ``steps - 1`` (device ops only, what a graph captures): each runs one
        token per sequence at the position after its last, the previous step's draft as input; a
        sequence whose ``room`` (drafts it may take) is used up stays where it is and writes
        nowhere. int64 [S, steps - 1]."""
        drafted = []
        for j in range(1, steps):
            active = room > j
            position = torch.where(active, position + 1, position)
            ids, hidden = self._run(ids, position, table_rows, hidden, width, None, active)
            drafted.append(ids)
        return torch.stack(drafted, 1) if drafted else ids.new_empty(len(ids), 0)

    def capture_graphs(self, sizes: list[int]) -> None:
        """One CUDA graph per batch size in ``sizes`` of draft steps 1 .. k - 1 (``_later_steps``
        over the whole table width, from static inputs; padding rows have no room and the padding
        table row), in the runner's graph pool: a draft then costs its first step (eager: its
        catch-up has a length of its own) and one replay."""
        r, k, most = self.runner, self.num_speculative_tokens, max(sizes)
        self._static = {"ids": torch.zeros(most, dtype=torch.int64, device=r.device),
                        "position": torch.zeros(most, dtype=torch.int64, device=r.device),
                        "table_rows": torch.full((most,), r.input_batch.pad_row, dtype=torch.int64, device=r.device),
                        "room": torch.zeros(most, dtype=torch.int64, device=r.device),
                        "hidden": (torch.zeros(most, self.network.hidden_size, dtype=r.dtype, device=r.device)
                                   if self.reads_features else None)}
        with torch.inference_mode(), r.on_device():
            for size in sorted(sizes, reverse=True):
                def steps(size=size):
                    s = self._static
                    return self._later_steps(s["ids"][:size], s["position"][:size], s["table_rows"][:size],
                                             None if s["hidden"] is None else s["hidden"][:size], s["room"][:size],
                                             r.max_blocks_per_seq, k)

                side = torch.cuda.Stream(r.device)
                side.wait_stream(torch.cuda.current_stream(r.device))
                with torch.cuda.stream(side):
                    steps()  # warm-up outside the capture
                torch.cuda.current_stream(r.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=r.graph_pool):
                    out = steps()
                self.graphs[size] = (graph, out)
        torch.cuda.synchronize(r.device)

    def _replay(self, size: int, ids: torch.Tensor, position: torch.Tensor, table_rows: torch.Tensor,
                hidden: torch.Tensor | None, room: torch.Tensor) -> torch.Tensor:
        """``_later_steps`` of ``len(ids)`` sequences by the graph of ``size`` rows (padding rows
        take no room)."""
        s, n = self._static, len(ids)
        s["ids"][:n] = ids
        s["position"][:n] = position
        s["table_rows"][:n] = table_rows
        s["table_rows"][n:size] = self.runner.input_batch.pad_row
        s["room"][:n] = room
        s["room"][n:size] = 0
        if hidden is not None:
            s["hidden"][:n] = hidden
        graph, out = self.graphs[size]
        graph.replay()
        return out

    def _first_step(self, seq: Sequence) -> tuple[int, list[int], list[int]] | None:
        """(first position, input ids, feature rows of the last step) of ``seq``'s first draft step,
        None when it cannot draft. The draft model: its newest token. A head: positions
        ``[kv_len, n - 1)`` with the tokens after them, their features from the last step."""
        n = seq.num_known_tokens
        if not self.reads_features:
            return n - 1, [seq.last_token_id], []
        last = self._last_tokens.get(seq.request_id)
        if last is None:
            return None
        step_start, rows = last
        start = max(self.kv_len.get(seq.request_id, 0), step_start)
        if start >= n - 1 or n - 1 > step_start + len(rows):
            return None
        return start, seq.token_ids[start + 1:n], rows[start - step_start:n - 1 - step_start]

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, token_rows: torch.Tensor, hidden: torch.Tensor | None,
             width: int, last: torch.Tensor | None,
             active: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft forward over decode tokens (``ids`` at ``positions`` of the table rows
        ``token_rows``, contexts within ``width`` table columns; ``active`` False: write nowhere)
        -> (greedy next ids, the head's ``prenorm``) of the rows ``last`` (None: every row)."""
        input_batch = self.runner.input_batch
        slots = input_batch.slots(token_rows, positions)
        if active is not None:
            slots = torch.where(active, slots, -1)
        attention = AttentionContext(has_prefill=False, slot_mapping=slots,
                                     block_tables=input_batch.block_tables.index_select(0, token_rows)[:, :width],
                                     context_lens=(positions + 1).to(torch.int32))
        with forward_context(attention):
            if not self.reads_features:
                out = self.network(ids, positions)
                out = out if last is None else out.index_select(0, last)
                return self.network.compute_logits(out).argmax(-1), None
            normed, prenorm = self.network(positions, self.target.model.embed_tokens(ids), hidden)
        if last is not None:
            normed, prenorm = normed.index_select(0, last), prenorm.index_select(0, last)
        return self.network.draft_ids(normed, self.target), prenorm

    def _chunk_context(self, table_rows: list[int], starts: list[int],
                       lens: list[int]) -> tuple[torch.Tensor, AttentionContext]:
        """Positions [T] and the prefill context of chunks ``[starts[i], starts[i] + lens[i])`` of
        the sequences in ``table_rows``, each over its cached prefix."""
        starts_t, lens_t = torch.tensor(starts), torch.tensor(lens)
        kv_lens = starts_t + lens_t
        zero = torch.zeros(1, dtype=torch.int64)
        cu_q, cu_k = torch.cat([zero, lens_t.cumsum(0)]), torch.cat([zero, kv_lens.cumsum(0)])
        rows_t = torch.tensor(table_rows)
        parts = {"positions": torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]),
                 "token_rows": rows_t.repeat_interleave(lens_t), "cu_q": cu_q, "cu_k": cu_k}
        if any(starts):
            parts["kv_positions"] = torch.cat([torch.arange(int(k)) for k in kv_lens])
            parts["kv_rows"] = rows_t.repeat_interleave(kv_lens)
        d = to_device_packed(parts, self.runner.device)
        input_batch = self.runner.input_batch
        attention = AttentionContext(
            has_prefill=True, slot_mapping=input_batch.slots(d["token_rows"], d["positions"]),
            cu_seqlens_q=d["cu_q"].to(torch.int32), cu_seqlens_k=d["cu_k"].to(torch.int32),
            max_seqlen_q=max(lens), max_seqlen_k=int(kv_lens.max()),
            prefill_kv_slots=input_batch.slots(d["kv_rows"], d["kv_positions"]) if any(starts) else None)
        return d["positions"], attention


def entry_token_rows(batch: ScheduledBatch) -> list[list[int]]:
    """Per entry of ``batch``, the indices of its tokens in the step's token order (position order):
    the leading entries whose tokens are all sampled (decodes, with their drafts) put their own
    token at their entry index and their drafts after every such entry's token, in entry order;
    the prefill chunks follow, contiguous (``ModelRunner.prepare``'s layout)."""
    nums, drafts = batch.num_tokens, batch.drafts
    num_decode = next((i for i, (n, d) in enumerate(zip(nums, drafts)) if n != 1 + len(d)), len(nums))
    rows, at = [], num_decode
    for i in range(num_decode):
        rows.append([i, *range(at, at + len(drafts[i]))])
        at += len(drafts[i])
    for n in nums[num_decode:]:
        rows.append(list(range(at, at + n)))
        at += n
    return rows

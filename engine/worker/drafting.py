"""Model-based drafters of speculative decoding: a smaller draft model ("draft"), an EAGLE-3 head
("eagle3") or DeepSeek-V3's MTP layer ("mtp"), drafting greedily on the device.

The draft network keeps its own KV caches in the target's pool: one cache per draft attention
layer with the target's ``num_blocks``, addressed by the target's block tables (the same block
ids, the same slots), so the scheduler's blocks hold both and nothing else is allocated per
sequence. The KV of a rejected draft sits where the target's does, and is overwritten the same way.

Two calls keep it in step with the target:

- ``extend(step)``, by the runner right after each target forward, runs the draft network over
  the positions of the step it can write now, as prefill chunks over their cached prefix (``kv_len``:
  positions of a request whose draft KV is written). A draft model needs, at position ``t``, token
  ``t``: it runs over each entry's own tokens not yet in its KV (a prefill chunk; a decode that did
  not draft), never over drafts: its draft steps wrote their inputs' KV, kept where the target
  accepted them. A head (EAGLE-3, MTP) needs, at position ``t``, token ``t + 1`` and the target's
  features of ``t``: it runs over each entry's positions whose next token the host already knows
  (prefill chunks but a prompt's last token) and keeps the step's features for the rest.
- ``propose(seqs, rooms)``, by the scheduler before the verify step (every drafting sequence's
  slots taken for ``rooms`` drafts). The first draft step catches up (the head: positions
  ``[kv_len, n - 1)`` from the last step's features; the draft model: positions ``[kv_len, n)``,
  usually the newest token alone) and predicts the first draft; each further step runs one token
  per sequence (the head feeding its own ``prenorm``), greedy; one host -> device copy before,
  one device -> host copy at the end. Under CUDA graphs every step replays from one graph per
  batch size, the first step padded to ``catch_up`` tokens a sequence (k + 1 for a head, 2 for a
  draft model; a longer catch-up runs eagerly).

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
PER_TOKEN = ("ids", "positions", "token_rows", "valid", "features")  # the draft graphs' static inputs of each
# first-step token (padded to catch_up a sequence); the others are one per sequence


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
        self.kv_len: dict[str, int] = {}  # request id -> positions whose draft KV is written
        # the draft model: drafts its last draft's later steps ran from position kv_len on (dropped when kv_len moves)
        self._written: dict[str, int] = {}
        self._last_features: torch.Tensor | None = None
        self._last_tokens: dict[str, tuple[int, list[int]]] = {}  # request id -> (first position, token rows)
        self.kv_caches: list[torch.Tensor] = []
        # the most first-step tokens of a sequence: the last step's accepted positions (a draft model's: its
        # last draft's, when every draft was accepted, and the newest token)
        self.catch_up = self.num_speculative_tokens + 1 if self.reads_features else 2
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # batch size -> (graph, drafts)
        self.graph_replays = 0  # drafts made by replaying a graph

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return kv_bytes_per_token(self.network, dtype)

    def bind(self) -> None:
        """The draft network's caches: one per draft attention layer, the target pool's blocks."""
        r = self.runner
        self.kv_caches = bind_kv_cache(self.network, r.num_blocks, r.block_size, r.kv_cache_dtype, r.device)

    def forget(self, seq: Sequence) -> None:
        self.kv_len.pop(seq.request_id, None)
        self._written.pop(seq.request_id, None)

    # ---- after each target forward ----

    def extend(self, step: ForwardBatch) -> None:
        """Keep the draft KV in step with the target's after ``step``'s forward (device work only):
        run the draft network over each entry's positions it can write now (a head: those whose
        next token is known; a draft model: the entry's own tokens, not its drafts, not yet in its
        KV), as prefill chunks over their cached prefix."""
        batch = step.batch
        if self.reads_features:
            tokens = entry_token_rows(batch)
            self._last_features = self.target.model.features
            self._last_tokens = {seq.request_id: (start, rows)
                                 for seq, start, rows in zip(batch.seqs, batch.starts, tokens)}
        chunks = []  # (entry, seq, begin, end): the positions to run
        for i, (seq, start, num) in enumerate(zip(batch.seqs, batch.starts, batch.num_tokens)):
            if self.reads_features:
                begin, end = start, min(start + num, seq.num_known_tokens - 1)
            else:
                begin, end = max(self.kv_len.get(seq.request_id, 0), start), start + num - len(batch.drafts[i])
            if end > begin:
                chunks.append((i, seq, begin, end))
                self.kv_len[seq.request_id] = end
                self._written.pop(seq.request_id, None)
        if not chunks:
            return
        table_rows = self.runner.input_batch.rows([seq for _, seq, _, _ in chunks])
        positions, attention = self._chunk_context(table_rows, [b for _, _, b, _ in chunks],
                                                   [e - b for _, _, b, e in chunks])
        if self.reads_features:  # at position t: token t + 1 and the target's features of t
            host = {"ids": [t for _, seq, b, e in chunks for t in seq.token_ids[b + 1:e + 1]],
                    "rows": [r for i, _, b, e in chunks for r in tokens[i][:e - b]]}
        else:
            host = {"ids": [t for _, seq, b, e in chunks for t in seq.token_ids[b:e]]}
        d = to_device_packed({k: torch.tensor(v, dtype=torch.int64) for k, v in host.items()}, self.runner.device)
        with forward_context(attention):
            if self.reads_features:
                hidden = self.network.project(self._last_features.index_select(0, d["rows"]))
                self.network(positions, self.target.model.embed_tokens(d["ids"]), hidden)
            else:
                self.network(d["ids"], positions)

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
        size = min((b for b in self.graphs if b >= len(seqs)), default=None)
        if max(len(ids) for _, ids, _ in first) > self.catch_up:  # never expected: the eager path takes any length
            size = None
        d = self._step_inputs(seqs, rooms, first, size)
        features = None
        if self.reads_features:
            features = self._last_features.index_select(0, d.pop("feature_rows"))
        if size is None:
            last_position = max(start + len(ids) - 1 for start, ids, _ in first)
            width = min(self.runner.max_blocks_per_seq,
                        math.ceil((last_position + max(rooms)) / self.runner.block_size))
            out = self._draft_steps(**d, features=features, valid=None, width=width, steps=max(rooms))
        else:
            out = self._replay(size, d, features)[:len(seqs)]
        for i, seq, (start, ids, _), row, room in zip(todo, seqs, first, out.tolist(), rooms):
            drafts[i] = row[:room]
            self.kv_len[seq.request_id] = start + len(ids)
            if not self.reads_features:  # the later steps ran room - 1 drafts from position kv_len on
                self._written[seq.request_id] = room - 1
        return drafts

    def _step_inputs(self, seqs: list[Sequence], rooms: list[int], first: list[tuple[int, list[int], list[int]]],
                     size: int | None) -> dict[str, torch.Tensor]:
        """The device inputs of ``_draft_steps`` (one host -> device copy): each sequence's first-step
        tokens (``first``: ``_first_step`` 's), its table row and room, and for a head the feature
        rows of the last step. ``size`` (a graph's rows): every sequence's first step padded to
        ``catch_up`` tokens and the sequences to ``size`` (padding: the pad table row, position 0,
        ``valid`` 0, no room), else packed, every token valid."""
        pad_row = self.runner.input_batch.pad_row
        entries = [(row, *f) for row, f in zip(self.runner.input_batch.rows(seqs), first)]
        entries += [(pad_row, 0, [], [])] * ((size or 0) - len(seqs))  # padding sequences: no tokens
        per = self.catch_up if size is not None else None
        columns = ["ids", "positions", "token_rows"] + ["feature_rows"] * self.reads_features + ["valid"] * bool(per)
        host: dict[str, list[int]] = {name: [] for name in columns}
        host["last"] = []
        for row, start, ids, feature_rows in entries:
            tokens = {"ids": ids, "positions": range(start, start + len(ids)), "token_rows": [row] * len(ids),
                      "feature_rows": feature_rows, "valid": [1] * len(ids)}
            pad = 0 if per is None else per - len(ids)
            for name in columns:
                host[name] += [*tokens[name], *[pad_row if name == "token_rows" else 0] * pad]
            host["last"].append(len(host["ids"]) - pad - 1)
        host["table_rows"] = [row for row, *_ in entries]
        host["room"] = rooms + [0] * (len(entries) - len(seqs))
        return to_device_packed({k: torch.tensor(v, dtype=torch.int64) for k, v in host.items()}, self.runner.device)

    def _draft_steps(self, ids: torch.Tensor, positions: torch.Tensor, token_rows: torch.Tensor,
                     features: torch.Tensor | None, valid: torch.Tensor | None, last: torch.Tensor,
                     table_rows: torch.Tensor, room: torch.Tensor, width: int, steps: int) -> torch.Tensor:
        """Every draft step (device ops only, what a graph captures) -> int64 [S, steps] greedy drafts.

        Step 0 runs the first-step tokens ``ids`` at ``positions`` (of the table rows ``token_rows``;
        ``valid`` 0: padding, written nowhere; None: all valid) as decode tokens, the head over
        ``project(features)``; ``last`` [S] indexes each sequence's last token, whose prediction is
        its first draft. Steps 1 .. ``steps - 1`` run one token per sequence (``_later_steps``)."""
        hidden = None if features is None else self.network.project(features)
        active = None if valid is None else valid > 0
        next_ids, hidden = self._run(ids, positions, token_rows, hidden, width, last, active)
        position = positions.index_select(0, last)
        later = self._later_steps(next_ids, position, table_rows, hidden, room, width, steps)
        return torch.cat([next_ids[:, None], later], 1)

    def _later_steps(self, ids: torch.Tensor, position: torch.Tensor, table_rows: torch.Tensor,
                     hidden: torch.Tensor | None, room: torch.Tensor, width: int, steps: int) -> torch.Tensor:
        """Draft steps 1 .. ``steps - 1``: each runs one token per sequence at the position after
        its last, the previous step's draft as input; a sequence whose ``room`` (drafts it may
        take) is used up stays where it is and writes nowhere. int64 [S, steps - 1]."""
        drafted = []
        for j in range(1, steps):
            active = room > j
            position = torch.where(active, position + 1, position)
            ids, hidden = self._run(ids, position, table_rows, hidden, width, None, active)
            drafted.append(ids)
        return torch.stack(drafted, 1) if drafted else ids.new_empty(len(ids), 0)

    def capture_graphs(self, sizes: list[int]) -> None:
        """One CUDA graph per batch size in ``sizes`` of every draft step (``_from_static``), in the
        runner's graph pool: a draft then costs one copy in, one replay and one copy back."""
        r = self.runner
        self.allocate_static(max(sizes))
        with torch.inference_mode(), r.on_device():
            for size in sorted(sizes, reverse=True):
                side = torch.cuda.Stream(r.device)
                side.wait_stream(torch.cuda.current_stream(r.device))
                with torch.cuda.stream(side):
                    self._from_static(size)  # warm-up outside the capture
                torch.cuda.current_stream(r.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=r.graph_pool):
                    out = self._from_static(size)
                self.graphs[size] = (graph, out)
        torch.cuda.synchronize(r.device)

    def allocate_static(self, most: int) -> None:
        """The graphs' static inputs for up to ``most`` sequences (``_step_inputs`` 's, padded, and
        a head's features), zeros: every token padding."""
        r, per = self.runner, self.catch_up
        self._static = {name: torch.zeros(most * per if name in PER_TOKEN else most, dtype=torch.int64,
                                          device=r.device)
                        for name in ("ids", "positions", "token_rows", "valid", "last", "table_rows", "room")}
        self._static["features"] = None
        if self.reads_features:
            width = len(self.network.capture_layers) * self.target.config.hidden_size
            self._static["features"] = torch.zeros(most * per, width, dtype=r.dtype, device=r.device)

    def load_static(self, inputs: dict[str, torch.Tensor], features: torch.Tensor | None) -> None:
        """Copy ``_step_inputs`` 's padded ``inputs`` (and a head's ``features`` of their first-step
        tokens) into the static inputs."""
        for name, value in inputs.items():
            self._static[name][:len(value)].copy_(value)
        if features is not None:
            self._static["features"][:len(features)].copy_(features)

    def _from_static(self, size: int) -> torch.Tensor:
        """``_draft_steps`` of the first ``size`` sequences of the static inputs, over the whole table
        width, k steps (what the graph of ``size`` captures)."""
        rows = {name: size * self.catch_up if name in PER_TOKEN else size for name in self._static}
        s = {name: None if t is None else t[:rows[name]] for name, t in self._static.items()}
        return self._draft_steps(**s, width=self.runner.max_blocks_per_seq, steps=self.num_speculative_tokens)

    def _replay(self, size: int, inputs: dict[str, torch.Tensor], features: torch.Tensor | None) -> torch.Tensor:
        """``_draft_steps`` of ``inputs`` (padded to ``size`` sequences) by the graph of ``size``."""
        self.load_static(inputs, features)
        graph, out = self.graphs[size]
        graph.replay()
        self.graph_replays += 1
        return out

    def _first_step(self, seq: Sequence) -> tuple[int, list[int], list[int]] | None:
        """(first position, input ids, feature rows of the last step) of ``seq``'s first draft step,
        None when it cannot draft. The draft model: positions ``[kv_len, n)``, its own tokens, where
        ``kv_len`` has grown by the positions the last draft's later steps wrote before ``n - 1``: the
        newest token, and the last draft after a fully accepted draft (``extend`` wrote the rest). A
        head: positions ``[kv_len, n - 1)`` with the tokens after them, their features from the last
        step."""
        n = seq.num_known_tokens
        kv_len = self.kv_len.get(seq.request_id)
        if not self.reads_features:
            if kv_len is None:
                return None
            # those before n - 1 held accepted drafts (the first rejected one sat at n - 1)
            start = min(kv_len + self._written.pop(seq.request_id, 0), n - 1)
            return start, seq.token_ids[start:n], []
        last = self._last_tokens.get(seq.request_id)
        if last is None:
            return None
        step_start, rows = last
        start = max(kv_len or 0, step_start)
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

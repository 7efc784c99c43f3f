"""Prefill-first continuous batching with chunked prefill and preemption by recompute. Pure Python.

Every step is either one prefill batch or one decode batch (every running sequence, in
admission order). A prefill batch first continues the running sequences whose prompt is
only partly computed, then admits waiting sequences in FCFS order, all within
``max_num_batched_tokens``: a prompt longer than what is left of that budget is prefilled in
chunks over several steps, and a chunk that stops short of the prompt's end samples nothing.
Decode runs only when no sequence is mid-prefill.

Admission (``admission``):

- ``"watermark"`` (default): a waiting sequence starts when its blocks (after prefix-cache
  hits) fit while ``watermark_blocks`` stay free for the running sequences to grow into (no
  watermark when nothing runs). When a decode step finds no free block for a running
  sequence's next token, the newest running sequence is preempted (repeatedly, possibly the
  sequence itself): its blocks are freed, it goes back to the FRONT of the waiting queue with
  its generated tokens, and is later recomputed by prefilling prompt + output so far (its
  published blocks are prefix-cache hits while they last). The oldest running sequence is never
  preempted for a younger one, so it always progresses.
- ``"reserve"``: a sequence starts only when the cache can hold its worst case (prompt +
  max_tokens, capped by max_model_len) on top of the worst cases of all running sequences, so a
  running sequence can always append and nothing is ever preempted.

A request that could never run (prompt over max_model_len, or a worst case over the whole
pool) is REJECTED at ``add``; anything else is admitted once the engine is idle, so the
scheduler cannot deadlock.

Prefix-cache hashes of a step's blocks are published in ``postprocess``, once that step's
K/V exists and only for the tokens computed so far; sequences of one prefill batch therefore
never share blocks computed in that same batch, and a failed step (``fail_in_flight``)
publishes nothing.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus

ADMISSION_POLICIES = ("watermark", "reserve")  # the first is the default


class Scheduler:
    """Owns waiting/running sequences and assigns every status transition.

    ``watermark`` is the fraction of the pool (at least one block) that watermark admission
    leaves free. ``num_preemptions`` counts preemptions; ``preempted`` holds the sequences the
    last ``schedule()`` preempted (the engine makes its runner forget them).
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_id: int | Iterable[int] | None, admission: str = "watermark",
                 watermark: float = 0.01):
        if max_num_seqs < 1 or max_model_len < 1:
            raise ValueError(f"max_num_seqs and max_model_len must be >= 1, got {max_num_seqs}, {max_model_len}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({max_num_seqs}): a decode batch has one token per sequence")
        if admission not in ADMISSION_POLICIES:
            raise ValueError(f"admission must be one of {', '.join(ADMISSION_POLICIES)}, got {admission!r}")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.admission = admission
        self.watermark = watermark
        self.watermark_blocks = max(1, int(watermark * block_manager.num_blocks))
        if eos_token_id is None:
            eos_token_id = ()
        self.eos_token_ids = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preempted: list[Sequence] = []
        self.num_preemptions = 0
        self._in_flight: list[Sequence] = []  # the batch between schedule() and postprocess()

    def add(self, seq: Sequence) -> bool:
        """Queue a WAITING sequence; False (and status REJECTED with ``reject_reason``)
        when it could never run."""
        if seq.status is not SequenceStatus.WAITING:
            raise ValueError(f"{seq.request_id} is {seq.status.name}, not WAITING")
        if any(s.request_id == seq.request_id for s in (*self.waiting, *self.running)):
            raise ValueError(f"request id {seq.request_id!r} is already scheduled")
        reason = self._reject_reason(seq)
        if reason is not None:
            seq.status = SequenceStatus.REJECTED
            seq.reject_reason = reason
            return False
        self.waiting.append(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences to run this step and whether it is a prefill; ``([], False)``
        when nothing is waiting that fits and nothing is running. Each scheduled sequence
        computes ``num_scheduled_tokens`` tokens from ``num_computed_tokens`` on. A non-empty
        batch must be passed to ``postprocess`` before the next ``schedule``: its blocks'
        K/V exist only once the model has run (prefix hits rely on that)."""
        if self._in_flight:
            raise RuntimeError("schedule() called again before postprocess() of the previous batch")
        self.preempted = []
        batch, is_prefill = self._schedule_prefill(), True
        if not batch:
            batch, is_prefill = self._schedule_decode(), False
        self._in_flight = batch
        return batch, is_prefill

    def postprocess(self, seqs: list[Sequence], is_prefill: bool, token_ids: list[int]) -> list[Sequence]:
        """Record the step's computed tokens (publishing their full blocks) and append one new
        token per sequence whose context is now fully computed (a prefill chunk short of the end
        gets none); finish (and free) those that sampled EOS (unless ignore_eos) or a stop token
        id, or reached max_tokens or max_model_len. Sequences aborted since ``schedule`` get no
        token; their blocks, whose K/V this step wrote, are freed now. Returns the sequences
        this step finished."""
        if len(seqs) != len(token_ids):
            raise ValueError(f"{len(seqs)} sequences but {len(token_ids)} token ids")
        self._in_flight = []
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.publish(seq, seq.num_computed_tokens)
            if seq.is_finished:
                self.block_manager.free(seq)
                continue
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk short of the end: its token is discarded
            seq.output_token_ids.append(token_id)
            reason = self._finish_reason(seq, token_id)
            if reason is not None:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = reason
                self.block_manager.free(seq)
                finished.append(seq)
            elif is_prefill:
                seq.status = SequenceStatus.RUNNING_DECODE
        if finished:
            self.running = [s for s in self.running if not s.is_finished]
        return finished

    def abort(self, request_id: str) -> bool:
        """``finish(request_id, "abort")``."""
        return self.finish(request_id, "abort")

    def finish(self, request_id: str, reason: str) -> bool:
        """Finish a waiting or running sequence with ``reason`` (e.g. "abort", or "stop" for a
        stop string the engine matched) and free its blocks (for a sequence in the batch being
        run: at that batch's ``postprocess``, once its K/V is written, so no prefix hit can land
        on blocks never computed); False when no unfinished sequence has this id."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    if not any(seq is s for s in self._in_flight):
                        self.block_manager.free(seq)
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = reason
                    return True
        return False

    def fail_in_flight(self) -> list[Sequence]:
        """The scheduled batch's forward failed: finish its sequences with reason "error" and
        free their blocks without publishing any hash (their K/V may not exist). Returns the
        sequences it finished."""
        failed = [s for s in self._in_flight if not s.is_finished]
        for seq in self._in_flight:
            self.block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = seq.finish_reason or "error"
        self._in_flight = []
        self.running = [s for s in self.running if not s.is_finished]
        return failed

    def _schedule_prefill(self) -> list[Sequence]:
        """Next chunks of the running sequences still prefilling (in admission order), then
        waiting sequences in FCFS order while they fit the sequence and block budgets and
        their uncached tokens fit what is left of the token budget; only the first sequence of
        a batch may be cut into chunks. (Sequences prefilled in one step cannot share the
        prefix blocks they compute, so a prompt that would be cut waits for the next step.)

        A sequence gets blocks for its whole context when it is admitted, not chunk by
        chunk: admission is the one place that decides whether it fits, so a later chunk
        never waits for a block and no prefill ever needs preempting."""
        budget = self.max_num_batched_tokens
        batch = []
        for seq in self.running:
            if budget == 0:
                return batch
            if seq.status is SequenceStatus.RUNNING_PREFILL:
                budget -= self._schedule_chunk(seq, budget)
                batch.append(seq)
        bm = self.block_manager
        reserve = self.admission == "reserve"
        reserved = sum(self._max_blocks(s) - len(s.block_table) for s in self.running) if reserve else 0
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if batch and seq.num_tokens - bm.cached_prefix_len(seq) > budget:
                break
            if reserve:
                growth = self._max_blocks(seq) - bm.blocks_for(seq.num_tokens)
                if not bm.can_allocate(seq, num_reserved=reserved + growth):
                    break
                reserved += growth
            elif not bm.can_allocate(seq, num_reserved=self.watermark_blocks if self.running else 0):
                break
            bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING_PREFILL
            seq.num_computed_tokens = seq.num_cached_tokens
            self.waiting.popleft()
            self.running.append(seq)
            budget -= self._schedule_chunk(seq, budget)
            batch.append(seq)
        return batch

    @staticmethod
    def _schedule_chunk(seq: Sequence, budget: int) -> int:
        """Schedule ``seq``'s next prefill chunk of at most ``budget`` tokens; returns its size."""
        seq.num_scheduled_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
        return seq.num_scheduled_tokens

    def _schedule_decode(self) -> list[Sequence]:
        """Every running sequence, oldest first, with a slot for its newest token; a sequence
        with no free block for it preempts the newest running ones (itself last)."""
        batch = []
        while len(batch) < len(self.running):
            seq = self.running[len(batch)]
            if self.block_manager.can_append(seq):
                self.block_manager.append_slot(seq)
                seq.num_scheduled_tokens = 1
                batch.append(seq)
            else:
                self._preempt(self.running.pop())
        return batch

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and put it back at the front of the waiting queue, keeping its
        output: it is recomputed (prompt + output so far) when admitted again."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.preempted.append(seq)
        self.num_preemptions += 1

    def _max_blocks(self, seq: Sequence) -> int:
        """Most KV blocks ``seq`` can ever hold: every token but the last sampled one
        gets KV, and generation stops at max_tokens or max_model_len tokens."""
        max_kv_tokens = min(seq.num_prompt_tokens + seq.sampling_params.max_tokens - 1, self.max_model_len)
        return self.block_manager.blocks_for(max_kv_tokens)

    def _reject_reason(self, seq: Sequence) -> str | None:
        n = seq.num_prompt_tokens
        if n > self.max_model_len:
            return f"prompt has {n} tokens, more than max_model_len ({self.max_model_len})"
        need, total = self._max_blocks(seq), self.block_manager.num_blocks
        if need > total:
            return f"prompt + max_tokens need {need} KV blocks, the cache has {total}"
        return None

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.sampling_params
        if (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

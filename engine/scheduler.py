"""Prefill-first continuous batching without preemption. Pure Python.

Every step is either one prefill batch (waiting sequences, FCFS) or one decode
batch (every running sequence, in admission order). A sequence is admitted only
when the cache can hold its worst case (prompt + max_tokens, capped by
max_model_len) on top of the worst cases of all running sequences, so a running
sequence can always append its next token: nothing is ever preempted and the
scheduler cannot deadlock. A request that could never fit is REJECTED at ``add``.

Prefix-cache hashes of a step's blocks are published in ``postprocess``, once
that step's K/V exists; sequences of one prefill batch therefore never share
blocks computed in that same batch, and a failed step (``fail_in_flight``)
publishes nothing.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


class Scheduler:
    """Owns waiting/running sequences and assigns every status transition."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_id: int | Iterable[int] | None):
        if max_num_seqs < 1 or max_model_len < 1:
            raise ValueError(f"max_num_seqs and max_model_len must be >= 1, got {max_num_seqs}, {max_model_len}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({max_num_seqs}): a decode batch has one token per sequence")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        if eos_token_id is None:
            eos_token_id = ()
        self.eos_token_ids = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
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
        when nothing is waiting that fits and nothing is running. A non-empty batch
        must be passed to ``postprocess`` before the next ``schedule``: its blocks'
        K/V exist only once the model has run (prefix hits rely on that)."""
        if self._in_flight:
            raise RuntimeError("schedule() called again before postprocess() of the previous batch")
        batch, is_prefill = self._admit_waiting(), True
        if not batch:
            for seq in self.running:
                self.block_manager.append_slot(seq)
            batch, is_prefill = list(self.running), False
        self._in_flight = batch
        return batch, is_prefill

    def postprocess(self, seqs: list[Sequence], is_prefill: bool, token_ids: list[int]) -> list[Sequence]:
        """Append one new token per scheduled sequence; finish (and free) those that
        sampled EOS (unless ignore_eos) or a stop token id, or reached max_tokens or
        max_model_len. Sequences aborted since ``schedule`` get no token; their blocks,
        whose K/V this step wrote, are freed now. Returns the sequences this step
        finished."""
        if len(seqs) != len(token_ids):
            raise ValueError(f"{len(seqs)} sequences but {len(token_ids)} token ids")
        self._in_flight = []
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            self.block_manager.publish(seq)
            if seq.is_finished:
                self.block_manager.free(seq)
                continue
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

    def _admit_waiting(self) -> list[Sequence]:
        """Allocate and start waiting sequences in FCFS order while they fit the
        sequence, token (uncached prompt tokens) and block budgets."""
        bm = self.block_manager
        reserved = sum(self._max_blocks(s) - len(s.block_table) for s in self.running)
        batch, num_new_tokens = [], 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            new_tokens = seq.num_prompt_tokens - bm.cached_prefix_len(seq)
            growth = self._max_blocks(seq) - bm.blocks_for(seq.num_prompt_tokens)
            if (num_new_tokens + new_tokens > self.max_num_batched_tokens
                    or not bm.can_allocate(seq, num_reserved=reserved + growth)):
                break
            bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING_PREFILL
            self.waiting.popleft()
            self.running.append(seq)
            batch.append(seq)
            num_new_tokens += new_tokens
            reserved += growth
        return batch

    def _max_blocks(self, seq: Sequence) -> int:
        """Most KV blocks ``seq`` can ever hold: every token but the last sampled one
        gets KV, and generation stops at max_tokens or max_model_len tokens."""
        max_kv_tokens = min(seq.num_prompt_tokens + seq.sampling_params.max_tokens - 1, self.max_model_len)
        return self.block_manager.blocks_for(max_kv_tokens)

    def _reject_reason(self, seq: Sequence) -> str | None:
        n = seq.num_prompt_tokens
        if n > self.max_model_len:
            return f"prompt has {n} tokens, more than max_model_len ({self.max_model_len})"
        if n > self.max_num_batched_tokens:
            return f"prompt has {n} tokens, more than max_num_batched_tokens ({self.max_num_batched_tokens})"
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

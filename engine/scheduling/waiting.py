"""The waiting queue: the order in which the scheduler admits waiting sequences. Pure Python.

Sequences put back by preemption (``appendleft``) come first, the one put back last at the front:
they are recomputed before anything new, and take no client's turn. Then the sequences
``append``ed take turns, round robin over their clients (``Sequence.client``): a turn admits the
oldest waiting sequence of the client whose turn it is, and that client's next turn comes after
one turn of every other client with a sequence waiting; a client that starts waiting has its
first turn after those already waiting. Within one client the order is first come, first served,
so with one client (every sequence's ``client`` "", as for ``LLMEngine`` users) the queue is
exactly FCFS.

The order depends only on the calls made, in their order: every TP rank, making the same calls,
admits the same sequences.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterator

from engine.scheduling.sequence import Sequence


class WaitingQueue:
    """Waiting sequences in admission order (module docstring). ``head(passed)`` is the next one to
    admit, skipping the clients in ``passed``; ``take(head)`` removes it once admitted, ending its
    client's turn; iteration yields every waiting sequence in the order admission takes them when
    nothing makes it wait (the first is ``head()``)."""

    def __init__(self) -> None:
        self._preempted: deque[Sequence] = deque()  # the next to recompute first
        self._clients: dict[str, deque[Sequence]] = {}  # client -> its sequences, oldest first; next turn first

    def __len__(self) -> int:
        return len(self._preempted) + sum(map(len, self._clients.values()))

    def __bool__(self) -> bool:
        return bool(self._preempted or self._clients)  # a client is listed only while it has sequences

    def __iter__(self) -> Iterator[Sequence]:
        yield from self._preempted
        queues = [list(queue) for queue in self._clients.values()]
        for turn in range(max(map(len, queues), default=0)):
            yield from (queue[turn] for queue in queues if turn < len(queue))

    @property
    def has_preempted(self) -> bool:
        """A preempted sequence waits: it is the head, before any client's turn."""
        return bool(self._preempted)

    def append(self, seq: Sequence) -> None:
        """A new sequence: last of its client's; a client not waiting so far takes its turn last."""
        self._clients.setdefault(seq.client, deque()).append(seq)

    def appendleft(self, seq: Sequence) -> None:
        """A preempted sequence: before every other."""
        self._preempted.appendleft(seq)

    def head(self, passed: Container[str] = ()) -> Sequence | None:
        """The next sequence to admit: the first preempted one, else the oldest of the first client
        in turn order not in ``passed``; None when there is none."""
        if self._preempted:
            return self._preempted[0]
        return next((queue[0] for client, queue in self._clients.items() if client not in passed), None)

    def take(self, seq: Sequence) -> None:
        """Remove ``seq``, a head just admitted: a preempted one leaves the front; a client's
        sequence ends its client's turn (the client goes last, or leaves when it has no more)."""
        if self._preempted and self._preempted[0] is seq:
            self._preempted.popleft()
            return
        queue = self._clients.get(seq.client)
        if not queue or queue[0] is not seq:
            raise ValueError(f"{seq.request_id} is not a head of the waiting queue")
        del self._clients[seq.client]
        queue.popleft()
        if queue:
            self._clients[seq.client] = queue  # re-inserted: last in turn order

    def remove(self, seq: Sequence) -> None:
        """Remove ``seq`` wherever it waits (finished while waiting); its client keeps its place
        in turn order while it has sequences left. A ValueError when it does not wait here."""
        if seq in self._preempted:
            self._preempted.remove(seq)
            return
        queue = self._clients.get(seq.client)
        if queue is None:
            raise ValueError(f"{seq.request_id} is not waiting")
        queue.remove(seq)
        if not queue:
            del self._clients[seq.client]

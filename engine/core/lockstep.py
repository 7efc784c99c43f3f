"""The tensor-parallel lock-step: how every rank's engine runs the same requests in the same steps.

Rank 0 decides (the server's engine loop: only rank 0 hears requests) and, every iteration, sends
the other ranks a two-int header over the TP group (payload bytes, stop) and, only when there are
commands, their pickled payload: ``("add", token_ids, params, client)`` or ``("abort",
request_id)``. Every rank then applies the same commands in the same order (request ids are
counters, identical on every rank; the client key of each add makes every rank's admission order
the same) and steps; the other ranks only follow (``mirror_rank0``), so
rank 0's collectives always meet theirs. ``send_commands`` is a no-op in one process. (``generate``
and the benchmarks need no leader: every rank makes the same calls.)

Error policy (``run_step``): in one process a step that raises fails the requests of the steps in
flight and the engine goes on; under TP it is re-raised, fatal, because the rank that raised missed
its peers' collectives.
"""
from __future__ import annotations

import logging
import pickle

import torch
import torch.distributed as dist

from engine.core.output_processor import RequestOutput
from engine.distributed import get_tp_group

log = logging.getLogger("engine.core.lockstep")


def send_commands(commands: list[tuple], stop: bool) -> None:
    """Rank 0: the header to every other rank, then the pickled commands when there are any."""
    tp = get_tp_group()
    if tp.size == 1:
        return
    payload = pickle.dumps(commands) if commands else b""
    dist.broadcast(torch.tensor([len(payload), int(stop)], dtype=torch.int64), group=tp.group, group_src=0)
    if payload:
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), group=tp.group, group_src=0)


def receive_commands() -> tuple[list[tuple], bool]:
    """Another rank: rank 0's commands and stop flag."""
    tp = get_tp_group()
    header = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(header, group=tp.group, group_src=0)
    size, stop = header.tolist()
    if not size:
        return [], bool(stop)
    payload = torch.empty(size, dtype=torch.uint8)
    dist.broadcast(payload, group=tp.group, group_src=0)
    return pickle.loads(payload.numpy().tobytes()), bool(stop)


def apply_commands(engine, commands: list[tuple]) -> list[str | None]:
    """Run commands, ``("add", token_ids, params, client)`` or ``("abort", request_id)``, on this
    rank's engine; returns each add's request id (None when the engine refused it)."""
    request_ids = []
    for command in commands:
        if command[0] == "add":
            try:
                _, token_ids, params, client = command
                request_ids.append(engine.add_request(token_ids, params, client=client))
            except Exception:
                log.exception("the engine refused a request")
                request_ids.append(None)
        else:
            engine.abort_request(command[1])
    return request_ids


def run_step(engine) -> tuple[list[RequestOutput], str | None]:
    """One ``engine.step()``: the outputs it pushed, and an error message when it raised (the
    engine has then finished the requests of the steps in flight with "error": their outputs
    are the ones returned). Under TP a failed step is re-raised: fatal."""
    try:
        return engine.step(), None
    except Exception as e:
        log.exception("engine step failed")
        if engine.tp.size > 1:
            raise
        return engine.take_outputs(), f"the engine failed on this request: {type(e).__name__}: {e}"


def mirror_rank0(engine) -> None:
    """A worker rank's loop: run rank 0's commands and steps until its stop. Any thread may run
    it: it makes the engine's device current first. A failed step raises (fatal under TP)."""
    if engine.device.type == "cuda":
        torch.cuda.set_device(engine.device)  # a new thread starts on cuda:0, whatever its rank's GPU
    while True:
        commands, stop = receive_commands()
        apply_commands(engine, commands)
        if stop:
            return
        if commands or engine.has_unfinished_requests():
            for output in engine.step():  # aborted and rejected ones included
                if output.finished:
                    engine.pop_request(output.request_id)

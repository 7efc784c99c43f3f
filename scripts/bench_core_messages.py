"""What the engine core's pipe costs per step (docs/architecture.md quotes it): one ``("outputs", ...)``
message of N deltas (one token of text each, the core's stats) pickled, sent to a spawned process and
back, and pickled alone; prints JSON.

    python scripts/bench_core_messages.py
"""
import json
import multiprocessing
import pickle
import time

from engine.core.engine_core import EngineStats
from engine.core.output_processor import RequestOutput

ROUNDS = 2000


def echo(pipe) -> None:
    while (message := pipe.recv()) is not None:
        pipe.send(message)


def main() -> None:
    context = multiprocessing.get_context("spawn")
    front, core = context.Pipe()
    process = context.Process(target=echo, args=(core,))
    process.start()
    report = {}
    for n in (16, 64, 256):
        message = ("outputs", [(str(i), RequestOutput(str(i), [], [1234], " word", False)) for i in range(n)],
                   EngineStats(n, 0, 0.1, 1, 1, 1, 1, 0, 0))
        for _ in range(50):
            front.send(message)
            front.recv()
        start = time.perf_counter()
        for _ in range(ROUNDS):
            front.send(message)
            front.recv()
        crossing = (time.perf_counter() - start) / ROUNDS / 2
        start = time.perf_counter()
        for _ in range(ROUNDS):
            pickle.loads(pickle.dumps(message))
        report[f"{n}_deltas"] = {"bytes": len(pickle.dumps(message)), "one_crossing_ms": round(crossing * 1e3, 3),
                                 "pickle_and_unpickle_ms": round((time.perf_counter() - start) / ROUNDS * 1e3, 3)}
    front.send(None)
    process.join()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

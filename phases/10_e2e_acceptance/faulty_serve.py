"""``[torchrun ...] faulty_serve.py RANK NTH [serve options]``: ``python -m engine serve`` whose rank
RANK raises in its NTH step launch (``NTH+``: in that one and every later one, a device that
stays broken) — the injected fault of the failure tests (test code). The fault is planted when
this file is imported, so it also reaches the engine core process that ``serve`` spawns (a spawned
process imports its parent's main file again, with the same arguments)."""
import os
import sys

from engine.__main__ import main
from engine.worker.model_runner import ModelRunner

rank, nth, persists = int(sys.argv[1]), int(sys.argv[2].rstrip("+")), sys.argv[2].endswith("+")
if int(os.environ.get("RANK", "0")) == rank:
    real_launch, calls = ModelRunner.launch, [0]

    def launch(self, batch, previous=None):
        calls[0] += 1
        if calls[0] == nth or persists and calls[0] > nth:
            raise RuntimeError(f"injected failure on rank {rank}")
        return real_launch(self, batch, previous)
    ModelRunner.launch = launch

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[3:]]))

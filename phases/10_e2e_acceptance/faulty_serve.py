"""``torchrun ... faulty_serve.py RANK NTH [serve options]``: ``python -m engine serve`` whose rank
RANK raises in its NTH step launch — the injected fault of the TP failure test (test code)."""
import os
import sys

from engine.__main__ import main
from engine.model_runner import ModelRunner

if __name__ == "__main__":
    rank, nth = int(sys.argv[1]), int(sys.argv[2])
    if int(os.environ.get("RANK", "0")) == rank:
        real_launch, calls = ModelRunner.launch, [0]

        def launch(self, batch, previous=None):
            calls[0] += 1
            if calls[0] == nth:
                raise RuntimeError(f"injected failure on rank {rank}")
            return real_launch(self, batch, previous)
        ModelRunner.launch = launch
    sys.exit(main(["serve", *sys.argv[3:]]))

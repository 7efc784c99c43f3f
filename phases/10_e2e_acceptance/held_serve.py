"""``python held_serve.py HOLD_FILE [serve options]``: ``python -m engine serve`` whose engine takes
no step while HOLD_FILE exists and every unfinished request has an output token (adds, aborts and
the drain still run) — test code: the drain test keeps its requests in flight until it has
checked the drain, however fast the machine generates. The hold is planted when this file is
imported, so it also reaches the engine core process that ``serve`` spawns."""
import sys
import time
from pathlib import Path

from engine.__main__ import main
from engine.core.llm_engine import LLMEngine

hold, real_step = Path(sys.argv[1]), LLMEngine.step


def step(self):
    running = [seq for seq in map(self.sequence, self.request_ids()) if not seq.is_finished]
    if running and hold.exists() and all(seq.output_token_ids for seq in running):
        time.sleep(0.01)
        return []
    return real_step(self)


LLMEngine.step = step

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[2:]]))

"""Command line: ``python -m engine generate | serve | bench``.

Under ``torchrun --nproc_per_node N -m engine ...`` every rank runs the same
command (tensor parallel); only rank 0 prints.
"""
from __future__ import annotations

import argparse
import sys

from engine.distributed import close_tp_distributed
from engine.entrypoints.bench import add_bench_command
from engine.entrypoints.generate import add_generate_command
from engine.entrypoints.server.app import add_serve_command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    add_generate_command(commands)
    add_serve_command(commands)
    add_bench_command(commands)
    args = parser.parse_args(argv)
    try:
        code = args.run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if code == 0:  # under torchrun: every rank leaves the group it joined before the interpreter ends
        close_tp_distributed()
    return code


if __name__ == "__main__":
    sys.exit(main())

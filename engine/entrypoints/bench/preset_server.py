"""``python -m engine.entrypoints.bench.preset_server --preset NAME [serve options]``: ``python -m engine
serve`` for a preset with random weights made on the device (no checkpoint), the server that
``python -m engine bench serve --launch --preset NAME --random-weights`` starts."""
from __future__ import annotations

import argparse
import functools
import sys

from engine.entrypoints.bench.models import PRESETS, random_weights_args, use_random_weights


def main(argv: list[str] | None = None) -> int:
    from engine.entrypoints.server.app import add_serve_command, serve

    parser = argparse.ArgumentParser(prog="python -m engine.entrypoints.bench.preset_server")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_command(commands)
    options = commands.choices["serve"]
    options.add_argument("--preset", choices=sorted(PRESETS), required=True)
    options.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    options.add_argument("--tokenizer", metavar="DIR", default=None,
                         help="the tokenizer files of DIR instead of a one-word tokenizer")
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    args.served_model_name = args.served_model_name or args.preset
    with random_weights_args(args) as preset_args:
        return serve(preset_args, core_setup=functools.partial(use_random_weights, args.preset, args.seed))


if __name__ == "__main__":
    sys.exit(main())

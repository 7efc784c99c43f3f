"""Move an engine module and rewrite every reference to it, as a refactoring tool would.

    python scripts/move_module.py engine/model/attention_context.py engine/model/layers/attention_context.py

The file moves (its new package directory made, with an ``__init__.py``, when absent); then in
every text file of the tree (``.git``, virtual environments and caches left out) the dotted
name (``engine.model.attention_context``, not a longer name it begins) and the path
(``engine/model/attention_context.py``) become the new ones: imports, the gates' ``unlocks:``,
the mutations' symbols, the layering contracts, the docs. A ``from PACKAGE import MODULE``
import cannot be rewritten by name, so the script stops first, naming each one. Prints every
file it changed.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache", ".import_linter_cache",
             "build", "node_modules"}


def dotted(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def text_files(root: Path):
    """Every readable text file under ``root`` but the skipped directories, egg-info and this script."""
    for path in sorted(root.rglob("*")):
        parts = path.relative_to(root).parts
        if path.is_file() and not SKIP_DIRS & set(parts) and not any(p.endswith(".egg-info") for p in parts) \
                and parts != ("scripts", "move_module.py"):
            try:
                yield path, path.read_text()
            except (UnicodeDecodeError, OSError):
                continue


def move(root: Path, old: str, new: str) -> list[str]:
    """Move module ``old`` to ``new`` (paths relative to ``root``) and rewrite the references;
    returns the files changed. ValueError when a reference cannot be rewritten by name."""
    if not (root / old).is_file() or (root / new).exists():
        raise ValueError(f"{old} must be a file and {new} must not exist")
    package, _, name = dotted(old).rpartition(".")
    by_name = re.compile(rf"^\s*from {re.escape(package)} import .*\b{re.escape(name)}\b", re.M)
    blocked = [f"{p.relative_to(root)}" for p, text in text_files(root) if p.suffix == ".py" and by_name.search(text)]
    if blocked:
        raise ValueError(f"`from {package} import {name}` in {', '.join(blocked)}: import it by its dotted name first")
    patterns = [(re.compile(rf"\b{re.escape(dotted(old))}(?![\w])"), dotted(new)),
                (re.compile(rf"\b{re.escape(old)}\b"), new)]
    (root / new).parent.mkdir(parents=True, exist_ok=True)
    init = (root / new).parent / "__init__.py"
    if not init.exists():
        init.write_text("")
    (root / old).rename(root / new)
    changed = []
    for path, text in text_files(root):
        rewritten = text
        for pattern, replacement in patterns:
            rewritten = pattern.sub(replacement, rewritten)
        if rewritten != text:
            path.write_text(rewritten)
            changed.append(str(path.relative_to(root)))
    return changed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--root", type=Path, default=Path.cwd())
    args = parser.parse_args()
    try:
        changed = move(args.root, args.old, args.new)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(changed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

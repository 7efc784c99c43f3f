"""Write the code-editing workload of ``python -m engine bench spec``
(engine/entrypoints/bench/spec_workload.json): functions from the held-out test split of the demo model's
corpus (files whose blake2b path bucket is "test" in scripts/train_demo_model.py, so the model
never trained on them), each with a small edit to ask for: a parameter renamed.

    python scripts/make_spec_workload.py            # this interpreter's stdlib; rewrites the file

Functions of 6..30 lines whose first parameter (not self / cls) is a plain name, in sorted path
order, one in every few so that several files contribute; at most ``--count``.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sysconfig
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "engine" / "bench" / "spec_workload.json"


def test_split_files() -> list[tuple[str, str]]:
    spec = importlib.util.spec_from_file_location("train_demo_model", REPO / "scripts" / "train_demo_model.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if script.split_of(rel) == "test" and not {"site-packages", "dist-packages"} & set(rel.split("/")):
            try:
                files.append((rel, path.read_text(encoding="utf-8")))
            except UnicodeDecodeError:
                continue
    return files


def functions(rel: str, text: str):
    """(name, source, first parameter) of each function of 6..30 lines in ``text``, dedented."""
    lines = text.splitlines()
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.FunctionDef) or node.decorator_list:
            continue
        params = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
        if not params or not 6 <= node.end_lineno - node.lineno + 1 <= 30:
            continue
        source = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        if source.isascii():
            yield node.name, source, params[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=24)
    parser.add_argument("--every", type=int, default=5, help="take one function in this many")
    args = parser.parse_args()
    found = [(rel, *f) for rel, text in test_split_files() for f in functions(rel, text)]
    chosen = found[::args.every][:args.count]
    items = [{"source": rel, "function": name, "code": code, "rename": [param, f"{param}_value"]}
             for rel, name, code, param in chosen]
    OUT.write_text(json.dumps({"description": __doc__.split("\n\n")[0], "functions": items}, indent=1) + "\n")
    print(f"wrote {len(items)} functions from {len({i['source'] for i in items})} files to {OUT}")


if __name__ == "__main__":
    main()

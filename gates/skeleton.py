"""Skeletons: functions whose bodies are replaced by ``raise NotImplementedError(...)``.

Read with ``ast``, rewritten as text: only the replaced bodies change, so comments, decorators
(``dataclass``, ``property``, ``torch.library.custom_op``, ``triton.jit``), signatures,
docstrings, class attributes, module constants and imports stay byte for byte, and a module
that registers things at import still imports.
"""
from __future__ import annotations

import ast
import json

FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def function_nodes(tree: ast.Module) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Qualified name -> node of every function and method (``Class.method``; nested classes
    too, functions inside functions not)."""
    found = {}

    def walk(body, prefix):
        for node in body:
            if isinstance(node, FUNCTIONS):
                found[prefix + node.name] = node
            elif isinstance(node, ast.ClassDef):
                walk(node.body, f"{prefix}{node.name}.")
    walk(tree.body, "")
    return found


def import_time(tree: ast.Module, called_elsewhere: set[str] = frozenset()) -> set[str]:
    """Top-level functions the module calls while it is imported (from module-level code, class
    bodies, decorators or default values; not under ``if __name__ == "__main__":``), those that
    other modules call while they are imported (``called_elsewhere``: ``imported_calls``), and the
    ones those call in turn: a skeleton of any of them would stop a module from importing, so they
    keep their bodies."""
    nodes = {n.name: n for n in tree.body if isinstance(n, FUNCTIONS)}
    kept = (_calls([n for n in tree.body if not _script_only(n)], False) | set(called_elsewhere)) & set(nodes)
    pending = set(kept)
    while pending:
        new = _calls(nodes[pending.pop()].body, True) & set(nodes) - kept
        kept |= new
        pending |= new
    return kept


def imported_calls(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module path (``engine/a/b.py``) -> the names of its top-level functions that other modules of
    ``trees`` import (``from engine.a.b import f``) and call while they are imported (a pydantic
    model's field annotations built by a helper of another module, say)."""
    found: dict[str, set[str]] = {}
    for tree in trees.values():
        imported = {}  # a name bound here -> (the module path it comes from, its name there)
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("engine"):
                base = node.module.replace(".", "/")
                source = next((p for p in (base + ".py", base + "/__init__.py") if p in trees), None)
                imported.update({a.asname or a.name: (source, a.name) for a in node.names if source})
        for name in _calls([n for n in tree.body if not _script_only(n)], False) & set(imported):
            source, function = imported[name]
            found.setdefault(source, set()).add(function)
    return found


def _calls(roots, bodies: bool) -> set[str]:
    """The names called (``name(...)``, or a bare ``@name`` decorator) in ``roots``; with ``bodies``
    false, a function's or lambda's body is skipped (only what runs at its definition counts)."""
    found, todo = set(), list(roots)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.ClassDef, *FUNCTIONS)):  # a bare @name decorator is a call too
            found |= {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
        if isinstance(node, (*FUNCTIONS, ast.Lambda)) and not bodies:  # only what runs at definition
            todo += [*getattr(node, "decorator_list", []), *node.args.defaults,
                     *(d for d in node.args.kw_defaults if d is not None)]
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            found.add(node.func.id)
        todo += ast.iter_child_nodes(node)
    return found


def _script_only(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":``, which runs only when the module is run as a script."""
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and any(isinstance(c, ast.Constant) and c.value == "__main__"
                                                   for c in test.comparators))


def _docstring(node) -> bool:
    first = node.body[0]
    return isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)


def skeletonize(source: str, messages: dict[str, str]) -> str:
    """``source`` with the body of each function named in ``messages`` (qualified name ->
    message) replaced by ``raise NotImplementedError(message)`` after its docstring."""
    nodes = function_nodes(ast.parse(source))
    unknown = sorted(set(messages) - set(nodes))
    if unknown:
        raise KeyError(f"no such function: {', '.join(unknown)}")
    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def index(lineno: int, col: int) -> int:  # ast columns count UTF-8 bytes
        return starts[lineno - 1] + len(lines[lineno - 1].encode()[:col].decode())

    edits = []
    for qualname, message in messages.items():
        node = nodes[qualname]
        statement = f"raise NotImplementedError({json.dumps(message, ensure_ascii=False)})"
        rest = node.body[1:] if _docstring(node) else node.body
        if rest:
            first, last = rest[0], rest[-1]
            end = index(last.end_lineno, last.end_col_offset)
            tail = lines[last.end_lineno - 1][end - starts[last.end_lineno - 1]:]
            if tail.lstrip().startswith("#"):  # the last statement's comment goes with it
                end += len(tail.rstrip("\r\n"))
            edits.append((index(first.lineno, first.col_offset), end, statement))
        else:  # a docstring and nothing else
            doc = node.body[0]
            at = index(doc.end_lineno, doc.end_col_offset)
            own_line = not lines[doc.lineno - 1].encode()[:doc.col_offset].strip()
            edits.append((at, at, f"\n{' ' * doc.col_offset}{statement}" if own_line else f"; {statement}"))
    for start, end, text in sorted(edits, reverse=True):
        source = source[:start] + text + source[end:]
    return source


def raising(source: str) -> dict[str, tuple[int, str]]:
    """Qualified name -> (line, message) of each function whose body, after its docstring, is
    only ``raise NotImplementedError("phase ...")``: the skeletons still to be written."""
    found = {}
    for qualname, node in function_nodes(ast.parse(source)).items():
        rest = node.body[1:] if _docstring(node) else node.body
        if len(rest) != 1 or not isinstance(rest[0], ast.Raise) or not isinstance(rest[0].exc, ast.Call):
            continue
        call = rest[0].exc
        if (isinstance(call.func, ast.Name) and call.func.id == "NotImplementedError" and len(call.args) == 1
                and isinstance(call.args[0], ast.Constant) and str(call.args[0].value).startswith("phase ")):
            found[qualname] = (node.lineno, call.args[0].value)
    return found

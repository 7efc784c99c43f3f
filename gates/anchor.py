"""Code addressed by symbol, not by text: find a class or function, read it in its canonical form,
and write a changed form back in its place.

A symbol is ``path::Qualified.name`` (``engine/scheduling/scheduler.py::Scheduler.postprocess``),
or ``path`` alone for the whole module. Its canonical form is ``ast.unparse`` of its node: the
same for any formatting of the source (``ruff format``, comments, line breaks, quotes), so a
change written against it (a mutation's ``find`` and ``replace``) still applies after a
formatter run, a move of the module (the symbol's path rewritten with its references) or an
edit anywhere else. ``splice`` writes a changed form back over the symbol's lines only
(decorators included), indented where the symbol stands: the rest of the file keeps its bytes.
"""
from __future__ import annotations

import ast
import io
import tokenize

DEFS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


class AnchorError(ValueError):
    """A symbol that names nothing, or a change that does not apply to it exactly once."""


def split_symbol(symbol: str) -> tuple[str, str]:
    """``path::Qualified.name`` -> (path, qualname); ``path`` -> (path, "")."""
    path, _, qualname = symbol.partition("::")
    return path, qualname


def locate(tree: ast.Module, qualname: str) -> ast.AST | None:
    """The class or function at ``qualname`` (dotted through class and function bodies); the
    module itself for ""; None when nothing is there."""
    node: ast.AST = tree
    for part in filter(None, qualname.split(".")):
        node = next((n for n in getattr(node, "body", []) if isinstance(n, DEFS) and n.name == part), None)
        if node is None:
            return None
    return node


def canonical(source: str, qualname: str, symbol: str = "") -> str:
    """The canonical text of ``qualname`` in ``source`` (AnchorError naming ``symbol`` when absent)."""
    node = locate(ast.parse(source), qualname)
    if node is None:
        raise AnchorError(f"{symbol or qualname}: no such class or function (moved or renamed?)")
    return ast.unparse(node)


def splice(source: str, qualname: str, text: str) -> str:
    """``source`` with the lines of ``qualname`` (from its first decorator to its end) replaced by
    ``text`` (a canonical form, unindented), indented where the symbol stands; the whole module
    for ""."""
    tree = ast.parse(source)
    node = locate(tree, qualname)
    if node is None:
        raise AnchorError(f"{qualname}: no such class or function")
    if node is tree:
        return text + "\n"
    lines = source.splitlines(keepends=True)
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    indent = lines[node.lineno - 1][:node.col_offset]
    return "".join(lines[:first - 1]) + _indent(text, indent) + "\n" + "".join(lines[node.end_lineno:])


def _indent(text: str, prefix: str) -> str:
    """``text`` with ``prefix`` before each non-blank line, except the lines inside a multi-line
    string (a docstring keeps its content)."""
    inside: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.STRING and token.end[0] > token.start[0]:
            inside.update(range(token.start[0] + 1, token.end[0] + 1))
    return "\n".join(line if i in inside or not line.strip() else prefix + line
                     for i, line in enumerate(text.split("\n"), 1))


def replace_in(source: str, symbol: str, find: str, replace: str) -> str:
    """``source`` with ``find`` replaced by ``replace`` in the canonical text of ``symbol``'s
    qualname; AnchorError (naming the symbol) unless ``find`` occurs there exactly once and the
    result parses."""
    _, qualname = split_symbol(symbol)
    text = canonical(source, qualname, symbol)
    n = text.count(find)
    if n != 1:
        raise AnchorError(f"{symbol}: the text to replace occurs {n} times in its canonical form (expected once; "
                          f"`python -m gates canonical {symbol}` prints it): {find!r}")
    changed = text.replace(find, replace)
    try:
        ast.parse(changed)
    except SyntaxError as e:
        raise AnchorError(f"{symbol}: the replaced form does not parse: {e}") from None
    return splice(source, qualname, changed)

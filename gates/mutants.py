"""Generated mutants of one function: small AST changes a test of its contract should notice.

Operators (``OPERATORS``), each applied at one site of the function's syntax tree:

- ``compare``: ``<`` <-> ``<=``, ``>`` <-> ``>=``, ``==`` <-> ``!=``, ``in`` <-> ``not in``,
  ``is`` <-> ``is not`` (a comparison of one operator);
- ``boolean``: ``and`` <-> ``or``;
- ``constant``: an int constant + 1 and - 1 (two mutants; never a bool);
- ``statement``: an expression statement, assignment or ``raise`` replaced by ``pass``;
- ``return``: ``return X`` -> ``return None``;
- ``arguments``: a call's first two positional arguments swapped;
- ``message``: a string with a space in it (a message, not a key), or an f-string's first such
  part, loses its first word;
- ``unsort``: ``sorted(x)`` / ``reversed(x)`` -> ``list(x)``;
- ``default``: a parameter's constant default changed (an int + 1, a bool negated).

A function's docstring is never mutated. A mutant is the function's canonical text
(``gates.anchor``) after the change; ``sites`` lists them in a fixed order (the tree's walk
order), so a seeded sample of a phase's mutants is the same on every run of the same code.
"""
from __future__ import annotations

import ast
import copy
from dataclasses import dataclass

OPERATORS = ("compare", "boolean", "constant", "statement", "return", "arguments", "message", "unsort", "default")
_FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
         ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_STATEMENTS = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Raise)


@dataclass(frozen=True)
class Mutant:
    """One change to one function: ``symbol`` (``path::qualname``), the operator, the site's index
    among that operator's sites in the function (walk order), its line in the source, the
    original and changed text of the node it changes, and the function's whole changed text."""
    symbol: str
    operator: str
    index: int
    line: int
    before: str
    after: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.symbol}#{self.operator}{self.index}"


def _docstring(fn: ast.AST) -> ast.AST | None:
    body = getattr(fn, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0]
    return None


def _first_word_dropped(value: str) -> str | None:
    head, space, rest = value.strip().partition(" ")
    return rest if space and head and rest else None


def _message_part(node: ast.AST) -> ast.Constant | None:
    """The string constant a ``message`` mutant edits in ``node`` (None: not one)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and _first_word_dropped(node.value):
        return node
    if isinstance(node, ast.JoinedStr):
        return next((v for v in node.values if isinstance(v, ast.Constant) and _first_word_dropped(v.value)), None)
    return None


def _sites(fn: ast.AST, operator: str) -> list[tuple[ast.AST, str]]:
    """The nodes of ``fn`` ``operator`` can change, with the way it changes each ("+1"/"-1" for
    constants, "" otherwise), in walk order."""
    skip = {id(n) for n in ast.walk(_docstring(fn))} if _docstring(fn) is not None else set()
    in_fstring = {id(v) for n in ast.walk(fn) if isinstance(n, ast.JoinedStr) for v in n.values}
    found = []
    for node in ast.walk(fn):
        if id(node) in skip:
            continue
        if operator == "compare" and isinstance(node, ast.Compare) and len(node.ops) == 1 \
                and type(node.ops[0]) in _FLIP:
            found.append((node, ""))
        elif operator == "boolean" and isinstance(node, ast.BoolOp):
            found.append((node, ""))
        elif operator == "constant" and isinstance(node, ast.Constant) and type(node.value) is int:
            found += [(node, "+1"), (node, "-1")]
        elif operator == "statement" and isinstance(node, _STATEMENTS) and node is not _docstring(fn):
            found.append((node, ""))
        elif operator == "return" and isinstance(node, ast.Return) and node.value is not None \
                and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            found.append((node, ""))
        elif operator == "arguments" and isinstance(node, ast.Call) and len(node.args) >= 2 \
                and not any(isinstance(a, ast.Starred) for a in node.args[:2]):
            found.append((node, ""))
        elif operator == "message" and id(node) not in in_fstring and _message_part(node) is not None:
            found.append((node, ""))
        elif operator == "unsort" and isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("sorted", "reversed") and len(node.args) == 1 and not node.keywords:
            found.append((node, ""))
        elif operator == "default" and isinstance(node, ast.arguments):
            for d in [*node.defaults, *node.kw_defaults]:
                if isinstance(d, ast.Constant) and (type(d.value) in (int, bool)):
                    found.append((d, ""))
    return found


def _change(node: ast.AST, operator: str, how: str) -> ast.AST:
    """Change ``node`` (a copy) as ``operator`` does; returns the node that replaces it."""
    if operator == "compare":
        node.ops = [_FLIP[type(node.ops[0])]()]
    elif operator == "boolean":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif operator == "constant":
        node.value += 1 if how == "+1" else -1
    elif operator == "statement":
        return ast.copy_location(ast.Pass(), node)
    elif operator == "return":
        node.value = None
    elif operator == "arguments":
        node.args[0], node.args[1] = node.args[1], node.args[0]
    elif operator == "message":
        part = _message_part(node)
        part.value = _first_word_dropped(part.value)
    elif operator == "unsort":
        node.func.id = "list"
    elif operator == "default":
        node.value = (not node.value) if type(node.value) is bool else node.value + 1
    return node


def _replace_child(root: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(root):
        for name, value in ast.iter_fields(parent):
            if isinstance(value, list) and any(v is old for v in value):
                setattr(parent, name, [new if v is old else v for v in value])
                return
            if value is old:
                setattr(parent, name, new)
                return


def mutants(symbol: str, fn: ast.AST) -> list[Mutant]:
    """Every mutant of function node ``fn`` (``symbol`` names it), operator by operator."""
    out = []
    for operator in OPERATORS:
        for index, (site, how) in enumerate(_sites(fn, operator)):
            twin = copy.deepcopy(fn)
            target, _ = _sites(twin, operator)[index]
            before = ast.unparse(target)
            changed = _change(target, operator, how)
            if changed is not target:
                _replace_child(twin, target, changed)
            text = ast.unparse(twin)
            if text != ast.unparse(fn):
                out.append(Mutant(symbol, operator, index, getattr(site, "lineno", fn.lineno), before,
                                  ast.unparse(changed), text))
    return out

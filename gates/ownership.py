"""Which phase owns each engine symbol, and the layering rule that ownership has to keep.

A gate's ``unlocks:`` lists ``path`` entries (a module, or a package directory: every module
under it) and ``path::QualifiedName`` entries (a top-level class or function, or a method
``Class.method``). The most specific entry owns: ``path::Class.method`` before
``path::Class`` before the file before the deepest directory; module-level code (imports,
constants) belongs to the module's owner. Every engine module with code, and every top-level
class and function in it, must have exactly one owner, and every entry must name something
and change an owner (a redundant entry is an error too).

The layering rule: what a unit (a module's top-level code, a top-level class or function, a
method an entry names) references must be owned by the unit's own phase or by one it depends
on, transitively. References are names bound by imports from ``engine`` (at module level or
inside the unit) and the top-level classes and functions of the unit's own module. Type
annotations are not references (the engine never evaluates them), nor are the module's own
constants (every skeleton keeps them). An engine module importing ``gates`` breaks the rule
too: the engine never depends on its test runner.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from gates.phases import discover
from gates.schema import Gate, parse_unlock
from gates.skeleton import function_nodes

ENGINE = "engine"


@dataclass(frozen=True)
class Entry:
    """One ``unlocks:`` entry; ``qualname`` is "" for a path entry."""
    phase: str
    where: str          # "phases/05_x/gate.yaml: unlocks[3]"
    path: str
    qualname: str


@dataclass
class Module:
    """An engine module: its syntax tree and top-level classes and functions by name."""
    path: str            # engine/x/y.py
    tree: ast.Module

    @property
    def defs(self) -> dict[str, ast.AST]:
        return {n.name: n for n in self.tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef,
                                                                    ast.AsyncFunctionDef))}

    def find(self, qualname: str) -> ast.AST | None:
        """The class or function at ``qualname`` (``Class.method`` walks into class bodies)."""
        node: ast.AST = self.tree
        for part in qualname.split("."):
            if not isinstance(node, (ast.Module, ast.ClassDef)):
                return None
            node = next((n for n in node.body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                         and n.name == part), None)
            if node is None:
                return None
        return node

    def functions(self) -> list[str]:
        """Qualified names of every function and method (not functions nested in functions)."""
        return list(function_nodes(self.tree))


def _has_code(tree: ast.Module) -> bool:
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in tree.body)


def engine_modules(root: Path) -> dict[str, Module]:
    """Every module under ``root/engine`` with code (an empty or docstring-only one needs no owner)."""
    modules = {}
    for file in sorted((root / ENGINE).rglob("*.py")):
        tree = ast.parse(file.read_text(), filename=str(file))
        if _has_code(tree):
            path = file.relative_to(root).as_posix()
            modules[path] = Module(path, tree)
    return modules


@dataclass
class Ownership:
    """``owner[(module path, qualname)]``: "" is the module's own code (and, by default, all of it)."""
    modules: dict[str, Module]
    gate_paths: dict[str, str]                       # phase -> its gate.yaml, for messages
    owner: dict[tuple[str, str], str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def owner_of(self, path: str, qualname: str = "") -> str | None:
        """The phase owning ``qualname`` in module ``path`` (the most specific entry), or None."""
        parts = qualname.split(".") if qualname else []
        for n in range(len(parts), -1, -1):
            found = self.owner.get((path, ".".join(parts[:n])))
            if found is not None:
                return found
        return None

    def functions_of(self, phases: set[str]) -> dict[str, list[str]]:
        """module path -> qualified names of the functions and methods ``phases`` own."""
        out = {}
        for path, module in self.modules.items():
            names = [q for q in module.functions() if self.owner_of(path, q) in phases]
            if names:
                out[path] = names
        return out


def _entries(root: Path, gates: dict[str, Gate]) -> tuple[list[Entry], dict[str, str]]:
    entries, gate_paths = [], {}
    for phase in discover(root):
        if phase.id not in gates:
            continue
        gate_paths[phase.id] = f"{phase.rel}/gate.yaml"
        for i, text in enumerate(gates[phase.id].unlocks):
            path, qualname = parse_unlock(text)
            entries.append(Entry(phase.id, f"{phase.rel}/gate.yaml: unlocks[{i}] {text}", path, qualname))
    return entries, gate_paths


def _covers(entry: Entry, module: str) -> bool:
    return module == entry.path or module.startswith(entry.path + "/")


def _names_nothing(root: Path, entry: Entry, modules: dict[str, Module]) -> str:
    """Why ``entry`` names nothing an owner can hold ("" when it names something)."""
    if entry.path != ENGINE and not entry.path.startswith(ENGINE + "/"):
        return "names nothing under engine/ (ownership covers the engine's modules only)"
    target = root / entry.path
    if not target.exists():
        return "names nothing: no such file or directory"
    if entry.qualname:
        if entry.path not in modules:
            return f"names nothing: {entry.path} is not an engine module with code"
        node = modules[entry.path].find(entry.qualname)
        if node is None:
            return f"names nothing: {entry.path} defines no class or function {entry.qualname}"
        return ""
    if target.is_dir():
        return "" if any(_covers(entry, m) for m in modules) else "names nothing: no engine module with code under it"
    return "" if entry.path in modules else "names nothing: not an engine module with code"


def _most_specific(candidates: list[Entry]) -> list[Entry]:
    """The entries of greatest path depth among ``candidates`` (a file is deeper than its directory)."""
    if not candidates:
        return []
    depth = max(len(e.path.split("/")) for e in candidates)
    return [e for e in candidates if len(e.path.split("/")) == depth]


def _twice(what: str, entries: list[Entry]) -> str:
    return (f"{what} is owned twice, by {' and by '.join(e.where for e in entries)}: keep one of these entries")


def load(root: Path, gates: dict[str, Gate]) -> Ownership:
    """Resolve every engine module's and symbol's owner from the ``unlocks:`` of ``gates``
    (phase id -> gate); ``problems`` lists entries that name nothing, are redundant or own a
    thing twice, and what no phase owns."""
    entries, gate_paths = _entries(root, gates)
    own = Ownership(engine_modules(root), gate_paths)
    valid = []
    for e in entries:
        why = _names_nothing(root, e, own.modules)
        if why:
            own.problems.append(f"{e.where}: {why}")
        else:
            valid.append(e)
    path_entries = [e for e in valid if not e.qualname]
    for path in own.modules:
        top = _most_specific([e for e in path_entries if _covers(e, path)])
        if len(top) > 1:
            own.problems.append(_twice(path, top))
        if top:
            own.owner[(path, "")] = top[0].phase
    by_symbol: dict[tuple[str, str], list[Entry]] = {}
    for e in valid:
        if e.qualname:
            by_symbol.setdefault((e.path, e.qualname), []).append(e)
    for (path, qualname), claims in by_symbol.items():
        if len(claims) > 1:
            own.problems.append(_twice(f"{path}::{qualname}", claims))
    # parents before children, so a method entry is judged against its class's owner
    for (path, qualname), claims in sorted(by_symbol.items(), key=lambda kv: (kv[0][0], kv[0][1].count("."))):
        before = own.owner_of(path, qualname)
        if before == claims[0].phase:
            own.problems.append(f"{claims[0].where}: redundant, phase {before} owns it already through a less "
                                "specific entry; drop this one")
        own.owner[(path, qualname)] = claims[0].phase
    own.problems += _redundant_paths(path_entries, own)
    own.problems += _unowned(own)
    return own


def _redundant_paths(path_entries: list[Entry], own: Ownership) -> list[str]:
    """File or directory entries that give every module they cover the owner it would have anyway."""
    problems = []
    for e in path_entries:
        enclosing = _most_specific([o for o in path_entries if o.path != e.path and _covers(o, e.path)])
        if enclosing and all(o.phase == e.phase for o in enclosing):
            problems.append(f"{e.where}: redundant, phase {e.phase} owns it already through {enclosing[0].path}; "
                            "drop this one")
    return problems


def _unowned(own: Ownership) -> list[str]:
    """Modules whose own code no entry owns (with the top-level symbols no ``::`` entry saves)."""
    problems = []
    for path, module in own.modules.items():
        if (path, "") in own.owner:
            continue
        missing = [q for q in module.defs if own.owner_of(path, q) is None]
        listed = f" and its top-level {', '.join(missing)}" if missing else ""
        problems.append(f"{path}: its module-level code{listed} owned by no phase; add `{path}` to unlocks: in the "
                        "gate.yaml of the phase whose tests cover it (phases/NN_*/gate.yaml)")
    return problems


# ---- the layering rule ----------------------------------------------------------------------------

Target = tuple[str, str]  # (module path, qualname or "" for the module's own code)


def _dotted(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _module_file(root: Path, dotted: str) -> str | None:
    """``engine.x.y`` -> ``engine/x/y.py`` or ``engine/x/y/__init__.py`` (None: no such module)."""
    base = dotted.replace(".", "/")
    return next((c for c in (f"{base}.py", f"{base}/__init__.py") if (root / c).is_file()), None)


@dataclass
class _Names:
    """What the names a unit may read stand for: engine imports and its module's top-level names."""
    root: Path
    modules: dict[str, Module]
    path: str                                            # the module being read
    targets: dict[str, Target] = field(default_factory=dict)
    module_names: set[str] = field(default_factory=set)  # names bound to a whole module

    def imports(self, nodes, bind: bool) -> dict[str, Target]:
        """What the ``engine`` imports among ``nodes`` bind; with ``bind``, the names keep it."""
        bound: dict[str, Target] = {}
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                package = self.path.split("/")[:-node.level] if node.level else []
                dotted = ".".join(package + [node.module or ""]).strip(".")
                pairs = [(a.asname or a.name, dotted, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                pairs = [(a.asname or a.name.split(".")[0], a.name, None) for a in node.names]
            else:
                continue
            for local, dotted, name in pairs:
                target = self._resolve(dotted, name) if dotted.split(".")[0] == ENGINE else None
                if target is not None:
                    bound[local] = target
                    if bind and target[1] == "" and _dotted(target[0]) == (f"{dotted}.{name}" if name else dotted):
                        self.module_names.add(local)
        if bind:
            self.targets.update(bound)
        return bound

    def _resolve(self, dotted: str, name: str | None) -> Target | None:
        sub = _module_file(self.root, f"{dotted}.{name}") if name else _module_file(self.root, dotted)
        if sub is not None:
            return (sub, "")
        path = _module_file(self.root, dotted)
        if path is None or path not in self.modules:
            return None
        return (path, name) if name in self.modules[path].defs else (path, "")

    def attribute(self, module: str, attr: str) -> Target:
        """``module.attr`` for a name bound to ``module``: a submodule, a top-level symbol, or its code."""
        sub = _module_file(self.root, f"{_dotted(module)}.{attr}")
        if sub is not None:
            return (sub, "")
        return (module, attr) if module in self.modules and attr in self.modules[module].defs else (module, "")


def module_imports(root: Path, own: Ownership, path: str) -> set[str]:
    """The engine modules that module ``path``'s top-level imports reach (the module of each name)."""
    names = _Names(root, own.modules, path)
    return {target[0] for target in names.imports(own.modules[path].tree.body, bind=False).values()}


class _References(ast.NodeVisitor):
    """The targets one unit refers to (``found``) and the bound names it reads (``used``). Type
    annotations are no references (``typing`` collects the names they read); the nodes in
    ``skip`` (sub-units with an owner of their own) are not read."""

    def __init__(self, names: _Names, skip: set[int]):
        self.names, self.skip = names, skip
        self.found: set[Target] = set()
        self.used: set[str] = set()
        self.typing: set[str] = set()

    def visit(self, node):
        if id(node) not in self.skip:
            super().visit(node)

    def _annotation(self, node: ast.AST | None):
        if node is not None:
            self.typing |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}

    def visit_arg(self, node: ast.arg):
        self._annotation(node.annotation)

    def visit_AnnAssign(self, node: ast.AnnAssign):
        self._annotation(node.annotation)
        self.visit(node.target)
        if node.value is not None:
            self.visit(node.value)

    def _function(self, node):
        self._annotation(node.returns)
        for d in node.decorator_list:
            self.visit(d)
        self.visit(node.args)
        for stmt in node.body:
            self.visit(stmt)

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Name(self, node: ast.Name):
        if node.id in self.names.targets:
            self.used.add(node.id)
            self.found.add(self.names.targets[node.id])

    def visit_Attribute(self, node: ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id in self.names.module_names:
            self.used.add(node.value.id)
            self.found.add(self.names.attribute(self.names.targets[node.value.id][0], node.attr))
        else:
            self.generic_visit(node)

    def visit_Import(self, node):
        self.found.update(self.names.imports([node], bind=False).values())

    visit_ImportFrom = visit_Import


def _units(own: Ownership, path: str) -> list[tuple[str, ast.AST | None]]:
    """(qualname, node) of the units of module ``path``: "" (the module's own code, node None),
    every top-level class and function, and every deeper symbol an entry names."""
    module = own.modules[path]
    units: list[tuple[str, ast.AST | None]] = [("", None)] + list(module.defs.items())
    units += [(q, module.find(q)) for (p, q) in own.owner if p == path and "." in q]
    return units


def _gates_imports(path: str, tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        found += [n for n in names if n.split(".")[0] == "gates"]
    return found


def _references(root: Path, own: Ownership, path: str) -> dict[str, set[Target]]:
    """Unit qualname -> the targets it refers to; an import no unit reads, not even in an
    annotation (a re-export), is the module's own reference."""
    module = own.modules[path]
    names = _Names(root, own.modules, path)
    names.targets |= {name: (path, name) for name in module.defs}
    imports = [n for n in module.tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    imported = names.imports(imports, bind=True)
    units = _units(own, path)
    sub_units = {id(n): q for q, n in units if n is not None}
    refs, read = {}, set()
    for qualname, node in units:
        visitor = _References(names, {i for i, q in sub_units.items() if q != qualname})
        for stmt in ([s for s in module.tree.body if s not in imports] if node is None else [node]):
            visitor.visit(stmt)
        refs[qualname] = visitor.found - {(path, qualname)}
        read |= visitor.used | visitor.typing
    refs[""] |= {t for name, t in imported.items() if name not in read}
    return refs


def layering(root: Path, own: Ownership, gates: dict[str, Gate]) -> list[str]:
    """Every reference that breaks the layering rule, one line each, saying what to change."""
    closure = dependency_closure(gates)
    problems = []
    for path, module in own.modules.items():
        problems += [f"{path}: imports {name}; the engine must not import the gate runner"
                     for name in _gates_imports(path, module.tree)]
        for qualname, targets in _references(root, own, path).items():
            phase = own.owner_of(path, qualname)
            for t_path, t_qual in sorted(targets):
                other = own.owner_of(t_path, t_qual)
                if phase is None or other is None or other == phase or other in closure[phase]:
                    continue
                user = f"{path}::{qualname}" if qualname else f"{path} (module-level code)"
                problems.append(
                    f"{user} (phase {phase}) uses {t_path + ('::' + t_qual if t_qual else '')} (phase {other}), "
                    f"but phase {phase} does not depend on {other}: move the code, let another phase own one of "
                    f"them (unlocks: in {own.gate_paths[phase]} or {own.gate_paths[other]}), or add the dependency")
    return problems


def dependency_closure(gates: dict[str, Gate]) -> dict[str, set[str]]:
    """Phase -> every phase it depends on, directly or not."""
    closure: dict[str, set[str]] = {}

    def deps(i: str) -> set[str]:
        if i not in closure:
            closure[i] = set()
            for d in gates[i].depends_on:
                closure[i] |= {d} | (deps(d) if d in gates else set())
        return closure[i]
    for i in gates:
        deps(i)
    return closure


def all_gates(root: Path) -> dict[str, Gate]:
    return {p.id: p.load_gate() for p in discover(root)}


def check(root: Path) -> list[str]:
    """Every ownership and layering problem of the tree at ``root`` (empty when there is none)."""
    gates = all_gates(root)
    own = load(root, gates)
    return own.problems + layering(root, own, gates)

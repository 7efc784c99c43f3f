"""No module of ``engine`` reaches itself through its imports, imports under ``if TYPE_CHECKING:``
included (``lint-imports`` leaves those out of its layering contracts; here they count, so an
annotation cannot hide a circle either)."""
from __future__ import annotations

import grimp


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan, iterative),
    each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, imported = work[-1]
            for other in imported:
                if other not in index:
                    index[other] = low[other] = len(index)
                    stack.append(other)
                    on_stack.add(other)
                    work.append((other, iter(sorted(graph.find_modules_directly_imported_by(other)))))
                    break
                if other in on_stack:
                    low[module] = min(low[module], index[other])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == module:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


def circle(graph: grimp.ImportGraph, component: list[str]) -> list[str]:
    """One circle through the component's first module: it, what it imports, ..., it again."""
    first = component[0]
    members = set(component)
    for imported in sorted(graph.find_modules_directly_imported_by(first) & members):
        back = graph.find_shortest_chain(importer=imported, imported=first)
        if back:
            return [first, *back]
    return component


def test_engine_has_no_import_circle():
    graph = grimp.build_graph("engine", exclude_type_checking_imports=False)
    circles = [circle(graph, component) for component in strongly_connected(graph)]
    assert not circles, "engine has import circles (each: a module, what it imports, ..., the module again; " \
        "imports under TYPE_CHECKING count):\n" + "\n".join(" -> ".join(c) for c in circles)

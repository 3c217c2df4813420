"""Fail when modules of a package import each other in a cycle (run by scripts/importcheck.sh, in its tool venv).

    python scripts/import_cycles.py PACKAGE

The package is found on sys.path (importcheck.sh sets PYTHONPATH to the folder holding it). Every import statement
counts, those under ``if TYPE_CHECKING:`` and those inside functions included: a cycle of type-only imports still
means neither module can be read, moved or tested without the other. A submodule importing its own package's
``__init__`` that imports it back is a cycle too (import-linter's acyclic_siblings contract compares sibling
subpackages and does not see it), so the check runs on the plain module graph: each strongly connected group of
two or more modules is one cycle, printed as its shortest loop through the group's first module, with the line of
each import. Exit status 1 when a cycle exists, 0 otherwise.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Dict, List, Mapping, Sequence, Set

import grimp


def strongly_connected(edges: Mapping[str, Set[str]]) -> List[List[str]]:
    """The groups of modules that reach each other (Tarjan's algorithm, iterative), each sorted, groups of one left
    out. ``edges`` maps every module to the modules it imports directly."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    groups: List[List[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return sorted(groups)


def shortest_loop(edges: Mapping[str, Set[str]], group: Sequence[str]) -> List[str]:
    """The shortest import path from the group's first module back to itself, staying inside the group (breadth
    first); the module appears at both ends."""
    start = group[0]
    members = set(group)
    came_from: Dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(edges[node] & members):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return path[::-1] + [start]
            if child not in came_from:
                came_from[child] = node
                queue.append(child)
    raise AssertionError(f"{start} is in a strongly connected group but reaches no loop")


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print("usage: import_cycles.py PACKAGE", file=sys.stderr)
        return 2
    graph = grimp.build_graph(argv[0], exclude_type_checking_imports=False, cache_dir=None)
    edges = {module: set(graph.find_modules_directly_imported_by(module)) for module in graph.modules}
    groups = strongly_connected(edges)
    if not groups:
        print(f"No import cycles between the modules of {argv[0]} ({len(edges)} modules).")
        return 0
    print(f"Import cycles between the modules of {argv[0]} BROKEN: {len(groups)} group(s) of modules import each "
          "other. Each loop below is the shortest through the group's first module; removing one import of it (or "
          "moving the shared names to a module both can import) breaks it.")
    for group in groups:
        loop = shortest_loop(edges, group)
        print()
        print(f"- cycle of {len(group)} module(s): {', '.join(group)}")
        for importer, imported in zip(loop, loop[1:]):
            lines = sorted({detail["line_number"] for detail in graph.get_import_details(importer=importer,
                                                                                          imported=imported)})
            where = ", ".join(f"l.{line}" for line in lines)
            print(f"    {importer} -> {imported} ({where})")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

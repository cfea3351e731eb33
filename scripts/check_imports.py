#!/usr/bin/env python3
"""Check that the import graph of the product runs one way (docs/ARCHITECTURE.md#packages).

The graph is read with `ast` from every `.py` file of the product packages; an import inside a
function or under `if TYPE_CHECKING:` is an arrow too (it is still a dependency of the design).
Four rules, each problem one line on stdout:

1. No module circle anywhere: no set of modules that import each other in a loop.
2. No folder cycle in `kiln_train`: its folders (and top-level modules) stand on floors, and a
   folder imports only folders on lower floors (`KILN_TRAIN_FLOORS`).
3. Packages stand on floors too (`PACKAGE_MAY_IMPORT`): `kiln_train` at the bottom, then the
   ground `kiln` (store, settings, broker), then `api`, `worker` and `migrations`, then the CLI;
   no arrow runs back up, and `api` never imports `worker`.
4. The api stays torch-free: what an api module imports at module level, followed through the
   module-level imports of everything it reaches, never loads torch, Triton, fla or `worker`.

Usage: .venv/bin/python scripts/check_imports.py [ROOT]   (exit 1 and one line per problem)
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("kiln_train", "kiln", "api", "worker", "migrations", "kiln_cli")
# Which product package may import which: the floors of the house, bottom to top.
PACKAGE_MAY_IMPORT = {
    "kiln_train": set(),
    "kiln": {"kiln_train"},
    "api": {"kiln", "kiln_train"},
    "worker": {"kiln", "kiln_train"},
    "migrations": {"kiln", "kiln_train"},
    "kiln_cli": {"kiln", "kiln_train", "api", "worker", "migrations"},
}
# The floors of kiln_train, bottom to top: a unit imports only units on lower floors. A unit is
# a folder (`data`) or a top-level module (`errors.py`); the package's `__init__.py` resolves its
# exports lazily, so it stands at the bottom and imports nothing of its own.
KILN_TRAIN_FLOORS = (
    ("errors.py", "__init__.py"),
    ("ground",),
    ("kernels",),
    ("optim",),
    ("sft_config.py",),
    ("data",),
    ("model",),
    ("artifacts",),
    ("checkpoint",),
    ("plan",),
    ("train",),
    ("interop", "qualify"),
)
# Modules the api must not load when it starts (rule 4), by top-level name.
API_MUST_NOT_LOAD = ("torch", "triton", "fla", "worker")


@dataclass
class Graph:
    """Module name → the product modules it imports; `runtime` keeps only module-level arrows."""

    files: dict[str, Path] = field(default_factory=dict)
    arrows: dict[str, set[str]] = field(default_factory=dict)
    runtime: dict[str, set[str]] = field(default_factory=dict)
    # Module-level imports of anything outside the product (top-level names: torch, flask).
    outside: dict[str, set[str]] = field(default_factory=dict)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_imports(tree: ast.Module) -> set[int]:
    """Ids of the import nodes that run when the module is imported (not in a def or TYPE_CHECKING)."""
    found: set[int] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.add(id(node))
            elif isinstance(node, ast.If):
                if not is_type_checking(node):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    visit(block)
            elif isinstance(node, ast.With):
                visit(node.body)

    visit(tree.body)
    return found


def import_targets(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, files: dict[str, Path]
) -> tuple[set[str], set[str]]:
    """The product modules one import statement loads, and the top-level names of the others."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        # `from X import y` loads the module X.y when there is one, else X itself.
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
    targets = {resolve(name, files) for name in names}
    outside = {name.split(".")[0] for name in names if resolve(name, files) is None}
    return targets - {None}, outside


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The product module a dotted name loads: itself, or the nearest package or module above it."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def read_graph(root: Path) -> Graph:
    graph = Graph()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            graph.files[module_name(root, path)] = path
    for module, path in graph.files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        at_load = runtime_imports(tree)
        is_package = path.name == "__init__.py"
        graph.arrows[module], graph.runtime[module], graph.outside[module] = set(), set(), set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            targets, outside = import_targets(node, module, is_package, graph.files)
            targets.discard(module)
            graph.arrows[module] |= targets
            if id(node) in at_load:
                graph.runtime[module] |= targets
                graph.outside[module] |= outside
    return graph


def circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(arrows):
        if start in index:
            continue
        work = [(start, iter(sorted(arrows.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(arrows.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return found


def kiln_train_unit(module: str, files: dict[str, Path]) -> str | None:
    parts = module.split(".")
    if parts[0] != "kiln_train":
        return None
    if len(parts) == 1:
        return "__init__.py"
    if len(parts) == 2 and files[module].name != "__init__.py":
        return f"{parts[1]}.py"
    return parts[1]


def arrows_between(graph: Graph, unit_of) -> dict[tuple[str, str], list[str]]:
    """(from unit, to unit) → the module arrows that make it, for units that differ."""
    found: dict[tuple[str, str], list[str]] = {}
    for module, targets in sorted(graph.arrows.items()):
        source = unit_of(module)
        for target in sorted(targets):
            dest = unit_of(target)
            if source and dest and source != dest:
                found.setdefault((source, dest), []).append(f"{module} -> {target}")
    return found


def check_module_circles(graph: Graph) -> list[str]:
    return [f"module circle: {' <-> '.join(members)}" for members in circles(graph.arrows)]


def check_kiln_train_floors(graph: Graph) -> list[str]:
    floor_of = {unit: floor for floor, units in enumerate(KILN_TRAIN_FLOORS) for unit in units}
    problems = []
    between = arrows_between(graph, lambda module: kiln_train_unit(module, graph.files))
    folder_arrows: dict[str, set[str]] = {}
    for (source, dest), how in between.items():
        folder_arrows.setdefault(source, set()).add(dest)
        if source not in floor_of or dest not in floor_of:
            unknown = source if source not in floor_of else dest
            problems.append(f"kiln_train/{unknown} has no floor in KILN_TRAIN_FLOORS")
        elif floor_of[dest] >= floor_of[source]:
            problems.append(f"kiln_train/{source} imports kiln_train/{dest} on its floor or above: {how[0]}")
    for members in circles(folder_arrows):
        problems.append(f"kiln_train folder cycle: {' <-> '.join(members)}")
    return sorted(set(problems))


def check_package_floors(graph: Graph) -> list[str]:
    between = arrows_between(graph, lambda module: module.split(".")[0])
    return [
        f"{source} imports {dest}, which stands above it: {how[0]}"
        for (source, dest), how in sorted(between.items())
        if dest not in PACKAGE_MAY_IMPORT[source]
    ]


def check_api_loads(graph: Graph) -> list[str]:
    problems = []
    for start in sorted(m for m in graph.files if m.split(".")[0] == "api"):
        seen, todo, via = {start}, [start], {start: ""}
        while todo:
            module = todo.pop()
            # Importing a.b.c runs a/__init__ and a/b/__init__ first.
            parents = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
            for target in sorted(graph.runtime[module] | (parents & graph.files.keys())):
                if target not in seen:
                    seen.add(target)
                    via[target] = module
                    todo.append(target)
        for bad in API_MUST_NOT_LOAD:
            culprit = next((m for m in sorted(seen) if bad in {m.split(".")[0]} | graph.outside[m]), None)
            if culprit is not None:
                chain = [culprit]
                while via[chain[-1]]:
                    chain.append(via[chain[-1]])
                problems.append(f"{start} loads {bad} when imported: {' <- '.join(chain)}")
    return problems


def check(root: Path) -> tuple[list[str], Graph]:
    graph = read_graph(root)
    problems = check_module_circles(graph)
    problems += check_kiln_train_floors(graph)
    problems += check_package_floors(graph)
    problems += check_api_loads(graph)
    return problems, graph


def main(argv: list[str]) -> int:
    root = Path(argv[1]).resolve() if len(argv) > 1 else Path(__file__).resolve().parent.parent
    problems, graph = check(root)
    for problem in problems:
        print(problem)
    arrows = sum(len(targets) for targets in graph.arrows.values())
    print(f"{len(graph.files)} modules, {arrows} import arrows; {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

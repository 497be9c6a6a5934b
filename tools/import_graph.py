"""Print finetune's import graph between its packages and top-level modules, and any
import cycle between modules. Reads the source with ast; imports nothing of finetune.

    python tools/import_graph.py            # edges between packages / top-level modules
    python tools/import_graph.py --modules  # edges between modules
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "finetune"


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, module: str, known: set[str]) -> set[str]:
    """finetune modules `path` imports, at any depth of the file (late imports too)."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
            if not all(name in known for name in names):
                names.append(base)  # a name defined in the module `base` itself
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            # A module's own packages run first whatever it imports: no edge of its own.
            if name.startswith("finetune") and not module.startswith(name + ".") and \
                    name != module and not (name == "finetune" and "." in module):
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    paths = {module_of(p): p for p in PACKAGE.rglob("*.py")}
    return {module: imports(path, module, set(paths)) for module, path in paths.items()}


def unit(module: str) -> str:
    """finetune.config.schema -> config; finetune.worker -> worker."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                item = stack.pop()
                component.append(item)
                if item == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def main() -> None:
    edges = graph()
    if "--modules" in sys.argv:
        for module in sorted(edges):
            for target in sorted(edges[module]):
                print(f"{module} -> {target}")
    else:
        units: dict[str, set[str]] = defaultdict(set)
        for module, targets in edges.items():
            units[unit(module)] |= {unit(t) for t in targets} - {unit(module)}
        for name in sorted(units):
            print(f"{name} -> {', '.join(sorted(units[name])) or '(nothing)'}")
    for component in cycles(edges):
        print("cycle:", " <-> ".join(component))


if __name__ == "__main__":
    main()

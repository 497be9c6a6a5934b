"""Print finetune's import graph between its packages and top-level modules, and any
import cycle between modules. Reads the source with ast; imports nothing of finetune.

    python tools/import_graph.py              # edges between packages / top-level modules
    python tools/import_graph.py --modules    # edges between modules
    python tools/import_graph.py --top-level  # only the imports that run when the module
                                              # is imported (not those inside functions)

tests/test_layers.py asserts the layering on the same reading.
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


def _top_level_nodes(body: list[ast.stmt]):
    """The statements that run when the module is imported: the module's own, and those
    inside its if/try/with/for/while blocks and class bodies; not function bodies, nor an
    `if TYPE_CHECKING:` block."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _top_level_nodes(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody"):
            yield from _top_level_nodes(getattr(node, field, None) or [])
        for handler in getattr(node, "handlers", None) or []:
            yield from _top_level_nodes(handler.body)


def imports(path: Path, module: str, known: set[str], top_level: bool = False,
            tree: ast.AST | None = None) -> set[str]:
    """finetune modules `path` imports, at any depth of the file (late imports too), or
    with `top_level` only those that run when it is imported. `tree`: read this part of
    the file (a function, say) instead of the whole."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    if tree is None:
        tree = ast.parse(path.read_text(), str(path))
    nodes = _top_level_nodes(tree.body) if top_level else ast.walk(tree)
    for node in nodes:
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


def modules() -> dict[str, Path]:
    """finetune.config.schema -> its file, for every module of the package."""
    return {module_of(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def graph(top_level: bool = False) -> dict[str, set[str]]:
    """module -> the finetune modules it imports (see `imports`)."""
    paths = modules()
    return {module: imports(path, module, set(paths), top_level)
            for module, path in paths.items()}


def unit(module: str) -> str:
    """finetune.config.schema -> config; finetune.cli -> cli."""
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
    edges = graph(top_level="--top-level" in sys.argv)
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

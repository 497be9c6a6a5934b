"""The package's layering, read from the source (tools/import_graph.py's ast reading; nothing
of finetune is imported): no import cycles, config at the bottom, the torch-free commands
free of the torch side, render apart from launch.

`python tools/import_graph.py [--modules] [--top-level]` prints the graph these tests read.
"""

from __future__ import annotations

import ast
import importlib.util

from conftest import REPO

_spec = importlib.util.spec_from_file_location("import_graph", REPO / "tools" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)

EVERY = import_graph.graph()  # every import, late ones (inside functions) too
TOP = import_graph.graph(top_level=True)  # those that run when the module is imported

# Packages that import torch, transformers, trl or peft, and the modules of theirs that do
# not (data/files.py: it reads and hashes files, and the fingerprint uses it; data/scan.py,
# with the row checks of data/rows.py, data/formats.py, data/peer_rows.py and
# data/images.py, is validate's data pass, and data/sizes.py its warnings;
# model/chat_template.py, the chat template checks it shares with training;
# inference/cli.py: the CLI builds its parsers at every start; run/launched.py: `finetune
# train` checks its launch before torch is loaded; run/noise.py: the library messages every
# command hides before the libraries load).
TORCH_SIDE = ("data", "model", "methods", "trainers", "run", "inference")
TORCH_SIDE_MODULES = ("finetune.commands.data_view", "finetune.commands.eval_saved")
NOT_TORCH_SIDE = ("finetune.data.files", "finetune.data.rows", "finetune.data.formats",
                  "finetune.data.peer_rows", "finetune.data.llava_rows",
                  "finetune.data.plain_text",
                  "finetune.data.images", "finetune.data.scan", "finetune.data.sizes",
                  "finetune.data.image_size",
                  "finetune.inference.cli", "finetune.run.launched", "finetune.run.noise",
                  "finetune.model.chat_template")
# What `finetune validate/render/estimate/plot/push/eval --help/launch --dry-run` and a
# launcher run: importing any of these must not load the torch side.
TORCH_FREE = ("config", "render", "launch", "rundir", "report", "hub", "estimate", "fileio",
              "errors", "cli")
TORCH_FREE_MODULES = ("finetune.commands.args", "finetune.commands.data",
                      "finetune.commands.eval", "finetune.commands.machine",
                      "finetune.run.launched", "finetune.inference.cli")


def unit(module: str) -> str:
    return import_graph.unit(module)


PACKAGES = {m for m, path in import_graph.modules().items() if path.name == "__init__.py"}


def torch_side(module: str) -> bool:
    """A module of the torch side. A package's __init__ is judged by what it imports (an
    empty finetune/data/__init__.py runs before data/files.py)."""
    return (unit(module) in TORCH_SIDE or module in TORCH_SIDE_MODULES) and \
        module not in NOT_TORCH_SIDE and module not in PACKAGES


def loaded_by(module: str) -> set[str]:
    """Every finetune module that importing `module` runs: its packages' __init__ and the
    top-level imports of each, transitively."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(2, len(parts)) if ".".join(parts[:i]) in TOP]
        todo += TOP[name]
    return seen


def package_edges(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(unit(a), unit(b)) for a, targets in edges.items() for b in targets
            if unit(a) != unit(b)}


def test_the_graph_is_read():
    # A reading that found nothing would pass every test below.
    assert "finetune.config.schema" in EVERY["finetune.config.load"]
    assert "finetune.run.worker" in EVERY["finetune.cli"]
    assert "finetune.run.worker" not in TOP["finetune.cli"]
    assert len(EVERY) > 50


def test_no_import_cycle_between_modules():
    assert import_graph.cycles(EVERY) == []


def test_config_imports_only_config_and_errors():
    outside = {(a, b) for a, targets in EVERY.items() if unit(a) == "config"
               for b in targets if unit(b) not in ("config", "errors")}
    assert not outside


def test_torch_free_modules_load_nothing_of_the_torch_side():
    found = {}
    for module in TOP:
        if unit(module) in TORCH_FREE or module in TORCH_FREE_MODULES:
            heavy = sorted(m for m in loaded_by(module) if torch_side(m))
            if heavy:
                found[module] = heavy
    assert not found


def test_the_cli_imports_the_torch_side_only_to_train():
    """Every command but `train` (argument parsing, validate, render, launch, slurm,
    estimate, reference) stays torch-free, late imports included."""
    path = import_graph.PACKAGE / "cli.py"
    known = set(EVERY)
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name != "_train":
            late = import_graph.imports(path, "finetune.cli", known, tree=node)
            heavy = sorted(m for name in late for m in loaded_by(name) if torch_side(m))
            if heavy:
                found[node.name] = heavy
    assert not found


def test_render_does_not_import_launch():
    assert not {(a, b) for a, targets in EVERY.items() if unit(a) == "render"
                for b in targets if unit(b) == "launch"}


# The pieces a run is built from do not import what assembles them: render (the run
# bundle and scripts) and methods (each method's data and trainer).
BUILDING_BLOCKS = ("data", "model", "estimate")
ASSEMBLERS = ("render", "methods")


def test_building_blocks_import_neither_render_nor_methods():
    edges = package_edges(EVERY)
    assert not {(a, b) for a, b in edges if a in BUILDING_BLOCKS and b in ASSEMBLERS}


def test_a_run_does_not_import_launch():
    """What runs on each rank (run/) checks how it was launched itself (run/launched.py);
    launch/ starts processes and may import run/, not the other way."""
    assert not {(a, b) for a, b in package_edges(EVERY) if a == "run" and b == "launch"}


def test_training_does_not_import_inference():
    """Training's packages load a saved run's model from model/saved.py; inference/ is
    what uses a run after training."""
    training = ("data", "model", "methods", "trainers", "run")
    assert not {(a, b) for a, b in package_edges(EVERY) if a in training and b == "inference"}


FILE_HELPERS = ("write_atomic", "sha256_of", "fsync_dir")


def test_file_helpers_come_from_fileio():
    """Atomic writes and hashes have one home, fileio/atomic.py: nothing takes them from
    the checkpoints module (which uses them too)."""
    found = []
    for module, path in import_graph.modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module != "finetune.fileio.atomic":
                found += [f"{module}: from {node.module} import {a.name}"
                          for a in node.names if a.name in FILE_HELPERS]
            elif isinstance(node, ast.Attribute) and node.attr in FILE_HELPERS:
                found.append(f"{module}: {ast.unparse(node)}")
    assert not found


def test_the_top_level_holds_only_the_entry_and_what_everything_shares():
    """Everything else lives in a package named for what it is (docs/architecture.md)."""
    top = sorted(p.name for p in import_graph.PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "cli.py", "compat.py", "errors.py"]
    for package in sorted(p for p in import_graph.PACKAGE.iterdir() if p.is_dir()
                          and p.name != "__pycache__"):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert doc, f"{package.name}/__init__.py says what the package holds"

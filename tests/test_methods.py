"""The method registry (finetune/config/methods.py): every record complete and consistent
with the TRL field manifest, the data layer, the model loader, the schema and its own
module; and no torch-free code branching on a method's name instead of its record."""

from __future__ import annotations

import ast
import importlib
import json
import typing

import pytest
from pydantic import BaseModel

from conftest import REPO
from finetune.config import trl_fields
from finetune.config.methods import ALL_STRATEGIES, METHODS, NAMES
from finetune.config.schema import DistributedSection, Experiment

RECORDS = list(METHODS.values())
ids = [m.name for m in RECORDS]


def _fields(record) -> dict:
    module, name = record.config_class
    manifest = json.loads(trl_fields.MANIFEST.read_text())["classes"]
    assert name in manifest, f"{name} is not in trl_fields.json: add it and regenerate"
    assert manifest[name]["module"] == module
    return manifest[name]["fields"]


def _section_model(name: str) -> type[BaseModel]:
    annotation = Experiment.model_fields[name].annotation
    found = [a for a in (annotation, *typing.get_args(annotation))
             if isinstance(a, type) and issubclass(a, BaseModel)]
    assert found, f"experiment key {name} is not a section"
    return found[0]


def _setting_exists(record, path: str) -> bool:
    """A dotted experiment path: a field of the config class under training, else a field
    of a schema section."""
    section, _, key = path.partition(".")
    if section == "training":
        return key in _fields(record)
    return section in Experiment.model_fields and key in _section_model(section).model_fields


def test_the_schema_takes_exactly_the_recorded_methods():
    assert typing.get_args(Experiment.model_fields["method"].annotation) == NAMES
    assert all(name == record.name for name, record in METHODS.items())


@pytest.mark.parametrize("record", RECORDS, ids=ids)
def test_config_class_and_its_defaults_are_in_the_manifest(record):
    fields = _fields(record)
    for key in record.defaults:
        assert key in fields and key not in trl_fields.OWNED, key
    if record.reference and record.reference.switch:
        assert record.reference.switch in fields


@pytest.mark.parametrize("record", RECORDS, ids=ids)
def test_head_and_formats_are_known(record):
    from finetune.data.rows import FORMATS
    from finetune.model.load import HEADS

    assert record.head in HEADS
    assert record.formats and len(set(record.formats)) == len(record.formats)
    assert all(name in FORMATS for name in record.formats)
    assert record.sequences in (1, 2)
    assert record.labels is None or record.head == "score"


@pytest.mark.parametrize("record", RECORDS, ids=ids)
def test_sections_and_settings_exist_in_the_schema(record):
    for section in record.sections:
        _section_model(section)
    paths = [record.max_length, record.completion_length, record.labels, record.value_model,
             record.reference.setting if record.reference else None]
    for path in filter(None, paths):
        assert _setting_exists(record, path), path
    assert (record.max_length is None) == record.generates  # one bound or the other
    strategies = typing.get_args(DistributedSection.model_fields["strategy"].annotation)
    assert set(record.strategies) <= set(strategies) == set(ALL_STRATEGIES)
    assert "none" in record.strategies


@pytest.mark.parametrize("record", RECORDS, ids=ids)
def test_module_builds_and_prepares(record):
    module = importlib.import_module(record.module)
    assert record.module.startswith("finetune.methods.")
    assert callable(getattr(module, "build_trainer", None))
    if record.tokenizes:
        assert callable(getattr(module, "prepare", None))


# Torch-free layers, the run and what reports on it read records instead of method names.
READERS = ["config", "data", "estimate", "model", "render", "run", "rundir", "report",
           "hub", "commands"]


def _name_branches(path) -> list[str]:
    """`x.method == "sft"`, `method in ("grpo", "ppo")` and the like."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = any(isinstance(s, (ast.Name, ast.Attribute)) and
                    getattr(s, "id", getattr(s, "attr", None)) == "method" for s in sides)
        constants = [c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant)]
        if names and any(value in NAMES for value in constants):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_no_branch_on_a_method_name():
    paths = []
    for reader in READERS:
        target = REPO / "finetune" / reader
        paths += sorted(target.rglob("*.py")) if target.is_dir() else [target]
    found = [hit for path in paths if path.name != "methods.py" for hit in _name_branches(path)]
    assert not found, f"branch on the method's record instead: {found}"

"""Input paths are a type of the schema (config/inputs.py), not a list kept by hand: every
setting that names a file or directory is declared, and resolution against the YAML file
and the existence checks follow the declaration."""

from __future__ import annotations

import re
import shutil
import typing

import pytest
from pydantic import BaseModel

from conftest import QUICKSTART, TINY_MODEL, run_cli
from finetune.config import inputs, load_experiment
from finetune.config.inputs import Input, Output
from finetune.config.inputs import _members as _types  # Optional/Annotated unwrapped
from finetune.config.methods import METHODS
from finetune.config.schema import Experiment

# A text setting whose name says file, path, dir, model, teacher, template, resume or
# function names a file or directory, unless it is here with the reason it does not.
LOOKS_LIKE_A_PATH = re.compile(r"path|file|dir|model|teacher|template|resume|function")
NOT_PATHS = {
    ("data", "train", "*", "data_files"): "files inside a hub dataset repository",
    ("data", "eval", "*", "data_files"): "files inside a hub dataset repository",
    ("output", "hub_model_id"): "a hub repository id to upload to",
    ("ppo", "value_model"): "separate or shared",
}


def _settings(model: type[BaseModel], loc: tuple = ()):
    """Every leaf setting of the schema, list items as '*'."""
    for name, field in model.model_fields.items():
        here = loc + (name,)
        nested = False
        for member in _types(field.annotation):
            if typing.get_origin(member) is list:
                for item in _types(typing.get_args(member)[0]):
                    if isinstance(item, type) and issubclass(item, BaseModel):
                        nested = True
                        yield from _settings(item, here + ("*",))
            elif isinstance(member, type) and issubclass(member, BaseModel):
                nested = True
                yield from _settings(member, here)
        if not nested:
            yield here, field.annotation


def _holds_text(annotation) -> bool:
    """str, or a list of str: what a path is written as (a bool flag is not)."""
    for member in _types(annotation):
        if member is str or (typing.get_origin(member) is list and str in _types(
                typing.get_args(member)[0])):
            return True
    return False


def test_every_setting_that_looks_like_a_path_is_declared():
    declared = inputs.declared(Experiment)
    undeclared = []
    for loc, annotation in _settings(Experiment):
        if not LOOKS_LIKE_A_PATH.search(loc[-1]) or loc in NOT_PATHS or not _holds_text(
                annotation):
            continue
        if loc not in declared and loc + ("*",) not in declared:
            undeclared.append(".".join(loc))
    assert not undeclared, f"declare these as Input(...) or Output() in the schema: {undeclared}"
    for loc in NOT_PATHS:  # the exceptions are real settings
        assert loc in dict(_settings(Experiment)), loc


def test_every_reference_model_a_method_record_names_is_a_model_input():
    declared = inputs.declared(Experiment)
    named = {m.reference.setting for m in METHODS.values() if m.reference and m.reference.setting}
    assert named == {"dpo.ref_model", "kto.ref_model"}
    for setting in named:
        assert declared[tuple(setting.split("."))] == Input("model"), setting


def test_the_declaration_holds_what_each_check_reads():
    declared = inputs.declared(Experiment)
    models = {".".join(loc) for loc, mark in declared.items()
              if isinstance(mark, Input) and mark.kind == "model"}
    assert models == {"model.name_or_path", "tokenizer.name_or_path", "dpo.ref_model",
                      "kto.ref_model", "rewards.model", "ppo.value_model_path"}
    assert declared[("distill", "teacher")] == Input("teacher")
    assert declared[("data", "train", "*", "path")] == Input("data")
    assert declared[("resume",)] == Input("checkpoint", relative_to="cwd")
    assert declared[("output", "dir")] == Output()
    # the forms a data source is written in before validation shapes it
    for loc in (("data", "train"), ("data", "train", 0), ("data", "eval", "path"),
                ("data", "eval", 1, "path")):
        assert inputs.mark_at(Experiment, loc) == Input("data"), loc
    assert inputs.mark_at(Experiment, ("data", "train", 0, "split")) is None


@pytest.mark.parametrize("loc", ["dpo.ref_model", "kto.ref_model", "ppo.value_model_path"])
def test_a_model_path_is_relative_to_the_yaml_file_wherever_it_is_declared(loc, tmp_path,
                                                                           monkeypatch):
    """Run from another directory, ./ref names the directory beside the YAML file, for
    every model input (kto's was once left out of a hand-kept list)."""
    project = tmp_path / "project"
    shutil.copytree(TINY_MODEL, project / "ref")
    method = {"dpo": "dpo", "kto": "kto", "ppo": "ppo"}[loc.split(".")[0]]
    extra = {"dpo": "dpo: {ref_model: ./ref}\n", "kto": "kto: {ref_model: ./ref}\n",
             "ppo": "ppo: {value_model_path: ./ref}\nrewards: {model: ./ref}\n"}[method]
    data = QUICKSTART / "data" / ("pref_train.jsonl" if method != "ppo" else "sft_train.jsonl")
    (project / "exp.yaml").write_text(
        f"method: {method}\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
        f"data: {{train: {data}}}\n" + extra)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    experiment = load_experiment(project / "exp.yaml")
    section, key = loc.split(".")
    assert getattr(getattr(experiment, section), key) == str(project / "ref")


@pytest.mark.slow
def test_validate_names_a_missing_model_input_at_its_yaml_path(write, tmp_path):
    """The existence check visits every declared model input (the CLI, one process)."""
    config = write("missing.yaml", f"method: kto\nmodel: {{name_or_path: {TINY_MODEL}, "
                                   f"init: random}}\ndata: {{train: "
                                   f"{QUICKSTART / 'data' / 'pref_train.jsonl'}}}\n"
                                   "kto: {ref_model: ./no-such-ref}\n")
    result = run_cli("validate", str(config), "--no-data", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"kto.ref_model: no such model directory: {tmp_path / 'no-such-ref'}" in \
        result.stderr, result.stderr

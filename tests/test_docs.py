"""The docs run as written: every `finetune` command in README.md and docs/ parses with the
CLI's own parser, every experiment and sweep they show loads (placed where the text puts
it, with the user's data files it names), and every file of the repository named in them
or in a config's comments exists. Torch-free: nothing trains here; the commands' runs are
the quickstart's and the other tests' business."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from conftest import QUICKSTART, REPO
from finetune.cli import build_parser
from finetune.config import load_experiment
from finetune.sweep.spec import read_sweep

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(lang: str) -> list[tuple[str, str]]:
    """(where, text) of every fenced block of `lang` ("" for unlabelled) in the docs."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) == lang:
                line = text[:match.start()].count("\n") + 1
                found.append((f"{doc.relative_to(REPO)}:{line}", match.group(2)))
    return found


def commands() -> list[tuple[str, list[str]]]:
    """Each `finetune ...` line of a bash block (continuations joined, comments cut, the
    block's own VAR=value substituted), as argv after `finetune`."""
    found = []
    for where, text in blocks("bash") + blocks(""):
        text = text.replace("\\\n", " ")
        variables: dict[str, str] = {}
        for line in text.splitlines():
            line = line.split("  #")[0].strip()
            assignment = re.fullmatch(r"([A-Z]+)=(\S+)", line)
            if assignment:
                variables[assignment.group(1)] = assignment.group(2)
                continue
            for name, value in variables.items():
                line = line.replace(f"${name}", value)
            for part in line.split("&&"):
                if re.match(r"\s*(\S*/)?finetune\s", part):
                    found.append((where, shlex.split(part)[1:]))
    return found


COMMANDS = commands()


def test_the_docs_show_commands_and_experiments():
    # A reading that found nothing would pass every test below.
    assert len(COMMANDS) > 20 and len(blocks("yaml")) > 5


def as_typed(argv: list[str]) -> list[str]:
    """What a reader types for the placeholders: <name> and CONFIG filled in, an optional
    [--flag VALUE] or [k=v ...] left out."""
    typed, optional = [], False
    for word in argv:
        optional = optional or word.startswith("[")
        if not optional:
            typed.append(re.sub(r"<\w+>", "x", "x.yaml" if word == "CONFIG" else word))
        optional = optional and not word.endswith("]")
    return typed


@pytest.mark.parametrize("where,argv", COMMANDS,
                         ids=[f"{w}:{' '.join(a)[:40]}" for w, a in COMMANDS])
def test_every_command_parses_and_names_files_that_exist(where, argv):
    argv = as_typed(argv)
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as exc:  # --help exits 0 after printing
        if exc.code != 0:
            pytest.fail(f"{where}: `finetune {' '.join(argv)}` does not parse")
        return
    # what cli.main accepts: overrides after the flags, nothing else
    assert not [word for word in extra if word.startswith("-")], (where, extra)
    config = getattr(args, "config", None)
    if isinstance(config, str) and config.startswith("configs/"):
        assert (REPO / config).is_file(), f"{where}: no {config}"


def _user_dir(tmp_path: Path) -> Path:
    """A user's checkout: the repository's configs, and the data files the docs tell them
    to bring (data/*.jsonl, their own rows: the quickstart's here)."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train", "chat", "math"):
        shutil.copy(QUICKSTART / "data" / "sft_train.jsonl", data / f"{name}.jsonl")
    return tmp_path


@pytest.mark.parametrize("where,text", blocks("yaml"), ids=[w for w, _ in blocks("yaml")])
def test_every_experiment_and_sweep_shown_loads(where, text, tmp_path, online):
    """A whole experiment (method or extends) loads as the reader saves it: README's
    walkthrough file beside the configs, an `extends: ../quickstart/...` one among the
    examples (and then it is the shipped file's opening). A sweep file reads as one. A
    section alone is added to the quickstart sft experiment."""
    home = _user_dir(tmp_path)
    if re.search(r"^parameters:", text, re.M):
        sweep = home / "sweep.yaml"
        sweep.write_text(text)
        read_sweep(sweep)
        return
    if "extends: ../quickstart/" in text:
        name = re.search(r"^name: (\S+)", text, re.M).group(1)
        shipped = REPO / "configs" / "examples" / f"{name}.yaml"
        body = [line for line in text.splitlines() if line.strip()]
        assert all(line in shipped.read_text() for line in body), f"{where}: not {shipped}"
        load_experiment(shipped)
        return
    if not re.search(r"^(method|extends):", text, re.M):
        text = "extends: configs/quickstart/sft.yaml\n" + text
    path = home / "experiment.yaml"
    path.write_text(text)
    load_experiment(path)


# Paths of the repository as the docs write them: configs/..., docs/x.md, tools/..., ...
REPO_PATH = re.compile(r"(?<![\w./-])((?:configs|docs|tests|tools|bench|finetune|"
                       r"accelerate_configs|ds_configs|\.ci)/[\w./-]*[\w/])")
# A module named from inside the package or the repository: run/worker.py, tests/x.py
MODULE = re.compile(r"(?<![\w./-])((?:[a-z_]+/)+[a-z_]+\.py)\b")
# (a library's own files, transformers' distributed/..., are not ours to check)
OURS = {p.name for base in (REPO, REPO / "finetune") for p in base.iterdir() if p.is_dir()}
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _named_paths(text: str) -> set[str]:
    return {p.rstrip("./") for p in REPO_PATH.findall(text)
            if "*" not in p and "<" not in p and not p.startswith("finetune/..")}


def test_every_repository_file_the_docs_and_configs_name_exists():
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        missing += [f"{doc.name}: {p}" for p in _named_paths(text) if not (REPO / p).exists()]
        missing += [f"{doc.name}: {m}" for m in MODULE.findall(text) if m.split("/")[0] in
                    OURS and not (REPO / m).exists() and not (REPO / "finetune" / m).exists()]
        for link in LINK.findall(text):
            if "://" not in link and not (doc.parent / link).exists():
                missing.append(f"{doc.name}: link {link}")
    for config in sorted((REPO / "configs").rglob("*.yaml")):
        comments = "\n".join(line.split("#", 1)[1] for line in config.read_text().splitlines()
                             if "#" in line)
        missing += [f"{config.relative_to(REPO)}: {p}" for p in _named_paths(comments)
                    if not (REPO / p).exists()]
    assert not missing

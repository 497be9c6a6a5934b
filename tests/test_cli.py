"""The CLI as a user runs it: help for every command, validate, exit codes, no traceback,
and no heavy imports on the light paths."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import DATA, REPO, TINY_MODEL, run_cli
from finetune.cli import build_parser

COMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)


@pytest.mark.parametrize("command", [None] + COMMANDS)
def test_help(command, tmp_path):
    args = ["--help"] if command is None else [command, "--help"]
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "usage: finetune" in result.stdout


def test_light_paths_import_no_torch(write):
    config = write("exp.yaml", f"method: sft\nmodel:\n  name_or_path: {TINY_MODEL}\n"
                               f"data:\n  train: {DATA}/sft_train.jsonl\n")
    code = ("import sys\nfrom finetune.cli import main\n"
            f"assert main(['validate', {str(config)!r}]) == 0\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'trl', 'peft', 'datasets', "
            "'accelerate', 'deepspeed') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_validate_ok_and_print(write, tmp_path):
    config = write("exp.yaml", f"method: sft\nmodel:\n  name_or_path: {TINY_MODEL}\n"
                               f"data:\n  train: {DATA}/sft_train.jsonl\n")
    result = run_cli("validate", str(config), cwd=tmp_path)
    assert result.returncode == 0 and ": ok (sft" in result.stdout
    result = run_cli("validate", str(config), "training.seed=7", "--print", cwd=tmp_path)
    assert result.returncode == 0 and "seed: 7" in result.stdout and "save_final: true" in result.stdout


def test_bad_config_exits_2_with_one_line_per_problem(write, tmp_path):
    config = write("exp.yaml", f"method: sft\nmodel:\n  name_or_path: {TINY_MODEL}\n"
                               f"data:\n  train: {DATA}/sft_train.jsonl\n"
                               "training:\n  max_steps: thirty\n  learning_rat: 0.1\n")
    result = run_cli("validate", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith(f"error: {config}:") for line in lines)
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_missing_file_exits_2(tmp_path):
    result = run_cli("validate", "nope.yaml", cwd=tmp_path)
    assert result.returncode == 2 and "no such experiment file" in result.stderr
    assert "Traceback" not in result.stderr


def test_unreachable_hub_model_is_a_clear_error(write, tmp_path):
    config = write("hub.yaml", "method: sft\nmodel:\n  name_or_path: Qwen/Qwen2.5-0.5B-Instruct\n"
                               f"data:\n  train: {DATA}/sft_train.jsonl\n")
    result = run_cli("train", str(config), cwd=tmp_path)  # offline (conftest), not cached
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "model.name_or_path: 'Qwen/Qwen2.5-0.5B-Instruct' is not a local directory, " \
           "and cannot be fetched from the hub offline" in result.stderr


@pytest.mark.slow
def test_trains_from_a_source_tree_without_installing(write, tmp_path):
    """`PYTHONPATH=. python -m finetune`: no distribution metadata for finetune. The
    environment is the installed packages without finetune's own (python -S: no .pth, so
    no editable install), the source tree on PYTHONPATH."""
    import importlib.util
    import os
    import shutil

    site = tmp_path / "site"
    site.mkdir()
    installed = Path(importlib.util.find_spec("torch").origin).parent.parent
    for entry in installed.iterdir():
        if not entry.name.startswith(("finetune", "__editable__")):
            (site / entry.name).symlink_to(entry)
    config = write("src.yaml", (
        f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
        f"data:\n  train: {{path: {DATA}/sft_train.jsonl, max_samples: 8}}\n"
        "evaluation: {before_training: false}\noutput: {plot: false}\n"
        "training: {max_steps: 2, per_device_train_batch_size: 4, save_strategy: 'no'}\n"))
    source = tmp_path / "src"  # the package alone: an editable install leaves egg-info
    shutil.copytree(REPO / "finetune", source / "finetune")
    env = {**os.environ, "PYTHONPATH": f"{source}{os.pathsep}{site}"}
    probe = subprocess.run([sys.executable, "-S", "-c",
                            "import importlib.metadata as m, finetune; m.version('finetune')"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    assert "PackageNotFoundError" in probe.stderr  # really not installed there
    result = subprocess.run([sys.executable, "-S", "-m", "finetune", "train", str(config)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finetune: done in" in result.stdout


def test_overrides_before_between_and_after_flags(write, tmp_path, monkeypatch, capsys):
    """`finetune launch exp.yaml a=1 --num-processes 2 b=2 --dry-run c=3`: every override
    counts, wherever it stands (cli.main joins those argparse leaves over)."""
    from finetune.cli import main

    monkeypatch.chdir(tmp_path)
    config = write("exp.yaml", f"method: sft\nmodel:\n  name_or_path: {TINY_MODEL}\n"
                               f"data:\n  train: {DATA}/sft_train.jsonl\n"
                               "distributed: {device: cpu}\n")
    assert main(["launch", str(config), "training.max_steps=5", "--num-processes", "2",
                 "name=mid", "--dry-run", "training.seed=9"]) == 0
    resolved = yaml.safe_load((tmp_path / "runs" / "mid" / "experiment.yaml").read_text())
    assert resolved["training"]["max_steps"] == 5 and resolved["training"]["seed"] == 9
    assert resolved["distributed"]["num_processes"] == 2
    capsys.readouterr()
    assert main(["validate", str(config), "training.max_steps=5", "--print",
                 "training.seed=9"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["training"]["max_steps"] == 5 and printed["training"]["seed"] == 9

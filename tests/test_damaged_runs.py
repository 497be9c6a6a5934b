"""A run directory damaged between attempts (by hand, a tool, a disk): one finished run is
trained once for the module, and each test damages a copy of it, then runs `finetune
train` again. Whatever the damage, nothing already written is lost: an error names the
file, or the run goes on from what is intact and says what it set aside."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import DATA, TINY_MODEL, run_cli
from finetune.rundir import checkpoints
from finetune.run.callbacks import read_metrics, truncate_metrics
from finetune.errors import RunError

# One worker runs this module: its module fixture (finished) trains once, not once per worker.
pytestmark = pytest.mark.xdist_group("damaged_runs")

# 8 rows in batches of 2: 4 steps an epoch, half an epoch is 2 steps, each one saved.
CONFIG = f"""\
name: base
method: sft
model: {{name_or_path: {TINY_MODEL}, init: random}}
data:
  train: {{path: {DATA}/sft_train.jsonl, max_samples: 8}}
  eval: {{path: {DATA}/sft_eval.jsonl, max_samples: 4}}
evaluation: {{before_training: false}}
training: {{num_train_epochs: 0.5, per_device_train_batch_size: 2, save_steps: 1,
           logging_steps: 1, max_length: 32}}
"""


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished run: checkpoint-1, checkpoint-2, final/, summary.json (and its config)."""
    root = tmp_path_factory.mktemp("finished")
    (root / "base.yaml").write_text(CONFIG)
    result = run_cli("train", str(root / "base.yaml"), cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A copy of the finished run, its working directory holding base.yaml and runs/."""
    shutil.copy(finished / "base.yaml", tmp_path / "base.yaml")
    shutil.copytree(finished / "runs", tmp_path / "runs")
    return tmp_path / "runs" / "base"


def unfinish(run_dir: Path) -> None:
    """As a kill after the last checkpoint was sealed leaves it (or summary.json deleted)."""
    (run_dir / "summary.json").unlink()
    (run_dir / "loss.png").unlink()
    shutil.rmtree(run_dir / "final")


def train(run_dir: Path, *overrides: str):
    cwd = run_dir.parent.parent
    return run_cli("train", str(cwd / "base.yaml"), *overrides, cwd=cwd)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("length", [[], ["training.max_steps=2"]], ids=["epochs", "max_steps"])
def test_resumed_at_its_last_step_the_run_ends_there_bitwise(run, length):
    """The Trainer resumed at its last step would take one more (its loop checks the
    count after a step): checkpoint-3 and a final/ of 3 steps for a run of 2. The run
    ends at the checkpoint: evaluated, final/ bitwise its weights, summary.json."""
    unfinish(run)
    result = train(run, *length)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").glob("checkpoint-*")) == [
        "checkpoint-1", "checkpoint-2"]
    assert_bitwise(weights(run / "final"), weights(run / "checkpoints" / "checkpoint-2"))
    assert "checkpoint-2 is at step 2 and the run has 2: nothing left to train" in \
        result.stdout
    assert json.loads((run / "summary.json").read_text())["global_step"] == 2
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert [r["step"] for r in records if "eval_loss" in r] == [2]  # evaluated after, once


@pytest.mark.slow
def test_a_damaged_checkpoint_is_moved_aside_and_the_run_goes_on(run):
    """checkpoint-2's manifest says step 1 (edited): damage, not a kill. It is moved aside
    untouched, the run resumes from checkpoint-1 and ends bitwise as it did uninterrupted;
    the half-written line a kill mid-append leaves in metrics.jsonl is dropped, said."""
    final = weights(run / "final")
    losses = [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    unfinish(run)
    second = run / "checkpoints" / "checkpoint-2"
    manifest = json.loads((second / checkpoints.MANIFEST).read_text())
    (second / checkpoints.MANIFEST).write_text(json.dumps({**manifest, "step": 1}))
    kept = files(second)
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 3, "loss": 1.')
    lines = len((run / "metrics.jsonl").read_text().split("\n"))

    result = train(run)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finetune: checkpoint-2 is damaged (named checkpoint-2, its manifest says step 1); " \
           "moving it aside to checkpoints/damaged-checkpoint-2: kept, never resumed from" \
           in result.stdout
    assert f"resuming from {run / 'checkpoints' / 'checkpoint-1'}" in result.stdout
    assert f"finetune: {run / 'metrics.jsonl'} line {lines}: half-written, as a kill " \
           "mid-append leaves it; dropped" in result.stdout
    assert files(run / "checkpoints" / "damaged-checkpoint-2") == kept
    assert checkpoints.problem(second) is None  # saved again, beside the damaged one
    assert_bitwise(weights(run / "final"), final)
    assert [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == losses


@pytest.mark.slow  # `run` copies a finished training run
def test_entries_of_the_wrong_kind_are_refused_naming_each(run):
    """A directory where finetune writes a file, a file where it writes a directory: each
    would fail a write mid-run (some after training). One error names them all, before
    anything is written."""
    unfinish(run)
    for name in ("stopped.json", "environment.json", "training_args.json", "loss.png",
                 "metrics.jsonl"):
        target = run / name
        if target.exists():
            target.unlink()
        target.mkdir()
    (run / "final").write_text("not a model")
    (run / ".final.partial").write_text("x")
    before = files(run)
    result = train(run)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.startswith(
        f"error: run directory {run}: environment.json is a directory, not a file; "
        "training_args.json is a directory, not a file; metrics.jsonl is a directory, not a "
        "file; loss.png is a directory, not a file; stopped.json is a directory, not a file; "
        "final is a file, not a directory; .final.partial is a file, not a directory. "
        "finetune writes there itself; nothing was changed."), result.stderr
    assert files(run) == before


def test_damaged_metrics_lines_are_dropped_with_a_note_naming_each(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    path.write_text(json.dumps(good[0]) + "\n[1, 2]\n" + '{"step": "5"}\n{"step": true}\n'
                    + json.dumps(good[1]) + "\n" + '{"step": 3, "lo')
    assert read_metrics(path) == good
    notes = truncate_metrics(path, 2)
    assert notes == [f"{path} line {n}: not a JSON object with a step number; dropped"
                     for n in (2, 3, 4)] + [
        f"{path} line 6: half-written, as a kill mid-append leaves it; dropped"]
    assert read_metrics(path) == good and path.read_text().endswith("}\n")
    assert truncate_metrics(path, None) == [] and path.read_text() == ""  # from scratch

    path.unlink()
    path.mkdir()
    with pytest.raises(RunError, match=f"cannot read {path} \\(Is a directory\\)"):
        read_metrics(path)


def test_writers_name_the_file_and_a_plot_that_fails_keeps_the_summary(tmp_path, capsys):
    from finetune.report.summary import write_json
    from finetune.run.worker import _save_final, _write_results

    (tmp_path / "loss.png").mkdir()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    _write_results(tmp_path, {"global_step": 1}, "title")
    assert json.loads((tmp_path / "summary.json").read_text()) == {"global_step": 1}
    assert f"finetune: warning: no loss curve: cannot write {tmp_path / 'loss.png'}" in \
        capsys.readouterr().err

    (tmp_path / "environment.json").mkdir()
    with pytest.raises(RunError, match=f"cannot write {tmp_path / 'environment.json'}: Is a"):
        write_json(tmp_path / "environment.json", {})

    (tmp_path / "final").write_text("not a model")
    with pytest.raises(RunError, match=f"cannot save the final model: {tmp_path / 'final'} is "
                                       "not a directory"):
        _save_final(None, None, tmp_path, True)  # refused before the trainer is asked

"""Trackers, tested offline and read back from their own files: a run killed past a
checkpoint and resumed keeps one MLflow run (a local file store), one W&B run (offline
mode, the run-<id>.wandb records read back) and one TensorBoard history without the
killed attempt's extra steps (EventAccumulator); exact match and the summary's numbers
reach all three. And validate: each tracker's package and what it needs configured."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from conftest import DATA, REPO, TINY_MODEL
from finetune.config import load_experiment
from finetune.config.rules.integrations import INTEGRATIONS, TRACKED
from finetune.errors import ConfigError

BASE = f"""\
method: sft
model: {{name_or_path: {TINY_MODEL}, init: random}}
data:
  train: {{path: {DATA}/sft_train.jsonl, max_samples: 8}}
"""


def problems(write, *overrides: str) -> list[str]:
    try:
        load_experiment(write("exp.yaml", BASE), list(overrides))
    except ConfigError as exc:
        return exc.problems
    return []


@pytest.fixture
def clean(monkeypatch, tmp_path):
    """No tracker settings or credentials of the machine running the tests."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_NESTED_RUN",
                 "MLFLOW_ALLOW_FILE_STORE", "WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED",
                 "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.chdir(tmp_path)


# validate


def test_each_missing_package_names_the_extra_that_installs_it():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for name in TRACKED:
        module, fix = INTEGRATIONS[name]
        assert fix == f'pip install "finetune[{name}]"'
        wanted = {"tensorboard": "tensorboard", "mlflow": "mlflow-skinny", "wandb": "wandb"}[name]
        assert any(req.startswith(wanted) for req in extras[name]), extras[name]
        assert any(req.startswith(wanted) for req in extras["test"]), "tested with it"


def test_a_tracker_that_is_not_installed_is_named_with_its_package(write, clean):
    [problem] = problems(write, "training.report_to=[tensorboard, comet_ml]")
    assert "training.report_to[1]: comet_ml needs the comet_ml package, which is not " \
           "installed: pip install comet_ml" in problem


def test_mlflow_file_store_needs_mlflow_s_opt_in(write, clean, monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path}/mlruns")
    [problem] = problems(write, "training.report_to=mlflow")
    assert "MLFLOW_ALLOW_FILE_STORE=true" in problem and "training.report_to" in problem
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert problems(write, "training.report_to=mlflow") == []
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "plain-path"))
    assert problems(write, "training.report_to=mlflow") == []


@pytest.mark.parametrize("uri,why", [
    ("file:{tmp}/exp.yaml/mlruns", "exp.yaml is a file, not a directory"),
    ("{tmp}/exp.yaml/mlruns", "exp.yaml is a file, not a directory"),
    ("sqlite:///{tmp}/no/such/dir/mlflow.db", "no directory"),
])
def test_mlflow_tracking_uri_that_cannot_hold_runs(write, clean, monkeypatch, tmp_path, uri,
                                                   why):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri.format(tmp=tmp_path))
    [problem] = problems(write, "training.report_to=[mlflow]")
    assert why in problem and "MLFLOW_TRACKING_URI" in problem


def test_mlflow_server_and_default_database_pass(write, clean, monkeypatch):
    assert problems(write, "training.report_to=mlflow") == []  # sqlite:///mlflow.db here
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.org")
    assert problems(write, "training.report_to=mlflow") == []


def test_mlflow_run_id_of_the_user_is_refused(write, clean, monkeypatch):
    monkeypatch.setenv("MLFLOW_RUN_ID", "0123abcd")
    [problem] = problems(write, "training.report_to=mlflow")
    assert "MLFLOW_RUN_ID is set" in problem and "trackers.json" in problem


def test_wandb_online_needs_a_key(write, clean, monkeypatch, tmp_path):
    [problem] = problems(write, "training.report_to=wandb")
    assert "W&B has no API key for api.wandb.ai" in problem
    assert "WANDB_API_KEY" in problem and "WANDB_MODE=offline" in problem
    [problem] = problems(write, "training.report_to=all")  # every installed one, W&B too
    assert "training.report_to: (all) W&B has no API key" in problem
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert problems(write, "training.report_to=wandb") == []
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / "no-netrc").write_text("machine api.wandb.ai login user password abc123\n")
    assert problems(write, "training.report_to=wandb") == []  # as `wandb login` leaves it
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert "no API key for wandb.example.org" in problems(write, "training.report_to=wandb")[0]
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert problems(write, "training.report_to=wandb") == []


# A whole run, killed and resumed


def _wandb_records(path: Path) -> list:
    """The records of an offline run-<id>.wandb file: a 7-byte W&B header, then LevelDB
    log blocks of 32 KiB (chunks: 4-byte checksum, 2-byte length, 1-byte type)."""
    from wandb.proto import wandb_internal_pb2

    data, records, pending, pos = path.read_bytes(), [], b"", 7
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl")
                                               .read_text().splitlines()) if "loss" in r}


@pytest.mark.slow
def test_killed_and_resumed_run_keeps_one_run_in_each_tracker(write, tmp_path, monkeypatch):
    from resumable import Run, wait_for_step

    steps = 40
    store = tmp_path / "mlruns"
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                       "MLFLOW_TRACKING_URI": f"file:{store}",
                       "MLFLOW_ALLOW_FILE_STORE": "true"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    config = write("tracked.yaml", f"""\
method: sft
model: {{name_or_path: {TINY_MODEL}, init: random}}
data:
  train: {{path: {DATA}/sft_train.jsonl, max_samples: 24}}
  eval: {{path: {DATA}/sft_eval.jsonl, max_samples: 4}}
evaluation: {{exact_match: true, max_new_tokens: 4}}
training:
  max_steps: {steps}
  per_device_train_batch_size: 4
  logging_steps: 1
  save_steps: 4
  eval_strategy: steps
  eval_steps: 20
  report_to: [tensorboard, mlflow, wandb]
""")
    run_dir = tmp_path / "runs" / "tracked"
    first = Run("train", config, tmp_path, 1)
    wait_for_step(first, run_dir, 6)
    first.kill_all()
    killed_at = max(_losses(run_dir))
    ids = json.loads((run_dir / "trackers.json").read_text())
    second = Run("train", config, tmp_path, 2)
    assert second.wait() == 0, second.text()[-3000:]
    assert "resuming from" in second.text()
    again = json.loads((run_dir / "trackers.json").read_text())
    assert again["mlflow"]["run_id"] == ids["mlflow"]["run_id"]
    assert again["wandb"]["run_id"] == ids["wandb"]["run_id"]
    losses = _losses(run_dir)  # finetune's own record: one loss per step
    assert sorted(losses) == list(range(1, steps + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    after = summary["after"]["eval_exact_match"]
    # Evaluated before training by the killed attempt: the summary has it from metrics.jsonl.
    assert {"eval_exact_match", "eval_loss"} <= set(summary["before"])
    print(f"killed at step {killed_at}, resumed from the checkpoint before it")

    # TensorBoard: in the run directory, the killed attempt's steps past its checkpoint
    # forgotten, so the history is the run's own.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert not (run_dir / "checkpoints" / "runs").exists()
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [s for s, _ in logged] == list(range(1, steps + 1))
    assert [v for _, v in logged] == pytest.approx([losses[s] for s, _ in logged], rel=1e-6)
    assert [e.step for e in events.Scalars("eval/exact_match")] == [0, steps]
    assert [e.step for e in events.Scalars("eval/loss")] == [0, 20, 40, 40]
    assert events.Scalars("summary/after/eval_exact_match")[-1].value == pytest.approx(after)

    # MLflow: one run, finished, with the evaluations before and after and the files.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"file:{store}")
    [experiment] = client.search_experiments()
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == ids["mlflow"]["run_id"] and run.info.status == "FINISHED"
    assert run.info.run_name == "tracked"
    history = {}
    for metric in sorted(client.get_metric_history(run.info.run_id, "loss"),
                         key=lambda m: m.timestamp):
        history[metric.step] = metric.value  # the resumed attempt's value last
    assert sorted(history) == list(range(1, steps + 1))
    assert [history[s] for s in sorted(history)] == pytest.approx(
        [losses[s] for s in sorted(history)])
    exact = client.get_metric_history(run.info.run_id, "eval_exact_match")
    assert sorted(m.step for m in exact) == [0, steps]
    assert run.data.metrics["summary/after/eval_exact_match"] == pytest.approx(after)
    assert run.data.metrics["summary/before/eval_loss"] == pytest.approx(
        summary["before"]["eval_loss"])
    files = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "experiment.yaml", "loss.png"} <= files

    # W&B: both attempts under one run id, in RUN_DIR/wandb; the summary and the files in
    # the last.
    run_id = ids["wandb"]["run_id"]
    attempts = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(attempts) == 2 and all(p.name.endswith(f"-{run_id}") for p in attempts)
    records = _wandb_records(attempts[-1] / f"run-{run_id}.wandb")
    [started] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert started.run_id == run_id and started.display_name == "tracked"
    summarized = {item.key: json.loads(item.value_json) for r in records
                  if r.WhichOneof("record_type") == "summary" for item in r.summary.update}
    assert summarized["after/eval_exact_match"] == pytest.approx(after)
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    # (the killed attempt's records died with it: wandb's writer process was killed too)
    assert [h["train/global_step"] for h in history if "eval/exact_match" in h] == [steps]
    logged_steps = [h["train/global_step"] for h in history if "train/loss" in h]
    assert logged_steps == list(range(logged_steps[0], steps + 1)) and logged_steps[0] > 1
    assert (attempts[-1] / "files" / "summary.json").is_file()

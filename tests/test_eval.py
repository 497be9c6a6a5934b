"""`finetune eval`: a trained run's final model (or a checkpoint), or an experiment's
starting model, evaluated without training. The numbers must be those training reported
for the same model and data (summary.json, metrics.jsonl); bad input is one error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import DATA, MINIMAL_SFT, QUICKSTART, TINY_MODEL, run_cli

# One worker runs this module: its module fixture (sft_run) trains once, not once per worker.
pytestmark = pytest.mark.xdist_group("eval")

# What describes the evaluation rather than the model: timings, the trainer's counters.
NOT_COMPARED = ("runtime", "per_second", "preparation_time", "num_tokens", "epoch")


def model_metrics(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not any(w in k for w in NOT_COMPARED)}


def assert_same_metrics(reported: dict, evaluated: dict) -> None:
    reported, evaluated = model_metrics(reported), model_metrics(evaluated)
    assert reported and set(reported) == set(evaluated)
    for key, value in reported.items():
        assert evaluated[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def eval_cli(*args: str, cwd) -> tuple[dict, str]:
    """Run `finetune eval ARGS`; (the JSON it wrote, its stdout)."""
    result = run_cli("eval", *args, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    written = result.stdout.strip().splitlines()[-1].removeprefix("  written to ")
    return json.loads(open(written).read()), result.stdout


def train(config, cwd, *overrides: str) -> None:
    result = run_cli("train", str(config), *overrides, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]


# ---- classification metrics (training and eval report the same compute_metrics) ----

def test_classification_metrics_by_hand():
    from finetune.trainers.classify import classification_metrics

    labels = np.array([0, 0, 1, 1, 2, 2])
    predicted = [0, 1, 1, 1, 0, 2]
    logits = np.eye(4)[predicted]  # argmax = predicted; class d: never true, never predicted
    metrics = classification_metrics(["a", "b", "c", "d"])(
        SimpleNamespace(predictions=logits, label_ids=labels))
    # a: 1 of 2 found, 1 of 2 predicted right -> F1 0.5; b: 2 of 2, 2 of 3 -> 0.8;
    # c: 1 of 2, 1 of 1 -> 2/3; d: no support, no prediction -> 0 (as sklearn's
    # zero_division=0 with the labels given).
    assert metrics["accuracy"] == pytest.approx(4 / 6)
    assert metrics["recall_a"] == 0.5 and metrics["recall_b"] == 1.0
    assert metrics["recall_c"] == 0.5 and metrics["recall_d"] == 0.0
    assert metrics["macro_f1"] == pytest.approx((0.5 + 0.8 + 2 / 3 + 0) / 4)


# ---- one clear error for what cannot be evaluated (before anything heavy loads) ----

def errors(capsys, *args: str) -> list[str]:
    from finetune.cli import main

    try:
        code = main(["eval", *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and all(line.startswith("error: ") for line in lines), err
    return lines


def rendered_run(tmp_path, write) -> Path:
    """A run directory as `finetune render` leaves it: experiment.yaml, nothing trained."""
    from finetune.cli import main

    config = write("exp.yaml", MINIMAL_SFT + f"  eval: {DATA}/sft_eval.jsonl\n"
                   f"output:\n  dir: {tmp_path / 'run'}\n")
    assert main(["render", str(config)]) == 0
    return tmp_path / "run"


def test_a_run_with_nothing_saved_or_an_unknown_checkpoint_is_one_error(tmp_path, write,
                                                                       capsys):
    run = rendered_run(tmp_path, write)
    capsys.readouterr()
    assert errors(capsys, str(run)) == [
        f"error: {run} has no final model (final/) and no complete checkpoint: nothing to "
        "evaluate"]
    (run / "checkpoints" / "checkpoint-3").mkdir(parents=True)  # a save cut short
    assert errors(capsys, str(run), "--checkpoint", "7") == [
        f"error: --checkpoint 7: {run} has no checkpoint-7 (its complete checkpoints: none)"]
    [line] = errors(capsys, str(run), "--checkpoint", "3")
    assert line.startswith(f"error: --checkpoint 3: {run}/checkpoints/checkpoint-3 cannot be "
                           "evaluated: no manifest")
    [line] = errors(capsys, str(run), "--checkpoint", "three")
    assert "--checkpoint: expected a step number, got 'three'" in line


def test_bad_targets_and_files_are_one_error_each(tmp_path, write, capsys):
    run = rendered_run(tmp_path, write)
    capsys.readouterr()
    assert errors(capsys, str(run), "--data", str(tmp_path / "missing.jsonl")) == [
        f"error: --data {tmp_path / 'missing.jsonl'}: no such file or directory"]
    assert errors(capsys, str(tmp_path / "nowhere")) == [
        f"error: {tmp_path / 'nowhere'}: no such run directory or experiment file"]
    [line] = errors(capsys, str(tmp_path))
    assert "is a directory but not a run directory: it has no experiment.yaml" in line
    config = write("no-eval.yaml", MINIMAL_SFT)
    assert errors(capsys, str(config)) == [
        f"error: {config}: the experiment has no eval data (data.eval or data.eval_fraction); "
        "give a file with --data FILE"]
    [line] = errors(capsys, str(config), "--checkpoint", "2")
    assert "--checkpoint 2: evaluates a checkpoint of a run; give its run directory" in line
    (run / "final").mkdir()
    (run / "taken.json").write_text("{}")
    assert errors(capsys, str(run), "--out", str(run / "taken.json")) == [
        f"error: --out {run / 'taken.json'}: exists; nothing was evaluated or written "
        "(choose another file, or move that one away)"]
    assert (run / "taken.json").read_text() == "{}"


# ---- trained runs: the same numbers as training reported ----

@pytest.mark.slow
@pytest.mark.parametrize("method", ["sft", "classify", "reward", "dpo"])
def test_final_model_scores_what_training_reported(method, tmp_path):
    train(QUICKSTART / f"{method}.yaml", tmp_path, "training.max_steps=4")
    run = tmp_path / "runs" / f"quickstart-{method}"
    summary = json.loads((run / "summary.json").read_text())
    record, stdout = eval_cli(str(run), cwd=tmp_path)
    assert_same_metrics(summary["after"], record["metrics"])
    assert record["model"] == str(run / "final") and record["method"] == method
    assert "finetune: evaluated" in stdout and "eval_loss" in stdout
    if method == "sft":  # evaluation.exact_match is on in the quickstart
        assert "eval_exact_match" in record["metrics"] and record["exact_match"]["samples"] == 200
    if method == "classify":
        assert {"eval_accuracy", "eval_macro_f1", "eval_recall_late"} <= set(record["metrics"])
    if method in ("reward", "dpo"):
        assert {"eval_accuracy", "eval_rewards/accuracies"} & set(record["metrics"])


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """The quickstart sft, 4 steps, a checkpoint and an evaluation every 2."""
    cwd = tmp_path_factory.mktemp("sft")
    train(QUICKSTART / "sft.yaml", cwd, "training.max_steps=4", "training.save_steps=2",
          "training.eval_strategy=steps", "training.eval_steps=2")
    return cwd, cwd / "runs" / "quickstart-sft"


@pytest.mark.slow
def test_a_checkpoint_scores_what_training_logged_at_its_step(sft_run):
    cwd, run = sft_run
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    at_two = next(r for r in logged if r["step"] == 2 and "eval_loss" in r)
    record, _ = eval_cli(str(run), "--checkpoint", "2", cwd=cwd)
    assert record["model"] == str(run / "checkpoints" / "checkpoint-2")
    assert record["checkpoint"] == 2
    assert_same_metrics({k: v for k, v in at_two.items() if k.startswith("eval_")},
                        {k: v for k, v in record["metrics"].items() if k != "eval_exact_match"})
    assert (run / "eval" / "sft_eval-checkpoint-2.json").is_file()


@pytest.mark.slow
def test_the_starting_model_scores_what_training_reported_before(sft_run):
    cwd, run = sft_run
    summary = json.loads((run / "summary.json").read_text())
    record, _ = eval_cli(str(QUICKSTART / "sft.yaml"), cwd=cwd)
    assert_same_metrics(summary["before"], record["metrics"])
    assert (run / "eval" / "sft_eval-start.json").is_file()


@pytest.mark.slow
def test_another_file_and_an_earlier_result_kept(sft_run, write):
    cwd, run = sft_run
    lines = (DATA / "sft_eval.jsonl").read_text().splitlines()
    held_out = write("held_out.jsonl", "\n".join(lines[:40]) + "\n")
    first, _ = eval_cli(str(run), "--data", str(held_out), cwd=cwd)
    again, _ = eval_cli(str(run), "--data", str(held_out), cwd=cwd)
    assert first["rows"] == 40 and first["data"] == [str(held_out)]
    assert_same_metrics(first["metrics"], again["metrics"])
    first_file = run / "eval" / "held_out-final.json"
    assert json.loads(first_file.read_text())["created"] == first["created"]
    assert (run / "eval" / "held_out-final-2.json").is_file()
    # 40 rows are not the 200 training evaluated on: another loss
    summary = json.loads((run / "summary.json").read_text())
    assert first["metrics"]["eval_loss"] != summary["after"]["eval_loss"]


@pytest.mark.slow
def test_a_bad_row_is_the_error_training_gives(sft_run, write):
    cwd, run = sft_run
    good = (DATA / "sft_eval.jsonl").read_text().splitlines()[0]
    bad = write("bad.jsonl", f"{good}\n{{\"messages\": [{{\"role\": \"user\"}}]}}\n")
    evaluated = run_cli("eval", str(run), "--data", str(bad), cwd=cwd)
    trained = run_cli("train", str(QUICKSTART / "sft.yaml"), f"data.eval={bad}",
                      "name=bad-data", cwd=cwd)
    assert evaluated.returncode == trained.returncode == 2
    error = lambda result: [line for line in result.stderr.splitlines()
                            if line.startswith("error:")]
    assert error(evaluated) and error(evaluated) == error(trained)
    assert f"{bad} row 2" in error(evaluated)[0]


LORA = """\
method: {method}
model:
  name_or_path: {model}
  init: random
peft:
  type: {peft}
  r: 4
data:
  train: {{path: {data}/{train}.jsonl, max_samples: 48}}
  eval: {{path: {data}/{evaluation}.jsonl, max_samples: 16}}
training:
  max_steps: 3
  per_device_train_batch_size: 8
  learning_rate: 1e-2
"""


@pytest.mark.slow
@pytest.mark.parametrize("method,peft,files", [
    ("sft", "lora", ("sft_train", "sft_eval")),
    ("dpo", "lora", ("pref_train", "pref_eval")),
    ("reward", "qlora", ("pref_train", "pref_eval"))])
def test_an_adapter_run_moved_elsewhere_scores_what_training_reported(method, peft, files,
                                                                      tmp_path, write):
    text = LORA.format(method=method, model=TINY_MODEL, peft=peft, data=DATA, train=files[0],
                       evaluation=files[1])
    config = write("exp.yaml", text)
    train(config, tmp_path)
    run = tmp_path / "moved" / "run"
    run.parent.mkdir()
    shutil.move(tmp_path / "runs" / "exp", run)  # its experiment.yaml names the old place
    summary = json.loads((run / "summary.json").read_text())
    record, _ = eval_cli(str(run), cwd=tmp_path)
    assert_same_metrics(summary["after"], record["metrics"])
    assert record["run_dir"] == str(run)
    assert not (tmp_path / "runs" / "exp").exists()


@pytest.mark.slow
def test_ppo_final_policy_scores_what_training_reported(tmp_path, write):
    """ppo evaluates by sampling from its seed: the policy loaded from final/ (value/
    beside it), against the starting policy as reference, gives training's numbers."""
    from test_ppo import _data, _rewards

    train_file, held_out = _data(tmp_path)
    config = write("ppo.yaml", f"""
name: ppo
method: ppo
model: {{name_or_path: {TINY_MODEL}, init: random}}
data: {{train: {train_file}, eval: {held_out}}}
rewards: {{functions: ["{_rewards(tmp_path)}:vowels"]}}
ppo: {{max_new_tokens: 6, rollout_batches: 2, ppo_epochs: 1}}
output: {{plot: false}}
training: {{max_steps: 4, per_device_train_batch_size: 4, learning_rate: 2.0e-3,
           save_strategy: 'no', activation_checkpointing: false}}
""")
    train(config, tmp_path)
    run = tmp_path / "runs" / "ppo"
    summary = json.loads((run / "summary.json").read_text())
    record, _ = eval_cli(str(run), cwd=tmp_path)
    assert_same_metrics(summary["after"], record["metrics"])
    assert summary["after"]["eval_kl"] != summary["before"]["eval_kl"]

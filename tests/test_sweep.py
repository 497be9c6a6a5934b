"""`finetune sweep`: trials are real tiny runs of the quickstart sft, each in a subprocess;
the sweep is stopped (SIGTERM) and killed (SIGKILL) mid-trial and continued."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import QUICKSTART, REPO, free_port, run_cli

SFT = str(QUICKSTART / "sft.yaml")
# Seconds per trial, not minutes: no evaluation before training, no generation.
FAST = ["evaluation.before_training=false", "evaluation.exact_match=false"]


def sweep_file(write, text: str, name: str = "sweep.yaml") -> str:
    return str(write(name, "metric: eval_loss\ngoal: minimize\n" + text))


def state(sweep_dir: Path) -> dict:
    return json.loads((sweep_dir / "sweep.json").read_text())


@pytest.mark.slow
def test_bad_sweep_keys_exit_2_naming_them(write, tmp_path):
    bad = sweep_file(write, "method: grid\ntrails: 3\nparameters:\n"
                            "  training.max_steps: {values: [2], log: true}\n")
    result = run_cli("sweep", SFT, bad, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "sweep.yaml: trails: unknown key" in result.stderr
    assert "parameters.training.max_steps: give either values" in result.stderr
    # a key the experiment does not have: refused before any trial runs, as validate would
    bad = sweep_file(write, "method: grid\nparameters:\n  training.learnin_rate: {values: [1e-3]}\n"
                            "  training.max_steps: {values: [2, many]}\n", "bad2.yaml")
    result = run_cli("sweep", SFT, bad, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "bad2.yaml: parameters.training.learnin_rate: 0.001" in result.stderr
    assert "did you mean learning_rate?" in result.stderr
    assert "bad2.yaml: parameters.training.max_steps: 'many'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()
    reserved = sweep_file(write, "method: grid\nparameters:\n  output.dir: {values: [a]}\n",
                          "bad3.yaml")
    result = run_cli("sweep", SFT, reserved, cwd=tmp_path)
    assert result.returncode == 2 and "parameters.output.dir: set by the sweep" in result.stderr
    # the command line setting a swept key: the trials would drop it without a word
    swept = sweep_file(write, "method: grid\nparameters:\n  training.learning_rate: "
                              "{values: [1e-3, 1e-4]}\n", "swept.yaml")
    for given in ("training.learning_rate=5e-4", "training={learning_rate: 5e-4}"):
        result = run_cli("sweep", SFT, swept, given, "--dry-run", cwd=tmp_path)
        assert result.returncode == 2, result.stdout + result.stderr
        key = given.partition("=")[0]
        assert f"error: {key}: set on the command line and swept (" in result.stderr
        assert "swept.yaml: parameters.training.learning_rate)" in result.stderr


def test_a_grid_too_large_to_run_is_refused_before_it_is_built(write, tmp_path):
    """10**12 combinations: counted, never built (that would never finish)."""
    values = "{values: [" + ", ".join(str(i) for i in range(100)) + "]}"
    grid = sweep_file(write, "method: grid\nparameters:\n" + "".join(
        f"  training.{key}: {values}\n" for key in ("seed", "data_seed", "warmup_steps",
                                                   "logging_steps", "save_steps", "max_steps")))
    result = run_cli("sweep", SFT, grid, "--dry-run", cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    assert result.stderr == f"error: {grid}: parameters: a grid of 1,000,000,000,000 " \
        "trials (the product of the number of values of each parameter), more than the " \
        "10,000 a sweep runs: use method random with trials: N (at most 10,000), which " \
        "draws from the same values, or give fewer values\n"


def test_long_keys_and_values_of_a_sweep_are_named_by_their_start_and_length(write, tmp_path):
    long = "k" * 10_000
    spec = sweep_file(write, f"method: grid\n? {long}\n: 1\nparameters:\n"
                             f"  training.seed: {{values: [{long}]}}\n")
    result = run_cli("sweep", SFT, spec, "--dry-run", cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and "k" * 200 not in result.stderr, result.stderr[:2000]
    assert f"error: {spec}: {'k' * 56}... (10,000 characters): unknown key\n" in result.stderr


@pytest.mark.slow
def test_random_is_reproducible_from_its_seed(write, tmp_path):
    text = ("method: random\ntrials: 5\nseed: {seed}\nparameters:\n"
            "  training.learning_rate: {{low: 1.0e-4, high: 1.0e-2, log: true}}\n"
            "  training.max_steps: {{low: 2, high: 9, type: int}}\n"
            "  peft.type: {{values: [none, lora]}}\n")
    plans = [run_cli("sweep", SFT, sweep_file(write, text.format(seed=seed), f"s{i}.yaml"),
                     "--dry-run", cwd=tmp_path) for i, seed in enumerate((3, 3, 4))]
    assert all(p.returncode == 0 for p in plans), plans[0].stderr
    assert plans[0].stdout == plans[1].stdout != plans[2].stdout
    lines = [line for line in plans[0].stdout.splitlines() if line.startswith("trial-")]
    assert len(lines) == 5
    for line in lines:
        params = dict(part.split("=") for part in line.split("  ", 1)[1].split(", "))
        assert 1e-4 <= float(params["training.learning_rate"]) <= 1e-2
        assert 2 <= int(params["training.max_steps"]) <= 9
        assert params["peft.type"] in ("none", "lora")


@pytest.mark.slow
def test_example_sweep_file_is_valid(tmp_path):
    result = run_cli("sweep", SFT, str(REPO / "configs" / "sweeps" / "quickstart-sft.yaml"),
                     "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("trial-") == 6


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "finetune", "sweep", *args], cwd=cwd,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _losses(metrics: Path) -> int:
    return metrics.read_text().count('"loss"') if metrics.exists() else 0


def _wait_for_training(metrics: Path, past: int = 0, timeout: float = 300) -> None:
    """Until the trial has logged two optimizer steps more than `past`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if _losses(metrics) >= past + 2:
            return
        time.sleep(0.3)
    raise AssertionError(f"{metrics}: no training logged in {timeout} s")


def _assert_finished(out: Path, stdout: str) -> None:
    """Every trial finished with its own steps; the sweep's record, its table, its plot and
    its last line name the trials' eval losses and the best."""
    record = state(out)
    assert record["status"] == "finished"
    assert [t["status"] for t in record["trials"]] == ["finished"] * 2
    losses = {}
    for trial in record["trials"]:
        run_dir = out / trial["name"]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["global_step"] == trial["params"]["training.max_steps"]
        assert trial["metric"] == summary["after"]["eval_loss"]
        losses[trial["name"]] = trial["metric"]
        assert (run_dir / "final").is_dir() and (run_dir / "experiment.yaml").is_file()
    best = min(losses, key=losses.get)
    assert f"finetune: best {best}: eval_loss" in stdout
    with open(out / "sweep_results.csv") as file:
        rows = list(csv.DictReader(file))
    assert [r["trial"] for r in rows] == sorted(losses)
    assert {r["trial"]: float(r["eval_loss"]) for r in rows} == losses
    assert (out / "sweep.png").stat().st_size > 0


@pytest.mark.slow
def test_a_grid_stopped_then_killed_continues_where_it_was_and_names_the_best(write,
                                                                              tmp_path):
    """One chain of a two-trial grid, two ways a sweep ends mid-trial: SIGTERM (the sweep
    stops its trial, which saves and exits 75), then, on the rerun, SIGKILL (the trial's
    parent-death signal saves it); the last rerun finishes the trial from its checkpoint
    without rerunning the first and names the best; a rerun of a finished sweep reruns
    nothing, a changed one is refused. (That a grid is every combination: the dry runs.)"""
    grid = sweep_file(write, "method: grid\nparameters:\n  training.max_steps: {values: [2, 40]}\n")
    out = tmp_path / "sweep"
    args = [SFT, grid, "--out", str(out), *FAST, "training.logging_steps=1",
            "training.save_steps=1000"]
    metrics = out / "trial-001" / "metrics.jsonl"
    sweep = _start(args, tmp_path)
    _wait_for_training(metrics)
    first = (out / "trial-000" / "summary.json").stat().st_mtime_ns
    os.kill(sweep.pid, signal.SIGTERM)
    output, _ = sweep.communicate(timeout=300)
    assert sweep.returncode == 75, output[-3000:]
    record = state(out)
    assert record["status"] == "stopped"
    assert [t["status"] for t in record["trials"]] == ["finished", "stopped"]
    assert (out / "trial-001" / "stopped.json").is_file()  # the trial saved and exited 75
    assert record["trials"][1]["exit_code"] == 75

    sweep = _start(args, tmp_path)
    _wait_for_training(metrics, past=_losses(metrics))
    os.kill(sweep.pid, signal.SIGKILL)
    output, _ = sweep.communicate(timeout=300)
    assert sweep.returncode == -9
    assert "resuming from" in output, output[-3000:]
    assert state(out)["trials"][1]["status"] == "running"  # as the kill left it

    again = run_cli("sweep", *args, cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "1 of 2 trials done" in again.stdout
    assert "resuming from" in again.stdout + again.stderr  # the run resumed, not restarted
    assert (out / "trial-000" / "summary.json").stat().st_mtime_ns == first  # not rerun
    _assert_finished(out, again.stdout)

    # run again: nothing is rerun
    stamps = {t["name"]: (out / t["name"] / "summary.json").stat().st_mtime_ns
              for t in state(out)["trials"]}
    done = run_cli("sweep", *args, cwd=tmp_path)
    assert done.returncode == 0 and "2 of 2 trials done" in done.stdout
    assert stamps == {n: (out / n / "summary.json").stat().st_mtime_ns for n in stamps}
    # a changed sweep is refused
    changed = sweep_file(write, Path(grid).read_text().replace("[2, 40]", "[2, 5]")
                         .split("goal: minimize\n", 1)[1], "changed.yaml")
    refused = run_cli("sweep", SFT, changed, *args[2:], cwd=tmp_path)
    assert refused.returncode == 2 and "a different sweep" in refused.stderr, refused.stderr


@pytest.mark.slow
def test_tpe_searches_with_optuna(write, tmp_path):
    pytest.importorskip("optuna")
    tpe = sweep_file(write, "method: tpe\ntrials: 2\nseed: 1\nstartup_trials: 1\nparameters:\n"
                            "  training.learning_rate: {low: 1.0e-4, high: 1.0e-2, log: true}\n"
                            "  training.max_steps: {values: [2, 3]}\n")
    out = tmp_path / "sweep"
    result = run_cli("sweep", SFT, tpe, "--out", str(out), *FAST, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    trials = state(out)["trials"]
    assert [t["status"] for t in trials] == ["finished"] * 2  # one random, one from TPE
    assert len({t["params"]["training.learning_rate"] for t in trials}) == 2
    for trial in trials:
        assert 1e-4 <= trial["params"]["training.learning_rate"] <= 1e-2
        summary = json.loads((out / trial["name"] / "summary.json").read_text())
        assert summary["global_step"] == trial["params"]["training.max_steps"]


@pytest.mark.slow
def test_median_pruning_stops_a_trial_worse_than_the_finished_ones(write, tmp_path):
    """A real trial pruned by a real one (the rule's cases: test_the_median_rule...)."""
    grid = sweep_file(write, "method: grid\nprune: {min_trials: 1}\nparameters:\n"
                             "  training.learning_rate: {values: [3.0e-3, 1.0e-7]}\n")
    out = tmp_path / "sweep"
    result = run_cli("sweep", SFT, grid, "--out", str(out), *FAST, "training.max_steps=12",
                     "training.warmup_steps=0", "training.eval_strategy=steps",
                     "training.eval_steps=2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    trials = state(out)["trials"]
    assert [t["status"] for t in trials] == ["finished", "pruned"]
    assert "pruning trial-001 at step" in result.stdout
    pruned = out / "trial-001"
    assert not (pruned / "summary.json").exists() and (pruned / "stopped.json").is_file()
    step = max(int(s) for s in trials[1]["intermediate"])
    assert step < 12
    # worse than the finished trial at a step it was evaluated at
    assert trials[1]["metric"] > trials[0]["intermediate"][str(step)]


def test_the_median_rule_waits_for_finished_trials_and_its_warmup():
    """Optuna's MedianPruner rule on recorded values: the trial's best so far against the
    median of the finished trials at its latest evaluation step."""
    from finetune.sweep.runner import should_prune
    from finetune.sweep.spec import Sweep

    def sweep(goal="minimize", **prune):
        return Sweep(method="grid", parameters={"training.seed": {"values": [1]}},
                     metric="eval_loss", goal=goal, prune=prune)

    finished = [{"status": "finished", "intermediate": {"2": 1.0, "4": 0.5}},
                {"status": "finished", "intermediate": {"2": 3.0, "4": 0.7}},
                {"status": "pruned", "intermediate": {"2": 0.1, "4": 0.1}}]  # not counted
    assert should_prune(sweep(), finished, {2: 2.5, 4: 0.65})  # 0.65 > median 0.6
    assert not should_prune(sweep(), finished, {2: 2.5, 4: 0.55})
    assert not should_prune(sweep(), finished, {2: 0.5, 4: 0.65})  # its best so far, 0.5
    assert not should_prune(sweep(min_trials=3), finished, {2: 2.5, 4: 0.65})
    assert not should_prune(sweep(warmup_steps=5), finished, {2: 2.5, 4: 0.65})
    assert not should_prune(sweep(), finished, {6: 9.0})  # no finished value at step 6
    assert should_prune(sweep("maximize"), finished, {2: 0.2, 4: 0.55})
    assert not should_prune(sweep("maximize"), finished, {2: 0.2, 4: 0.65})
    assert not should_prune(sweep().model_copy(update={"prune": None}), finished, {4: 9.0})


@pytest.mark.slow
def test_a_two_process_experiment_is_swept_through_finetune_launch(write, tmp_path):
    """Each trial of a DDP experiment runs as `finetune launch` (two gloo processes on the CPU):
    its run directory holds launch.sh and the Accelerate file, and the trial trained as two
    with the sweep's value. One trial: more would repeat the path."""
    grid = sweep_file(write, "method: grid\nparameters:\n"
                             "  training.learning_rate: {values: [3.0e-3]}\n")
    out = tmp_path / "sweep"
    result = run_cli("sweep", SFT, grid, "--out", str(out), *FAST, "training.max_steps=2",
                     "distributed.strategy=ddp", "distributed.num_processes=2",
                     "distributed.device=cpu", f"distributed.main_process_port={free_port()}",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    trials = state(out)["trials"]
    assert [t["status"] for t in trials] == ["finished"]
    run_dir = out / trials[0]["name"]
    assert (run_dir / "launch.sh").is_file() and (run_dir / "accelerate.yaml").is_file()
    assert "num_processes: 2" in (run_dir / "accelerate.yaml").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 2
    assert trials[0]["metric"] == summary["after"]["eval_loss"]
    assert "learning_rate: 0.003" in (run_dir / "experiment.yaml").read_text()

"""No secret in anything a run writes: a whole training run with a known hub token (in the
YAML and in the environment) leaves its bytes in no file of the run directory (checkpoints'
pickled training_args.bin included), and in neither stdout nor stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DATA, TINY_MODEL

pytestmark = pytest.mark.slow  # training runs in a subprocess

YAML_TOKEN = "hf_FAKEyamlSecret123"
ENV_TOKEN = "hf_FAKEenvSecret456"


def _leaks(folder: Path, *texts: str) -> list[str]:
    found = []
    for secret in (YAML_TOKEN, ENV_TOKEN):
        needle = secret.encode()
        found += [str(p) for p in folder.rglob("*") if p.is_file() and needle in p.read_bytes()]
        found += ["output"] if any(secret in text for text in texts) else []
    return found


def _train(config: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_TOKEN": ENV_TOKEN}
    return subprocess.run([sys.executable, "-m", "finetune", "train", str(config)], cwd=cwd,
                          env=env, text=True, capture_output=True, timeout=600)


def test_a_whole_run_holds_no_token(write, tmp_path):
    config = write("secret.yaml", f"""\
method: sft
model: {{name_or_path: {TINY_MODEL}, init: random}}
data:
  train: {{path: {DATA}/sft_train.jsonl, max_samples: 16}}
  eval: {{path: {DATA}/sft_eval.jsonl, max_samples: 4}}
training:
  hub_token: {YAML_TOKEN}
  max_steps: 2
  save_steps: 1
  per_device_train_batch_size: 4
  logging_steps: 1
""")
    result = _train(config, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "secret"
    pickles = sorted(run.rglob("training_args.bin"))
    assert len(pickles) == 3  # checkpoint-1, checkpoint-2, final
    assert _leaks(tmp_path / "runs", result.stdout, result.stderr) == []


def test_a_failing_run_does_not_echo_the_token(write, tmp_path):
    # TrainingArguments would refuse this (eval and save strategies differ); the config
    # rules now catch it first: either way one error, and the token stays out of the
    # message and of every file written so far.
    config = write("refused.yaml", f"""\
method: sft
model: {{name_or_path: {TINY_MODEL}, init: random}}
data:
  train: {{path: {DATA}/sft_train.jsonl, max_samples: 4}}
training:
  hub_token: {YAML_TOKEN}
  max_steps: 1
  load_best_model_at_end: true
""")
    result = _train(config, tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "load_best_model_at_end" in result.stderr and "Traceback" not in result.stderr
    assert _leaks(tmp_path / "runs", result.stdout, result.stderr) == []

"""Sharing on the hub, without a network: the exact upload (final/'s files and the model
card) is built apart from the upload, and tested; the Trainer never pushes (checkpoints
to a repository named "checkpoints"); validate refuses a push that could not happen; a
real run whose upload fails (a closed port for an endpoint) is complete, says how to
retry, and leaves its token in no file and no output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import DATA, TINY_MODEL, run_cli
from finetune import cli
from finetune.hub import upload
from finetune.config import load_experiment
from finetune.config.derived.effective import arguments
from finetune.errors import ConfigError, RunError
from finetune.render.bundle import resolved_yaml

TOKEN = "hf_FAKEhubSecret789"
HUB_EXPERIMENT = f"""\
name: shared
method: sft
model: {{name_or_path: org/base-model}}
peft: {{type: lora, r: 8}}
data:
  train: {{path: org/chat-data, split: train}}
  eval: {DATA}/sft_eval.jsonl
training:
  push_to_hub: true
  hub_token: {TOKEN}
  hub_private_repo: true
  learning_rate: 1e-4
  max_steps: 30
output: {{hub_model_id: me/shared-lora}}
"""


@pytest.fixture
def hub_env(monkeypatch, tmp_path, online):
    """Online (a stand-in hub that has every model), no token of the machine's own."""
    for name in ("HF_TOKEN", "HF_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))


def problems(path: Path, *overrides: str) -> list[str]:
    try:
        load_experiment(path, list(overrides))
    except ConfigError as exc:
        return exc.problems
    return []


def test_the_trainer_never_pushes(write, hub_env):
    experiment = load_experiment(write("exp.yaml", HUB_EXPERIMENT))
    kwargs = arguments(experiment, "cpu", run_dir=Path("/runs/shared"))
    assert kwargs["push_to_hub"] is False
    assert not [key for key in kwargs if key.startswith("hub_") and key != "hub_token"]


def test_validate_refuses_a_push_that_cannot_happen(write, hub_env, monkeypatch, tmp_path):
    path = write("exp.yaml", HUB_EXPERIMENT.replace(f"  hub_token: {TOKEN}\n", ""))
    [problem] = problems(path)
    assert "training.push_to_hub: no Hugging Face token: set HF_TOKEN" in problem
    assert "hf auth login" in problem
    stored = tmp_path / "hf-home" / "token"
    stored.parent.mkdir()
    stored.write_text("hf_stored\n")  # where `hf auth login` keeps it
    assert problems(path) == []
    stored.unlink()
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    assert problems(path) == []
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # (the hub model is refused offline too)
    [problem] = [p for p in problems(path) if "push_to_hub" in p]
    assert "cannot upload with HF_HUB_OFFLINE set" in problem and "finetune push" in problem


@pytest.mark.parametrize("override,message", [
    ("training.hub_strategy=checkpoint", "training.hub_strategy: finetune uploads only the "
                                         "final model"),
    ("training.hub_model_id=me/x", "training.hub_model_id: the repository is "
                                   "output.hub_model_id"),
    ("output.save_final=false", "training.push_to_hub: uploads the final model: needs "
                                "output.save_final"),
    ("output.hub_model_id=me/a/b", "output.hub_model_id: not a hub repository id"),
    ("training.push_to_hub=false", "output.hub_model_id: names where to upload: set "
                                   "training.push_to_hub"),
])
def test_validate_hub_settings(write, hub_env, override, message):
    found = problems(write("exp.yaml", HUB_EXPERIMENT), override)
    assert any(message in problem for problem in found), found


def _finished_run(write, tmp_path: Path) -> Path:
    """A run directory as a finished run leaves it: the resolved experiment, summary.json,
    training_args.json, final/ (files written here, in place of a training run's)."""
    experiment = load_experiment(write("exp.yaml", HUB_EXPERIMENT))
    run = tmp_path / "runs" / "shared"
    (run / "final" / "extra").mkdir(parents=True)
    (run / "checkpoints" / "checkpoint-30").mkdir(parents=True)
    (run / "experiment.yaml").write_text(resolved_yaml(experiment))
    (run / "summary.json").write_text(json.dumps({
        "name": "shared", "method": "sft", "seconds": 12.5, "global_step": 30,
        "before": {"eval_loss": 2.5, "eval_exact_match": 0.125, "eval_runtime": 1.0},
        "after": {"eval_loss": 1.25, "eval_exact_match": 0.75, "eval_runtime": 1.0},
        "train": {"train_loss": 1.5, "train_runtime": 10.0}}))
    (run / "training_args.json").write_text(json.dumps({
        "learning_rate": 1e-4, "per_device_train_batch_size": 8, "seed": 42,
        "hub_token": None, "output_dir": str(run / "checkpoints")}))
    (run / "environment.json").write_text(json.dumps({"precision": "bf16"}))
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json",
                 "training_args.bin", "README.md", "extra/notes.txt"):
        (run / "final" / name).write_text(name)
    (run / "checkpoints" / "checkpoint-30" / "adapter_model.safetensors").write_text("x")
    return run


def test_the_upload_is_final_only_with_a_card(write, hub_env, tmp_path):
    run = _finished_run(write, tmp_path)
    job = upload.plan(run)
    assert job.repo_id == "me/shared-lora" and job.private is True
    assert job.folder == run / "final"
    assert job.files == ("adapter_config.json", "adapter_model.safetensors", "extra/notes.txt",
                         "tokenizer.json")  # never training_args.bin (a pickle), nor PEFT's card
    card = job.card
    header = yaml.safe_load(card.split("---\n")[1])
    assert header == {"base_model": "org/base-model", "datasets": ["org/chat-data"],
                      "library_name": "peft", "pipeline_tag": "text-generation",
                      "tags": ["finetune", "sft", "lora"]}
    assert "# shared-lora" in card
    assert "A LoRA adapter fine-tuned from [org/base-model](https://huggingface.co/" \
           "org/base-model) with finetune's `sft` method." in card
    assert "- train: [org/chat-data](https://huggingface.co/datasets/org/chat-data) " \
           "(split train)" in card
    assert "- eval: a local file, `sft_eval.jsonl`" in card
    assert "| eval_exact_match | 0.125 | 0.75 |" in card and "| eval_loss | 2.5 | 1.25 |" in card
    assert "eval_runtime" not in card  # a measurement of the run, not of the model
    assert "30 optimizer steps in 12.5 s, final training loss 1.5." in card
    settings = yaml.safe_load(card.split("```yaml\n")[1].split("```")[0])
    assert settings["precision"] == "bf16" and settings["peft"]["r"] == 8
    assert settings["training"] == {"learning_rate": 1e-4, "per_device_train_batch_size": 8,
                                    "seed": 42, "max_steps": 30}
    assert 'AutoPeftModelForCausalLM.from_pretrained("me/shared-lora")' in card
    # Nothing local, nothing secret, nothing about where it is uploaded.
    for text in (str(tmp_path), str(DATA), TOKEN, "<redacted>", "push_to_hub", "checkpoint"):
        assert text not in card
    assert upload.plan(run, "me/other").repo_id == "me/other"


def test_push_dry_run_prints_the_upload(write, hub_env, tmp_path, capsys):
    run = _finished_run(write, tmp_path)
    assert cli.main(["push", str(run), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"finetune: upload to me/shared-lora: README.md (model card) and "
                          f"4 file(s) of {run / 'final'}\n  adapter_config.json\n")
    assert "--- README.md ---\n---\nbase_model: org/base-model\n" in out
    assert cli.main(["push", str(run), "--dry-run", "--repo", "a/b/c"]) == 2
    assert "--repo 'a/b/c': not a hub repository id" in capsys.readouterr().err


@pytest.mark.parametrize("missing,message", [
    ("summary.json", "summary.json is missing: a run is shared once it has finished"),
    ("final", "final is missing: only the final model is shared"),
])
def test_an_unfinished_run_is_not_shared(write, hub_env, tmp_path, missing, message):
    run = _finished_run(write, tmp_path)
    path = run / missing
    if path.is_dir():
        for child in sorted(path.rglob("*"), reverse=True):
            child.rmdir() if child.is_dir() else child.unlink()
        path.rmdir()
    else:
        path.unlink()
    with pytest.raises(RunError, match=message):
        upload.plan(run)


@pytest.mark.slow
def test_a_run_whose_upload_fails_is_complete_and_leaks_no_token(write, tmp_path):
    config = write("pushed.yaml", f"""\
method: sft
model: {{name_or_path: {TINY_MODEL}, init: random}}
peft: {{type: lora, r: 4}}
data:
  train: {{path: {DATA}/sft_train.jsonl, max_samples: 16}}
  eval: {{path: {DATA}/sft_eval.jsonl, max_samples: 4}}
evaluation: {{exact_match: true, max_new_tokens: 4}}
training:
  push_to_hub: true
  hub_token: {TOKEN}
  max_steps: 4
  save_steps: 2
  per_device_train_batch_size: 4
  logging_steps: 1
""")
    env = {key: value for key, value in os.environ.items()
           if key not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    # Nothing listens on port 9: the upload fails at once, as without a network.
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_TOKEN="hf_FAKEenvToken000",
               HF_HOME=str(tmp_path / "hf-home"))
    result = subprocess.run([sys.executable, "-m", "finetune", "train", str(config)],
                            cwd=tmp_path, env=env, text=True, capture_output=True, timeout=600)
    run = tmp_path / "runs" / "pushed"
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    [error] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: uploading {run / 'final'} to pushed failed: ")
    assert error.endswith(f"The run itself is complete; upload it again with `finetune push "
                          f"{run}`")
    assert (run / "summary.json").is_file() and (run / "final").is_dir()
    assert "finetune: upload to pushed: README.md (model card) and" in result.stdout
    for secret in (TOKEN, "hf_FAKEenvToken000"):
        assert secret not in result.stdout + result.stderr
        assert [p for p in run.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()] \
            == []

    dry = run_cli("push", str(run), "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    listed = [line.strip() for line in dry.stdout.split("--- README.md ---")[0].splitlines()[1:]]
    shipped = sorted(p.relative_to(run / "final").as_posix() for p in (run / "final").rglob("*")
                     if p.is_file() and p.name not in ("training_args.bin", "README.md"))
    assert listed == shipped and "adapter_model.safetensors" in listed
    card = dry.stdout.split("--- README.md ---\n")[1]
    summary = json.loads((run / "summary.json").read_text())
    assert "architecture of a local model, `tiny-llama`" in card
    assert "- train: a local file, `sft_train.jsonl`" in card
    assert f"| eval_loss | {summary['before']['eval_loss']:.4g} | " \
           f"{summary['after']['eval_loss']:.4g} |" in card
    assert TOKEN not in card and str(tmp_path) not in card

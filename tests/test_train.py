"""`finetune train` end to end in a subprocess, for every method x peft kind, on the
bundled tiny model: a few steps each, then the run directory is checked."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import DATA, TINY_MODEL, run_cli

pytestmark = pytest.mark.slow  # training runs

DATASETS = {"sft": ("sft_train", "sft_eval"), "reward": ("pref_train", "pref_eval"),
            "dpo": ("pref_train", "pref_eval")}
STEPS = 3


def experiment(method: str, peft: str) -> str:
    train, evaluation = DATASETS[method]
    peft_block = f"peft:\n  type: {peft}\n  r: 4\n" if peft != "none" else ""
    return (f"method: {method}\nmodel:\n  name_or_path: {TINY_MODEL}\n  init: random\n"
            f"{peft_block}data:\n  train: {{path: {DATA}/{train}.jsonl, max_samples: 48}}\n"
            f"  eval: {{path: {DATA}/{evaluation}.jsonl, max_samples: 16}}\n"
            f"training:\n  max_steps: {STEPS}\n  per_device_train_batch_size: 8\n"
            "  logging_steps: 1\n  learning_rate: 1e-3\n")


# Full fine-tuning of reward and dpo also runs, end to end, in test_quickstart.py.
@pytest.mark.parametrize("method,peft", [
    ("sft", "none"), ("sft", "lora"), ("sft", "qlora"), ("reward", "lora"),
    ("reward", "qlora"), ("dpo", "lora"), ("dpo", "qlora")])
def test_train_writes_a_complete_run_directory(method, peft, write, tmp_path):
    config = write(f"{method}-{peft}.yaml", experiment(method, peft))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / f"{method}-{peft}"

    resolved = yaml.safe_load((run / "experiment.yaml").read_text())
    assert resolved["method"] == method and resolved["peft"]["type"] == peft
    env = json.loads((run / "environment.json").read_text())
    assert env["device"] == "cpu" and env["precision"] == "fp32" and env["packages"]["trl"]
    args = json.loads((run / "training_args.json").read_text())
    assert args["bf16"] is False and args["fp16"] is False and args["use_cpu"] is True
    assert args["output_dir"] == str(run / "checkpoints")
    # Speed default: sft trains on flattened, padding-free batches unless told otherwise.
    assert args.get("padding_free", False) is (method == "sft")
    # activation_checkpointing auto: the tiny run fits the host many times over.
    assert args["activation_checkpointing"] is False
    assert "activation checkpointing off (auto): without it the estimate is" in result.stdout

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == STEPS and all(isinstance(x, float) for x in losses)
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] == STEPS
    assert summary["before"]["eval_loss"] != summary["after"]["eval_loss"]

    final = run / "final"
    assert (final / "tokenizer.json").exists()
    if peft == "none":
        assert (final / "model.safetensors").exists()
    else:
        assert (final / "adapter_model.safetensors").exists()
        config_json = json.loads((final / "adapter_config.json").read_text())
        assert config_json["r"] == 4
        assert f"peft {peft}" in result.stdout and "(100.00%)" not in result.stdout
    if method == "dpo":
        # The reference is the starting policy: at step 0 both implicit rewards are 0.
        assert summary["before"]["eval_rewards/chosen"] == 0.0
        assert summary["before"]["eval_rewards/rejected"] == 0.0
        assert summary["after"]["eval_rewards/chosen"] != 0.0
    if method == "reward":
        assert "eval_accuracy" in summary["after"]
    assert "finetune: done in" in result.stdout


def test_an_existing_run_is_never_overwritten(write, tmp_path):
    config = write("again.yaml", experiment("sft", "none").replace(
        f"max_steps: {STEPS}", "max_steps: 1"))
    assert run_cli("train", str(config), cwd=tmp_path).returncode == 0
    weights = tmp_path / "runs" / "again" / "final" / "model.safetensors"
    before = weights.read_bytes()
    result = run_cli("train", str(config), cwd=tmp_path)  # resume: auto: done, exit 0
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert "holds this run, finished (summary.json, step 1); nothing to do" in result.stdout
    result = run_cli("train", str(config), "resume=never", cwd=tmp_path)
    assert result.returncode == 2 and "already holds a final model (final/)" in result.stderr
    assert weights.read_bytes() == before

"""The reference-free preference methods, orpo, cpo and simpo (TRL's experimental
ORPOTrainer and CPOTrainer): each trains end to end with full fine-tuning, LoRA and QLoRA
into a complete run directory, learns the quickstart's preference pairs (held-out
preference accuracy rises), refuses per-sample weights with the reason, and is estimated
without a reference model. Exact resume and data parallelism are in test_resume.py and
test_data_parallel.py."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from conftest import DATA, QUICKSTART, REPO, TINY_MODEL, run_cli

pytestmark = pytest.mark.slow  # every test runs the CLI in a subprocess

STEPS = 3


def experiment(method: str, peft: str, extra: str = "") -> str:
    peft_block = f"peft:\n  type: {peft}\n  r: 4\n" if peft != "none" else ""
    return (f"method: {method}\nmodel:\n  name_or_path: {TINY_MODEL}\n  init: random\n"
            f"{peft_block}data:\n  train: {{path: {DATA}/pref_train.jsonl, max_samples: 48}}\n"
            f"  eval: {{path: {DATA}/pref_eval.jsonl, max_samples: 16}}\n"
            f"output: {{plot: false}}\n"
            f"training:\n  max_steps: {STEPS}\n  per_device_train_batch_size: 8\n"
            "  logging_steps: 1\n  learning_rate: 1e-3\n  max_length: 64\n" + extra)


@pytest.mark.parametrize("method,peft", [
    ("orpo", "none"), ("orpo", "lora"), ("orpo", "qlora"),
    ("cpo", "none"), ("cpo", "lora"), ("cpo", "qlora"), ("simpo", "lora")])
def test_train_writes_a_complete_run_directory(method, peft, write, tmp_path):
    config = write(f"{method}-{peft}.yaml", experiment(method, peft))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / f"{method}-{peft}"
    assert yaml.safe_load((run / "experiment.yaml").read_text())["method"] == method
    args = json.loads((run / "training_args.json").read_text())
    # simpo is CPOConfig with the simpo loss and no behaviour-cloning (NLL) term.
    assert (args.get("loss_type"), args.get("cpo_alpha")) == {
        "orpo": (None, None), "cpo": ("sigmoid", 1.0), "simpo": ("simpo", 0.0)}[method]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == STEPS and all(isinstance(x, float) and x == x for x in losses)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] == STEPS
    assert summary["before"]["eval_loss"] != summary["after"]["eval_loss"]
    assert "eval_rewards/accuracies" in summary["after"]
    if method == "orpo":
        assert "eval_log_odds_ratio" in summary["after"]
    final = run / "final"
    assert (final / "tokenizer.json").exists()
    weights = "model.safetensors" if peft == "none" else "adapter_model.safetensors"
    assert (final / weights).exists()
    if peft != "none":
        assert f"peft {peft}" in result.stdout and "(100.00%)" not in result.stdout
    assert "finetune: done in" in result.stdout


@pytest.mark.parametrize("method,overrides", [
    ("orpo", ()),
    # SimPO's own scale (the paper's beta 2 to 2.5, gamma/beta about 0.5).
    ("simpo", ("training.beta=2.0", "training.simpo_gamma=1.0"))])
def test_learns_the_quickstart_preferences(method, overrides, tmp_path):
    """The quickstart's dpo run (150 steps, random init) with the method swapped: the
    held-out pairs the policy prefers rise from chance to nearly all."""
    result = run_cli("train", str(QUICKSTART / "dpo.yaml"), f"method={method}",
                     f"name=q-{method}", *overrides, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / f"q-{method}" / "summary.json").read_text())
    before = summary["before"]["eval_rewards/accuracies"]
    after = summary["after"]["eval_rewards/accuracies"]
    margins = (summary["before"]["eval_rewards/margins"],
               summary["after"]["eval_rewards/margins"])
    print(f"{method} preference accuracy {before} -> {after}, margin {margins[0]:.4g} -> "
          f"{margins[1]:.4g}, in {summary['seconds']} s")
    assert after >= max(0.9, before + 0.3)
    assert margins[1] > margins[0] + 0.05


@pytest.mark.parametrize("method", ["orpo", "cpo", "simpo"])
def test_per_sample_weights_are_refused_with_the_reason(method, write, tmp_path):
    config = write("w.yaml", experiment(method, "none").replace(
        "max_samples: 48}", "max_samples: 48}\n  weight_column: w"))
    result = run_cli("validate", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"data.weight_column: not used by method {method}: its trainer has no per-sample " \
           "loss weights (they are for methods sft, reward, dpo and classify)" in result.stderr


def test_estimate_models_no_reference(write, tmp_path):
    """dpo holds a frozen copy of the policy under full fine-tuning; orpo holds none."""
    outputs = {}
    for method in ("dpo", "orpo"):
        config = write(f"{method}.yaml", experiment(method, "none"))
        result = run_cli("estimate", str(config), "--json", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        outputs[method] = json.loads(result.stdout)
    held = {m: o["configured"]["bytes"]["reference"] for m, o in outputs.items()}
    assert held["dpo"] == outputs["dpo"]["configured"]["bytes"]["trainable"] > 0
    assert held["orpo"] == 0
    assert outputs["orpo"]["settings"]["sequences_per_sample"] == 2

def test_a_prompt_that_fills_max_length_is_named(write, tmp_path):
    config = write("long.yaml", experiment("simpo", "none").replace(
        "max_length: 64", "max_length: 8"))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    # The first row checked: max_samples 48 is a seeded random sample, not the first rows.
    assert re.search(r"pref_train\.jsonl row \d+: the prompt alone has \d+ tokens", result.stderr)
    assert "training.max_length is 8: CPOTrainer keeps the whole prompt" in result.stderr


def test_example_configs_validate(online, tmp_path):
    for name in ("qwen2.5-0.5b-orpo-lora.yaml", "qwen2.5-0.5b-simpo-lora.yaml"):
        result = run_cli("validate", str(REPO / "configs" / "examples" / name), cwd=tmp_path)
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("method,trainer", [("dpo", "DPOTrainer"), ("kto", "KTOTrainer")])
def test_data_no_row_of_which_fits_is_named_before_training(method, trainer, write, tmp_path):
    """dpo and kto drop a row whose prompt alone fills max_length (methods/pairs.py): with
    every prompt that long, the error names the shortest one instead of training on none."""
    config = write(f"{method}-short.yaml", experiment(method, "lora").replace(
        "max_length: 64", "max_length: 4"))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert re.search(rf"error: data\.train: no row fits training\.max_length 4: {trainer} "
                     r"drops a row whose prompt alone is that long .*pref_train\.jsonl row \d+",
                     result.stderr), result.stderr[-2000:]

"""method rloo (TRL's RLOOTrainer) end to end through the CLI, on the bundled tiny model
from random weights: full fine-tuning, LoRA and QLoRA write a complete run directory
(the reference loaded by default, beta 0.05); it learns from a Python reward function;
it resumes bitwise after SIGTERM inside a generation window; it runs on 2 processes with
each prompt's group split across them; per-sample weights are refused with the reason.
Prompts, reward functions and the run layout are test_grpo.py's."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from conftest import REPO, free_port, run_cli
from finetune.rundir import checkpoint_state, checkpoints
from resumable import Run, assert_identical, logged, stopped_by_sigterm
from test_grpo import CLOCK, REWARDS, grpo, prompts, rewarded

pytestmark = pytest.mark.slow  # every test runs the CLI in a subprocess


def rloo(name: str, data: str, *, steps: int, **kwargs) -> str:
    """test_grpo's experiment with method rloo (beta 0.04 as there unless replaced)."""
    return grpo(name, data, steps=steps, **kwargs).replace("method: grpo", "method: rloo")


@pytest.mark.parametrize("peft", ["none", "lora", "qlora"])
def test_train_writes_a_complete_run_directory(peft, write, tmp_path):
    """Two steps with RLOOConfig's default beta (0.05): under full fine-tuning the
    reference is TRL's copy loaded from the run's init-model/, under (Q)LoRA the policy
    with its adapters disabled; either way the KL at step 1 is exactly 0."""
    write("rewards.py", REWARDS)
    data = prompts(tmp_path / "prompts.jsonl", 16)
    peft_block = "{type: none}" if peft == "none" else f"{{type: {peft}, r: 4}}"
    config = write(f"r-{peft}.yaml", rloo(f"r-{peft}", data, steps=2, peft=peft_block).replace(
        "  beta: 0.04\n", ""))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / f"r-{peft}"
    assert yaml.safe_load((run / "experiment.yaml").read_text())["method"] == "rloo"
    args = json.loads((run / "training_args.json").read_text())
    assert args["beta"] == 0.05 and args["num_generations"] == 8
    records = rewarded(run)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["kl"] == 0.0  # the reference is the starting policy
    assert all(math.isfinite(r["reward"]) and math.isfinite(r["kl"]) for r in records)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] == 2
    final = run / "final"
    assert (final / "tokenizer.json").exists()
    weights = "model.safetensors" if peft == "none" else "adapter_model.safetensors"
    assert (final / weights).exists()
    if peft != "none":
        assert f"peft {peft}" in result.stdout
    assert "finetune: done in" in result.stdout


def test_rloo_learns_from_a_reward_function(write, tmp_path):
    """grpo's learning test with rloo's leave-one-out baseline: LoRA on the random-init
    tiny Llama (final norm trained too) learns to emit digits, rewarded per generated
    token (measured: mean reward 0.033 -> 0.38 over 50 steps); the KL to the starting
    adapter starts at exactly 0 and grows as the policy moves."""
    write("rewards.py", REWARDS)
    data = prompts(tmp_path / "prompts.jsonl", 64)
    # RLOO subtracts beta x the completion's summed KL from its reward: against rewards of
    # ~0.03 per token grpo's beta 0.04 outweighs the reward and the policy stays put.
    config = write("learn.yaml", rloo("learn", data, steps=50, extra=(
        "  learning_rate: 0.1\n  lr_scheduler_type: constant\n  save_steps: 1000\n")).replace(
        "beta: 0.04", "beta: 0.005"))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = rewarded(tmp_path / "runs" / "learn")
    assert [r["step"] for r in records] == list(range(1, 51))
    reward = [r["reward"] for r in records]
    assert all(r["rewards/digits/mean"] == r["reward"] for r in records)  # one source, weight 1
    start, end = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    kl = [r["kl"] for r in records]
    print(f"rloo learning: mean reward {start:.3f} (steps 1-5) -> {end:.3f} (steps 46-50); "
          f"kl {kl[0]} -> max {max(kl):.3f}")
    assert end > 3 * start and end - start > 0.06, reward
    assert kl[0] == 0.0 and max(kl) > 0.1 and all(math.isfinite(k) for k in kl), kl
    assert (tmp_path / "runs" / "learn" / "final" / "adapter_model.safetensors").exists()


def test_sigterm_inside_a_generation_window_then_resume_is_bitwise_identical(write, tmp_path):
    """As grpo's: generation windows of steps_per_generation 3 x num_iterations 2 = 6
    steps; SIGTERM lands inside one, the checkpoint carries the buffer as the "rloo" part
    of the state record, and the resumed run ends bitwise equal to an uninterrupted one
    (weights, losses, reward, kl, ...), across an epoch boundary."""
    write("rewards.py", REWARDS)
    data = prompts(tmp_path / "prompts.jsonl", 12)
    extra = ("  learning_rate: 0.05\n  steps_per_generation: 3\n  num_iterations: 2\n"
             "  save_steps: 4\n")
    peft = "{type: lora, r: 8, dropout: 0.1, modules_to_save: [norm]}"
    text = rloo("cut", data, steps=14, peft=peft, extra=extra).replace(
        "logging_steps: 1", "logging_steps: 2")
    reference = write("whole.yaml", text.replace("name: cut", "name: whole"))
    whole = Run("train", reference, tmp_path, 0)
    assert whole.wait() == 0, whole.text()[-3000:]

    config = write("cut.yaml", text)
    run_dir = tmp_path / "runs" / "cut"
    stopped_by_sigterm("train", config, run_dir, tmp_path, 2)
    saved_at = json.loads((run_dir / checkpoints.STOPPED).read_text())["step"]
    state = checkpoint_state.load(run_dir / "checkpoints" / f"checkpoint-{saved_at}", 0)
    assert "grpo" not in state
    assert state["rloo"]["step"] == saved_at and saved_at % 6, saved_at  # mid-window
    assert len(state["rloo"]["buffer"]) == 3

    second = Run("train", config, tmp_path, 2)
    assert second.wait() == 0, second.text()[-3000:]
    assert f"resuming from {run_dir}/checkpoints/checkpoint-{saved_at}" in second.text()
    print(f"rloo: SIGTERM saved at step {saved_at} (generation window of 6 steps)")
    assert_identical(run_dir, tmp_path / "runs" / "whole", f"rloo, stopped at {saved_at}")

    def metrics(run):
        return [{k: v for k, v in r.items() if k not in CLOCK} for r in logged(run)]
    assert metrics(run_dir) == metrics(tmp_path / "runs" / "whole")
    assert [r["step"] for r in rewarded(run_dir)] == [1, 8, 14]


def test_rloo_on_two_processes_with_groups_split_across_them(write, tmp_path):
    """DDP with 4 prompts' completions per process and 8 per prompt: every group spans
    both processes, so the leave-one-out baselines need the rewards gathered from both.
    (Completions are sampled with per-process seeds, as TRL seeds each device, so a
    2-process run is not numerically equal to a 1-process one.)"""
    write("rewards.py", REWARDS)
    data = prompts(tmp_path / "prompts.jsonl", 16)
    config = write("ddp.yaml", rloo("ddp", data, steps=2, extra=(
        "  per_device_train_batch_size: 4\n  save_strategy: 'no'\n")).replace(
        "evaluation:", "distributed: {strategy: ddp, num_processes: 2, device: cpu, "
                       f"main_process_port: {free_port()}}}\nevaluation:").replace(
        "  per_device_train_batch_size: 16\n", ""))
    result = run_cli("launch", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "x 2 process(es)" in result.stdout
    records = rewarded(tmp_path / "runs" / "ddp")
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["reward"]) for r in records)
    assert records[0]["kl"] == 0.0
    assert (tmp_path / "runs" / "ddp" / "final" / "adapter_model.safetensors").exists()


def test_weights_refused_and_the_reference_estimated(write, tmp_path):
    """Per-sample weights are refused at validate with the reason; the estimate holds a
    frozen reference under full fine-tuning by default (beta 0.05), none with beta 0."""
    write("rewards.py", REWARDS)
    data = prompts(tmp_path / "prompts.jsonl", 16)
    text = rloo("w", data, steps=2, peft="{type: none}").replace("  beta: 0.04\n", "")
    config = write("w.yaml", text.replace("rewards:", "  weight_column: w\nrewards:", 1))
    result = run_cli("validate", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "data.weight_column: not used by method rloo: its samples are weighted by their " \
           "rewards" in result.stderr
    held = {}
    for beta in ("", "  beta: 0.0\n"):
        config = write("e.yaml", text + beta)
        result = run_cli("estimate", str(config), "--json", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        configured = json.loads(result.stdout)["configured"]["bytes"]
        held[beta] = (configured["reference"], configured["trainable"])
    assert held[""][0] == held[""][1] > 0
    assert held["  beta: 0.0\n"][0] == 0


def test_example_config_validates(online, tmp_path):
    result = run_cli("validate", str(REPO / "configs" / "examples" /
                                     "qwen2.5-0.5b-rloo-lora.yaml"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr

"""method grpo end to end through the CLI, on the bundled tiny model from random weights:
it learns from a Python reward function, combines a reward model (a LoRA `method:
reward` run) with a function by rewards.weights, resumes bitwise after SIGTERM inside a
generation window, and names a reward function that fails."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from conftest import DATA, TINY_MODEL, free_port, run_cli
from finetune.rundir import checkpoint_state, checkpoints
from resumable import Run, assert_identical, logged, stopped_by_sigterm

WORDS = "apple rose yak tree goat sun van fish zebra kite wolf egg pen queen".split()

# Written next to each test's YAML (rewards.functions paths are relative to it).
REWARDS = '''
def digits(completions, completion_ids, task, **kwargs):
    """Digits per generated token: a random-init model emits one ~3% of the time."""
    assert all(t == "digits" for t in task)  # extra data columns arrive as keyword arguments
    return [sum(ch.isdigit() for ch in text) / max(len(ids), 1)
            for text, ids in zip(completions, completion_ids)]


def length(completions, **kwargs):
    return [len(text) / 100 for text in completions]


def broken(completions, **kwargs):
    raise ValueError("no score for " + repr(completions[0][:0]))
'''

# Timing keys differ between any two runs; everything else must be equal.
# The Trainer's end-of-run train_loss averages the steps of the last train() call only.
CLOCK = {"time", "step_time", "train_runtime", "train_samples_per_second",
         "train_steps_per_second", "train_loss"}


def prompts(path, count: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(count):
            handle.write(json.dumps({"prompt": "sort: " + " ".join(rng.sample(WORDS, 3)),
                                     "task": "digits"}) + "\n")
    return str(path)


def grpo(name: str, data: str, *, steps: int, functions: str = "[rewards.py:digits]",
         peft: str = "{type: lora, r: 8, alpha: 64, dropout: 0, modules_to_save: [norm]}",
         extra: str = "", rewards_extra: str = "") -> str:
    return (f"name: {name}\nmethod: grpo\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
            f"peft: {peft}\ndata:\n  train: {{path: {data}}}\n"
            f"rewards: {{functions: {functions}{rewards_extra}}}\n"
            "evaluation: {before_training: false}\noutput: {plot: false}\n"
            f"training:\n  max_steps: {steps}\n  per_device_train_batch_size: 16\n"
            "  num_generations: 8\n  max_completion_length: 12\n  beta: 0.04\n"
            "  logging_steps: 1\n  seed: 0\n  activation_checkpointing: false\n" + extra)


def rewarded(run_dir) -> list[dict]:
    return [r for r in logged(run_dir) if "reward" in r]


@pytest.mark.slow
def test_grpo_learns_from_a_reward_function(write, tmp_path):
    """LoRA on the random-init tiny Llama (its final norm trained too: with tied
    embeddings of std 0.02 the adapters alone can barely sharpen the output distribution)
    learns to emit digits, rewarded per generated token; the KL to the reference (the
    starting adapter) starts at exactly 0 and stays bounded."""
    write("rewards.py", REWARDS)
    data = prompts(tmp_path / "prompts.jsonl", 64)
    config = write("learn.yaml", grpo("learn", data, steps=50, extra=(
        "  learning_rate: 0.1\n  lr_scheduler_type: constant\n  save_steps: 1000\n")))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = rewarded(tmp_path / "runs" / "learn")
    assert [r["step"] for r in records] == list(range(1, 51))
    reward = [r["reward"] for r in records]
    assert all(r["rewards/digits/mean"] == r["reward"] for r in records)  # one source, weight 1
    start, end = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    kl = [r["kl"] for r in records]
    print(f"grpo learning: mean reward {start:.3f} (steps 1-5) -> {end:.3f} (steps 46-50); "
          f"kl {kl[0]} -> max {max(kl):.3f}")
    assert end > 3 * start and end - start > 0.06, reward
    assert kl[0] == 0.0  # the reference is the starting policy
    assert all(0 <= k < 4 for k in kl), kl  # uniform -> mostly digits is ~ln(349/10) nats
    final = tmp_path / "runs" / "learn" / "final"
    assert (final / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_reward_model_from_a_lora_reward_run_with_a_function_and_weights(write, tmp_path):
    """rewards.model names a LoRA `method: reward` run (its adapter merged into its
    init-model/ base); the policy is fully fine-tuned with beta > 0, so TRL's separate
    reference model is loaded from the run's init-model/ (KL exactly 0 at step 1). The
    logged reward is the weighted sum of both sources."""
    write("rewards.py", REWARDS)
    reward_run = write("rm.yaml", (
        f"name: rm\nmethod: reward\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
        f"peft: {{type: lora, r: 4}}\ndata:\n  train: {{path: {DATA}/pref_train.jsonl, "
        "max_samples: 16}\nevaluation: {before_training: false}\noutput: {plot: false}\n"
        "training:\n  max_steps: 2\n  per_device_train_batch_size: 8\n  max_length: 64\n"
        "  activation_checkpointing: false\n"))
    result = run_cli("train", str(reward_run), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "runs" / "rm" / "final" / "adapter_config.json").is_file()

    data = prompts(tmp_path / "prompts.jsonl", 16)
    config = write("both.yaml", grpo(
        "both", data, steps=2, functions="[rewards.py:length]", peft="{type: none}",
        rewards_extra=", model: runs/rm, weights: [0.5, 2.0]"))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = rewarded(tmp_path / "runs" / "both")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        model, function = r["rewards/reward_model/mean"], r["rewards/length/mean"]
        assert model != 0 and function > 0
        assert r["reward"] == pytest.approx(0.5 * model + 2.0 * function, rel=1e-5, abs=1e-6)
    assert records[0]["kl"] == 0.0
    assert (tmp_path / "runs" / "both" / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_sigterm_inside_a_generation_window_then_resume_is_bitwise_identical(write, tmp_path):
    """Completions are generated for steps_per_generation 3 x num_iterations 2 = 6 steps at
    a time and kept in memory; SIGTERM lands inside such a window (and inside a logging
    window, logging_steps 2), the checkpoint carries the buffer, and the resumed run ends
    with bitwise the same weights, losses and GRPO metrics (reward, kl, ...) as an
    uninterrupted one. 12 prompts: 2 generations (12 steps) per epoch; the checkpoint is
    in the second epoch, whose order the resumed run must draw as the uninterrupted one
    did (TRL's sampler seeds its generator once: methods/online.py EpochOrder)."""
    write("rewards.py", REWARDS)
    data = prompts(tmp_path / "prompts.jsonl", 12)
    extra = ("  learning_rate: 0.05\n  steps_per_generation: 3\n  num_iterations: 2\n"
             "  save_steps: 4\n")
    peft = "{type: lora, r: 8, dropout: 0.1, modules_to_save: [norm]}"
    text = grpo("cut", data, steps=20, peft=peft, extra=extra).replace(
        "logging_steps: 1", "logging_steps: 2")
    reference = write("whole.yaml", text.replace("name: cut", "name: whole"))
    whole = Run("train", reference, tmp_path, 0)
    assert whole.wait() == 0, whole.text()[-3000:]

    config = write("cut.yaml", text)
    run_dir = tmp_path / "runs" / "cut"
    stopped_by_sigterm("train", config, run_dir, tmp_path, 14)
    saved_at = json.loads((run_dir / checkpoints.STOPPED).read_text())["step"]
    checkpoint = run_dir / "checkpoints" / f"checkpoint-{saved_at}"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["epoch"] > 1
    state = checkpoint_state.load(checkpoint, 0)["grpo"]
    assert state["step"] == saved_at and saved_at % 6, saved_at  # mid-window
    assert len(state["buffer"]) == 3  # one slice of the generation per step
    assert checkpoint_state.path(checkpoint, 0).name in \
        checkpoints.read_manifest(checkpoint)["files"]

    second = Run("train", config, tmp_path, 2)
    assert second.wait() == 0, second.text()[-3000:]
    assert f"resuming from {run_dir}/checkpoints/checkpoint-{saved_at}" in second.text()
    print(f"grpo: SIGTERM saved at step {saved_at} (generation window of 6 steps)")
    assert_identical(run_dir, tmp_path / "runs" / "whole", f"grpo, stopped at {saved_at}")

    def metrics(run):
        return [{k: v for k, v in r.items() if k not in CLOCK} for r in logged(run)]
    assert metrics(run_dir) == metrics(tmp_path / "runs" / "whole")
    # Rewards are logged where completions were generated: steps 1, 7, 13 and 19.
    assert [r["step"] for r in rewarded(run_dir)] == [1, 8, 14, 20]
    assert [r["step"] for r in logged(run_dir) if "loss" in r] == [1, *range(2, 21, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("function, message", [
    ("rewards.py:nowhere", "error: rewards.functions[0]: rewards.py has no function 'nowhere'"),
    ("rewards.py:broken", "error: rewards.functions[0] (rewards.py:broken) raised ValueError: "
                          "no score for ''"),
])
def test_a_reward_function_that_is_missing_or_fails_is_named(function, message, write,
                                                             tmp_path):
    write("rewards.py", REWARDS)
    data = prompts(tmp_path / "prompts.jsonl", 16)
    config = write("bad.yaml", grpo("bad", data, steps=2, functions=f"[{function}]"))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message.split("rewards.py")[0]), errors
    assert message.split("rewards.py")[-1] in errors[0], errors


def test_reward_function_results_are_checked():
    """In-process: what a wrapped reward function may return (None: TRL's 'not scored')."""
    from finetune.errors import RunError
    from finetune.methods.grpo import _checked

    def score(completions, **kwargs):
        return kwargs["answer"]

    checked = _checked(score, "rewards.functions[1] (m:score)")
    assert checked.__name__ == "score"  # TRL's metric key rewards/score/...
    assert checked(prompts=["p", "p"], completions=["a", "b"], answer=[1, None]) == [1, None]
    assert checked(prompts=["p"], completions=["a"], answer=torch.tensor([0.5])) == [0.5]
    for answer, problem in (([1.0], "returned 1 rewards for 2 completions"),
                            (["high", 1.0], "returned str 'high' at index 0"),
                            ([True, 1.0], "returned bool True at index 0"),
                            ([float("inf"), 1.0], "returned inf at index 0"),
                            (0.5, "returned float, not a list")):
        with pytest.raises(RunError, match=r"^rewards\.functions\[1\] \(m:score\): ") as raised:
            checked(prompts=["p", "p"], completions=["a", "b"], answer=answer)
        assert problem in str(raised.value)

    def positional(completions):
        return [0.0] * len(completions)

    with pytest.raises(RunError, match=r"raised TypeError: .*accept \*\*kwargs"):
        _checked(positional, "rewards.functions[0] (m:positional)")(
            prompts=["p"], completions=["a"], completion_ids=[[1]])


@pytest.mark.slow
def test_grpo_on_two_processes_with_chat_prompts(write, tmp_path):
    """DDP: generations, rewards and the group statistics over 2 processes; chat
    prompts reach the reward function as message lists."""
    write("rewards.py", REWARDS + '''

def chat_digits(prompts, completions, completion_ids, **kwargs):
    assert all(isinstance(p, list) and p[0]["role"] == "user" for p in prompts)
    texts = [c[-1]["content"] for c in completions]
    return digits(texts, completion_ids, **kwargs)
''')
    rng = random.Random(1)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": " ".join(
        rng.sample(WORDS, 3))}], "task": "digits"}) + "\n" for _ in range(16)))
    config = write("ddp.yaml", grpo("ddp", str(data), steps=2,
                                    functions="[rewards.py:chat_digits]", extra=(
        "  per_device_train_batch_size: 8\n  save_strategy: 'no'\n")).replace(
        "evaluation:", "distributed: {strategy: ddp, num_processes: 2, device: cpu, "
                       f"main_process_port: {free_port()}}}\nevaluation:").replace(
        "  per_device_train_batch_size: 16\n", ""))
    result = run_cli("launch", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "x 2 process(es)" in result.stdout
    records = rewarded(tmp_path / "runs" / "ddp")
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["reward"]) for r in records)
    assert (tmp_path / "runs" / "ddp" / "final" / "adapter_model.safetensors").exists()

"""method: ppo (finetune.trainers.ppo), measured on real runs of the bundled tiny model:
it learns a synthetic reward on held-out prompts with the KL to the start bounded; the
math matches hand computations; gradient accumulation leaves the updates unchanged;
SIGTERM mid-rollout then resume ends bitwise equal to an uninterrupted run; LoRA
with a shared value head under 2-process DDP gives each rank its own prompts and saves
the adapter and the head."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch
from safetensors.torch import load_file

from conftest import DATA, TINY_MODEL, free_port, run_cli
from finetune.rundir import checkpoint_state, checkpoints
from finetune.trainers import ppo_math
from resumable import Run, logged, stopped_by_sigterm

REWARDS = '''
import json, os
from pathlib import Path


def _text(completion):
    return completion[0]["content"] if isinstance(completion, list) else completion


def vowels(prompts, completions, **kwargs):
    """The fraction of the response's characters that are vowels (random tiny model: ~0.18)."""
    return [sum(ch in "aeiou" for ch in _text(c)) / max(len(_text(c)), 1) for c in completions]


def vowels_seen(prompts, completions, completion_ids, trainer_state, topic, **kwargs):
    """vowels, recording which prompts this rank scored at which step."""
    assert len(topic) == len(prompts) == len(completion_ids)
    assert all(len(ids) >= 1 for ids in completion_ids)
    rank = os.environ.get("RANK", "0")
    with open(Path(__file__).with_name(f"seen-{rank}.jsonl"), "a") as handle:
        handle.write(json.dumps({"step": trainer_state.global_step, "prompts": prompts}) + "\\n")
    return vowels(prompts, completions)
'''
WORDS = ["apple", "bread", "cat", "dog", "egg", "fish", "goat", "hat", "ice", "jam"]


def _prompts(tmp_path, name: str, rows: list, chat: bool) -> str:
    path = tmp_path / f"{name}.jsonl"
    with path.open("w") as handle:
        for i, words in enumerate(rows):
            text = "say: " + " ".join(words)
            prompt = [{"role": "user", "content": text}] if chat else text + " ->"
            handle.write(json.dumps({"prompt": prompt, "topic": f"t{i % 3}"}) + "\n")
    return str(path)


def _data(tmp_path, chat: bool = True) -> tuple[str, str]:
    """Training prompts and held-out prompts (word triples never seen in training)."""
    triples = list(itertools.permutations(WORDS, 3))
    random.Random(0).shuffle(triples)
    return (_prompts(tmp_path, "train", triples[:256], chat),
            _prompts(tmp_path, "eval", triples[256:288], chat))


def _rewards(tmp_path) -> str:
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return str(path)


def _records(run_dir) -> list[dict]:
    return [r for r in logged(run_dir) if "loss" in r]


# ---- 1. it learns ----

@pytest.mark.slow
def test_ppo_raises_the_reward_on_held_out_prompts_with_bounded_kl(write, tmp_path):
    train, held_out = _data(tmp_path)
    rewards = _rewards(tmp_path)
    config = write("learn.yaml", f"""
name: learn
method: ppo
model: {{name_or_path: {TINY_MODEL}, init: random}}
data: {{train: {train}, eval: {held_out}}}
rewards: {{functions: ["{rewards}:vowels"]}}
ppo: {{max_new_tokens: 6, rollout_batches: 2, ppo_epochs: 4, kl_coef: 0.02}}
output: {{plot: false}}
training:
  max_steps: 96
  per_device_train_batch_size: 16
  learning_rate: 2.0e-3
  lr_scheduler_type: constant
  logging_steps: 8
  save_strategy: 'no'
  seed: 1
  activation_checkpointing: false
""")
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "learn"
    summary = json.loads((run / "summary.json").read_text())
    before, after = summary["before"], summary["after"]
    records = _records(run)
    kls = [r["ppo/kl"] for r in records]
    print(f"ppo learning: eval_reward_mean {before['eval_reward_mean']:.4f} -> "
          f"{after['eval_reward_mean']:.4f}, eval_kl {before['eval_kl']:.3f} -> "
          f"{after['eval_kl']:.3f}, rollout KL max {max(kls):.3f}, "
          f"train reward {records[0]['ppo/reward_mean']:.4f} -> "
          f"{records[-1]['ppo/reward_mean']:.4f}")
    assert summary["global_step"] == 96 and before["eval_samples"] == 32
    assert before["eval_kl"] == 0.0  # the reference is the starting policy
    # learned: the held-out reward rises by more than half of its starting value
    assert after["eval_reward_mean"] > before["eval_reward_mean"] + 0.1, (before, after)
    assert records[-1]["ppo/reward_mean"] > records[0]["ppo/reward_mean"] + 0.1
    # ... and stays near the reference: KL in nats per 6-token response (a collapse to
    # one token would be up to 6 x ln(349) = 35)
    assert records[0]["ppo/kl"] == 0.0 and 0 < after["eval_kl"] < 15 and max(kls) < 15
    for key in ("loss", "ppo/reward_mean", "ppo/kl", "ppo/entropy", "ppo/clipfrac_policy",
                "ppo/clipfrac_value", "ppo/value_loss", "ppo/policy_loss",
                "ppo/explained_variance", "ppo/kl_coef", "ppo/response_length",
                "ppo/rewards/vowels"):
        assert all(isinstance(r[key], float) and math.isfinite(r[key]) for r in records), key
    final = run / "final"
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= \
        {p.name for p in final.iterdir()}
    assert (final / "value" / "model.safetensors").is_file()  # the separate value model
    assert load_file(final / "value" / "value_head.safetensors")["weight"].shape == (1, 128)


# ---- 2. the math ----

def test_gae_whitening_and_clipped_losses_match_hand_computations():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.2, 0.1], [1.0, 2.0, 3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = ppo_math.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: d2 = 2 - .1 = 1.9; d1 = .9*.1 - .2 = -.11; d0 = 1 + .9*.2 - .5 = .68
    #        A2 = 1.9, A1 = -.11 + .72*1.9 = 1.258, A0 = .68 + .72*1.258 = 1.58576
    # row 1 (2 tokens; nothing after the last): d1 = 1 - 2 = -1, d0 = .9*2 - 1 = .8
    #        A1 = -1, A0 = .8 + .72*(-1) = .08
    expected = torch.tensor([[1.58576, 1.258, 1.9], [0.08, -1.0, 0.0]])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, torch.tensor([[2.08576, 1.458, 2.0], [1.08, 1.0, 0.0]]))

    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    white = ppo_math.whiten(x, torch.tensor([[1, 1, 1], [1, 0, 0]]))
    std = math.sqrt((1.5 ** 2 + 0.5 ** 2 + 0.5 ** 2 + 1.5 ** 2) / 3)  # unbiased, mean 2.5
    torch.testing.assert_close(white, torch.tensor(
        [[-1.5 / std, -0.5 / std, 0.5 / std], [1.5 / std, 0.0, 0.0]]))

    ratios = torch.tensor([1.5, 0.5, 0.5, 1.1])
    adv = torch.tensor([1.0, 1.0, -2.0, -1.0])
    loss, clipped = ppo_math.clipped_policy_loss(ratios.log(), torch.zeros(4), adv,
                                                 torch.tensor([1, 1, 1, 0]), cliprange=0.2)
    # max(-A r, -A clip(r, .8, 1.2)): -1.2 (clipped), -0.5, 1.6 (clipped); masked: 0
    torch.testing.assert_close(loss, torch.tensor([-1.2, -0.5, 1.6, 0.0]))
    assert clipped.tolist() == [1.0, 0.0, 1.0, 0.0]
    vloss, vclipped = ppo_math.clipped_value_loss(
        torch.tensor([1.0, 0.0, 1.0, 2.0]), torch.tensor([0.5, 0.5, 0.9, 0.5]),
        torch.tensor([0.0, 1.0, 2.0, 2.0]), torch.ones(4), cliprange_value=0.2)
    # .5 max((v-R)^2, (clip(v, old-.2, old+.2)-R)^2): .5*1, .5*1, .5*1, .5*(0.7-2)^2
    torch.testing.assert_close(vloss, torch.tensor([0.5, 0.5, 0.5, 0.845]))
    assert vclipped.tolist() == [0.0, 0.0, 0.0, 1.0]
    # Ziegler et al.: the error is clipped to +-0.2 and scaled by samples / horizon
    assert ppo_math.adaptive_kl(0.1, 2.0, 1.0, 1000, 64) == pytest.approx(0.1 * (1 + 0.2 * 0.064))
    assert ppo_math.adaptive_kl(0.1, 0.9, 1.0, 1000, 64) == pytest.approx(0.1 * (1 - 0.1 * 0.064))


@pytest.mark.slow
def test_gradient_accumulation_leaves_the_updates_unchanged(write, tmp_path):
    """Batch 4 x accumulation 1 and 2 x 2 (fp32, SGD): the rollouts are the same (one
    sampling batch of the whole rollout), and the loss, normalised by the mini-batch's
    token count, gives the same steps to rounding."""
    train, _ = _data(tmp_path)
    rewards = _rewards(tmp_path)
    runs = {}
    for accumulation in (1, 2):
        name = f"ga{accumulation}"
        config = write(f"{name}.yaml", f"""
name: {name}
method: ppo
model: {{name_or_path: {TINY_MODEL}, init: random}}
data: {{train: {train}}}
rewards: {{functions: ["{rewards}:vowels"]}}
ppo: {{max_new_tokens: 6, rollout_batches: 2, ppo_epochs: 1}}
evaluation: {{before_training: false}}
output: {{plot: false}}
training:
  max_steps: 4
  per_device_train_batch_size: {4 // accumulation}
  gradient_accumulation_steps: {accumulation}
  optim: sgd
  learning_rate: 0.1
  lr_scheduler_type: constant
  weight_decay: 0.0
  max_grad_norm: 0.0
  logging_steps: 1
  save_strategy: 'no'
  seed: 3
  activation_checkpointing: false
""")
        result = run_cli("train", str(config), cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[accumulation] = tmp_path / "runs" / name
    init = load_file(runs[1] / "init-model" / "model.safetensors")
    one, two = _weights(runs[1]), _weights(runs[2])
    worst = max(((one[k] - two[k]).norm() / (one[k] - init[k[len("policy."):]]).norm()).item()
                for k in one if k.startswith("policy.") and k[len("policy."):] in init)
    print(f"ppo accumulation 1 vs 2: policy update rel. diff {worst:.2e}")
    assert worst <= 1e-4
    losses = [[r["loss"] for r in _records(run)] for run in runs.values()]
    assert len(losses[0]) == 4
    assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-6)


# ---- 3. exact resume ----

def _resumable(name: str, train: str, rewards: str) -> str:
    """Full fine-tuning, separate value model, adaptive KL; 20 prompts = 2 rollouts of 8
    per epoch (6 optimizer steps each: 3 PPO epochs x 2 mini-batches of 2 x 2 micro), so
    18 steps cross an epoch; checkpoints every 4 steps land mid-rollout."""
    return f"""
name: {name}
method: ppo
model: {{name_or_path: {TINY_MODEL}, init: random}}
data: {{train: {{path: {train}, max_samples: 20}}}}
rewards: {{functions: ["{rewards}:vowels"]}}
ppo: {{max_new_tokens: 5, rollout_batches: 2, ppo_epochs: 3, kl_target: 0.5, kl_horizon: 200}}
evaluation: {{before_training: false}}
output: {{plot: false}}
training:
  max_steps: 18
  per_device_train_batch_size: 2
  gradient_accumulation_steps: 2
  learning_rate: 2.0e-3
  logging_steps: 1
  save_steps: 4
  seed: 5
  activation_checkpointing: false
"""


def _weights(run_dir) -> dict[str, torch.Tensor]:
    final = run_dir / "final"
    out = {f"policy.{k}": v for k, v in load_file(final / "model.safetensors").items()}
    out.update({f"value.{k}": v for k, v in
                load_file(final / "value" / "model.safetensors").items()})
    out.update({f"head.{k}": v for k, v in
                load_file(final / "value" / "value_head.safetensors").items()})
    return out


@pytest.mark.slow
def test_sigterm_mid_rollout_then_resume_is_bitwise_identical(write, tmp_path):
    """Stopped by SIGTERM inside a rollout's cycle (its buffer, the adaptive KL
    coefficient and the logging window go into the checkpoint), resumed, and continued
    across an epoch: the same weights and logs, bit for bit, as a run never stopped.
    (SIGKILL and resuming from periodic checkpoints: tests/test_resume.py, for every
    Trainer-based method alike.)"""
    seed = random.randrange(10**6)
    term_at = random.Random(seed).randint(2, 3)
    train, _ = _data(tmp_path)
    rewards = _rewards(tmp_path)
    whole = Run("train", write("ref.yaml", _resumable("ref", train, rewards)), tmp_path, 0)
    assert whole.wait() == 0, whole.text()[-3000:]

    config = write("cut.yaml", _resumable("cut", train, rewards))
    run_dir = tmp_path / "runs" / "cut"
    stopped_by_sigterm("train", config, run_dir, tmp_path, term_at)
    saved_at = json.loads((run_dir / checkpoints.STOPPED).read_text())["step"]
    state = checkpoint_state.load(run_dir / "checkpoints" / f"checkpoint-{saved_at}", 0)["ppo"]
    assert saved_at % 6, f"step {saved_at} ends a rollout; the test wants one mid-rollout"
    assert state["rollout"] is not None and len(state["rollout"]["prompts"]) == 8

    second = Run("train", config, tmp_path, 2)
    assert second.wait() == 0, second.text()[-3000:]
    assert f"resuming from {run_dir}/checkpoints/checkpoint-{saved_at}" in second.text()
    print(f"ppo resume: SIGTERM at step {term_at}, saved at step {saved_at} (rollout step "
          f"{saved_at % 6} of 6), seed {seed}")

    ours, reference = _weights(run_dir), _weights(tmp_path / "runs" / "ref")
    assert ours.keys() == reference.keys()
    different = [k for k in ours if not torch.equal(ours[k], reference[k])]
    assert not different, f"seed {seed}: weights differ in {different[:5]}"
    strip = lambda records: [{k: v for k, v in r.items() if k != "time"} for r in records]
    ref_records = _records(tmp_path / "runs" / "ref")
    assert strip(_records(run_dir)) == strip(ref_records), f"seed {seed}: logs differ"
    assert [r["step"] for r in ref_records] == list(range(1, 19))
    # the adaptive coefficient moved, and was carried through the checkpoints
    assert len({r["ppo/kl_coef"] for r in ref_records}) > 2


# ---- 4 + 5. LoRA, shared value head, two processes ----

@pytest.mark.slow
def test_lora_shared_value_head_on_two_processes(write, tmp_path):
    train, _ = _data(tmp_path, chat=False)
    rewards = _rewards(tmp_path)
    config = write("ddp.yaml", f"""
name: ddp
method: ppo
model: {{name_or_path: {TINY_MODEL}, init: random}}
peft: {{type: lora, r: 4, dropout: 0.1}}
data: {{train: {{path: {train}, max_samples: 32}}}}
rewards: {{functions: ["{rewards}:vowels_seen"]}}
ppo: {{value_model: shared, max_new_tokens: 4, rollout_batches: 1, ppo_epochs: 2,
       stop_strings: ["."], missing_eos_penalty: 0.1}}
distributed: {{strategy: ddp, num_processes: 2, device: cpu, main_process_port: {free_port()}}}
evaluation: {{before_training: false}}
output: {{plot: false}}
training:
  max_steps: 4
  per_device_train_batch_size: 4
  learning_rate: 1.0e-3
  logging_steps: 1
  save_strategy: 'no'
  seed: 3
  activation_checkpointing: false
""")
    result = run_cli("launch", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "x 2 process(es)" in result.stdout

    seen = {rank: [json.loads(line) for line in
                   (tmp_path / f"seen-{rank}.jsonl").read_text().splitlines()]
            for rank in (0, 1)}
    # a rollout every 2 optimizer steps, 4 prompts per rank, the ranks' prompts distinct
    assert [s["step"] for s in seen[0]] == [s["step"] for s in seen[1]] == [0, 2]
    for ours, theirs in zip(seen[0], seen[1]):
        assert len(ours["prompts"]) == len(theirs["prompts"]) == 4
        assert not set(ours["prompts"]) & set(theirs["prompts"])
    assert set(seen[0][0]["prompts"]) != set(seen[0][1]["prompts"])

    run = tmp_path / "runs" / "ddp"
    records = _records(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    final = run / "final"
    adapter = load_file(final / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert json.loads((final / "adapter_config.json").read_text())["r"] == 4
    assert json.loads((final / "value" / "value.json").read_text())["value_model"] == "shared"
    assert load_file(final / "value" / "value_head.safetensors")["weight"].shape == (1, 128)
    assert not (final / "value" / "model.safetensors").exists()


@pytest.mark.slow
def test_qlora_policy_with_a_reward_run_as_reward_and_value_model(write, tmp_path):
    """A `method: reward` run directory scores the responses (with a function, weighted)
    and starts the separate value model; the policy is QLoRA."""
    reward_config = write("rm.yaml", f"""
name: rm
method: reward
model: {{name_or_path: {TINY_MODEL}, init: random}}
data: {{train: {{path: {DATA}/pref_train.jsonl, max_samples: 8}}}}
evaluation: {{before_training: false}}
output: {{plot: false}}
training: {{max_steps: 2, per_device_train_batch_size: 4, save_strategy: 'no'}}
""")
    result = run_cli("train", str(reward_config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    reward_run = tmp_path / "runs" / "rm"
    train, _ = _data(tmp_path)
    config = write("qlora.yaml", f"""
name: qlora
method: ppo
model: {{name_or_path: {TINY_MODEL}, init: random}}
peft: {{type: qlora, r: 4}}
data: {{train: {{path: {train}, max_samples: 16}}}}
rewards: {{model: {reward_run}, functions: ["{_rewards(tmp_path)}:vowels"], weights: [0.5, 2.0]}}
ppo: {{value_model_path: {reward_run}, max_new_tokens: 4, rollout_batches: 1, ppo_epochs: 1}}
evaluation: {{before_training: false}}
output: {{plot: false}}
training: {{max_steps: 2, per_device_train_batch_size: 4, logging_steps: 1,
           save_strategy: 'no', seed: 3}}
""")
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = _records(tmp_path / "runs" / "qlora")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        parts = {k: v for k, v in record.items() if k.startswith("ppo/rewards/")}
        assert len(parts) == 2, record  # the reward model and the function, each logged
        model_part = next(v for k, v in parts.items() if "vowels" not in k)
        assert record["ppo/reward_mean"] == pytest.approx(
            0.5 * model_part + 2.0 * record["ppo/rewards/vowels"], rel=1e-4, abs=1e-5)
        assert all(math.isfinite(v) for v in record.values() if isinstance(v, float))
    final = tmp_path / "runs" / "qlora" / "final"
    assert (final / "adapter_model.safetensors").exists()
    assert (final / "value" / "value_head.safetensors").exists()

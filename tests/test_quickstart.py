"""The quickstart's learning claims, asserted: each bundled experiment trains from random
weights on the CPU and improves clearly on held-out prompts never seen in training."""

from __future__ import annotations

import json
import re

import pytest

from conftest import QUICKSTART, run_cli

pytestmark = pytest.mark.slow


def train(method: str, tmp_path) -> dict:
    # sft is the README's command: a real interpreter start; the others fork warm.
    result = run_cli("train", str(QUICKSTART / f"{method}.yaml"), cwd=tmp_path, timeout=900,
                     cold=method == "sft")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finetune: done in" in result.stdout
    (tmp_path / "quickstart.log").write_text(result.stdout + result.stderr)
    return json.loads((tmp_path / "runs" / f"quickstart-{method}" / "summary.json").read_text())


def test_sft_learns_to_sort_held_out_word_sets(tmp_path):
    summary = train("sft", tmp_path)
    # Quiet: no Python warning, no library's [WARNING] line (run/noise.py hides the known
    # ones at their source) in the README's command, a cold start that imports everything.
    output = (tmp_path / "quickstart.log").read_text()
    noise = [line for line in output.splitlines()
             if re.search(r"\w+Warning\b|\[WARNING\]|^WARNING", line)]
    assert not noise, noise
    print("sft exact match", summary["before"]["eval_exact_match"], "->",
          summary["after"]["eval_exact_match"], f"in {summary['seconds']} s")
    assert summary["before"]["eval_exact_match"] <= 0.05
    assert summary["after"]["eval_exact_match"] >= 0.5


def test_reward_model_ranks_held_out_pairs(tmp_path):
    summary = train("reward", tmp_path)
    print("reward accuracy", summary["before"]["eval_accuracy"], "->",
          summary["after"]["eval_accuracy"], f"in {summary['seconds']} s")
    assert summary["after"]["eval_accuracy"] >= 0.9


def test_dpo_prefers_the_right_answer_on_held_out_pairs(tmp_path):
    summary = train("dpo", tmp_path)
    before = summary["before"]["eval_rewards/accuracies"]
    after = summary["after"]["eval_rewards/accuracies"]
    print("dpo preference accuracy", before, "->", after, f"in {summary['seconds']} s")
    assert after >= max(0.8, before + 0.5)


def test_classifier_recalls_every_class_despite_imbalance(tmp_path):
    summary = train("classify", tmp_path)
    after = summary["after"]
    print("classify accuracy", summary["before"]["eval_accuracy"], "->",
          after["eval_accuracy"], "macro-F1", after["eval_macro_f1"],
          f"in {summary['seconds']} s")
    assert after["eval_accuracy"] >= 0.9 and after["eval_macro_f1"] >= 0.9
    # the rarest class (10 % of training rows) is still found
    assert after["eval_recall_late"] >= 0.8


def test_vlm_answers_questions_about_held_out_pictures(tmp_path):
    summary = train("vlm", tmp_path)
    before, after = summary["before"]["eval_exact_match"], summary["after"]["eval_exact_match"]
    print("vlm exact match", before, "->", after, f"in {summary['seconds']} s")
    assert before <= 0.05 and after >= 0.8


def test_vlm_dpo_prefers_the_right_answer_about_held_out_pictures(tmp_path):
    summary = train("vlm-dpo", tmp_path)
    before = summary["before"]["eval_rewards/accuracies"]
    after = summary["after"]["eval_rewards/accuracies"]
    print("vlm dpo preference accuracy", before, "->", after, f"in {summary['seconds']} s")
    assert before <= 0.05 and after >= 0.85  # 0.94 at seed 0; seeds 1, 2: 0.91, 0.89

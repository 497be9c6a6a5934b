"""`finetune generate --best-of N`: sampled completions scored by a reward run or a
reward function (or the run's own rewards: section), written as preference rows that a
dpo and a reward run then train on, through the CLI. Scores are checked against the
reward recomputed here (a length function), and the chosen against the argmax."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import DATA, QUICKSTART, run_cli

# One worker runs this module: its module fixture (runs) trains once, not once per worker.
pytestmark = pytest.mark.xdist_group("best_of_n")

LENGTH = '''
def length(completions, **kwargs):
    """Characters of the completion (an assistant turn or text)."""
    return [float(len(c[0]["content"] if isinstance(c, list) else c)) for c in completions]


def same(completions, **kwargs):
    return [1.0] * len(completions)


def by_bonus(completions, bonus, **kwargs):
    """Uses a column of the prompts file."""
    return [float(b) for b in bonus]
'''


def finetune(*args, cwd: Path):
    return run_cli(*map(str, args), cwd=cwd)


def train(root: Path, config: Path, *overrides: str) -> Path:
    run = root / config.stem
    result = finetune("train", config, f"output.dir={run}", "training.save_steps=100",
                      *overrides, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(root, a tiny sft run, a tiny reward run, reward functions file, prompts file)."""
    root = tmp_path_factory.mktemp("best-of-n")
    sft = train(root, QUICKSTART / "sft.yaml", "training.max_steps=20",
                "training.warmup_steps=2")
    reward = train(root, QUICKSTART / "reward.yaml", "training.max_steps=10",
                   "training.warmup_steps=2")
    functions = root / "rewards.py"
    functions.write_text(LENGTH)
    prompts = root / "prompts.jsonl"
    rows = [json.loads(line) for line in (DATA / "sft_eval.jsonl").read_text().splitlines()[:5]]
    prompts.write_text("".join(json.dumps({**row, "topic": f"t{i}", "bonus": i % 3}) + "\n"
                               for i, row in enumerate(rows)))
    return root, sft, reward, functions, prompts


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def text(value) -> str:
    return value[0]["content"] if isinstance(value, list) else value


@pytest.mark.slow
def test_best_of_4_by_a_reward_run_trains_dpo_and_reward(runs):
    root, sft, reward, _, prompts = runs
    out = root / "by-model.jsonl"
    result = finetune("generate", sft, "--file", prompts, "--best-of", 4, "--reward", reward,
                      "--max-new-tokens", 10, "--batch-size", 2, "--out", out, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(out)
    assert 1 <= len(rows) <= 5
    for row in rows:
        assert len(row["scores"]) == 4
        assert row["chosen_score"] == max(row["scores"]) > row["rejected_score"] == \
            min(row["scores"])
        assert row["prompt"][0]["role"] == "user" and row["chosen"][0]["role"] == "assistant"
        assert row["topic"].startswith("t") and "reference" in row  # columns kept
    # The same seed samples the same completions.
    again = root / "again.jsonl"
    assert finetune("generate", sft, "--file", prompts, "--best-of", 4, "--reward", reward,
                    "--max-new-tokens", 10, "--batch-size", 2, "--out", again,
                    cwd=root).returncode == 0
    assert again.read_text() == out.read_text()
    # The loop: dpo from the sft model on the rows, and a reward model on them.
    for config, extra in (("dpo.yaml", (f"model.name_or_path={sft / 'final'}",
                                        "model.init=pretrained")), ("reward.yaml", ())):
        run = root / f"loop-{config}"
        trained = finetune("train", QUICKSTART / config, f"output.dir={run}",
                           f"data.train={out}", "data.eval=null", "training.max_steps=2",
                           "training.warmup_steps=0", "training.per_device_train_batch_size=2",
                           *extra, cwd=root)
        assert trained.returncode == 0, trained.stderr[-3000:]
        assert (run / "final" / "config.json").is_file()


@pytest.mark.slow
def test_best_of_4_by_a_function_chooses_the_argmax(runs):
    root, sft, _, functions, prompts = runs
    out = root / "by-length.jsonl"
    result = finetune("generate", sft, "--prompt", "sort: cat dog", "--prompt", "sort: b a",
                      "--raw", "--best-of", 4, "--reward", f"{functions}:length", "--pairs",
                      "all", "--temperature", 1.5, "--max-new-tokens", 12, "--out", out,
                      cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(out)
    assert rows
    for prompt in ("sort: cat dog", "sort: b a"):
        mine = [r for r in rows if r["prompt"] == prompt]  # --raw: text as given
        if not mine:
            continue  # four completions of one length: a tie, skipped
        scores = mine[0]["scores"]
        assert len(mine) == sum(s < max(scores) for s in scores)  # --pairs all
        for row in mine:
            assert isinstance(row["chosen"], str)
            assert row["chosen_score"] == len(row["chosen"]) == max(scores)
            assert row["rejected_score"] == len(row["rejected"]) < row["chosen_score"]
        assert sorted(r["rejected_score"] for r in mine) == \
            sorted(s for s in scores if s < max(scores))
    # Weighted: 2 x length + 1 x bonus (a column of the prompts file).
    weighted = root / "weighted.jsonl"
    result = finetune("generate", sft, "--file", prompts, "--best-of", 3, "--reward",
                      f"{functions}:length", "--reward", f"{functions}:by_bonus",
                      "--reward-weights", "2,1", "--max-new-tokens", 8, "--out", weighted,
                      cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    for row in read_jsonl(weighted):
        assert row["chosen_score"] == 2 * len(text(row["chosen"])) + row["bonus"]
        assert row["rejected_score"] == 2 * len(text(row["rejected"])) + row["bonus"]


@pytest.mark.slow
def test_ties_are_skipped_and_counted_and_the_runs_own_rewards_serve(runs, tmp_path):
    root, sft, _, functions, prompts = runs
    out = tmp_path / "ties.jsonl"
    result = finetune("generate", sft, "--file", prompts, "--best-of", 2, "--reward",
                      f"{functions}:same", "--max-new-tokens", 4, "--out", out, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    assert out.read_text() == ""
    assert "0 preference row(s) from 5 prompt(s)" in result.stderr
    assert "5 prompt(s) skipped: their 2 samples all scored the same" in result.stderr
    assert "warning: only 0 of 5 prompt(s) gave a pair: a preference run on these 0 row(s) " \
           "learns from 0% of the prompts" in result.stderr
    # A grpo-like run: its experiment's rewards: section scores when --reward is not given.
    grpo = tmp_path / "grpo-run"
    shutil.copytree(sft, grpo)
    spec = yaml.safe_load((grpo / "experiment.yaml").read_text())
    spec.update(method="grpo", rewards={"functions": [f"{functions}:length"]})
    (grpo / "experiment.yaml").write_text(yaml.safe_dump(spec))
    own = tmp_path / "own.jsonl"
    result = finetune("generate", grpo, "--file", prompts, "--best-of", 3, "--max-new-tokens",
                      8, "--out", own, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rewards.py:length" in result.stderr
    for row in read_jsonl(own):
        assert row["chosen_score"] == len(text(row["chosen"])) == max(row["scores"])


@pytest.mark.slow
def test_bad_flags_exit_2_naming_the_flag_and_outputs_are_kept(runs, tmp_path):
    root, sft, reward, functions, prompts = runs
    base = ("generate", sft, "--file", prompts)
    cases = [
        (("--reward", reward), "error: --reward: only with --best-of N"),
        (("--image", prompts), "error: --image: with --prompt only"),
        (("--best-of", 2, "--temperature", 0, "--reward", reward), "error: --temperature 0"),
        (("--best-of", 2, "--reward", tmp_path / "nowhere"), "no such directory"),
        (("--best-of", 2, "--reward", sft), "is a sft run, not a `method: reward` run"),
        (("--best-of", 2, "--reward", sft / "final"), "is not a reward model"),
        (("--best-of", 2, "--reward", reward, "--reward", reward), "2 reward models"),
        (("--best-of", 2, "--reward", f"{functions}:nothing"), "has no function 'nothing'"),
        (("--best-of", 2, "--reward", "nowhere.py:f"), "no such file: nowhere.py"),
        (("--best-of", 2, "--reward", reward, "--reward-weights", "1,2"),
         "--reward-weights: 2 weight(s) for 1 --reward"),
        (("--best-of", 2), "--reward is needed"),
        (("--best-of", 1, "--reward", reward), "--best-of: must be 2..1024"),
    ]
    for flags, message in cases:
        result = finetune(*base, *flags, "--out", tmp_path / "never.jsonl", cwd=root)
        assert result.returncode == 2, (flags, result.stderr[-2000:])
        assert message in result.stderr, (flags, result.stderr[-2000:])
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "never.jsonl").exists()
    kept = tmp_path / "kept.jsonl"
    kept.write_text("mine\n")
    flags = ("--best-of", 2, "--reward", f"{functions}:length", "--max-new-tokens", 4)
    result = finetune(*base, *flags, "--out", kept, cwd=root)
    assert result.returncode == 2 and f"--out {kept} exists" in result.stderr
    assert kept.read_text() == "mine\n"
    assert finetune(*base, *flags, "--out", kept, "--force", cwd=root).returncode == 0
    assert read_jsonl(kept)

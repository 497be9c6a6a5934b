"""finetune/report/plots.py: the loss.png of a run and `finetune plot`. The figures are checked by
what they plot (panels, lines, points), read back from the matplotlib figure, not pixels."""

from __future__ import annotations

import json
import math

import pytest

from conftest import TINY_MODEL, run_cli
from finetune.report import plots
from finetune.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def shown(fig) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """{panel (y label): {line label: [(step, value), ...]}}."""
    return {ax.get_ylabel(): {line.get_label(): [tuple(p) for p in line.get_xydata()]
                              for line in ax.get_lines()}
            for ax in fig.axes}


def run_dir(tmp_path, name: str, records: list, method: str = "sft", extra: str = ""):
    path = tmp_path / name
    path.mkdir()
    (path / "experiment.yaml").write_text(f"name: {name}\nmethod: {method}\n")
    (path / "metrics.jsonl").write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records) + extra)
    return path


SFT = [{"step": 0, "eval_loss": 6.0},
       {"step": 5, "loss": 5.5, "learning_rate": 1e-3, "grad_norm": 2.0},
       {"step": 10, "loss": 4.0, "learning_rate": 5e-4},
       {"step": 10, "eval_loss": 4.5, "eval_runtime": 0.1},
       {"step": 10, "train_loss": 4.7, "train_runtime": 3.0}]
# What grpo (TRL's GRPOTrainer, beta > 0) and ppo (ours) log, by key (tests/test_grpo.py,
# tests/test_ppo.py train such runs; test_real_grpo_and_ppo_runs_are_plotted below too).
GRPO = [{"step": 0, "eval_loss": 0.0, "eval_reward": 0.19, "eval_kl": 0.0},
        {"step": 1, "loss": 0.0, "learning_rate": 1e-6, "reward": 0.23, "reward_std": 0.06,
         "kl": 0.0, "entropy": 5.8},
        {"step": 2, "loss": 0.0, "learning_rate": 8e-7, "reward": 0.18, "kl": 1e-7}]
PPO = [{"step": 0, "eval_reward_mean": 0.15, "eval_kl": 0.0},
       {"step": 1, "loss": 0.04, "learning_rate": 5e-5, "ppo/reward_mean": 0.17, "ppo/kl": 0.0},
       {"step": 2, "loss": 0.09, "learning_rate": 4e-5, "ppo/reward_mean": 0.18, "ppo/kl": 0.01},
       {"step": 2, "eval_reward_mean": 0.14, "eval_kl": 0.02}]


def test_a_run_shows_training_loss_eval_points_and_the_learning_rate(tmp_path):
    fig = plots.figure([plots.read_run(run_dir(tmp_path, "a", SFT))], title="a (sft)")
    assert shown(fig) == {
        "loss": {"train": [(5, 5.5), (10, 4.0)], "eval": [(0, 6.0), (10, 4.5)]},
        "learning rate": {"train": [(5, 1e-3), (10, 5e-4)]}}
    loss, rate = fig.axes
    assert loss.get_lines()[1].get_linestyle() == "None"  # eval: points, not a line
    assert loss.get_lines()[1].get_marker() == "o"
    assert rate.get_xlabel() == "optimizer step" and fig.get_suptitle() == "a (sft)"


@pytest.mark.parametrize("method, records, reward, kl", [
    ("grpo", GRPO, {"train": [(1, 0.23), (2, 0.18)], "eval": [(0, 0.19)]},
     {"train": [(1, 0.0), (2, 1e-7)], "eval": [(0, 0.0)]}),
    ("ppo", PPO, {"train": [(1, 0.17), (2, 0.18)], "eval": [(0, 0.15), (2, 0.14)]},
     {"train": [(1, 0.0), (2, 0.01)], "eval": [(0, 0.0), (2, 0.02)]})])
def test_grpo_and_ppo_runs_add_reward_and_kl_panels(tmp_path, method, records, reward, kl):
    fig = plots.figure([plots.read_run(run_dir(tmp_path, method, records, method))])
    panels = shown(fig)
    assert list(panels) == ["loss", "reward", "KL to reference", "learning rate"]
    assert panels["reward"] == reward and panels["KL to reference"] == kl


def test_damaged_lines_and_non_finite_values_are_not_points(tmp_path, capsys):
    records = [SFT[1], "[1, 2]", '{"step": "5", "loss": 1}', '{"step": true, "loss": 1}',
               {"step": 7, "loss": "nan", "learning_rate": 1e-3},
               {"step": 8, "loss": True, "learning_rate": 1e-3}, SFT[2]]
    path = run_dir(tmp_path, "a", records, extra='{"step": 11, "lo')
    run = plots.read_run(path)
    assert shown(plots.figure([run]))["loss"] == {"train": [(5, 5.5), (10, 4.0)]}
    assert main(["plot", str(path)]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "note" in line]
    assert notes == [f"finetune: note: {path / 'metrics.jsonl'} line {n}: not a JSON object "
                     "with a step number; dropped from the plot" for n in (2, 3, 4)] + [
        f"finetune: note: {path / 'metrics.jsonl'} line 8: half-written, as a kill "
        "mid-append leaves it; dropped from the plot"]
    assert f"finetune: wrote {path / 'loss.png'}" in out
    assert (path / "loss.png").read_bytes()[:8] == PNG


def test_runs_are_overlaid_one_colour_each_with_a_legend_by_name(tmp_path, capsys):
    first, second = run_dir(tmp_path, "base", SFT), run_dir(tmp_path, "tuned", PPO, "ppo")
    out = tmp_path / "both.png"
    assert main(["plot", str(first), str(second), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    fig = plots.figure([plots.read_run(first), plots.read_run(second)])
    panels = shown(fig)
    assert panels["loss"] == {"base train": [(5, 5.5), (10, 4.0)],
                              "base eval": [(0, 6.0), (10, 4.5)],
                              "tuned train": [(1, 0.04), (2, 0.09)]}
    assert panels["reward"] == {"tuned train": [(1, 0.17), (2, 0.18)],
                                "tuned eval": [(0, 0.15), (2, 0.14)]}
    colour = {line.get_label(): line.get_color() for ax in fig.axes for line in ax.get_lines()}
    assert colour["base train"] == colour["base eval"] != colour["tuned train"] == \
        colour["tuned eval"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["base", "tuned", "train",
                                                                  "eval"]


def test_runs_of_the_same_name_are_told_apart_by_path(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    dirs = [run_dir(tmp_path / "x", "same", SFT), run_dir(tmp_path / "y", "same", SFT)]
    runs = plots._labelled([plots.read_run(d) for d in dirs], dirs)
    assert [r.label for r in runs] == [str(d) for d in dirs]


def test_metric_picks_the_panels(tmp_path):
    path = run_dir(tmp_path, "a", SFT)
    out = tmp_path / "grad.svg"
    assert main(["plot", str(path), "--metric", "grad_norm", "--metric", "eval_loss",
                 "--out", str(out)]) == 0
    assert out.read_text().startswith("<?xml")
    fig = plots.figure([plots.read_run(path)], plots.metric_panels(["grad_norm", "loss"]))
    assert shown(fig) == {"grad_norm": {"train": [(5, 2.0)]},
                          "loss": {"train": [(5, 5.5), (10, 4.0)],
                                   "eval": [(0, 6.0), (10, 4.5)]}}


def test_bad_plot_requests_are_one_error_line(tmp_path, capsys):
    good = run_dir(tmp_path, "a", SFT)
    (tmp_path / "empty").mkdir()
    cases = [
        ([str(tmp_path / "empty")], f"error: {tmp_path / 'empty'}: no metrics.jsonl: not a "
                                    "run directory, or a run that has logged nothing yet"),
        ([str(tmp_path / "gone")], f"error: {tmp_path / 'gone'}: no such run directory"),
        ([str(good), str(good)], "error: --out FILE is needed to plot several runs"),
        ([str(good), "--metric", "los"], "error: --out FILE is needed"),
        ([str(good), "--out", str(tmp_path / "a.xyz")], "error: --out "
         f"{tmp_path / 'a.xyz'}: the file name's ending says the image format; one of "),
        ([str(good), "--metric", "grad_nrm", "--out", str(tmp_path / "g.png")],
         f"error: --metric grad_nrm: not logged in {good / 'metrics.jsonl'}; did you mean "
         "grad_norm?"),
        ([str(good), "--out", str(tmp_path)], f"error: --out {tmp_path} is a directory"),
    ]
    for args, error in cases:
        assert main(["plot", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith(error) and len(err.splitlines()) == 1, (args, err)
    nothing = run_dir(tmp_path, "b", [{"step": 1, "grad_norm": 1.0}])
    assert main(["plot", str(nothing)]) == 2
    assert capsys.readouterr().err == ("error: nothing to plot: no loss, reward, KL or learning "
                                       f"rate logged in {nothing / 'metrics.jsonl'}\n")
    assert not (nothing / "loss.png").exists()


def _quick(method: str, data: str, extra: str) -> str:
    return (f"name: {method}\nmethod: {method}\nmodel: {{name_or_path: {TINY_MODEL}, "
            f"init: random}}\ndata: {{train: {data}, eval_fraction: 0.25}}\n"
            "rewards: {functions: [rewards.py:vowels]}\n"
            "training:\n  max_steps: 4\n  per_device_train_batch_size: 8\n  logging_steps: 1\n"
            "  eval_strategy: steps\n  eval_steps: 2\n  per_device_eval_batch_size: 8\n"
            "  activation_checkpointing: false\n" + extra)


@pytest.mark.slow
def test_real_grpo_and_ppo_runs_are_plotted(write, tmp_path):
    """Tiny grpo (beta > 0, so TRL logs kl) and ppo runs write loss.png themselves, with
    reward and KL panels; `finetune plot` overlays the two in a subprocess."""
    write("rewards.py", "def vowels(prompts, completions, **kwargs):\n"
                        "    return [sum(c in 'aeiou' for c in text) / max(len(text), 1)\n"
                        "            for text in completions]\n")
    words = "apple bread cat dog egg fish goat hat ice jam".split()
    data = write("prompts.jsonl", "".join(
        json.dumps({"prompt": f"say: {a} {b} ->"}) + "\n" for a in words for b in words[:4]))
    configs = {"grpo": _quick("grpo", data, "  num_generations: 4\n  max_completion_length: 6\n"
                                            "  beta: 0.04\n"),
               "ppo": _quick("ppo", data, "") + "ppo: {max_new_tokens: 6, rollout_batches: 2}\n"}
    runs = []
    for method, text in configs.items():
        result = run_cli("train", str(write(f"{method}.yaml", text)), cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append(tmp_path / "runs" / method)
        assert (runs[-1] / "loss.png").read_bytes()[:8] == PNG
        panels = shown(plots.figure([plots.read_run(runs[-1])]))
        assert list(panels) == ["loss", "reward", "KL to reference", "learning rate"], method
        assert [step for step, _ in panels["reward"]["train"]] == [1, 2, 3, 4], method
        assert [step for step, _ in panels["reward"]["eval"]] == [0, 2, 4, 4], method
        assert all(math.isfinite(v) for _, v in panels["KL to reference"]["train"])
    result = run_cli("plot", *map(str, runs), "--out", "both.png", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout == "finetune: wrote both.png\n", \
        result.stderr
    assert (tmp_path / "both.png").read_bytes()[:8] == PNG


def test_plot_imports_no_torch(tmp_path):
    import subprocess
    import sys

    path = run_dir(tmp_path, "a", SFT)
    code = ("import sys\nfrom finetune.cli import main\n"
            f"assert main(['plot', {str(path)!r}]) == 0\n"
            "heavy = [m for m in ('torch', 'transformers', 'trl') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (path / "loss.png").read_bytes()[:8] == PNG

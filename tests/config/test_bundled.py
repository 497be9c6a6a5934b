"""Every experiment under configs/ validates, found by walking the tree."""

from __future__ import annotations

import pytest

from conftest import REPO
from finetune.config import load_experiment

# configs/sweeps/ holds sweep files (finetune sweep), validated by tests/test_sweep.py.
EXPERIMENTS = sorted(p for p in (REPO / "configs").rglob("*.yaml")
                     if "sweeps" not in p.relative_to(REPO / "configs").parts)


def test_there_are_experiments():
    assert len(EXPERIMENTS) >= 4


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_experiment_validates(path, online):
    load_experiment(path)


@pytest.mark.parametrize("method", ["sft", "reward", "dpo"])
def test_quickstart_with_a_hub_model_validates(method, online):
    """The quickstart file with a hub model and hub data is a valid experiment as is."""
    data = "trl-lib/Capybara" if method == "sft" else "trl-lib/ultrafeedback_binarized"
    exp = load_experiment(REPO / "configs" / "quickstart" / f"{method}.yaml", [
        "model.name_or_path=Qwen/Qwen2.5-0.5B-Instruct", "model.init=pretrained",
        f"data.train={data}", "data.eval=null", "data.eval_fraction=0.01"])
    assert exp.model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"

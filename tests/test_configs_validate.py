"""Every experiment under configs/ validates, found by walking the tree."""

from __future__ import annotations

import pytest

from conftest import REPO
from finetune.config import load_experiment

EXPERIMENTS = sorted(p for p in (REPO / "configs").rglob("*.yaml"))


def test_there_are_experiments():
    assert len(EXPERIMENTS) >= 4


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_experiment_validates(path):
    load_experiment(path)

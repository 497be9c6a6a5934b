"""Data mixtures (data/mix.py): max_samples keeps a seeded random sample, weights set each
source's share of the mix with exact counts, the same seed gives the same rows, and the mix
is part of the cache key and of the resume fingerprint."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_MODEL, run_cli
from finetune.config import load_experiment
from finetune.data.load import ORIGIN, load_data
from finetune.data.mix import draw, shares
from finetune.errors import RunError
from finetune.report.summary import describe_mix
from finetune.rundir.fingerprint import differences, fingerprint
from finetune.rundir.resume import plan_resume

from test_checkpoints import fake_checkpoint


def _rows(prefix: str, n: int) -> str:
    return "".join(json.dumps({"prompt": f"{prefix} {i}", "completion": "x"}) + "\n"
                   for i in range(n))


@pytest.fixture
def sources(tmp_path):
    (tmp_path / "a.jsonl").write_text(_rows("a", 10))
    (tmp_path / "b.jsonl").write_text(_rows("b", 30))
    return tmp_path


def _experiment(folder: Path, train: str, extra: str = "", overrides=()):
    path = folder / "exp.yaml"
    path.write_text(f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
                    f"data:\n  train: {train}\n{extra}training: {{seed: 3}}\n")
    return load_experiment(path, list(overrides))


def _origins(splits) -> Counter:
    """Rows taken per (file, row number)."""
    return Counter((Path(o.split(" row ")[0]).name, int(o.split(" row ")[1]))
                   for o in splits.train[ORIGIN])


def test_shares_are_exact_and_add_up_to_the_total():
    assert shares([10, 30], [1, 1]) == [20, 20]
    assert shares([10, 30], [1, 3]) == [10, 30]
    assert shares([100, 50, 50], [1, 1, 2]) == [50, 50, 100]
    # 10 rows in thirds: 3.33 each; the one row rounding leaves goes to the first.
    assert shares([5, 5], [1, 2]) == [3, 7]
    assert shares([4, 3, 3], [1, 1, 1]) == [4, 3, 3]
    counts = shares([7, 1000, 13], [0.2, 0.5, 0.3])
    assert counts == [204, 510, 306] and sum(counts) == 1020


def test_draw_repeats_whole_then_samples_without_replacement():
    rng = np.random.default_rng(0)
    picked = draw(10, 25, rng)
    counts = Counter(picked)
    assert len(picked) == 25 and set(counts) <= set(range(10))
    assert sorted(counts.values()) == [2] * 5 + [3] * 5  # 2 whole copies + 5 distinct
    sample = draw(10, 4, np.random.default_rng(0))
    assert len(set(sample)) == 4 and sample == sorted(sample)


def test_weights_give_exact_counts_and_oversample_the_small_source(sources):
    train = f"[{{path: {sources}/a.jsonl, weight: 1}}, {{path: {sources}/b.jsonl, weight: 1}}]"
    splits = load_data(_experiment(sources, train))
    taken = _origins(splits)
    per_file = Counter(name for name, _ in taken.elements())
    assert per_file == {"a.jsonl": 20, "b.jsonl": 20}  # total 40, half each
    assert all(taken[("a.jsonl", n)] == 2 for n in range(1, 11))  # 10 rows, twice each
    assert all(taken[("b.jsonl", n)] <= 1 for n in range(1, 31))  # 20 of 30, no repeats
    assert [(m["source"].endswith(f), m["taken"], m["share"]) for m, f in
            zip(splits.mix, ("a.jsonl", "b.jsonl"))] == [(True, 20, 0.5), (True, 20, 0.5)]
    assert "20 rows (50.0%) of its 10 (weight 1, 10 rows repeated 2.00x)" in describe_mix(
        splits.mix)[0]


def test_max_samples_is_a_seeded_sample_the_same_for_a_seed(sources):
    train = f"{{path: {sources}/b.jsonl, max_samples: 12}}"
    first = _origins(load_data(_experiment(sources, train)))
    again = _origins(load_data(_experiment(sources, train)))
    assert first == again and sum(first.values()) == 12 and max(first.values()) == 1
    assert sorted(n for _, n in first) != list(range(1, 13))  # not the first rows
    other = _origins(load_data(_experiment(sources, train, "  seed: 4\n")))
    assert other != first and sum(other.values()) == 12
    # data.seed defaults to training.seed
    assert _origins(load_data(_experiment(sources, train, overrides=["training.seed=4"]))) \
        == other
    whole = _origins(load_data(_experiment(sources, f"{{path: {sources}/b.jsonl, "
                                                    "max_samples: 99}")))
    assert sorted(whole) == [("b.jsonl", n) for n in range(1, 31)]


def test_max_samples_then_weights(sources):
    train = (f"[{{path: {sources}/a.jsonl, weight: 3}}, "
             f"{{path: {sources}/b.jsonl, weight: 1, max_samples: 6}}]")
    splits = load_data(_experiment(sources, train))
    per_file = Counter(name for name, _ in _origins(splits).elements())
    assert per_file == {"a.jsonl": 12, "b.jsonl": 4}  # total 10 + 6, 3:1
    b_rows = {n for name, n in _origins(splits) if name == "b.jsonl"}
    assert len(b_rows) == 4


@pytest.mark.slow
def test_refused_settings_name_the_source(sources, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}}}\ndata:\n  train:\n"
                      f"    - {{path: {sources}/a.jsonl, weight: 2}}\n"
                      f"    - {{path: {sources}/b.jsonl, data_files: x.json}}\n")
    result = run_cli("validate", str(config), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "data.train" in result.stderr and "source(s) 1" in result.stderr
    config.write_text(f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}}}\ndata:\n  train:\n"
                      f"    - {{path: {sources}/b.jsonl, data_files: x.json}}\n")
    result = run_cli("validate", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "data.train.0.data_files" in result.stderr.replace(
        "[0]", ".0"), result.stderr
    assert "only for hub datasets" in result.stderr


def test_a_changed_mix_is_another_fingerprint_and_refused_on_resume(sources, tmp_path):
    plain = _experiment(sources, f"{{path: {sources}/a.jsonl}}")
    before = dict(fingerprint(plain))
    # An experiment without the new settings keeps an earlier checkpoint's fingerprint.
    assert "data.seed" not in before and not any(k.startswith("data.max_samples") for k in before)
    assert before["data.train"][0].keys().isdisjoint({"weight", "data_files"})
    weighted = _experiment(sources, f"[{{path: {sources}/a.jsonl, weight: 1}}, "
                                    f"{{path: {sources}/b.jsonl, weight: 1}}]")
    reweighted = _experiment(sources, f"[{{path: {sources}/a.jsonl, weight: 2}}, "
                                      f"{{path: {sources}/b.jsonl, weight: 1}}]")
    assert differences(fingerprint(weighted), fingerprint(reweighted))
    reseeded = _experiment(sources, f"[{{path: {sources}/a.jsonl, weight: 1}}, "
                                    f"{{path: {sources}/b.jsonl, weight: 1}}]", "  seed: 9\n")
    assert differences(fingerprint(weighted), fingerprint(reseeded)) == [
        "data.seed: '<not set>' -> 9"]
    # A checkpoint from when max_samples kept the first rows saw other rows.
    sampled = _experiment(sources, f"{{path: {sources}/a.jsonl, max_samples: 5}}")
    old = {k: v for k, v in fingerprint(sampled).items() if not k.startswith("data.max_samples")}
    assert differences(old, fingerprint(sampled)) == [
        "data.max_samples keeps: '<not set>' -> 'a seeded random sample'"]

    run = tmp_path / "run"
    fake_checkpoint(run, 4, weighted)
    with pytest.raises(RunError) as refused:
        plan_resume(reweighted, run)
    assert "data.train" in str(refused.value)
    assert plan_resume(weighted, run).checkpoint.name == "checkpoint-4"


@pytest.mark.slow
def test_the_mix_is_part_of_the_cache_key(sources):
    from finetune.data.prepare import cache_key
    from finetune.model.tokenizer import load_tokenizer

    one = _experiment(sources, f"[{{path: {sources}/a.jsonl, weight: 1}}, "
                               f"{{path: {sources}/b.jsonl, weight: 1}}]")
    tokenizer = load_tokenizer(one)
    two = _experiment(sources, f"[{{path: {sources}/a.jsonl, weight: 1}}, "
                               f"{{path: {sources}/b.jsonl, weight: 2}}]")
    seeded = _experiment(sources, f"[{{path: {sources}/a.jsonl, weight: 1}}, "
                                  f"{{path: {sources}/b.jsonl, weight: 1}}]", "  seed: 5\n")
    keys = {cache_key(e, tokenizer) for e in (one, two, seeded)}
    assert len(keys) == 3


@pytest.mark.slow
def test_training_prints_the_mix_also_from_the_cache(sources, tmp_path):
    config = tmp_path / "mix.yaml"
    body = (f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\ndata:\n"
            f"  train:\n    - {{path: {sources}/a.jsonl, weight: 3}}\n"
            f"    - {{path: {sources}/b.jsonl, weight: 1, max_samples: 20}}\n"
            "training: {max_steps: 1, per_device_train_batch_size: 4}\n"
            "evaluation: {before_training: false}\noutput: {plot: false}\n")
    config.write_text(f"name: first\n{body}")
    lines = []
    for name in ("first", "second"):  # the second run loads the entry the first cached
        config.write_text(f"name: {name}\n{body}")
        result = run_cli("train", str(config), cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        lines.append([line for line in result.stdout.splitlines()
                      if "a.jsonl:" in line or "b.jsonl:" in line])
    assert "data loaded from the cache" in result.stdout
    assert lines[0] == lines[1] and len(lines[0]) == 2
    assert lines[0][0].lstrip().startswith("mix        train ")
    assert "a.jsonl: 23 rows (76.7%) of its 10 (weight 3, 10 rows repeated 2.30x)" \
        in lines[0][0]
    assert "b.jsonl: 7 rows (23.3%) of its 30 (max_samples 20, weight 1)" in lines[0][1]


# Preparation in several processes (data/parallel.py).

def test_processes_default_to_the_available_cores_and_skip_small_data(sources):
    import os

    from finetune.data.parallel import ROWS_PER_PROCESS, processes

    exp = _experiment(sources, f"{{path: {sources}/a.jsonl}}")
    cores = len(os.sched_getaffinity(0))
    assert processes(exp, 10) is None
    assert processes(exp, 100 * ROWS_PER_PROCESS) == (cores if cores > 1 else None)
    four = _experiment(sources, f"{{path: {sources}/a.jsonl}}",
                       overrides=["training.dataset_num_proc=4"])
    assert processes(four, 100 * ROWS_PER_PROCESS) == 4
    assert processes(four, 3 * ROWS_PER_PROCESS) == 3


def _chat(n: int, bad: int | None = None) -> list[dict]:
    rows = [{"messages": [{"role": "user", "content": f"question {i} " * (1 + i % 7)},
                          {"role": "assistant", "content": f"answer {i} " * (1 + i % 5)}],
             ORIGIN: f"chat.jsonl row {i + 1}"} for i in range(n)]
    if bad is not None:  # assistant-only loss and no assistant turn: nothing to train
        rows[bad]["messages"] = rows[bad]["messages"][:1]
    return rows


# Runs in a fresh interpreter, as training does: forking a pool from the pytest-xdist
# worker (which has I/O threads) can copy a lock another thread holds, and hang.
TOKENIZE_IN_PROCESSES = r"""
import sys
from pathlib import Path

import pytest
from datasets import Dataset

from finetune.data import sft_tokens
from finetune.errors import DataError
from finetune.model.tokenizer import load_tokenizer
from test_mixtures import _chat, _experiment, _rows

tmp_path = Path(sys.argv[1])
(tmp_path / "x.jsonl").write_text(_rows("x", 1))
exp = _experiment(tmp_path, f"{tmp_path}/x.jsonl")
tokenizer = load_tokenizer(exp)
masking = sft_tokens.Masking(assistant_only=True, max_length=24)
rows = Dataset.from_list(_chat(300))
one = sft_tokens.tokenize(rows, tokenizer, "messages", masking, "train")
three = sft_tokens.tokenize(rows, tokenizer, "messages", masking, "train", num_proc=3)
assert 0 < len(one) < 300  # truncation left some rows nothing to train: dropped
assert one["input_ids"] == three["input_ids"] and one["labels"] == three["labels"]
with pytest.raises(DataError, match="chat.jsonl row 250: nothing to train"):
    sft_tokens.tokenize(Dataset.from_list(_chat(300, bad=249)), tokenizer, "messages",
                        masking, "train", num_proc=2)
print("same rows")
"""


@pytest.mark.slow
def test_tokenizing_in_several_processes_gives_the_same_rows(tmp_path):
    result = subprocess.run([sys.executable, "-c", TOKENIZE_IN_PROCESSES, str(tmp_path)],
                            cwd=Path(__file__).parent, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and "same rows" in result.stdout, result.stderr[-3000:]

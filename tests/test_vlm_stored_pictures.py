"""Rows whose pictures are stored in the rows themselves (datasets' Image feature, as a hub
dataset with images or a parquet file holds them: {"bytes", "path"}), not file paths, in
TRL's rows (`messages` + `images`) and in LLaVA's (`conversations` + `image`):
validate checks each picture's bytes as training does (one line naming file, row and
images[i]), training and its exact-match evaluation read them as they read the same
pictures from files, and a hub dataset's `images` of paths (relative to nothing) is
refused in one line. And per-turn loss weights, which the vision path does not take, are
one line at validate as at training."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import QUICKSTART, run_cli
from finetune.config import load_experiment
from finetune.errors import DataError

DATA = QUICKSTART / "data"
TINY_VLM = QUICKSTART / "tiny-vlm"


def quickstart_rows(name: str, count: int) -> list[dict]:
    """The quickstart's first rows of data/NAME.jsonl (TRL's format, one picture each),
    their image paths absolute."""
    rows = [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines()]
    return [{**r, "images": [str(DATA / p) for p in r["images"]]} for r in rows[:count]]


def with_pictures(rows: list[dict], broken: int | None = None, **columns):
    """rows as a dataset whose `images` are datasets' Image holding each picture's bytes
    (row `broken`, from 1, with bytes that are no picture), as a hub dataset has them."""
    from datasets import Dataset, Image, List

    pictures = [[{"bytes": b"not a picture" if n == broken else Path(p).read_bytes(),
                  "path": Path(p).name} for p in r["images"]]
                for n, r in enumerate(rows, 1)]
    ds = Dataset.from_dict({**{key: [r[key] for r in rows] for key in rows[0]
                               if key != "images"}, "images": pictures, **columns})
    return ds.cast_column("images", List(Image()))


def stored(path: Path, rows: list[dict], broken: int | None = None) -> Path:
    """rows as a parquet file written by datasets, their pictures in it (with_pictures)."""
    with_pictures(rows, broken).to_parquet(str(path))
    return path


def llava_stored(path: Path, rows: list[dict], broken: int | None = None) -> Path:
    """rows (one picture each, before the question) as LLaVA's rows in a parquet file
    written by datasets: `conversations` with an `<image>` placeholder where the picture
    stands, its bytes stored in `image` (datasets' Image; row `broken` no picture)."""
    from datasets import Dataset, Image

    turns = [[{"from": "human", "value": "<image>" + r["messages"][0]["content"][1]["text"]},
              {"from": "gpt", "value": r["messages"][1]["content"][0]["text"]}] for r in rows]
    image = [{"bytes": b"not a picture" if n == broken else Path(r["images"][0]).read_bytes(),
              "path": Path(r["images"][0]).name} for n, r in enumerate(rows, 1)]
    Dataset.from_dict({"conversations": turns, "image": image}).cast_column(
        "image", Image()).to_parquet(str(path))
    return path


def config(write, name: str, train: Path, evaluation: Path, method: str = "sft") -> Path:
    """A 2-step run of method on the tiny VLM (sft: with the exact match of its answers)."""
    exact_match = "true" if method == "sft" else "false"
    return write(f"{name}.yaml", f"""name: {name}
method: {method}
model:
  name_or_path: {TINY_VLM}
  init: random
data:
  train: {train}
  eval: {evaluation}
evaluation:
  exact_match: {exact_match}
  max_new_tokens: 4
training:
  max_steps: 2
  per_device_train_batch_size: 8
  max_length: 64
  activation_checkpointing: false
  logging_steps: 1
  save_steps: 100
  seed: 0
""")


def test_a_broken_stored_picture_is_one_line_at_validate_as_at_training(write, tmp_path):
    from finetune.data.load import load_data

    rows = quickstart_rows("vlm_train", 3)
    good = stored(tmp_path / "good.parquet", rows)
    result = run_cli("validate", str(config(write, "good", good, good)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"{good}: 3 rows, format messages" in result.stdout
    bad = stored(tmp_path / "bad.parquet", rows, broken=2)
    path = config(write, "bad", bad, good)
    result = run_cli("validate", str(path), cwd=tmp_path)
    assert result.returncode == 2
    said = f"{bad} row 2: images[0]: a stored picture ('0001.png', 13 bytes): not an " \
           "image Pillow can read (UnidentifiedImageError)"
    assert said in result.stderr and "Traceback" not in result.stderr
    with pytest.raises(DataError) as caught:  # training's reader
        load_data(load_experiment(path))
    assert str(caught.value) == said
    llava = llava_stored(tmp_path / "llava.parquet", rows, broken=2)  # LLaVA's rows alike
    path = config(write, "llava", llava, good)
    result = run_cli("validate", str(path), cwd=tmp_path)
    said = f"{llava} row 2: images[0]: a stored picture ('0001.png', 13 bytes): not an " \
           "image Pillow can read (UnidentifiedImageError)"
    assert result.returncode == 2 and said in result.stderr, result.stderr
    with pytest.raises(DataError) as caught:
        load_data(load_experiment(path))
    assert str(caught.value) == said


def test_training_reads_stored_pictures_with_one_copy_of_the_rows(write, tmp_path):
    """Training's reader (data/load.py) converts the parquet to Arrow, checks the pictures
    undecoded (the same table, no copy) and decodes them (one cast: one copy): two Arrow
    files, the same bytes of pictures each, and the rows' pictures decoded."""
    from PIL.Image import Image as Picture

    from finetune.data import scratch
    from finetune.data.load import load_data

    rows = quickstart_rows("vlm_train", 3)
    data = stored(tmp_path / "train.parquet", rows)
    # this process's reads (data/scratch.py: <host>.<pid>.<random>/), not other runs'
    ours = lambda: {p for p in scratch.reads_root().glob(f"*.{os.getpid()}.*/**/*.arrow")}
    before = ours()
    splits = load_data(load_experiment(config(write, "read", data, data)))
    written = ours() - before
    assert len(written) == 2 * 2, sorted(written)  # train and eval, each read apart
    assert isinstance(splits.train[0]["images"][0], Picture)


def test_a_hub_dataset_gives_stored_pictures_not_paths(tmp_path):
    """data/load.py reads a hub dataset's rows through the same images.resolved as a
    file's, labelled with the dataset's id (no file to put paths next to)."""
    from datasets import Dataset
    from PIL.Image import Image as Picture

    from finetune.data import images

    rows = quickstart_rows("vlm_train", 2)
    origin = ["someone/pictures row 1", "someone/pictures row 2"]
    paths = Dataset.from_dict({"messages": [r["messages"] for r in rows],
                               "images": [r["images"] for r in rows], "origin": origin})
    with pytest.raises(DataError) as caught:
        images.resolved("someone/pictures", paths, "origin", "sft")
    assert str(caught.value).startswith("someone/pictures: `images` holds file paths, and a "
                                        "hub dataset's paths are relative to nothing")
    pictures = images.undecoded(with_pictures(rows, origin=origin))
    assert isinstance(pictures[0]["images"][0]["bytes"], bytes)  # checked as stored
    read = images.resolved("someone/pictures", pictures, "origin", "sft")
    picture = read[1]["images"][0]  # decoded, as the collator takes it
    assert isinstance(picture, Picture) and picture.size == (32, 32)


@pytest.mark.slow
@pytest.mark.parametrize("method,data", [("sft", "vlm"), ("dpo", "vlm_pref")])
def test_the_tiny_vlm_trains_on_stored_pictures_as_on_their_files(write, tmp_path, method,
                                                                   data):
    """The same rows (conversations for sft, pairs for dpo), pictures stored in parquet or
    named as files, and for sft as LLaVA's rows with stored pictures: the same losses
    (and sft's exact match) before and after (the collators and the evaluation get the
    same pictures), and `finetune data` renders the stored ones with their image tokens."""
    train, evaluation = quickstart_rows(f"{data}_train", 16), quickstart_rows(f"{data}_eval", 8)
    files = {}
    for name, rows in (("train", train), ("eval", evaluation)):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    given = {"paths": (files["train"], files["eval"]),
             "stored": (stored(tmp_path / "train.parquet", train),
                        stored(tmp_path / "eval.parquet", evaluation))}
    if method == "sft":  # and as LLaVA's rows, `<image>` in the turn, the picture in `image`
        given["llava"] = (llava_stored(tmp_path / "llava_train.parquet", train),
                          llava_stored(tmp_path / "llava_eval.parquet", evaluation))
    summaries = {}
    for name, (train_file, eval_file) in given.items():
        path = config(write, name, train_file, eval_file, method)
        result = run_cli("train", str(path), cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        summaries[name] = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
    named = summaries["paths"]
    compared = ["eval_loss"] + (["eval_exact_match"] if method == "sft" else [])
    for name, kept in summaries.items():
        for when in ("before", "after"):
            for key in compared:
                assert kept[when][key] == named[when][key], (name, when, key)
        assert kept["train"]["train_loss"] == named["train"]["train_loss"], name
    kept = summaries["stored"]
    assert kept["after"]["eval_loss"] != kept["before"]["eval_loss"]  # it trained
    if method == "dpo":
        return
    shown = run_cli("data", str(tmp_path / "stored.yaml"), "-n", "1", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert f"--- {tmp_path / 'train.parquet'} row 1 (39 tokens)" in shown.stdout
    assert "<image>" * 16 + " What shape is it?" in shown.stdout


def turn_weighted(write, tmp_path) -> Path:
    """An experiment on the tiny VLM whose second row weighs its answer (a message's
    `weight`)."""
    rows = quickstart_rows("vlm_train", 2)
    rows[1]["messages"][1]["weight"] = 2.0
    data = tmp_path / "weighted.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return config(write, "weighted", data, data)


# Per-turn weights with images train (tests/test_weighted.py); every turn trained, a turn
# is no longer a run of trained tokens, so they are refused then.
TURN_WEIGHTS = "error: data.train: `weight` on messages (per-turn loss weights) for a " \
    "vision-language model needs training.assistant_only_loss (its turns are found as the " \
    "runs of trained tokens); leave it unset or true"
EVERY_TURN = "training.assistant_only_loss=false"


def test_per_turn_weights_with_images_and_every_turn_trained_are_one_line_at_validate(
        write, tmp_path):
    result = run_cli("validate", str(turn_weighted(write, tmp_path)), EVERY_TURN,
                     cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == TURN_WEIGHTS
    result = run_cli("validate", str(turn_weighted(write, tmp_path)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_per_turn_weights_with_images_and_every_turn_trained_are_the_same_line_at_training(
        write, tmp_path):
    result = run_cli("train", str(turn_weighted(write, tmp_path)), EVERY_TURN, cwd=tmp_path)
    assert result.returncode != 0
    assert TURN_WEIGHTS in result.stderr.splitlines() and "Traceback" not in result.stderr

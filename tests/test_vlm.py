"""Vision-language models: a VLM told from its config.json (torch-free, as validate needs
it), and rows with images checked by validate and by training alike (one error naming
file, row and path)."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import QUICKSTART, TINY_MODEL, run_cli
from finetune.config import load_experiment, vision
from finetune.data.scan import check_data
from finetune.errors import DataError

TINY_VLM = QUICKSTART / "tiny-vlm"
PICTURE = QUICKSTART / "data" / "vlm_train" / "0000.png"


def row(*images: str) -> dict:
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "What is it?"}]
    return {"messages": [{"role": "user", "content": parts},
                         {"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
            "images": list(images)}


def experiment(write, tmp_path, rows: list[dict], model=TINY_VLM):
    """An sft experiment on rows with images, in tmp_path/data/rows.jsonl, beside one
    real picture (data/pic.png) and a file that is no image (data/notes.png)."""
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    shutil.copy(PICTURE, data / "pic.png")
    (data / "notes.png").write_text("not a picture\n")
    (data / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return write("exp.yaml", f"method: sft\nmodel:\n  name_or_path: {model}\n  init: random\n"
                             f"data:\n  train: {data / 'rows.jsonl'}\n")


def training_error(path) -> str:
    """The error training's reader (data/load.py) gives for the experiment's data."""
    from finetune.data.load import load_data

    with pytest.raises(DataError) as caught:
        load_data(load_experiment(path))
    return str(caught.value)


def test_a_vision_language_model_is_told_from_its_config_without_torch():
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    assert vision.image_text_model_types() == set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    assert vision.is_vision_language(str(TINY_VLM))
    assert not vision.is_vision_language(str(TINY_MODEL))


def test_rows_with_images_validate(write, tmp_path):
    path = experiment(write, tmp_path, [row("pic.png"), row()])
    result = run_cli("validate", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert ": 2 rows, format messages" in result.stdout


def test_a_missing_image_is_one_line_naming_file_row_and_path(write, tmp_path):
    path = experiment(write, tmp_path, [row("pic.png"), row("pics/missing.png")])
    data = tmp_path / "data" / "rows.jsonl"
    result = run_cli("validate", str(path), cwd=tmp_path)
    assert result.returncode == 2
    said = f"{data} line 2: images[0] 'pics/missing.png': no such file " \
           f"({tmp_path / 'data' / 'pics' / 'missing.png'})"
    assert said in result.stderr and "Traceback" not in result.stderr
    assert training_error(path) == said.replace("line 2", "row 2")


def test_a_file_that_is_no_image_is_named_at_validate_and_at_training(write, tmp_path):
    path = experiment(write, tmp_path, [row("notes.png")])
    with pytest.raises(DataError) as caught:
        check_data(load_experiment(path))
    said = str(caught.value)
    assert said.startswith(f"{tmp_path / 'data' / 'rows.jsonl'} line 1: images[0] "
                           "'notes.png': not an image Pillow can read")
    assert training_error(path).startswith(said.split(": not an image")[0]
                                           .replace("line 1", "row 1"))


def test_image_parts_and_files_must_agree(write, tmp_path):
    path = experiment(write, tmp_path, [{**row("pic.png"), "images": ["pic.png", "pic.png"]}])
    with pytest.raises(DataError, match=r"line 1: `images` gives 2 file\(s\) for 1 image "):
        check_data(load_experiment(path))  # rows.py's check: training runs it too


def test_rows_with_images_need_a_vision_language_model(write, tmp_path):
    path = experiment(write, tmp_path, [row("pic.png")], model=TINY_MODEL)
    with pytest.raises(DataError, match="is not a vision-language model .model_type llama"):
        check_data(load_experiment(path))

"""kto on a vision-language model: unpaired rows with images (TRL's `prompt` /
`completion` / `label` + `images`) checked by validate and by training alike, and
preference pairs with images read as two unpaired rows that both keep the pictures, and
LLaMA-Factory's kto rows (`messages` + `label`) with images read alike;
training through TRL's KTOTrainer and its vision collator on the tiny VLM, a row whose
prompt max_length would cut dropped and counted. The refusals shared with dpo (a missing
picture; what TRL refuses): tests/test_vlm_dpo.py; Llama 3.2 Vision's:
tests/test_vlm_mllama.py."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import QUICKSTART, run_cli
from finetune.config import load_experiment
from test_vlm import collated_batch
from test_vlm_dpo import PICTURE, TINY_VLM, said, training_error, validate_error

DATA = QUICKSTART / "data"


def unpaired(*images: str, answer: str = "red", label: bool = True) -> dict:
    question = [{"role": "user", "content": [*({"type": "image"} for _ in images),
                                              {"type": "text", "text": "What color is it?"}]}]
    return {"prompt": question, "completion": said(answer), "label": label,
            "images": list(images)}


def experiment(write, tmp_path, rows: list[dict], extra: str = ""):
    """kto on the tiny VLM, its rows in tmp_path/data/rows.jsonl beside data/pic.png and
    the quickstart's training pictures (data/vlm_train)."""
    data = tmp_path / "data"
    data.mkdir(parents=True, exist_ok=True)
    shutil.copy(PICTURE, data / "pic.png")
    if not (data / "vlm_train").exists():
        (data / "vlm_train").symlink_to(DATA / "vlm_train")
    (data / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return write("kto.yaml", f"""name: kto
method: kto
model: {{name_or_path: {TINY_VLM}, init: random}}
data: {{train: {data / 'rows.jsonl'}}}
output: {{plot: false}}
training:
  per_device_train_batch_size: 4
  learning_rate: 1e-3
  optim: adamw_torch
  max_length: 64
  activation_checkpointing: false
  logging_steps: 1
  seed: 0
{extra}""")


def test_unpaired_rows_with_images_are_checked_at_validate_as_at_training(write, tmp_path):
    path = experiment(write, tmp_path, [unpaired("pic.png"), unpaired(label=False)])
    result = run_cli("validate", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert ": 2 rows, format unpaired_preference" in result.stdout
    where = f"{tmp_path / 'data' / 'rows.jsonl'} line 2"
    for row, problem in (
            (unpaired("pic.png") | {"images": []},
             "`images` gives 0 file(s) for 1 image part(s) in `prompt`"),
            (unpaired("pic.png") | {"completion": [{"role": "assistant", "content": [
                {"type": "image"}, {"type": "text", "text": "red"}]}]},
             "an image part in `completion`: pictures belong to the prompt"),
            (unpaired("pics/missing.png"), "images[0] 'pics/missing.png': no such file")):
        path = experiment(write, tmp_path, [unpaired("pic.png"), row])
        at_validate = validate_error(path)
        assert f"{where}: {problem}" in at_validate, at_validate
        assert training_error(path) == at_validate.replace("line 2", "row 2")


def labelled(*images: str, label: bool = True) -> dict:
    """LLaMA-Factory's kto row: a conversation, its last turn the labelled answer."""
    row = unpaired(*images, label=label)
    return {"messages": row["prompt"] + row["completion"], "label": label,
            "images": row["images"]}


def test_labelled_messages_with_images_keep_their_pictures_with_the_prompt(write, tmp_path):
    """LLaMA-Factory's kto rows (`messages` + `label`) with `images`: validated as
    training reads them (a missing picture one line naming file, row and path), and read
    as unpaired rows whose prompt (the turns before the last) keeps its pictures."""
    from finetune.data.load import load_data

    path = experiment(write, tmp_path, [labelled("pic.png"), labelled(label=False)])
    result = run_cli("validate", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert ": 2 rows, format labelled_messages" in result.stdout
    train = load_data(load_experiment(path)).train
    rows = sorted((dict(r) for r in train), key=lambda r: not r["label"])
    pictured, plain = rows
    assert pictured["prompt"][0]["content"][0]["type"] == "image"
    assert [p["type"] for p in pictured["completion"][0]["content"]] == ["text"]
    assert pictured["images"] == [str(tmp_path / "data" / "pic.png")], pictured["images"]
    assert pictured["label"] is True and plain["label"] is False and not plain["images"]

    path = experiment(write, tmp_path, [labelled("pic.png"), labelled("pics/missing.png")])
    at_validate = validate_error(path)
    where = f"{tmp_path / 'data' / 'rows.jsonl'} line 2"
    assert f"{where}: images[0] 'pics/missing.png': no such file" in at_validate, at_validate
    assert "\n" not in at_validate
    assert training_error(path) == at_validate.replace("line 2", "row 2")


@pytest.mark.slow
def test_kto_trains_the_tiny_vlm_on_picture_pairs(write, tmp_path):
    """The quickstart's picture pairs, each read as a desirable and an undesirable row
    that both keep the picture; a pair whose prompt has three pictures (past 64 tokens)
    dropped twice and counted, as `finetune data` shows. Two steps through `finetune train`;
    final/ loads as a VLM with its processor. The batch the trainer builds (here from
    unpaired rows with images): the pictures' pixel values, each prompt's 16 image tokens,
    none of them trained: what trains is the completion."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    pairs = [json.loads(line) for line in (DATA / "vlm_pref_train.jsonl").read_text()
             .splitlines()[:8]]
    pairs[-1]["images"] *= 3
    pairs[-1]["prompt"][0]["content"][:0] = [{"type": "image"}] * 2
    path = experiment(write, tmp_path, pairs, "  max_steps: 2\n  save_steps: 2\n")
    result = run_cli("train", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data.train: 2 of 16 row(s) dropped: training.max_length 64 would cut their " \
           "prompt's image tokens or leave no completion token" in result.stdout
    shown = run_cli("data", str(path), "-n", "1", cwd=tmp_path)  # as the collator makes them
    assert shown.returncode == 0, shown.stderr[-3000:]
    prompt = "<|bos|><|user|>" + "<image>" * 16 + " What shape is it?<|end|><|assistant|>"
    assert f"row 1 (chosen) (39 tokens)\ndesirable: {prompt}⟦ ring<|eos|>⟧" in shown.stdout
    assert "training.max_length 64: 2 of 16 rows longer: 0 cut, 2 dropped" in shown.stdout
    run = tmp_path / "runs" / "kto"
    logged = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in r]
    assert len(logged) == 2 and all(r["num_tokens"] > 0 for r in logged)
    assert AutoModelForImageTextToText.from_pretrained(run / "final").config.model_type == \
        "llava"
    assert AutoProcessor.from_pretrained(run / "final").image_token == "<image>"

    rows = [unpaired(p["images"][0], answer=p[key][0]["content"][0]["text"],
                     label=key == "chosen") for p in pairs[:2] for key in ("chosen", "rejected")]
    for row in rows:
        row["images"] = [f"vlm_train/{row['images'][0].split('/')[-1]}"]
    batch, processor, _ = collated_batch(tmp_path / "unpaired", [], experiment(
        write, tmp_path / "unpaired", rows))
    image = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    assert batch["pixel_values"].shape[0] == 4  # one picture per row
    assert (batch["input_ids"] == image).sum(dim=1).tolist() == [16] * 4
    assert not (batch["completion_mask"].bool() & (batch["input_ids"] == image)).any()
    trained = sorted(processor.tokenizer.decode(ids[mask.bool()]).strip() for ids, mask in
                     zip(batch["input_ids"], batch["completion_mask"]))
    answers = sorted(f"{r['completion'][0]['content'][0]['text']}<|eos|>" for r in rows)
    assert trained == answers
    assert "KL_input_ids" in batch and sorted(batch["label"].tolist()) == [False, False,
                                                                           True, True]

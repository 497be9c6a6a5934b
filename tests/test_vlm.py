"""Vision-language models: a VLM told from its config.json (torch-free, as validate needs
it), rows with images checked by validate and by training alike (one error naming file,
row and path), and the bundled tiny LLaVA trained end to end through TRL's vision path:
the loss masks checked on the batches its collator makes, final/ scored by `finetune
eval` and answering through `finetune generate`, and a resumed run ending where the
uninterrupted one did."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest

from conftest import QUICKSTART, REPO, TINY_MODEL, run_cli
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


def test_a_vision_language_model_is_told_from_its_config():
    assert vision.is_vision_language(str(TINY_VLM))
    assert not vision.is_vision_language(str(TINY_MODEL))


@pytest.mark.slow  # imports transformers' model mapping, and with it torch
def test_the_model_types_read_are_transformers_own():
    """config/vision.py reads the installed mapping from its source, without importing it
    (test_layers: config imports no torch); here it is compared with the mapping itself."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    assert vision.image_text_model_types() == set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def test_rows_with_images_validate(write, tmp_path):
    path = experiment(write, tmp_path, [row("pic.png"), row()])
    result = run_cli("validate", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert ": 2 rows, format messages" in result.stdout


@pytest.mark.slow  # loads the processor (and torch)
def test_text_turns_take_the_images_before_the_first_user_turn(write, tmp_path):
    """TRL's other vision layout: every turn's content text, the images placed at the start
    of the first user turn; its collator renders them as the processor's image tokens."""
    from transformers import AutoProcessor
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    text_turns = {"messages": [{"role": "user", "content": "What color is the shape?"},
                               {"role": "assistant", "content": "red"}],
                  "images": ["pic.png"]}
    path = experiment(write, tmp_path, [text_turns])
    check_data(load_experiment(path))
    processor = AutoProcessor.from_pretrained(TINY_VLM)
    batch = DataCollatorForVisionLanguageModeling(processor, assistant_only_loss=True)(
        [{**text_turns, "images": [str(tmp_path / "data" / "pic.png")]}])
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    assert (batch["input_ids"] == image_token).sum() == 16


@pytest.mark.slow  # loads the processor (and torch)
def test_a_max_length_that_cuts_image_tokens_is_one_line():
    from transformers import AutoProcessor
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from finetune.methods.sft_vision import ImageTokensKept

    processor = AutoProcessor.from_pretrained(TINY_VLM)
    collate = ImageTokensKept(DataCollatorForVisionLanguageModeling(processor, max_length=12), 12)
    with pytest.raises(DataError, match="training.max_length 12 cuts a row of this batch inside"):
        collate([row(str(PICTURE))])
    uncut = ImageTokensKept(DataCollatorForVisionLanguageModeling(processor), None)
    assert "pixel_values" in uncut([row(str(PICTURE))])


@pytest.mark.slow  # loads the processor (and torch)
def test_rows_max_length_would_cut_inside_their_images_are_dropped_and_counted():
    """The quickstart's rows: 16 image tokens end at 18; "What shape is it?" answers from
    token 33, "What color is the shape?" from 40. max_length 36 keeps the first kind and
    drops the second, counted; 17 cuts every picture: one line naming the setting."""
    from finetune.data.load import load_data
    from finetune.methods.sft import prepare
    from finetune.model.tokenizer import load_processor

    config = QUICKSTART / "vlm.yaml"
    processor = load_processor(load_experiment(config))
    experiment = load_experiment(config, ["training.max_length=36"])
    splits = load_data(experiment)
    shape_questions = sum(r["messages"][0]["content"][1]["text"] == "What shape is it?"
                          for r in splits.train)
    prepared = prepare(splits, processor, experiment)
    assert 0 < shape_questions == len(prepared.train) < 2000
    assert all(r["messages"][0]["content"][1]["text"] == "What shape is it?"
               for r in prepared.train)
    assert f"data.train: {2000 - shape_questions} of 2000 row(s) dropped: training.max_length " \
           "36 would cut their image tokens or leave no trained token" in prepared.notes
    cut = load_experiment(config, ["training.max_length=17"])
    with pytest.raises(DataError, match="data.train: no row fits training.max_length 17 with "
                                        "its image tokens"):
        prepare(load_data(cut), processor, cut)


@pytest.mark.slow  # loads the processor (and torch)
def test_finetune_data_shows_rows_as_the_vision_collator_makes_them(write, tmp_path):
    path = experiment(write, tmp_path, [row("pic.png")])
    result = run_cli("data", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "<image>" * 16 + " What is it?<|end|><|assistant|>⟦ red<|eos|>⟧" in result.stdout
    assert "row 1 (34 tokens)" in result.stdout  # the 16 image tokens counted
    # every turn trained: the user's text too, never the image tokens it is given
    result = run_cli("data", str(path), "training.assistant_only_loss=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "<image>" * 16 + "⟦ What is it?" in result.stdout, result.stdout


def test_a_prompt_file_names_its_missing_image(tmp_path):
    from finetune.inference.prompts import from_file

    prompts = tmp_path / "prompts.jsonl"
    shutil.copy(PICTURE, tmp_path / "pic.png")
    prompts.write_text(json.dumps(row("pic.png")) + "\n" + json.dumps(row("gone.png")) + "\n")
    with pytest.raises(DataError) as caught:
        from_file(str(prompts))
    assert str(caught.value) == f"{prompts} line 2: images[0] 'gone.png': no such file " \
                                f"({tmp_path / 'gone.png'})"
    prompts.write_text(json.dumps(row("pic.png")) + "\n")
    [prompt] = from_file(str(prompts))
    assert prompt.images == [str(tmp_path / "pic.png")] and prompt.reference == "red"


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


def test_what_a_vision_language_model_cannot_train_with_yet_is_refused_at_validate():
    from finetune.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        load_experiment(QUICKSTART / "vlm.yaml", ["method=orpo", "data.train=x.jsonl"])
    said = str(caught.value)
    assert "method: " in said and "only sft, dpo, kto, grpo, rloo and distill train one yet" in said


@pytest.mark.slow
def test_the_tiny_vlm_learns_from_images_and_trains_only_the_answers(tmp_path):
    steps = ["training.max_steps=40", "training.warmup_steps=4", "training.save_steps=20",
             "training.per_device_train_batch_size=16", "training.logging_steps=5",
             "evaluation.max_samples=16"]
    result = run_cli("train", str(QUICKSTART / "vlm.yaml"), *steps, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "quickstart-vlm"
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if "loss" in r]
    assert losses[-1] < losses[0] / 3, losses
    summary = json.loads((run / "summary.json").read_text())
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"] / 3
    assert summary["before"]["eval_exact_match"] == 0  # generated from prompts with images
    assert 0 <= summary["after"]["eval_exact_match"] <= 1
    assert (run / "final" / "processor_config.json").is_file()  # final/ loads as it trained
    # `finetune eval` loads final/ (saved under the checkpoint's key names) and scores what
    # training reported after
    evaluated = run_cli("eval", str(run), cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    scored = json.loads((run / "eval" / "vlm_eval-final.json").read_text())["metrics"]
    for key in ("eval_loss", "eval_exact_match"):
        assert scored[key] == pytest.approx(summary["after"][key], rel=1e-5), key
    # `finetune generate` answers from the pictures as evaluation did (greedy, one batch)
    (tmp_path / "vlm_eval").symlink_to(QUICKSTART / "data" / "vlm_eval")
    rows = (QUICKSTART / "data" / "vlm_eval.jsonl").read_text().splitlines()[:16]
    (tmp_path / "prompts.jsonl").write_text("\n".join(rows) + "\n")
    generated = run_cli("generate", str(run), "--file", "prompts.jsonl", "--batch-size", "16",
                        "--max-new-tokens", "8", cwd=tmp_path)
    assert generated.returncode == 0, generated.stderr[-3000:]
    answers = [json.loads(line) for line in generated.stdout.splitlines()]
    assert [a["images"] for a in answers] == [  # resolved next to the prompts file
        [str((tmp_path / "vlm_eval" / f"{i:04d}.png").resolve())] for i in range(16)]
    hits = sum(a["completion"].strip() == a["reference"] for a in answers)
    assert hits / 16 == summary["after"]["eval_exact_match"]
    # --prompt with --image: the first row's question about its picture, answered alike
    first = json.loads(rows[0])
    flags = run_cli("generate", str(run), "--prompt", first["messages"][0]["content"][-1]["text"],
                    "--image", first["images"][0], "--max-new-tokens", "8", cwd=tmp_path)
    assert flags.returncode == 0, flags.stderr[-3000:]
    assert json.loads(flags.stdout)["completion"] == answers[0]["completion"]
    # --best-of: each prompt sampled with its pictures, scored by a function; the rows
    # carry the pictures and validate as dpo rows for the VLM
    (tmp_path / "rewards.py").write_text("def length(completions, **kwargs):\n"
                                         "    return [float(len(str(c))) for c in completions]\n")
    (tmp_path / "best.jsonl").write_text("\n".join(rows[:4]) + "\n")
    best = run_cli("generate", str(run), "--file", "best.jsonl", "--best-of", "4",
                   "--reward", "rewards.py:length", "--max-new-tokens", "4", "--temperature", "4",
                   "--out", "pairs.jsonl", cwd=tmp_path)
    assert best.returncode == 0, best.stderr[-3000:]
    pairs = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert pairs and all(p["chosen_score"] > p["rejected_score"] for p in pairs)
    pictured = iter([(json.loads(r)["messages"][:1], a["images"]) for r, a in zip(rows, answers)])
    for pair in pairs:  # one row a prompt (best-worst), in the prompts' order
        assert (pair["prompt"], pair["images"]) in pictured
    dpo = tmp_path / "dpo.yaml"
    dpo.write_text(f"method: dpo\nmodel: {{name_or_path: {QUICKSTART / 'tiny-vlm'}, "
                   "init: random}\ndata: {train: pairs.jsonl}\n")
    checked = run_cli("validate", str(dpo), cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    judge = tmp_path / "judge"  # a text reward model: the tiny Llama with a scalar head
    shutil.copytree(QUICKSTART / "tiny-llama", judge)
    config = json.loads((judge / "config.json").read_text())
    (judge / "config.json").write_text(json.dumps(
        {**config, "architectures": ["LlamaForSequenceClassification"],
         "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}))
    judged = run_cli("generate", str(run), "--file", "best.jsonl", "--best-of", "2",
                     "--reward", str(judge), cwd=tmp_path)
    assert judged.returncode != 0 and "reads text, and the samples answer pictures it " \
        "cannot see" in judged.stderr, judged.stderr[-2000:]
    if shutil.which("tmux"):  # as test_inference's chat in a terminal
        chat_with_images(run, tmp_path, [json.loads(r) for r in rows[:2]], answers[:2])
    # Resumed from step 20 (the Trainer's own resume would load none of those weights:
    # trainers/vision.py), the run ends where the uninterrupted one did. The sealed
    # checkpoint holds the processor (it loads as a model on its own).
    from finetune.rundir import checkpoints

    sealed = checkpoints.read_manifest(run / "checkpoints" / "checkpoint-20")["files"]
    assert {"processor_config.json", "chat_template.jinja", "tokenizer.json"} <= set(sealed)
    shutil.rmtree(run / "checkpoints" / "checkpoint-40")
    shutil.rmtree(run / "final")
    (run / "summary.json").unlink()
    again = run_cli("train", str(QUICKSTART / "vlm.yaml"), *steps, cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stdout and "checkpoint-20" in again.stdout
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["after"]["eval_loss"] == pytest.approx(summary["after"]["eval_loss"],
                                                          rel=1e-4)

    batch, processor, _ = collated_batch(tmp_path, steps)
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    assistant = processor.tokenizer.convert_tokens_to_ids("<|assistant|>")
    labels, ids = batch["labels"], batch["input_ids"]
    trained = labels != -100
    assert (ids == image_token).sum(dim=1).eq(16).all()  # every row has its picture
    assert not (trained & (ids == image_token)).any()
    for row_ids, row_trained in zip(ids.tolist(), trained.tolist()):
        start = row_ids.index(assistant) + 1  # the answer follows the assistant marker
        assert not any(row_trained[:start])
        answer = [t for t, keep in zip(row_ids, row_trained) if keep]
        assert answer == row_ids[start:start + len(answer)]
        assert processor.tokenizer.decode(answer) .strip() in (
            "red<|eos|>", "green<|eos|>", "blue<|eos|>", "yellow<|eos|>", "ring<|eos|>",
            "square<|eos|>", "triangle<|eos|>"), processor.tokenizer.decode(answer)


def chat_with_images(run, tmp_path, rows: list[dict], answers: list[dict]) -> None:
    """`finetune chat --image` in a real terminal answers each row's question about its
    picture as `finetune generate` did; /image attaches one later; a wrong path is one
    line and the chat goes on."""
    from test_inference import tmux, wait_for

    questions = [r["messages"][0]["content"][-1]["text"] for r in rows]
    session, status = f"vlm-chat-{tmp_path.name}", tmp_path / "chat-status"
    command = (f"cd {tmp_path} && PYTHONPATH={REPO} {sys.executable} -m finetune chat {run} "
               f"--image {rows[0]['images'][0]} --max-new-tokens 8; echo $? > {status}; "
               "sleep 60")
    tmux("new-session", "-d", "-s", session, "-x", "200", "-y", "40", command)
    try:
        wait_for(session, "you> ")
        tmux("send-keys", "-t", session, questions[0], "Enter")
        wait_for(session, f"{questions[0]}\nassistant> {answers[0]['completion']}\nyou> ")
        tmux("send-keys", "-t", session, "/image vlm_eval/none.png", "Enter")
        wait_for(session, "finetune: /image vlm_eval/none.png: no such file")
        tmux("send-keys", "-t", session, "/reset", "Enter")
        wait_for(session, "finetune: conversation reset")
        tmux("send-keys", "-t", session, f"/image {rows[1]['images'][0]}", "Enter")
        wait_for(session, "image 1 attached to your next message")
        tmux("send-keys", "-t", session, questions[1], "Enter")
        wait_for(session, f"{questions[1]}\nassistant> {answers[1]['completion']}\nyou> ")
        tmux("send-keys", "-t", session, "C-d")
        screen = wait_for(session, "finetune: bye")
        deadline = time.time() + 60
        while not status.exists() and time.time() < deadline:
            time.sleep(0.1)
        assert status.read_text().strip() == "0" and "Traceback" not in screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


@pytest.mark.slow  # builds the model and a trainer
def test_text_only_rows_train_beside_rows_with_images(write, tmp_path):
    """A VLM run takes conversations without pictures too (a file with no `images` at all,
    or rows of one with none): they collate beside rows with pictures, only the answers
    train, and a step's gradient reaches the tower through the rows that have one."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(PICTURE, data / "pic.png")
    text = {"messages": [{"role": "user", "content": "Say red."},
                         {"role": "assistant", "content": "red"}]}
    (data / "text.jsonl").write_text(json.dumps(text) + "\n")
    (data / "mixed.jsonl").write_text(json.dumps(row("pic.png")) + "\n" + json.dumps(text) + "\n")
    for name, pictures in (("text", 0), ("mixed", 1)):
        config = write(f"{name}.yaml", f"method: sft\nmodel: {{name_or_path: {TINY_VLM}, "
                                       f"init: random}}\ndata: {{train: {data / name}.jsonl}}\n"
                                       "training: {per_device_train_batch_size: 2}\n")
        batch, processor, model = collated_batch(tmp_path / name, [], config)
        image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
        counts = (batch["input_ids"] == image_token).sum(dim=1).tolist()
        assert sorted(counts) == ([0, 16] if pictures else [0])
        assert ("pixel_values" in batch) == bool(pictures)
        trained = [processor.tokenizer.decode(ids[labels != -100]) for ids, labels in
                   zip(batch["input_ids"], batch["labels"])]
        assert all(t.strip() == "red<|eos|>" for t in trained), trained
        loss = model(**{k: v for k, v in batch.items() if k != "weight"}).loss
        loss.backward()
        tower = [p.grad for n, p in model.named_parameters() if "vision_tower" in n]
        assert any(g is not None and g.abs().sum() > 0 for g in tower) == bool(pictures)
    # every turn trained (training.assistant_only_loss false): never the image tokens
    batch, processor, _ = collated_batch(tmp_path / "every-turn",
                                         ["training.assistant_only_loss=false"], config)
    pictured = batch["input_ids"] == image_token
    assert pictured.sum() == 16 and (batch["labels"][pictured] == -100).all()
    assert ((batch["labels"] != -100) & ~pictured).sum() > 10  # the user's turns train


@pytest.mark.slow  # builds the model and a trainer
@pytest.mark.parametrize("family", ["gemma3", "qwen2_vl"])
def test_the_markers_around_image_tokens_never_train(family, write, tmp_path):
    """Every turn trained (training.assistant_only_loss false): the markers the processor
    puts around a picture's tokens are masked with them, though transformers'
    image_token_ids names only the image token for these (model/vision.py _markers):
    Gemma 3's <start_of_image>/<end_of_image>, Qwen2-VL's <|vision_start|>/<|vision_end|>."""
    import torch
    from vlm_configs import GEMMA3_TOKENS, QWEN2_VL_IMAGE, tiny_gemma3, tiny_qwen2_vl

    from finetune.methods.vision_lengths import measure

    if family == "qwen2_vl":  # transformers' Qwen2-VL processor takes a video processor,
        pytest.importorskip("torchvision")  # which needs torchvision (test_vlm_qwen2.py)
        build, tokens = tiny_qwen2_vl, QWEN2_VL_IMAGE.replace("><", ">\n<").split("\n")
    else:
        build, tokens = tiny_gemma3, [GEMMA3_TOKENS[k] for k in ("boi_token", "image_token",
                                                                 "eoi_token")]
    model = build(tmp_path / family)
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(PICTURE, data / "pic.png")
    text = {"messages": [{"role": "user", "content": "Say red."},
                         {"role": "assistant", "content": "red"}]}
    (data / "rows.jsonl").write_text(json.dumps(row("pic.png")) + "\n" + json.dumps(text) + "\n")
    config = write("exp.yaml", f"method: sft\nmodel: {{name_or_path: {model}, init: random}}\n"
                               f"data: {{train: {data / 'rows.jsonl'}}}\n"
                               "training: {per_device_train_batch_size: 2, "
                               "assistant_only_loss: false}\n")
    batch, processor, _ = collated_batch(tmp_path / "run", [], config)
    start, image, end = processor.tokenizer.convert_tokens_to_ids(tokens)
    ids, labels = batch["input_ids"], batch["labels"]
    assert [(ids == t).sum().item() for t in (start, image, end)] == [1, 4, 1]
    assert (labels[torch.isin(ids, torch.tensor([start, image, end]))] == -100).all()
    trained = [processor.tokenizer.decode(i[l != -100]) for i, l in zip(ids, labels)]
    assert any("What is it?" in t for t in trained) and \
        any("Say red." in t for t in trained), trained  # the user's turns train
    # max_length is measured to the end marker (Gemma 3's image_token_id is its start)
    pictured = next(i[m.bool()] for i, m in zip(ids, batch["attention_mask"]) if start in i)
    measured = measure(processor, row("pic.png")["messages"], [str(data / "pic.png")], False)
    assert measured.image_end == pictured.tolist().index(end) + 1


@pytest.mark.slow  # imports transformers' Idefics3 processor (and torch)
def test_idefics3s_tile_markers_are_image_tokens():
    """Idefics3 (SmolVLM) cuts a picture into tiles, each behind <fake_token_around_image>
    and its <row_r_col_c> tag, then the whole picture behind <global-img>: every token of
    that expansion but its newlines (text) is one image_token_ids masks."""
    import sys

    from PIL import Image
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import \
        Idefics3ImageProcessorPil

    from finetune.model.vision import image_token_ids

    sys.path.insert(0, str(QUICKSTART))
    import make_assets

    sys.path.remove(str(QUICKSTART))
    tokenizer = make_assets.build_tokenizer()
    tokenizer.add_tokens(["<global-img>"] + [f"<row_{r}_col_{c}>" for r in range(1, 7)
                                             for c in range(1, 7)], special_tokens=True)
    processor = Idefics3Processor(image_processor=Idefics3ImageProcessorPil(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}), tokenizer=tokenizer,
        image_seq_len=2)
    ids = processor(text=["<image>hi"], images=[[Image.new("RGB", (64, 40))]])["input_ids"][0]
    masked = set(image_token_ids(processor))
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens.count("<fake_token_around_image>") == 6 and "<row_2_col_2>" in tokens
    assert "".join(t for i, t in zip(ids, tokens) if i not in masked) == "ĠĊĠĊĊĠhi"


def collated_batch(tmp_path, overrides, config=QUICKSTART / "vlm.yaml"):
    """(a training batch as the run's trainer collates it, the processor, the model): the
    experiment built the way `finetune train` builds it (run/build.py), its first batch
    taken from the trainer's own dataloader."""
    from finetune.methods import Job
    from finetune.model.hardware import resolve_hardware
    from finetune.run.build import method_trainer, starting_model, tokenizer_and_data

    experiment = load_experiment(config, overrides)
    run_dir = tmp_path / "inspect"
    run_dir.mkdir(parents=True)
    hw = resolve_hardware(experiment)
    processor, data = tokenizer_and_data(experiment, run_dir)
    args, model = starting_model(experiment, hw, processor, run_dir, 0, run_dir, False)
    trainer = method_trainer(Job(experiment=experiment, run_dir=run_dir, hardware=hw,
                                 tokenizer=processor, model=model, data=data, args=args))
    return next(iter(trainer.get_train_dataloader())), processor, model


# LLaVA's rows (and LLaMA-Factory's): sharegpt turns with `<image>` placeholders, and
# `image` or `images` beside (data/llava_rows.py), read as TRL's vision rows.
def llava(value: str, *images: str) -> dict:
    return {"conversations": [{"from": "human", "value": value}, {"from": "gpt", "value": "red"}],
            **({"image": images[0]} if len(images) == 1 else {"images": list(images)})}


def test_llava_placeholders_become_image_parts_where_they_stand():
    from finetune.data import formats

    roles = formats.speaker_roles({})
    given = llava("<image>Is <image> the same as this?<image>", "a.png", "b.png", "c.png")
    assert formats.fit_problem(given, "sharegpt", roles) is None
    assert formats.convert_row(given, "sharegpt", "messages", roles) == {
        "messages": [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "Is "}, {"type": "image"},
            {"type": "text", "text": " the same as this?"}, {"type": "image"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
        "images": ["a.png", "b.png", "c.png"]}
    two = formats.convert_row(llava("<image>\n<image>", "a.png", "b.png"), "sharegpt",
                              "messages", roles)
    assert two["messages"][0]["content"] == [{"type": "image"}, {"type": "text", "text": "\n"},
                                             {"type": "image"}]
    one = formats.convert_row(llava("<image>What is it?", "a.png"), "sharegpt", "messages",
                              roles)
    assert one == {"messages": row("a.png")["messages"], "images": ["a.png"]}  # `image`: one file


def test_llava_rows_read_as_the_hand_written_vision_rows(write, tmp_path):
    """After reading, a LLaVA file is the file of TRL's vision rows a user would write (the
    same rows, the same schema): training takes the existing messages + images path."""
    from finetune.data.load import ORIGIN, load_data

    for side in ("written", "llava"):
        (tmp_path / side).mkdir()
    written = experiment(write, tmp_path / "written", [row("pic.png"), row("pic.png", "pic.png"),
                                                       row()])
    expected = load_data(load_experiment(written))
    rows = [llava("<image>What is it?", "pic.png"), llava("<image><image>What is it?",
                                                          "pic.png", "pic.png"),
            {"conversations": [{"from": "human", "value": "What is it?"},
                               {"from": "gpt", "value": "red"}], "images": []}]
    read = load_data(load_experiment(experiment(write, tmp_path / "llava", rows)))
    assert read.format == expected.format == "messages"
    assert read.train.features == expected.train.features
    drop = lambda ds: [{**r, "images": [p.replace("/llava/", "/written/") for p in r["images"]]}
                       for r in ds.remove_columns(ORIGIN)]
    assert drop(read.train) == [r for r in expected.train.remove_columns(ORIGIN)]
    assert f"{tmp_path / 'llava' / 'data' / 'rows.jsonl'}: sharegpt rows read as messages " \
           "(`from` names mapped to roles); in 2 row(s) with images each <image> placeholder " \
           "as an image part of its turn (`image` as a one-item `images`), for TRL's vision " \
           "format" in read.notes


def test_llava_rows_with_a_wrong_count_or_a_missing_file_are_one_line(write, tmp_path):
    data = tmp_path / "data" / "rows.jsonl"
    path = experiment(write, tmp_path, [llava("<image>What?", "pic.png"),
                                        llava("<image> or <image>?", "pic.png")])
    result = run_cli("validate", str(path), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    said = f"{data} line 2: 2 <image> placeholder(s) in the turns for 1 image file(s) in " \
           "`image`: give one file per placeholder (read as sharegpt; tried messages: "
    assert said in result.stderr
    [line] = [l for l in result.stderr.splitlines() if str(data) in l]
    assert training_error(path) == line.removeprefix("error: ").replace("line 2", "row 2")
    experiment(write, tmp_path, [llava("<image>What?", "pic.png"),
                                 llava("<image> or <image>?", "pic.png", "gone.png")])
    result = run_cli("validate", str(path), cwd=tmp_path)
    said = f"{data} line 2: images[1] 'gone.png': no such file ({data.parent / 'gone.png'})"
    assert result.returncode == 2 and said in result.stderr
    assert training_error(path) == said.replace("line 2", "row 2")
    text_model = experiment(write, tmp_path, [llava("<image>What?", "pic.png")],
                            model=TINY_MODEL)
    with pytest.raises(DataError, match=r"line 1: the row has images, and model.name_or_path "
                                        r".* is not a vision-language model .model_type llama"):
        check_data(load_experiment(text_model))


@pytest.mark.parametrize("name", ["qwen2.5-vl-3b-sft-lora", "qwen2.5-vl-3b-dpo-lora",
                                  "paligemma2-3b-vqa-lora"])
def test_the_vision_language_example_configs_validate(name, online, tmp_path):
    """A real vision-language model and hub data with pictures (validated against the
    stand-in hub: the model's config is not read, the rows are not fetched)."""
    result = run_cli("validate", str(REPO / "configs" / "examples" / f"{name}.yaml"),
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr

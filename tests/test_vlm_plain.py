"""Prompt/completion rows with pictures for sft on a vision-language model: plain ones
(methods/sft_plain_vision.py; PaliGemma's prefix and suffix, VQA files) and
conversational ones (TRL's collator), the completion trained; generation and exact match
encode plain prompts as training does (model/vision.plain_prompts). LLaMA-Factory's alpaca
rows with pictures, and a row's one picture given as `image`, are read as such rows."""

from __future__ import annotations

import json

import pytest

from conftest import QUICKSTART, run_cli

PICTURES = QUICKSTART / "data"


def quickstart_rows(count: int, plain: str | None = "") -> list[dict]:
    """The VLM quickstart's first rows as prompt/completion rows: plain (the prompt led by
    `plain`, e.g. an image placeholder) or, with plain None, conversational."""
    rows = []
    for line in (PICTURES / "vlm_train.jsonl").read_text().splitlines()[:count]:
        row = json.loads(line)
        user, answer = row["messages"]
        images = [str(PICTURES / path) for path in row["images"]]
        if plain is None:
            rows.append({"prompt": [user], "completion": [answer], "images": images})
        else:
            question = next(p["text"] for p in user["content"] if p["type"] == "text")
            rows.append({"prompt": plain + question, "completion": answer["content"][0]["text"],
                         "images": images})
    return rows


def experiment(write, name: str, model, rows: list[dict], method: str = "sft",
               extra: str = "") -> str:
    data = write(f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return write(f"{name}.yaml", f"name: {name}\nmethod: {method}\n{extra}"
                                 f"model: {{name_or_path: {model}, init: random}}\n"
                                 f"data: {{train: {data}, eval: {data}}}\n"
                                 "evaluation: {exact_match: true, max_new_tokens: 4}\n"
                                 "training: {max_steps: 2, per_device_train_batch_size: 4, "
                                 "max_length: 64, activation_checkpointing: false}\n"
                                 f"output: {{dir: {data.parent / 'runs' / name}}}\n")


@pytest.mark.slow  # builds a tiny PaliGemma, its trainer, and trains it in a process
def test_paligemma_trains_a_causal_suffix_after_its_prefix_and_generates(write, tmp_path):
    """PaliGemma has no chat template: its rows are a plain prefix (the prompt, with the
    pictures) and suffix (the answer). The collated batch marks the suffix causal
    (token_type_ids 1), trains it and its EOS only, and an answer token sees none after
    it, which TRL's layout (everything 0, the prefix's attention both ways) would let it.
    Conversations, methods other than sft and a trained prefix are one line at validate."""
    import torch
    from test_vlm import collated_batch
    from vlm_configs import tiny_paligemma

    from finetune.data.rows import PREFIX_LM_ROWS

    model_dir = tiny_paligemma(tmp_path / "paligemma")
    template = f"tokenizer: {{chat_template: {QUICKSTART / 'tiny-vlm' / 'chat_template.jinja'}}}\n"
    for name, rows, method, said in (
            ("chat", quickstart_rows(4, None), "sft", PREFIX_LM_ROWS),  # given a template
            ("dpo", quickstart_rows(4), "dpo", "PaliGemma (model_type paligemma) trains with "
                                               "sft only yet")):
        result = run_cli("validate", experiment(write, name, model_dir, rows, method, template),
                         cwd=tmp_path)
        assert result.returncode != 0 and said in result.stderr, result.stderr
    config = experiment(write, "plain", model_dir, quickstart_rows(8))
    result = run_cli("validate", config, "training.completion_only_loss=false", cwd=tmp_path)
    assert result.returncode != 0 and "training.completion_only_loss: false would train " \
        "PaliGemma's prefix" in result.stderr, result.stderr
    batch, processor, model = collated_batch(tmp_path, [], config)
    tokenizer = processor.tokenizer
    suffix = (batch["token_type_ids"] == 1) & (batch["attention_mask"] == 1)
    assert torch.equal(batch["labels"] != -100, suffix)  # the suffix trains, nothing else
    expected = {f"{r['completion']}<|eos|>" for r in quickstart_rows(8)}
    assert all(tokenizer.decode(ids[trained]).strip() in expected
               for ids, trained in zip(batch["input_ids"], suffix))
    assert ((batch["input_ids"] == processor.image_token_id).sum(1) == 16).all()  # a picture
    model.eval()
    row = 0
    last = int(suffix[row].nonzero().max())  # the EOS
    changed = {k: v.clone() for k, v in batch.items() if k != "labels"}
    changed["input_ids"][row, last] -= 1  # another token than EOS
    for types, sees_ahead in ((batch["token_type_ids"], False),
                              (torch.zeros_like(batch["token_type_ids"]), True)):
        with torch.no_grad():
            before = model(**{**changed, "input_ids": batch["input_ids"],
                              "token_type_ids": types}).logits[row, :last]
            after = model(**{**changed, "token_type_ids": types}).logits[row, :last]
        assert torch.allclose(before, after, atol=1e-6) != sees_ahead
    result = run_cli("train", config, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval_exact_match" in result.stdout
    prompts = write("prompts.jsonl", "".join(json.dumps({k: r[k] for k in ("prompt", "images")})
                                             + "\n" for r in quickstart_rows(2)))
    result = run_cli("generate", tmp_path / "runs" / "plain", "--file", prompts,
                     "--max-new-tokens", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert [a["images"] for a in answers] == [r["images"] for r in quickstart_rows(2)]


@pytest.mark.slow  # builds the tiny VLM's trainer
def test_prompt_completion_rows_with_pictures_train_their_completion(write, tmp_path):
    """The tiny LLaVA: a conversational prompt/completion row (TRL's collator) and a plain
    one with `<image>` where the picture goes (led by the tokenizer's BOS where it puts
    one, ended by EOS) each train the completion only; a plain prompt without the
    placeholder is one line naming the file and row."""
    from test_vlm import collated_batch

    from finetune.errors import DataError

    model = QUICKSTART / "tiny-vlm"
    for name, plain in (("chat", None), ("plain", "<image>")):
        config = experiment(write, name, model, quickstart_rows(4, plain))
        batch, processor, _ = collated_batch(tmp_path / name, [], config)
        tokenizer = processor.tokenizer
        pictured = batch["input_ids"] == processor.image_token_id
        assert pictured.sum() == 4 * 16 and (batch["labels"][pictured] == -100).all()
        trained = [tokenizer.decode(ids[labels != -100]) for ids, labels
                   in zip(batch["input_ids"], batch["labels"])]
        answers = sorted(f"{r['completion']}<|eos|>" for r in quickstart_rows(4))
        assert sorted(t.strip() for t in trained) == answers, trained
    config = experiment(write, "unplaced", model, quickstart_rows(4, ""))
    with pytest.raises(DataError, match=r"unplaced.jsonl row 1: the processor cannot take this "
                                        r"plain prompt with its 1 picture.*`<image>`"):
        collated_batch(tmp_path / "unplaced", [], config)


@pytest.mark.slow  # builds the tiny VLM's trainer
def test_alpaca_rows_with_pictures_are_conversational_prompt_completion_rows(write, tmp_path):
    """LLaMA-Factory's alpaca rows with images: `<image>` where a picture goes in the
    instruction (or input), the files in `images` or `image`. Read as the conversational
    prompt/completion rows a user would write (each placeholder an image part), they
    train the output only; a wrong count is one line at validate and at training; grpo
    reads them as prompts with their pictures."""
    from test_vlm import collated_batch

    from finetune.config import load_experiment
    from finetune.data.load import ORIGIN, load_data
    from finetune.errors import DataError

    model = QUICKSTART / "tiny-vlm"
    pictures = quickstart_rows(4, None)
    alpaca = [{"instruction": "<image>" + r["prompt"][0]["content"][1]["text"], "input": "",
               "output": r["completion"][0]["content"][0]["text"], "image": r["images"][0]}
              for r in pictures]
    read = load_data(load_experiment(experiment(write, "alpaca", model, alpaca)))
    written = load_data(load_experiment(experiment(write, "written", model, pictures)))
    assert read.format == written.format == "prompt_completion"
    rows = lambda ds: list(ds.remove_columns(ORIGIN))
    assert rows(read.train) == rows(written.train)
    assert any("alpaca rows read as prompt/completion messages" in n and "in 4 row(s) with "
               "images each <image> placeholder as an image part" in n for n in read.notes)
    batch, processor, _ = collated_batch(tmp_path / "alpaca", [], tmp_path / "alpaca.yaml")
    trained = [processor.tokenizer.decode(ids[labels != -100]).strip()
               for ids, labels in zip(batch["input_ids"], batch["labels"])]
    assert sorted(trained) == sorted(f"{r['output']}<|eos|>" for r in alpaca)
    (tmp_path / "rf.py").write_text("def f(completions, **kw):\n    return [0.0] * len(completions)\n")
    grpo = write("grpo.yaml", f"method: grpo\nmodel: {{name_or_path: {model}, init: random}}\n"
                              f"data: {{train: {tmp_path / 'alpaca.jsonl'}}}\n"
                              "rewards: {functions: [rf.py:f]}\n")
    prompts = load_data(load_experiment(grpo))
    assert prompts.format == "prompt"
    assert rows(prompts.train)[0]["prompt"] == pictures[0]["prompt"]
    assert rows(prompts.train)[0]["images"] == pictures[0]["images"]
    twice = [{**alpaca[0], "input": "and <image>"}]
    config = experiment(write, "twice", model, twice)
    result = run_cli("validate", config, cwd=tmp_path)
    said = "twice.jsonl line 1: 2 <image> placeholder(s) in the turns for 1 image file(s) " \
           "in `image`: give one file per placeholder"
    assert result.returncode == 2 and said in result.stderr, result.stderr
    with pytest.raises(DataError, match=said.replace("line", "row").replace("(", r"\(")
                       .replace(")", r"\)")):
        load_data(load_experiment(config))


@pytest.mark.slow  # reads the rows with datasets (and the processor)
def test_one_picture_as_image_is_a_one_item_images(write, tmp_path):
    """VQA files often give their one picture as `image` (TRL's collators take it so):
    conversations and prompt/completion rows read it as a one-item `images`, at validate
    and at training; a question/answer file with `data.columns` trains as written rows."""
    from finetune.config import load_experiment
    from finetune.data.load import ORIGIN, load_data

    model = QUICKSTART / "tiny-vlm"
    rows = quickstart_rows(4, "<image>")
    vqa = [{"question": r["prompt"], "answer": r["completion"], "image": r["images"][0]}
           for r in rows]
    data = write("vqa.jsonl", "".join(json.dumps(r) + "\n" for r in vqa))
    config = write("vqa.yaml", f"method: sft\nmodel: {{name_or_path: {model}, init: random}}\n"
                               f"data: {{train: {{path: {data}, columns: {{prompt: question, "
                               "completion: answer}}}\n")
    written = load_data(load_experiment(experiment(write, "written", model, rows)))
    read = load_data(load_experiment(config))
    strip = lambda ds: list(ds.remove_columns(ORIGIN))
    assert strip(read.train) == strip(written.train)
    assert any("`image` read as a one-item `images`" in note for note in read.notes)
    result = run_cli("validate", config, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    chats = [{"messages": r["prompt"] + r["completion"], "image": r["images"][0]}
             for r in quickstart_rows(4, None)]
    chats[1]["image"] = "gone.png"
    config = experiment(write, "chats", model, chats)
    result = run_cli("validate", config, cwd=tmp_path)
    said = "chats.jsonl line 2: images[0] 'gone.png': no such file"
    assert result.returncode == 2 and said in result.stderr, result.stderr

"""Assistant-only sft of a vision-language model whose chat template has no
{% generation %} markers, as a hub checkpoint's has not (methods/vision_turns.py): one TRL
ships a training version of trains through that version, any other has its assistant
turns found by prefixes, the same tokens the markers would give; a template that cannot
be split is one error naming the row."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import QUICKSTART, run_cli
from test_vlm import PICTURE, collated_batch

# LLaVA-1.5-like: the assistant's turn after "ASSISTANT:", no markers. MARKED renders the
# same text with the markers around what "through the turn" adds to "up to it, with the
# generation prompt".
USER = ("{% if m['role'] == 'user' %}{{ 'USER:' }}{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}{{ ' <image>' }}{% else %}{{ ' ' + c['text'] }}{% endif %}"
        "{% endfor %}{{ '\\n' }}{% else %}{{ 'ASSISTANT:' }}")
REPLY = "{% for c in m['content'] %}{{ ' ' + c['text'] + '\\n' }}{% endfor %}"
PLAIN = ("{% for m in messages %}" + USER + REPLY + "{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
MARKED = PLAIN.replace(REPLY, "{% generation %}" + REPLY + "{% endgeneration %}")
# Its generation prompt is not what its turns start with: no prefix splits it.
UNSPLIT = PLAIN.replace("{% if add_generation_prompt %}{{ 'ASSISTANT:' }}",
                        "{% if add_generation_prompt %}{{ 'BOT:' }}")
assert UNSPLIT != PLAIN


def two_turns(tmp_path: Path) -> Path:
    """A row of two turns, a picture in each user turn, and a text-only row."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(PICTURE, data / "pic.png")
    picture = [{"type": "image"}, {"type": "text", "text": "Its color?"}]
    rows = [{"messages": [{"role": "user", "content": picture},
                          {"role": "assistant", "content": "red"},
                          {"role": "user", "content": picture},
                          {"role": "assistant", "content": "red again"}],
             "images": ["pic.png", "pic.png"]},
            {"messages": [{"role": "user", "content": "Say blue."},
                          {"role": "assistant", "content": "blue"}]}]
    (data / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data / "rows.jsonl"


def config(write, rows: Path, template: str) -> Path:
    (rows.parent / "template.jinja").write_text(template)
    return write("exp.yaml", f"method: sft\nmodel: {{name_or_path: {QUICKSTART / 'tiny-vlm'}, "
                             f"init: random}}\ndata: {{train: {rows}}}\n"
                             f"tokenizer: {{chat_template: {rows.parent / 'template.jinja'}}}\n"
                             "training: {per_device_train_batch_size: 2, seed: 0}\n")


def trained(batch, processor) -> list[str]:
    return [processor.tokenizer.decode(ids[labels != -100])
            for ids, labels in zip(batch["input_ids"], batch["labels"])]


@pytest.mark.slow  # builds the model and three trainers
def test_turns_without_markers_train_what_markers_would(write, tmp_path):
    from trl.chat_template_utils import get_training_chat_template

    from finetune.methods.vision_turns import Turns, turns_of

    rows = two_turns(tmp_path)
    marked, processor, _ = collated_batch(tmp_path / "m", [], config(write, rows, MARKED))
    plain, processor, _ = collated_batch(tmp_path / "p", [], config(write, rows, PLAIN))
    assert turns_of(processor) == Turns(by_prefixes=True)
    assert (plain["input_ids"] == marked["input_ids"]).all()
    assert (plain["labels"] == marked["labels"]).all()
    assert sorted(trained(plain, processor)) == [" blue\n", " red\n red again\n"]

    # a template TRL has a training version of: that version's markers, as TRL's trainer
    # swaps it in (the tokens measured while preparing included)
    known = (Path(__import__("trl").__file__).parent / "chat_templates" / "llava_next.jinja")
    batch, processor, _ = collated_batch(tmp_path / "k", [],
                                         config(write, rows, known.read_text()))
    assert turns_of(processor).template == get_training_chat_template(processor) is not None
    assert sorted(trained(batch, processor)) == [" blue</s>", " red</s> red again</s>"]


@pytest.mark.slow  # two CLI processes
def test_finetune_data_shows_the_turns_and_names_a_row_it_cannot_split(write, tmp_path):
    rows = two_turns(tmp_path)
    shown = run_cli("data", "-n", "2", str(config(write, rows, PLAIN)), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "ASSISTANT:⟦ red\n⟧USER: <image>" in shown.stdout
    assert "ASSISTANT:⟦ blue\n⟧" in shown.stdout

    refused = run_cli("train", str(config(write, rows, UNSPLIT)), cwd=tmp_path)
    assert refused.returncode != 0
    error = refused.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: {rows} row 1: the chat template does not render this "
                            "conversation turn by turn"), refused.stderr[-3000:]
    assert "training.assistant_only_loss: false" in error


@pytest.mark.slow  # loads the processor; two worker processes
def test_rows_are_measured_alike_in_worker_processes(tmp_path):
    """What preparing keeps, and each row's assistant spans, whether this process measures
    the rows or workers do (a hub processor takes tens of ms a photo: data/parallel.py)."""
    from datasets import Dataset
    from transformers import AutoProcessor

    from finetune.data.load import ORIGIN
    from finetune.methods import vision_lengths
    from finetune.methods.vision_turns import SPANS, rendered_ids, turns_of
    from finetune.model.vision import with_images

    path = two_turns(tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    parts = lambda m: {**m, "content": [{"type": "text", "text": m["content"]}]
                       if isinstance(m["content"], str) else m["content"]}  # one Arrow type
    rows = [{"messages": [parts(m) for m in r["messages"]],
             "images": [str(path.parent / i) for i in r.get("images", [])],
             ORIGIN: f"{path} row {n + 1}"} for n, r in enumerate(rows * 3)]
    processor = AutoProcessor.from_pretrained(QUICKSTART / "tiny-vlm")
    processor.chat_template = PLAIN
    turns = turns_of(processor)
    for limit in (None, 40):  # 40: the rows with pictures would be cut inside them
        kept = [vision_lengths.kept(Dataset.from_list(rows), "train", processor, limit, True,
                                    list, notes, turns, workers)
                for notes, workers in (([], None), ([], 2))]
        assert kept[0].to_list() == kept[1].to_list()
        assert len(kept[0]) == (6 if limit is None else 3)
    text_only = kept[0][0]  # the pictured rows were cut
    ids = rendered_ids(processor, with_images(text_only["messages"], []))["input_ids"][0]
    assert [processor.tokenizer.decode(ids[a:b]) for a, b in text_only[SPANS]] == [" blue\n"]


class Counted:
    """An image processor that counts the calls made to it."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.slow  # loads the processor
def test_a_turn_after_the_last_picture_is_found_without_the_pictures_again(tmp_path):
    """The work, bounded: the spans of a one-turn row with a picture come from its one
    pass through the processor (the answer's text, tokenized alone, is the tail of the
    row's tokens); a turn with a picture after it renders its prefix with its pictures."""
    from datasets import Dataset
    from transformers import AutoProcessor

    from finetune.data.load import ORIGIN
    from finetune.methods import vision_lengths
    from finetune.methods.vision_turns import SPANS, rendered_ids, turns_of
    from finetune.model.vision import with_images

    processor = AutoProcessor.from_pretrained(QUICKSTART / "tiny-vlm")
    processor.chat_template = PLAIN
    processor.image_processor = counted = Counted(processor.image_processor)
    picture = [{"type": "image"}, {"type": "text", "text": "Its color?"}]
    answer = [{"type": "text", "text": "red"}]
    one_turn = [{"role": "user", "content": picture}, {"role": "assistant", "content": answer}]
    rows = Dataset.from_list([{"messages": one_turn, "images": [str(PICTURE)],
                               ORIGIN: f"row {n}"} for n in range(4)])
    kept = vision_lengths.kept(rows, "train", processor, None, True, list, [],
                               turns_of(processor))
    assert counted.calls == 4
    ids = rendered_ids(processor, with_images(one_turn, [str(PICTURE)]))["input_ids"][0]
    assert kept[SPANS] == [[[len(ids) - 5, len(ids)]]] * 4
    assert processor.tokenizer.decode(ids[-5:]) == " red\n"

    counted.calls = 0
    two = one_turn + [{"role": "user", "content": picture},
                      {"role": "assistant", "content": answer}]
    vision_lengths.measure(processor, two, [str(PICTURE)] * 2, True, list, turns_of(processor))
    assert counted.calls == 3  # the whole; the first turn's start and end, each with a picture


@pytest.mark.slow  # loads the processor; two worker processes
def test_finetune_data_renders_alike_in_worker_processes(tmp_path):
    """`finetune data` over rows with pictures: the same samples, in the same order,
    whether this process renders the rows or workers do (training.dataset_num_proc, where
    there are 2,000 rows a process: data/parallel.py)."""
    from finetune.commands.data_view import _sft_vision, in_processes
    from finetune.config import load_experiment
    from finetune.data.load import load_data
    from finetune.model.tokenizer import load_processor

    lines = (QUICKSTART / "data" / "vlm_train.jsonl").read_text().splitlines()[:6]
    for line in lines:
        for image in json.loads(line)["images"]:
            (tmp_path / image).parent.mkdir(exist_ok=True)
            shutil.copy(QUICKSTART / "data" / image, tmp_path / image)
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    experiment = load_experiment(QUICKSTART / "vlm.yaml", [
        f"data.train={tmp_path / 'rows.jsonl'}", "data.eval=null", "evaluation.exact_match=false"])
    splits, processor = load_data(experiment), load_processor(experiment)
    rows = splits.train
    made = [list(in_processes(_sft_vision, rows, processor, experiment, splits, "train", n))
            for n in (None, 2)]
    assert made[0] == made[1] and len(made[0]) == 6
    assert made[0][0].parts[0][2].count(True) > 0  # the answer trains

"""dpo on a vision-language model: preference rows with images (TRL's `prompt` /
`chosen` / `rejected` + `images`) checked by validate and by training alike, one error
naming file, row and path; pictures given as URLs (refused offline, fetched and checked
online); a method or a model that cannot take images refused at validate; the settings
TRL refuses for such rows refused at validate naming their YAML path. The training
itself: tests/test_quickstart.py (configs/quickstart/vlm-dpo.yaml)."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import threading

import pytest

from conftest import QUICKSTART, TINY_MODEL, run_cli
from finetune.config import load_experiment
from finetune.data.scan import check_data
from finetune.errors import ConfigError, DataError

TINY_VLM = QUICKSTART / "tiny-vlm"
PICTURE = QUICKSTART / "data" / "vlm_train" / "0000.png"


def said(text: str) -> list[dict]:
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


def pair(*images: str, prompt: bool = True) -> dict:
    """A question about the pictures, the right answer chosen, a wrong one rejected; with
    `prompt`, or (prompt=False) the question as the turn chosen and rejected share."""
    question = [{"role": "user", "content": [*({"type": "image"} for _ in images),
                                              {"type": "text", "text": "What color is it?"}]}]
    if not prompt:
        return {"chosen": question + said("red"), "rejected": question + said("blue"),
                "images": list(images)}
    return {"prompt": question, "chosen": said("red"), "rejected": said("blue"),
            "images": list(images)}


def experiment(write, tmp_path, rows: list[dict], model=TINY_VLM, method="dpo",
               extra: str = ""):
    """The experiment, its rows in tmp_path/data/pairs.jsonl beside one real picture
    (data/pic.png)."""
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    shutil.copy(PICTURE, data / "pic.png")
    (data / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return write("exp.yaml", f"method: {method}\nmodel:\n  name_or_path: {model}\n"
                             f"  init: random\ndata:\n  train: {data / 'pairs.jsonl'}\n{extra}")


def validate_error(path) -> str:
    with pytest.raises(DataError) as caught:
        check_data(load_experiment(path))
    return str(caught.value)


def training_error(path) -> str:
    """The error training's reader (data/load.py) gives for the experiment's data."""
    from finetune.data.load import load_data

    with pytest.raises(DataError) as caught:
        load_data(load_experiment(path))
    return str(caught.value)


def test_preference_rows_with_images_validate(write, tmp_path):
    """A given prompt with its image parts, a prompt taken from the turns chosen and
    rejected share, text turns (TRL puts the pictures before the first user turn), and
    a pair without pictures, in one run."""
    text_turns = {"prompt": [{"role": "user", "content": "What color is it?"}],
                  "chosen": [{"role": "assistant", "content": "red"}],
                  "rejected": [{"role": "assistant", "content": "blue"}], "images": ["pic.png"]}
    for rows in ([pair("pic.png"), pair()], [pair("pic.png", prompt=False)], [text_turns]):
        path = experiment(write, tmp_path, rows)
        result = run_cli("validate", str(path), cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert f": {len(rows)} rows, format preference" in result.stdout


@pytest.mark.parametrize("method", ["dpo", "kto"])  # kto: the pairs unpaired after the check
def test_a_missing_picture_is_the_same_line_at_validate_and_at_training(write, tmp_path, method):
    path = experiment(write, tmp_path, [pair("pic.png"), pair("pics/missing.png")],
                      method=method)
    result = run_cli("validate", str(path), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    line = f"{tmp_path / 'data' / 'pairs.jsonl'} line 2: images[0] 'pics/missing.png': no " \
           f"such file ({tmp_path / 'data' / 'pics' / 'missing.png'})"
    assert line in result.stderr
    assert training_error(path) == line.replace("line 2", "row 2")


@pytest.mark.parametrize("rows, problem", [
    ([pair("pic.png") | {"images": ["pic.png", "pic.png"]}],
     "`images` gives 2 file(s) for 1 image part(s) in `prompt`"),
    ([pair("pic.png", prompt=False) | {"images": []}],
     "`images` gives 0 file(s) for 1 image part(s) in `the prompt turns chosen and rejected "
     "share`"),
    ([pair("pic.png") | {"chosen": [{"role": "assistant", "content": [
        {"type": "image"}, {"type": "text", "text": "red"}]}]}],
     "an image part in the answer of `chosen`: pictures belong to the prompt"),
    ([{"prompt": "What color is it?", "chosen": "red", "rejected": "blue",
       "images": ["pic.png"]}],
     "`images` needs conversational rows"),
], ids=["count", "shared-prompt count", "picture in an answer", "text rows"])
def test_pictures_and_image_parts_must_agree(write, tmp_path, rows, problem):
    path = experiment(write, tmp_path, rows)
    at_validate = validate_error(path)
    assert f"{tmp_path / 'data' / 'pairs.jsonl'} line 1: {problem}" in at_validate, at_validate
    assert training_error(path) == at_validate.replace("line 1", "row 1")


def test_a_url_is_refused_offline_at_validate_and_at_training(write, tmp_path):
    url = "https://example.com/pic.png"
    path = experiment(write, tmp_path, [pair(url)])
    result = run_cli("validate", str(path), cwd=tmp_path)  # tests run with HF_HUB_OFFLINE=1
    line = f"{tmp_path / 'data' / 'pairs.jsonl'} line 1: images[0] '{url}': a URL, and " \
           "HF_HUB_OFFLINE is set: nothing is fetched offline; download the picture and " \
           "give its path"
    assert result.returncode == 2 and line in result.stderr, result.stderr
    assert training_error(path) == line.replace("line 1", "row 1")


@pytest.fixture
def picture_server(tmp_path, monkeypatch):
    """Online, with a web server on this machine serving tmp_path/www (one picture)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    (tmp_path / "www").mkdir()
    shutil.copy(PICTURE, tmp_path / "www" / "pic.png")
    (tmp_path / "www" / "notes.png").write_text("not a picture\n")
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(tmp_path / "www"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_online_a_url_is_fetched_and_checked_once(write, tmp_path, picture_server):
    from finetune.data.load import load_data

    path = experiment(write, tmp_path, [pair(f"{picture_server}/pic.png")])
    check_data(load_experiment(path))
    splits = load_data(load_experiment(path))
    assert splits.train["images"] == [[f"{picture_server}/pic.png"]]  # the processor fetches it
    for name, problem in (("gone.png", "cannot be fetched (HTTPError: HTTP Error 404"),
                          ("notes.png", "not an image Pillow can read (14 bytes of image/png)")):
        path = experiment(write, tmp_path, [pair(f"{picture_server}/{name}")])
        at_validate = validate_error(path)
        assert f"line 1: images[0] '{picture_server}/{name}': {problem}" in at_validate
        assert training_error(path) == at_validate.replace("line 1", "row 1")


def test_pictures_need_a_vision_language_model_and_a_method_that_takes_them(write, tmp_path):
    where = f"{tmp_path / 'data' / 'pairs.jsonl'} line 1"
    path = experiment(write, tmp_path, [pair("pic.png")], model=TINY_MODEL)
    assert validate_error(path).startswith(f"{where}: the row has images, and model."
                                           f"name_or_path {TINY_MODEL} is not a vision-language")
    path = experiment(write, tmp_path, [pair("pic.png")], model=TINY_MODEL, method="reward")
    line = f"{where}: the row has images, and method reward does not take images; sft, dpo, " \
           "kto, grpo, rloo and distill train on rows with images (docs/vision.md)"
    assert validate_error(path) == line
    assert training_error(path) == line.replace("line 1", "row 1")


@pytest.mark.parametrize("setting, key", [
    ("training:\n  truncation_mode: keep_end\n", "training.truncation_mode"),
    ("training:\n  precompute_ref_log_probs: true\n", "training.precompute_ref_log_probs"),
    ("training:\n  padding_free: true\n", "training.padding_free"),
    ("training:\n  pad_to_multiple_of: 8\n", "training.pad_to_multiple_of"),  # dpo's, kto's
])
def test_what_trl_refuses_for_pairs_with_images_is_refused_at_validate(write, setting, key):
    path = write("exp.yaml", f"extends: {QUICKSTART / 'vlm-dpo.yaml'}\n{setting}")
    with pytest.raises(ConfigError) as caught:
        load_experiment(path)
    [problem] = caught.value.problems
    assert f"exp.yaml:" in problem and f": {key}: {TINY_VLM} is a vision-language model: " \
        in problem, problem


@pytest.mark.slow  # loads the processor (and torch)
def test_finetune_data_shows_pairs_as_the_vision_collator_makes_them(write, tmp_path):
    path = experiment(write, tmp_path, [pair("pic.png", prompt=False)])
    result = run_cli("data", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    prompt = "<|bos|><|user|>" + "<image>" * 16 + " What color is it?<|end|><|assistant|>"
    assert f"chosen: {prompt}⟦ red<|eos|>⟧" in result.stdout, result.stdout
    assert f"rejected: {prompt}⟦ blue<|eos|>⟧" in result.stdout
    assert "row 1 (40 tokens)" in result.stdout  # the 16 image tokens counted


# ---- grpo and rloo: prompts with images ----

REWARDS = "def right(completions, answer, **kwargs):\n" \
          "    return [float(answer[i] in str(c)) for i, c in enumerate(completions)]\n" \
          "def length(completions, **kwargs):\n" \
          "    return [float(len(str(c))) for c in completions]\n"


def grpo_experiment(write, tmp_path, rows: list[dict], extra: str = "", method: str = "grpo",
                    reward: str = "right"):
    """grpo (or rloo) on prompts with images (tmp_path/data/prompts.jsonl beside
    data/pic.png), run as runs/<method>."""
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    shutil.copy(PICTURE, data / "pic.png")
    (data / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(REWARDS)
    return write(f"{method}.yaml", f"method: {method}\nmodel:\n  name_or_path: {TINY_VLM}\n"
                                   f"  init: random\ndata:\n  train: {data / 'prompts.jsonl'}\n"
                                   f"rewards: {{functions: [rewards.py:{reward}]}}\n{extra}")


def question(*images: str) -> dict:
    return {"prompt": pair(*images)["prompt"], "answer": "red", "images": list(images)}


def test_prompts_and_their_pictures_must_agree(write, tmp_path):
    path = grpo_experiment(write, tmp_path, [question("pic.png"),
                                             question("pic.png") | {"images": []}])
    at_validate = validate_error(path)
    assert at_validate.startswith(f"{tmp_path / 'data' / 'prompts.jsonl'} line 2: `images` "
                                  "gives 0 file(s) for 1 image part(s) in `prompt`"), at_validate
    assert training_error(path) == at_validate.replace("line 2", "row 2")


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_online_methods_refuse_picture_bounds_they_would_not_apply(write, tmp_path, method):
    path = grpo_experiment(write, tmp_path, [question("pic.png")], method=method,
                           extra="vision:\n  max_pixels: 4096\n")
    with pytest.raises(ConfigError) as caught:
        load_experiment(path)
    [problem] = caught.value.problems
    assert f": vision.max_pixels: not supported for {method} yet" in problem, problem


@pytest.mark.slow
def test_grpo_generates_from_prompts_with_their_pictures(write, tmp_path):
    """One step: the tiny LLaVA's processor refuses an image token without its picture,
    so a step that ran got the pictures; and each prompt counts its 16 image tokens, as
    `finetune data` shows it; a prompt the context cannot hold with the completion budget
    is dropped, counted in the start summary."""
    too_long = question("pic.png", "pic.png", "pic.png")  # 66 tokens: past 64 - 4
    path = grpo_experiment(write, tmp_path, [question("pic.png")] * 8 + [too_long], extra=(
        "training:\n  max_steps: 1\n  per_device_train_batch_size: 4\n  num_generations: 4\n"
        "  max_completion_length: 4\n  activation_checkpointing: false\n"))
    result = run_cli("train", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data.train: 1 of 9 prompt(s) dropped: with their image tokens and " \
           "training.max_completion_length 4 they exceed the model's context of 64 tokens " \
           "(max_position_embeddings)" in result.stdout  # the start summary
    [step] = [json.loads(line) for line in
              (tmp_path / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()
              if '"num_tokens"' in line][:1]
    prompt_tokens = step["num_tokens"] / 4 - step["completions/mean_length"]
    assert prompt_tokens == 19 - 1 + 16  # the rendered question, its <image> as 16 tokens
    shown = run_cli("data", str(path), "-n", "1", cwd=tmp_path)  # as the trainer renders it
    assert shown.returncode == 0, shown.stderr
    assert "row 1 (34 tokens)" in shown.stdout and "<image>" * 16 + " What color" in shown.stdout


@pytest.mark.slow
def test_rloo_generates_from_prompts_with_their_pictures_and_resumes(write, tmp_path):
    """rloo prepares and renders its prompts as grpo does (test above): its steps ran, so
    they got the pictures, each prompt counted with its 16 image tokens, the one too long
    dropped and counted. Resumed from its sealed checkpoint-1 (the weights loaded back
    through from_pretrained, trainers/vision.py: the Trainer's own loading would find none
    and train on from the starting weights), it ends with the uninterrupted run's weights."""
    import torch
    from safetensors.torch import load_file

    too_long = question("pic.png", "pic.png", "pic.png")
    # length: completions score apart, so step 1 changes the weights
    path = grpo_experiment(write, tmp_path, [question("pic.png")] * 8 + [too_long],
                           method="rloo", reward="length", extra=(
        "training:\n  max_steps: 2\n  save_steps: 1\n  logging_steps: 1\n"
        "  per_device_train_batch_size: 4\n  num_generations: 4\n"
        "  max_completion_length: 4\n  activation_checkpointing: false\n"))
    result = run_cli("train", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data.train: 1 of 9 prompt(s) dropped: with their image tokens and " \
           "training.max_completion_length 4 they exceed the model's context of 64 tokens " \
           "(max_position_embeddings)" in result.stdout
    run = tmp_path / "runs" / "rloo"
    [step] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"num_tokens"' in line][:1]
    assert step["num_tokens"] / 4 - step["completions/mean_length"] == 19 - 1 + 16
    final = load_file(run / "final" / "model.safetensors")
    start = load_file(run / "init-model" / "model.safetensors")
    assert any(not torch.equal(final[k], start[k]) for k in final)
    shutil.rmtree(run / "checkpoints" / "checkpoint-2")
    shutil.rmtree(run / "final")
    (run / "summary.json").unlink()
    again = run_cli("train", str(path), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stdout and "checkpoint-1" in again.stdout
    resumed = load_file(run / "final" / "model.safetensors")
    assert all(torch.equal(resumed[k], final[k]) for k in final)


@pytest.mark.slow  # loads the processor (and torch)
def test_a_prompt_without_pictures_is_prepared_in_parts_as_the_trainers_render_it(
        write, tmp_path):
    """RLOOTrainer turns text contents into parts only in a batch with pictures
    (GRPOTrainer always): prepared, every content of a VLM's prompt is in parts, as
    GRPOTrainer's own preparation gives them, the pictures' parts before the first user
    text; the length finetune measures (kept_prompts) is that of the trainers' rendering."""
    from trl.data_utils import prepare_multimodal_messages

    from finetune.data.load import load_data
    from finetune.methods.rloo import prepare
    from finetune.model.tokenizer import load_processor
    from finetune.model.vision import chat_prompts

    said = [{"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What color is red?"}]
    path = grpo_experiment(write, tmp_path, [
        {"prompt": said, "answer": "red", "images": []},
        {"prompt": said, "answer": "red", "images": ["pic.png"]}],
        method="rloo", extra="training:\n  max_completion_length: 4\n")
    experiment = load_experiment(path)
    processor = load_processor(experiment)
    text, pictured = prepare(load_data(experiment), processor, experiment).train["prompt"]
    assert text == prepare_multimodal_messages(said) == [
        {"role": "system", "content": [{"type": "text", "text": "Answer in one word."}]},
        {"role": "user", "content": [{"type": "text", "text": "What color is red?"}]}]
    assert pictured == [text[0], {"role": "user", "content": [{"type": "image"},
                                                              *text[1]["content"]]}]
    # RLOOTrainer's and GRPOTrainer's call (_tokenize_prompts) against kept_prompts' measure
    rendered = processor.apply_chat_template([text], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
    assert chat_prompts(processor, [text], [[]])["input_ids"].tolist() == rendered


@pytest.mark.slow  # imports TRL (and torch)
def test_training_refuses_what_validate_refuses_for_a_hub_model():
    """A hub vision-language model is known as one at training only: methods/dpo.py and
    methods/kto.py refuse there the settings config/rules/vision.py refuses for a local
    one."""
    from finetune.methods.dpo import vision_problems

    from finetune.methods import kto

    overrides = ["training.truncation_mode=keep_end", "training.precompute_ref_log_probs=true",
                 "data.weight_column=w"]  # weighted pairs train (trainers/weighted.py)
    experiment = load_experiment(QUICKSTART / "dpo.yaml", overrides)  # a text model: valid
    assert [p.split(":")[0] for p in vision_problems(experiment)] == [
        "training.truncation_mode", "training.precompute_ref_log_probs"]
    experiment = load_experiment(QUICKSTART / "dpo.yaml", [
        "method=kto", "training.precompute_ref_log_probs=true", "training.pad_to_multiple_of=8"])
    assert [p.split(":")[0] for p in kto.vision_problems(experiment)] == [
        "training.precompute_ref_log_probs", "training.pad_to_multiple_of"]


@pytest.mark.slow  # loads the processor (and torch)
def test_pairs_max_length_would_cut_inside_their_prompts_images_are_dropped_and_counted(
        write, tmp_path):
    """A picture after the question ends its image tokens later than one before it: a
    max_length between the two keeps the first kind and drops the second, counted; one
    below both is one line naming the setting."""
    from finetune.data.load import load_data
    from finetune.methods.dpo import prepare
    from finetune.model.tokenizer import load_processor

    early = pair("pic.png")
    late = pair("pic.png")
    late["prompt"][0]["content"].reverse()  # the question first, then the picture
    path = experiment(write, tmp_path, [early, late, early])
    processor = load_processor(load_experiment(path))
    fits = load_experiment(path, ["training.max_length=20"])
    prepared = prepare(load_data(fits), processor, fits)
    assert len(prepared.train) == 2 and \
        all(r["prompt"][0]["content"][0] == {"type": "image"} for r in prepared.train)
    assert "data.train: 1 of 3 pair(s) dropped: training.max_length 20 would cut their " \
           "prompt's image tokens" in prepared.notes
    cut = load_experiment(path, ["training.max_length=10"])
    with pytest.raises(DataError, match="data.train: no pair's prompt fits training.max_length 10"):
        prepare(load_data(cut), processor, cut)


@pytest.mark.slow  # loads the processor (and torch)
def test_prompts_the_context_cannot_hold_with_their_pictures_are_dropped_and_counted(
        write, tmp_path):
    """grpo generates from a prompt whole (TRL 1.16 cuts none): one whose tokens, its
    image tokens included, leave too little of the tiny model's 64 positions for
    max_completion_length is dropped and counted, in train as in eval; none left is one
    line naming the setting."""
    from finetune.data.load import load_data
    from finetune.methods.grpo import prepare
    from finetune.model.tokenizer import load_processor

    one, two = question("pic.png"), question("pic.png", "pic.png")  # 34 and 50 tokens
    path = grpo_experiment(write, tmp_path, [one, two, one, two, one])
    processor = load_processor(load_experiment(path))
    fits = load_experiment(path, ["training.max_completion_length=15",
                                  f"data.eval={tmp_path / 'data' / 'prompts.jsonl'}"])
    prepared = prepare(load_data(fits), processor, fits)
    assert [len(r["images"]) for r in prepared.train] == [1] * 3
    assert [len(r["images"]) for r in prepared.eval] == [1] * 3
    dropped = "2 of 5 prompt(s) dropped: with their image tokens and " \
              "training.max_completion_length 15 they exceed the model's context of 64 " \
              "tokens (max_position_embeddings)"
    assert f"data.train: {dropped}" in prepared.notes and f"data.eval: {dropped}" in prepared.notes
    none = load_experiment(path, ["training.max_completion_length=31"])  # 33 < 34
    with pytest.raises(DataError) as caught:
        prepare(load_data(none), processor, none)
    assert str(caught.value) == (
        "data.train: no prompt fits the model's context of 64 tokens (max_position_embeddings) "
        "with its image tokens and training.max_completion_length 31 (`finetune data` shows "
        "every row's length with its image tokens): lower training.max_completion_length")


def _dpo_trainer(config, run_dir):
    """The dpo trainer `finetune train` builds for the experiment (run/build.py)."""
    from finetune.methods import Job
    from finetune.model.hardware import resolve_hardware
    from finetune.run.build import method_trainer, starting_model, tokenizer_and_data

    experiment = load_experiment(config)
    run_dir.mkdir(parents=True)
    hw = resolve_hardware(experiment)
    processor, data = tokenizer_and_data(experiment, run_dir)
    args, model = starting_model(experiment, hw, processor, run_dir, 0, run_dir, False)
    return method_trainer(Job(experiment=experiment, run_dir=run_dir, hardware=hw,
                              tokenizer=processor, model=model, data=data, args=args))


@pytest.mark.slow  # builds four trainers of the tiny VLM
def test_weighted_pairs_with_pictures_weigh_trls_own_pair_losses(write, tmp_path):
    """data.weight_column on pairs with pictures: the loss is the weighted mean of the
    pair losses TRL's own vision DPOTrainer computes. Weights (2, 2) give its loss over
    both pairs, (1, 0) its loss of the first pair alone, gradients alike."""
    import torch

    rows = [json.loads(line) for line in
            (QUICKSTART / "data" / "vlm_pref_train.jsonl").read_text().splitlines()[:2]]
    for row in rows:
        row["images"] = [str(QUICKSTART / "data" / p) for p in row["images"]]

    def loss_and_grads(name, pairs, weights=None):
        given = [{**r, "w": w} for r, w in zip(pairs, weights)] if weights else pairs
        data = write(f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in given))
        column = ", weight_column: w" if weights else ""
        config = write(f"{name}.yaml", f"method: dpo\nmodel: {{name_or_path: {TINY_VLM}, "
                                       f"init: random}}\ndata: {{train: {data}{column}}}\n"
                                       "training: {seed: 3, max_length: 64, "
                                       "activation_checkpointing: false}\n")
        trainer = _dpo_trainer(config, tmp_path / name)
        assert (type(trainer).__name__ == "WeightedVisionDPOTrainer") == bool(weights)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(pairs))])
        trainer.model.train()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()
                               if p.grad is not None}

    for weights, alone in (([2.0, 2.0], rows), ([1.0, 0.0], rows[:1])):
        weighted, weighted_grads = loss_and_grads(f"w{weights[1]:g}", rows, weights)
        trl, trl_grads = loss_and_grads(f"trl{len(alone)}", alone)
        assert torch.allclose(weighted, trl, atol=1e-6), (weights, weighted, trl)
        assert weighted_grads.keys() == trl_grads.keys() and weighted_grads
        for name, grad in weighted_grads.items():
            assert torch.allclose(grad, trl_grads[name], atol=1e-6), (weights, name)

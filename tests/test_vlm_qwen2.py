"""Qwen2-VL, whose processor needs torchvision: transformers 5.23 builds a processor that
takes videos (Qwen2-VL's, Qwen2.5-VL's, SmolVLM's, ...) only with its video processor, and
every video processor needs torchvision; a processor cannot be built without one
(ProcessorMixin checks each part's class, and the video processors' base class is not
importable from transformers without torchvision).

Without torchvision (CI: its CPU torch has no matching torchvision, docs/install.md), such a
model is refused in one line saying what to install, by training's processor load and by
the load of a run's model (model/tokenizer.py processor_from) alike. Validate does not
load processors (it stays torch-free, and the machine that trains may have torchvision).

With torchvision (`bash setup.sh --cuda` installs it, on any machine: docs/testing.md), a
tiny Qwen2-VL (and Qwen2.5-VL, Qwen3-VL, Qwen3.5, SmolVLM) learns the vision quickstart and its run is used
as a user uses one."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from conftest import DATA, QUICKSTART, run_cli

TORCHVISION = importlib.util.find_spec("torchvision") is not None
without_torchvision = pytest.mark.skipif(TORCHVISION,
                                         reason="torchvision is installed: these processors load")
with_torchvision = pytest.mark.skipif(
    not TORCHVISION, reason="needs torchvision, which CI's CPU torch has none of: run it in a "
                            "`bash setup.sh --cuda` environment (docs/testing.md)")

PICTURE = QUICKSTART / "data" / "vlm_train" / "0000.png"
REFUSAL = ("the processor of {!r} needs torchvision, which is not installed: pip install "
           "torchvision (the build made for the installed torch {}, from where it came; bash "
           "setup.sh --cuda or --torch-index URL installs the pair: docs/install.md)")


@without_torchvision
@pytest.mark.slow  # builds the model directory, loads the processor (and torch)
def test_a_qwen2_vl_without_torchvision_is_one_line_at_training_and_at_load(write, tmp_path):
    import torch
    from vlm_configs import tiny_qwen2_vl

    from finetune.config.schema import Experiment
    from finetune.errors import ConfigError
    from finetune.model.saved import RunModel, load_tokenizer
    from finetune.model.tokenizer import load_processor

    model = tiny_qwen2_vl(tmp_path / "qwen2_vl")
    shutil.copy(PICTURE, tmp_path / "pic.png")
    parts = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    (tmp_path / "rows.jsonl").write_text(json.dumps(
        {"messages": [{"role": "user", "content": parts},
                      {"role": "assistant", "content": "red"}], "images": ["pic.png"]}) + "\n")
    config = write("exp.yaml", f"method: sft\nmodel: {{name_or_path: {model}, init: random}}\n"
                               f"data: {{train: {tmp_path / 'rows.jsonl'}}}\n")
    refusal = lambda source: REFUSAL.format(str(source), torch.__version__)
    result = run_cli("train", config, cwd=tmp_path)
    assert (result.returncode, result.stderr) == \
        (2, f"error: model.name_or_path: {refusal(model)}\n"), result.stderr
    # the load itself, and a run's model's
    experiment = Experiment.model_validate({"name": "q", "method": "sft", "model": {
        "name_or_path": str(model), "init": "random"}, "data": {"train": "rows.jsonl"}})
    with pytest.raises(ConfigError) as caught:
        load_processor(experiment)
    assert caught.value.problems == [f"model.name_or_path: {refusal(model)}"]
    with pytest.raises(ConfigError) as caught:
        load_tokenizer(RunModel(tmp_path, experiment, model, adapter=False))
    assert caught.value.problems == [f"{model}: {refusal(model)}"]


@with_torchvision
@pytest.mark.slow  # trains twice (~1 minute on 2 cores)
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "smolvlm"])
def test_a_qwen2_vl_learns_the_vision_quickstart_and_answers_from_its_pictures(family,
                                                                               tmp_path):
    """The vision quickstart (configs/quickstart/vlm.yaml) with a tiny Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL or Qwen3.5 in place of its LLaVA (its pictures' patches merged
    2x2, placed by its 3D rotary positions; Qwen2.5-VL's tower attends within windows,
    then over the picture; Qwen3-VL's adds its first block's merged patches into the
    language model's first layer; Qwen3.5's language model mixes linear and full
    attention): held-out exact match from 0 to 0.85, 0.94, 0.95 and 0.88 (seed 0, one CPU
    thread, 30-40 s of training; 2 threads round otherwise); `finetune generate` answers the held-out prompts from
    their pictures as the run's own evaluation scored them; and dpo from that model, on
    the dpo quickstart's pairs with pictures, moves preference accuracy from 0 to about
    0.93. So for a tiny SmolVLM (its processor needs torchvision and num2words; 4 image
    tokens behind its markers): 0 to 0.985, and dpo 0 to 0.995."""
    from vlm_configs import tiny_qwen2_vl, tiny_smolvlm

    directory = tmp_path / family
    model = tiny_smolvlm(directory) if family == "smolvlm" else tiny_qwen2_vl(directory, family)
    run = tmp_path / "sft"
    result = run_cli("train", QUICKSTART / "vlm.yaml", f"model.name_or_path={model}",
                     f"output.dir={run}", cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    before, after = summary["before"]["eval_exact_match"], summary["after"]["eval_exact_match"]
    print(family, "exact match", before, "->", after, f"in {summary['seconds']} s")
    assert before <= 0.05 and after >= 0.7

    (tmp_path / "vlm_eval").symlink_to(DATA / "vlm_eval")  # paths relative to the file
    shutil.copy(DATA / "vlm_eval.jsonl", tmp_path / "prompts.jsonl")
    out = tmp_path / "answers.jsonl"
    result = run_cli("generate", run, "--file", tmp_path / "prompts.jsonl", "--out", out,
                     "--max-new-tokens", 8, "--batch-size", 50, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(answers) == 200 and all(len(a["images"]) == 1 for a in answers)
    hits = sum(a["completion"].strip() == a["reference"].strip() for a in answers) / 200
    assert hits == pytest.approx(after, abs=0.02)  # other batches, the same answers

    pairs = tmp_path / "dpo"
    result = run_cli("train", QUICKSTART / "vlm-dpo.yaml", f"model.name_or_path={run / 'final'}",
                     "model.init=pretrained", f"output.dir={pairs}", cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((pairs / "summary.json").read_text())
    before = summary["before"]["eval_rewards/accuracies"]
    after = summary["after"]["eval_rewards/accuracies"]
    print(family, "dpo preference accuracy", before, "->", after)
    assert before <= 0.05 and after >= 0.8


@with_torchvision
@pytest.mark.slow  # loads the processor (and torch)
def test_finetune_data_counts_a_qwen2_vl_picture_as_training_fits_it(write, tmp_path):
    """Qwen2-VL's image tokens follow the picture's size: `finetune data` fits the pictures
    to vision.max_pixels as training does (a 32x32 picture is 4 tokens; under 256 pixels it
    is 16x16, 1 token), and its length statistics count them so."""
    from vlm_configs import tiny_qwen2_vl

    model = tiny_qwen2_vl(tmp_path / "qwen2_vl")
    config = write("sft.yaml", f"method: sft\nmodel: {{name_or_path: {model}, init: random}}\n"
                               f"data: {{train: {DATA / 'vlm_train.jsonl'}}}\n")
    tokens = {}
    for bound in ([], ["vision.max_pixels=256"]):
        result = run_cli("data", config, "-n", "1", *bound, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        [row] = [line for line in result.stdout.splitlines() if "<|vision_start|>" in line]
        tokens[bool(bound)] = row.count("<|image_pad|>")
    assert tokens == {False: 4, True: 1}

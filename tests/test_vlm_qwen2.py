"""Qwen2-VL without torchvision: transformers 5.23 builds a processor that takes videos
(Qwen2-VL's, Qwen2.5-VL's, SmolVLM's, ...) only with its video processor, and every video
processor needs torchvision; a processor cannot be built without one (ProcessorMixin
checks each part's class, and the video processors' base class is not importable from
transformers without torchvision). So such a model is refused in one line saying what to
install, by training's processor load and by the load of a run's model
(model/tokenizer.py processor_from) alike. Validate does not load processors (it stays
torch-free, and the machine that trains may have torchvision)."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from conftest import QUICKSTART, run_cli

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None,
                                reason="torchvision is installed: these processors load")

PICTURE = QUICKSTART / "data" / "vlm_train" / "0000.png"
REFUSAL = ("the processor of {!r} needs torchvision, which is not installed: pip install "
           "torchvision (the build matching the installed torch {})")


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

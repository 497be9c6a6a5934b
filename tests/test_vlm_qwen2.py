"""Qwen2-VL without torchvision: transformers 5.23 builds a processor that takes videos
(Qwen2-VL's, Qwen2.5-VL's, SmolVLM's, ...) only with its video processor, and every video
processor needs torchvision; a processor cannot be built without one (ProcessorMixin
checks each part's class, and the video processors' base class is not importable from
transformers without torchvision). So such a model is refused in one line naming its
type and what to install: by validate (torch-free, config/vision.torchvision_refusal; not
a rule of the experiment: estimate needs no processor), by training's processor load and
by the load of a run's model (model/tokenizer.py processor_from), alike."""

from __future__ import annotations

import importlib.util
import json
import shutil
from importlib.metadata import version

import pytest

from conftest import QUICKSTART, run_cli

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None,
                                reason="torchvision is installed: these processors load")

PICTURE = QUICKSTART / "data" / "vlm_train" / "0000.png"
REFUSAL = ("a qwen2_vl model's processor (transformers' Qwen2VLProcessor) needs torchvision, "
           "which is not installed: pip install torchvision (the build matching the "
           f"installed torch {version('torch')})")


@pytest.mark.slow  # builds the model directory, loads the processor (and torch)
def test_a_qwen2_vl_without_torchvision_is_one_line_at_validate_and_at_load(write, tmp_path):
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
    for command, where in (("validate", f"{config}: "), ("train", "")):
        result = run_cli(command, config, cwd=tmp_path)
        assert (result.returncode, result.stderr) == \
            (2, f"error: {where}model.name_or_path: {REFUSAL}\n"), result.stderr
    # the load itself (a hub model's, which validate cannot read), and a run's model's
    experiment = Experiment.model_validate({"name": "q", "method": "sft", "model": {
        "name_or_path": str(model), "init": "random"}, "data": {"train": "rows.jsonl"}})
    with pytest.raises(ConfigError) as caught:
        load_processor(experiment)
    assert caught.value.problems == [f"model.name_or_path: {REFUSAL}"]
    with pytest.raises(ConfigError) as caught:
        load_tokenizer(RunModel(tmp_path, experiment, model, adapter=False))
    assert caught.value.problems == [f"{model}: {REFUSAL}"]


@pytest.mark.slow  # imports the processor class of every vision-language model type
def test_the_torch_free_rule_agrees_with_transformers_processor_classes():
    """torchvision_refusal reads transformers' source; the classes themselves say which
    processors take a video processor (or need torchvision outright: Pixtral's)."""
    import transformers
    from transformers.models.auto.modeling_auto import \
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    from finetune.config import vision

    refused = set()
    for model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        name = PROCESSOR_MAPPING_NAMES.get(model_type)
        assert vision.processor_classes().get(model_type) == name, model_type
        try:
            takes = name is not None and \
                "video_processor" in getattr(transformers, name).get_attributes()
        except ImportError:
            takes = True
        assert (vision.torchvision_refusal(model_type) is not None) == takes, model_type
        refused |= {model_type} if takes else set()
    assert {"qwen2_vl", "qwen2_5_vl", "smolvlm", "mistral3"} <= refused
    assert not {"llava", "gemma3", "idefics3", "mllama", "paligemma"} & refused

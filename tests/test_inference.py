"""Using a run's model after training: final/ loads on its own with the transformers and
PEFT auto classes (in a fresh process, from another working directory, after the run
directory is moved), `finetune merge`, `finetune generate` and `finetune chat` (in a real
terminal, through tmux). The runs are the quickstart's, trained for a few steps.

"What the run produced" is read from the run itself: the greedy answers its evaluation
recorded (metrics.jsonl), its eval accuracy (summary.json), and its weights on disk, put
together here by hand (base + scale x B @ A) as an independent reference for the logits.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import DATA, QUICKSTART, REPO, run_cli

IDS = [[1, 5, 9, 17, 40, 101, 7, 3]]  # token ids for a logits comparison (vocab 349)

# Loads a model directory with an auto class in a fresh process and prints its logits on
# IDS, its greedy answers to the prompts given (rendered text), and, for a sequence
# classifier, its predicted labels for texts.
LOAD = r"""
import json, sys, torch, transformers, peft
directory, name, task = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
auto = getattr(peft if name.startswith("AutoPeft") else transformers, name)
model = auto.from_pretrained(directory).eval()
out = {"class": type(model).__name__}
with torch.no_grad():
    out["logits"] = model(torch.tensor(task["ids"])).logits.tolist()
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    out["generated"] = []
    for prompt in task.get("prompts", []):
        enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
        ids = model.generate(**enc, max_new_tokens=12, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        out["generated"].append(tok.decode(ids[0, enc["input_ids"].shape[1]:],
                                           skip_special_tokens=True).strip())
    out["labels"] = []
    for text in task.get("texts", []):
        enc = tok(text, truncation=True, max_length=task["max_length"], return_tensors="pt")
        index = int(model(**enc).logits[0].argmax())
        out["labels"].append(model.config.id2label[index])
    out["scores"] = []
    for ids in task.get("pairs", []):
        out["scores"].append([float(model(torch.tensor([i])).logits[0, 0]) for i in ids])
print(json.dumps(out))
"""


def load_elsewhere(directory: Path, auto_class: str, cwd: Path, **task) -> dict:
    """The LOAD script in a fresh interpreter, run from `cwd` (not the run directory)."""
    task.setdefault("ids", IDS)
    result = subprocess.run([sys.executable, "-c", LOAD, str(directory), auto_class,
                             json.dumps(task)], cwd=cwd, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def reconstructed(base: Path, adapter: Path | None, head: str = "lm"):
    """The model from the files alone: the base's safetensors, plus alpha/r x B @ A for
    every adapted weight and the adapter's full modules (a score head)."""
    import torch
    from safetensors.torch import load_file
    from transformers import (AutoConfig, AutoModelForCausalLM,
                              AutoModelForSequenceClassification)

    cls = AutoModelForCausalLM if head == "lm" else AutoModelForSequenceClassification
    model = cls.from_config(AutoConfig.from_pretrained(base), dtype=torch.float32)
    state = load_file(str(base / "model.safetensors"))
    if adapter is not None:
        spec = json.loads((adapter / "adapter_config.json").read_text())
        scale = spec["lora_alpha"] / spec["r"]
        lora = load_file(str(adapter / "adapter_model.safetensors"))
        for key, value in lora.items():
            name = key.removeprefix("base_model.model.")
            if ".lora_A." in key:
                target = name.replace(".lora_A.weight", ".weight")
                state[target] = state[target] + scale * lora[key.replace("lora_A", "lora_B")] @ value
            elif ".lora_B." not in key:
                state[name] = value
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


def reference_logits(model) -> list:
    import torch

    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.tolist()


def assert_close(a, b, tolerance: float) -> None:
    import torch

    difference = (torch.tensor(a) - torch.tensor(b)).abs().max().item()
    assert difference <= tolerance, difference


def train(root: Path, config: Path, *overrides: str) -> Path:
    run = root / "run"
    result = run_cli("train", str(config), f"output.dir={run}", "training.save_steps=10",
                     *overrides, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def recorded_answers(run: Path) -> list[dict]:
    """The greedy answers the run's evaluation after training wrote (sft exact match)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in records if r.get("when") == "after")["exact_match_examples"]


SFT = QUICKSTART / "sft.yaml"
FAST = ("training.warmup_steps=5",)


@pytest.fixture(scope="module")
def full_sft(tmp_path_factory):
    return train(tmp_path_factory.mktemp("full"), SFT, "training.max_steps=60", *FAST)


@pytest.fixture(scope="module")
def lora_sft(tmp_path_factory, full_sft):
    """LoRA on a pretrained local base (the full run's final model)."""
    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    shutil.copytree(full_sft / "final", base)
    return train(root, SFT, f"model.name_or_path={base}", "model.init=pretrained",
                 "peft.type=lora", "training.max_steps=20", *FAST)


@pytest.fixture(scope="module")
def random_lora(tmp_path_factory):
    """A random-init LoRA run, trained in one place and then moved: the original path is
    returned too (the adapter's record names it)."""
    root = tmp_path_factory.mktemp("random-lora")
    trained = train(root, SFT, "peft.type=lora", "training.max_steps=40",
                    "training.learning_rate=3e-3", *FAST)
    moved = root / "moved" / "elsewhere"
    moved.parent.mkdir()
    trained.rename(moved)
    return moved, trained


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "lora", "random-lora"])
def test_final_loads_on_its_own_and_answers_as_the_run_did(kind, full_sft, lora_sft,
                                                           random_lora, tmp_path):
    run = {"full": full_sft, "lora": lora_sft, "random-lora": random_lora[0]}[kind]
    final = run / "final"
    answers = recorded_answers(run)
    loaded = load_elsewhere(final, "AutoModelForCausalLM", tmp_path,
                            prompts=[a["prompt"] for a in answers])
    assert loaded["generated"] == [a["generated"] for a in answers]
    if kind == "full":
        reference = reconstructed(final, None)
    else:
        base = run / "init-model" if kind == "random-lora" else run.parent / "base"
        reference = reconstructed(base, final)
        assert loaded["class"] == "LlamaForCausalLM"
    assert_close(loaded["logits"], reference_logits(reference), 1e-5)
    if kind == "lora":  # the adapter names its base: PEFT's own auto class loads it
        peft = load_elsewhere(final, "AutoPeftModelForCausalLM", tmp_path)
        assert peft["class"] == "PeftModelForCausalLM"
        assert_close(peft["logits"], loaded["logits"], 1e-6)


@pytest.mark.slow
def test_a_random_init_adapter_names_init_model_and_carries_its_base(random_lora, tmp_path):
    moved, trained = random_lora
    final = moved / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(trained / "init-model")
    # The base's files sit next to the adapter, hard-linked to init-model/'s.
    for name in ("config.json", "model.safetensors"):
        assert (final / name).stat().st_ino == (moved / "init-model" / name).stat().st_ino
    # Moved, AutoModelForCausalLM loaded it above; PEFT's AutoPeftModel loads the base at
    # the recorded path, so it loads where the run was trained.
    trained.parent.mkdir(parents=True, exist_ok=True)
    moved.rename(trained)
    try:
        peft = load_elsewhere(trained / "final", "AutoPeftModelForCausalLM", tmp_path)
        plain = load_elsewhere(trained / "final", "AutoModelForCausalLM", tmp_path)
    finally:
        trained.rename(moved)
    assert peft["class"] == "PeftModelForCausalLM"
    assert_close(peft["logits"], plain["logits"], 1e-6)

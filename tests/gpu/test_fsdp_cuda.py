"""FSDP versions 1 and 2 through `finetune launch` on CUDA (tests/test_fsdp.py is what a
CPU machine can check: the rendered file, and the refusal without CUDA).

Two processes where the machine has two GPUs, else one. One process proves: accelerate
accepts the generated accelerate.yaml and builds the FSDP plugin, model and optimizer are
prepared together (the evaluation before training runs in on_train_begin), FSDP1 generates
(exact match) under summon_full_params, a sharded checkpoint is saved, and the final model is
gathered as a FULL_STATE_DICT and saved whole. It does NOT prove sharding across ranks,
sync_module_states or cpu_ram_efficient_loading on a rank above 0, nor that generation and
the final gather do not hang with several ranks: that needs a machine with 2+ GPUs."""

from __future__ import annotations

import math
import shutil

import pytest

from conftest import QUICKSTART

from .helpers import CUDA, SFT, TINY_CONFIG, finetune, finite, losses, read_json

STEPS = 5


@pytest.mark.parametrize("version,port", [(1, 29790), (2, 29791)])
def test_fsdp_trains_and_saves_a_whole_model(version, port, gpu, tmp_path, figures):
    processes = 2 if gpu["count"] >= 2 else 1
    run = tmp_path / "run"
    result = finetune("launch", SFT, CUDA, "distributed.strategy=fsdp",
                      f"distributed.fsdp.version={version}",
                      f"distributed.num_processes={processes}",
                      f"distributed.main_process_port={port}", f"training.max_steps={STEPS}",
                      "training.save_steps=3", "training.warmup_steps=0",
                      "training.logging_steps=1", f"output.dir={run}", cwd=tmp_path,
                      timeout=300)
    summary = read_json(run / "summary.json")
    step_losses = losses(run)
    figures(processes=processes, losses=step_losses, seconds=summary["seconds"],
            eval_loss=[summary["before"]["eval_loss"], summary["after"]["eval_loss"]])
    assert read_json(run / "environment.json")["device"] == "cuda"
    assert f"x {processes} process(es)" in result.stdout  # the start summary's batch line
    assert summary["global_step"] == STEPS
    assert len(step_losses) == STEPS and finite(step_losses)
    # The sharded parameters were stepped: 5 steps at 1e-3 from random weights.
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"] - 0.05
    assert "eval_exact_match" in summary["after"]  # generation under FSDP
    assert (run / "checkpoints" / "checkpoint-3" / "finetune-manifest.json").is_file()

    # final/: one whole model (not a rank's shard) that transformers loads as it is.
    from transformers import AutoModelForCausalLM

    assert (run / "final" / "model.safetensors").stat().st_size > 0
    model, info = AutoModelForCausalLM.from_pretrained(run / "final", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), \
        info
    embed = model.get_input_embeddings().weight
    assert tuple(embed.shape) == (TINY_CONFIG["vocab_size"], TINY_CONFIG["hidden_size"])
    assert all(p.isfinite().all() and p.abs().max() > 0 for p in model.parameters())
    assert math.isfinite(summary["after"]["eval_loss"])


@pytest.mark.parametrize("version,peft,port", [(1, "none", 29792), (2, "lora", 29793)])
def test_fsdp_trains_a_vision_language_model(version, peft, port, gpu, tmp_path, figures):
    """The vision quickstart's tiny LLaVA under FSDP: its _no_split_modules name a class it
    lacks (CLIPTextEmbeddings), on which accelerate's wrap (and peft's, under LoRA)
    stopped before finetune cut them to the classes it has (tests/test_fsdp.py). FSDP1,
    full training with the tower frozen: units with frozen and trained parameters
    (use_orig_params); final/ loads with AutoModelForImageTextToText, its tower the
    starting one and its language model moved. FSDP2 under LoRA: the adapter on the
    language model only. A few steps from saved weights; the loss falls."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForImageTextToText

    start = tmp_path / "start"
    shutil.copytree(QUICKSTART / "tiny-vlm", start)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(start)).save_pretrained(
        start)
    processes = 2 if gpu["count"] >= 2 else 1
    run = tmp_path / "run"
    finetune("launch", QUICKSTART / "vlm.yaml", CUDA, f"model.name_or_path={start}",
             "model.init=pretrained", f"peft.type={peft}", "vision.freeze_tower=true",
             "distributed.strategy=fsdp", f"distributed.fsdp.version={version}",
             f"distributed.num_processes={processes}", f"distributed.main_process_port={port}",
             f"training.max_steps={STEPS}", "training.warmup_steps=0",
             "training.logging_steps=1", "training.save_steps=1000",
             "evaluation.max_samples=32", f"output.dir={run}", cwd=tmp_path, timeout=300)
    summary = read_json(run / "summary.json")
    step_losses = losses(run)
    figures(processes=processes, losses=step_losses, seconds=summary["seconds"],
            eval_loss=[summary["before"]["eval_loss"], summary["after"]["eval_loss"]])
    assert summary["global_step"] == STEPS and finite(step_losses)
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"] - 0.05
    if peft == "lora":
        with safe_open(run / "final" / "adapter_model.safetensors", "pt") as adapter:
            names = list(adapter.keys())
        assert names and all(".language_model." in name for name in names), names
        return
    before = AutoModelForImageTextToText.from_pretrained(start).state_dict()
    after = AutoModelForImageTextToText.from_pretrained(run / "final").state_dict()
    assert after.keys() == before.keys()
    tower = [k for k in before if ".vision_tower." in k]
    assert tower and all(torch.equal(after[k], before[k]) for k in tower)
    language = [k for k in before if ".language_model." in k]
    assert sum(not torch.equal(after[k], before[k]) for k in language) > len(language) // 2

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

import pytest

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

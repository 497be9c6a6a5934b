"""DeepSpeed ZeRO-2 and ZeRO-3, with and without CPU offload, on 2 CPU processes through
the Trainer: the weights after k SGD steps match plain DDP's (fp32)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import DATA, TINY_MODEL, free_port, run_cli

# One worker runs this module: its module fixture (ddp_weights) trains once, not once per worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("deepspeed")]  # DeepSpeed training runs

VARIANTS = {
    "ddp": "{strategy: ddp",
    "zero2": "{strategy: deepspeed, deepspeed: {zero_stage: 2}",
    "zero2-offload": "{strategy: deepspeed, deepspeed: {zero_stage: 2, offload_optimizer: cpu}",
    "zero3": "{strategy: deepspeed, deepspeed: {zero_stage: 3}",
    "zero3-offload": "{strategy: deepspeed, deepspeed: {zero_stage: 3, offload_optimizer: cpu, "
                     "offload_params: cpu}",
}


def experiment(variant: str, port: int) -> str:
    return (f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
            f"data:\n  train: {{path: {DATA}/sft_train.jsonl, max_samples: 4}}\n"
            f"distributed: {VARIANTS[variant]}, num_processes: 2, device: cpu, "
            f"main_process_port: {port}}}\n"
            "evaluation: {before_training: false}\noutput: {plot: false}\n"
            "training: {max_steps: 3, per_device_train_batch_size: 2, optim: sgd, "
            "learning_rate: 0.1, max_grad_norm: 0.0, save_strategy: 'no', seed: 3, "
            "activation_checkpointing: false}\n")


@pytest.fixture(scope="module")
def ddp_weights(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    (tmp / "ddp.yaml").write_text(experiment("ddp", free_port()))
    result = run_cli("launch", str(tmp / "ddp.yaml"), cwd=tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp / "runs" / "ddp"
    return load_file(run / "final" / "model.safetensors"), load_file(
        run / "init-model" / "model.safetensors")


# zero2-offload's path (DeepSpeed's CPU Adam on offloaded optimizer states) is in
# zero3-offload too, which offloads the parameters as well: exhaustive.
@pytest.mark.parametrize("variant", [
    pytest.param(v, marks=pytest.mark.exhaustive) if v == "zero2-offload" else v
    for v in VARIANTS if v != "ddp"])
def test_zero_matches_ddp(variant, ddp_weights, write, tmp_path):
    """The first case on a fresh machine runs over 60 s: its ranks are the first DeepSpeed
    processes of the virtual environment, and DeepSpeed compiles its shared-memory
    communication op for the CPU then (30-80 s, cached in ~/.cache/torch_extensions)."""
    config = write(f"{variant}.yaml", experiment(variant, free_port()))
    result = run_cli("launch", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "x 2 process(es)" in result.stdout
    ref, init = ddp_weights
    weights = load_file(tmp_path / "runs" / variant / "final" / "model.safetensors")
    assert set(ref) <= set(weights)  # ZeRO may also write the tied lm_head
    worst = max(((weights[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)
    moved = max((ref[k] - init[k]).norm().item() for k in ref)
    print(f"{variant}: weights rel. diff to DDP {worst:.2e}")
    assert moved > 0 and worst <= 1e-5

"""Generated Accelerate and DeepSpeed files, checked by the tools that consume them."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest
import yaml

from conftest import DATA, REPO, TINY_MODEL, run_cli
from finetune.config import load_experiment
from finetune.render.scripts import launch_argv
from finetune.render.bundle import write_bundle
from finetune.render.presets import render_presets

PRESETS = sorted((REPO / "accelerate_configs").glob("*.yaml"))
DS_PRESETS = sorted((REPO / "ds_configs").glob("*.json"))


def base(extra: str = "") -> str:
    return (f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
            f"data:\n  train: {{path: {DATA}/sft_train.jsonl, max_samples: 16}}\n"
            "training: {per_device_train_batch_size: 3, gradient_accumulation_steps: 2, "
            "max_steps: 2, max_grad_norm: 0.5}\n" + extra)


def test_presets_are_exactly_the_generator_output():
    rendered = render_presets()
    on_disk = {p for p in [*PRESETS, *DS_PRESETS]}
    assert set(rendered) == on_disk, "run `python -m finetune.render.presets`"
    for path, text in rendered.items():
        assert path.read_text() == text, f"{path} differs: run `python -m finetune.render.presets`"
    assert not any("num_processes: 8" in p.read_text() for p in PRESETS)


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_accelerate_loader_accepts_presets(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    assert config.distributed_type.value == yaml.safe_load(path.read_text())["distributed_type"]


@pytest.mark.slow
def test_deepspeed_presets_resolve_through_transformers():
    """HfTrainerDeepSpeedConfig fills every "auto" from the training arguments, in every
    preset. In a process of their own (a DeepSpeed config is global to transformers), all in
    one: one import of transformers, not one per preset."""
    code = f"""
import json
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
args = TrainingArguments(output_dir="/tmp/unused", per_device_train_batch_size=3,
                         gradient_accumulation_steps=2, max_grad_norm=0.5, bf16=True,
                         use_cpu=True, report_to="none")
for ds in {[str(ds) for ds in DS_PRESETS]!r}:
    hf = HfTrainerDeepSpeedConfig(ds)
    hf.trainer_config_process(args)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         vocab_size=128))
    hf.trainer_config_finalize(args, model, num_training_steps=10)
    text = json.dumps(hf.config)
    assert '"auto"' not in text, (ds, text)
    c = hf.config
    assert c["train_batch_size"] == 3 * 2 * args.world_size, (ds, c)
    assert c["train_micro_batch_size_per_gpu"] == 3 and c["gradient_accumulation_steps"] == 2, ds
    assert c["gradient_clipping"] == 0.5 and c["bf16"]["enabled"] is True, ds
    assert c["fp16"]["enabled"] is False, ds
    print("ok", ds, c["zero_optimization"]["stage"])
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("ok ") == len(DS_PRESETS) == 5, result.stdout


def test_bundle_files_and_quoting(write, tmp_path):
    exp = load_experiment(write("exp.yaml", base(
        "distributed: {strategy: deepspeed, num_processes: 4, num_machines: 2, "
        "main_process_ip: 10.1.2.3, deepspeed: {zero_stage: 3}}\n")))
    out = tmp_path / "it's a dir"
    files = {p.name for p in write_bundle(exp, out)}
    assert files == {"experiment.yaml", "deepspeed.json", "accelerate.yaml", "launch.sh"}
    accel = yaml.safe_load((out / "accelerate.yaml").read_text())
    assert accel["num_processes"] == 4 and accel["num_machines"] == 2
    assert accel["deepspeed_config"]["deepspeed_config_file"] == str(out / "deepspeed.json")
    assert json.loads((out / "deepspeed.json").read_text())["zero_optimization"]["stage"] == 3
    script = (out / "launch.sh").read_text()
    assert subprocess.run(["bash", "-n", str(out / "launch.sh")]).returncode == 0
    line = next(l for l in script.splitlines() if l.startswith("exec "))
    for rank in (0, 1):  # the line, with the script's rank, parses back to the launch argv
        words = shlex.split(line[len("exec "):].replace('"$rank"', str(rank)))
        assert words == launch_argv(exp, out, rank)
        assert words[words.index("--machine_rank") + 1] == str(rank)


def test_torchrun_launcher_argv(write, tmp_path):
    exp = load_experiment(write("exp.yaml", base(
        "distributed: {strategy: ddp, processes_per_machine: 2, num_machines: 2, "
        "launcher: torchrun, rdzv_timeout: 30}\n")))
    argv = launch_argv(exp, tmp_path, 1)
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    joined = " ".join(argv)
    assert "--nnodes 2 --nproc-per-node 2 --node-rank 1" in joined
    assert "--rdzv-conf timeout=30" in joined


@pytest.mark.slow
def test_render_and_dry_run_commands(write, tmp_path):
    config = write("exp.yaml", base("distributed: {strategy: ddp, num_processes: 2}\n"))
    result = run_cli("render", str(config), "--out", str(tmp_path / "bundle"), cwd=tmp_path)
    assert result.returncode == 0 and "launch.sh" in result.stdout
    result = run_cli("launch", str(config), "--dry-run", cwd=tmp_path)
    assert result.returncode == 0 and "accelerate.commands.launch" in result.stdout
    assert (tmp_path / "runs" / "exp" / "launch.sh").exists()
    assert not (tmp_path / "runs" / "exp" / "final").exists()


def _fake_nvidia_smi(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    return bin_dir


def test_device_probe_reads_the_driver_and_cuda_visible_devices(tmp_path):
    from finetune.launch.probe import PROC_GPUS, probe_device

    smi = str(_fake_nvidia_smi(tmp_path))
    assert probe_device({"PATH": smi}) == ("cuda", "nvidia-smi lists 1 GPU(s)") or \
        PROC_GPUS.exists()
    assert probe_device({"PATH": smi, "CUDA_VISIBLE_DEVICES": "0,1"})[0] == "cuda"
    assert probe_device({"PATH": smi, "CUDA_VISIBLE_DEVICES": "GPU-5a3b"})[0] == "cuda"
    for hidden in ("", "-1", "NoDevFiles", " "):
        assert probe_device({"PATH": smi, "CUDA_VISIBLE_DEVICES": hidden})[0] == "cpu"
    if not PROC_GPUS.exists():
        assert probe_device({"PATH": str(tmp_path)})[0] == "cpu"


@pytest.mark.slow
def test_render_resolves_device_auto_here_and_slurm_leaves_it_to_the_node(write, tmp_path):
    import os

    config = write("exp.yaml", base("distributed: {num_processes: 2}\n"))
    env = {**os.environ, "PATH": f"{_fake_nvidia_smi(tmp_path)}:{os.environ['PATH']}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    result = subprocess.run([sys.executable, "-m", "finetune", "render", str(config), "--out",
                             str(tmp_path / "gpu")], cwd=tmp_path, env=env, text=True,
                            capture_output=True)
    assert result.returncode == 0, result.stderr
    assert "distributed.device auto -> cuda on this machine" in result.stdout
    accel = yaml.safe_load((tmp_path / "gpu" / "accelerate.yaml").read_text())
    assert accel["mixed_precision"] == "bf16" and accel["distributed_type"] == "MULTI_GPU"
    assert "device: cuda" in (tmp_path / "gpu" / "experiment.yaml").read_text()
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run([sys.executable, "-m", "finetune", "render", str(config), "--out",
                             str(tmp_path / "cpu")], cwd=tmp_path, env=env, text=True,
                            capture_output=True)
    assert "distributed.device auto -> cpu on this machine (CUDA_VISIBLE_DEVICES=''" in \
        result.stdout
    assert yaml.safe_load((tmp_path / "cpu" / "accelerate.yaml").read_text())[
        "mixed_precision"] == "no"
    # A login node renders the job; each compute node resolves auto when it launches.
    result = subprocess.run([sys.executable, "-m", "finetune", "slurm", str(config), "--nodes",
                             "2", "--gpus-per-node", "1", "--time", "10"], cwd=tmp_path,
                            env=env, text=True, capture_output=True)
    assert result.returncode == 0, result.stderr
    assert "device: auto" in (tmp_path / "runs" / "exp" / "experiment.yaml").read_text()

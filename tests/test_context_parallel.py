"""Context parallelism without CUDA: what can be checked on a CPU machine.

accelerate's torch context parallelism needs FSDP2, which accelerate 1.15 runs only on
accelerators (tests/test_fsdp.py), so it cannot train here. Checked: the accelerate.yaml
that `finetune render` writes for distributed.context_parallel is what accelerate's own
config loader reads and what its launcher turns into the ParallelismConfig meant
(FSDP shards x context parallel = processes), and a launch that bypasses the file is
refused on every rank. On GPUs: docs/distributed.md, "Tensor and context parallelism"."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import DATA, TINY_MODEL, free_port, run_cli

PROBE = """
import json, os
from accelerate.parallelism_config import ParallelismConfig
config = ParallelismConfig()  # what Accelerator() builds from the launcher's variables
print("PROBE " + json.dumps({"use": os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG"),
    "fsdp": os.environ.get("ACCELERATE_USE_FSDP"), "version": os.environ.get("FSDP_VERSION"),
    "sizes": [config.dp_replicate_size, config.dp_shard_size, config.tp_size, config.cp_size,
              config.sp_size], "backend": config.cp_backend,
    "comm": config.cp_handler.cp_comm_strategy, "mesh": config._get_mesh()}))
"""


def experiment(extra: str = "") -> str:
    return (f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random, "
            "attn_implementation: sdpa}\n"
            f"data:\n  train: {{path: {DATA}/sft_train.jsonl, max_samples: 4}}\n"
            "distributed: {strategy: fsdp, num_processes: 4, device: cuda, "
            f"main_process_port: {free_port()}, context_parallel: 2{extra}}}\n"
            "output: {plot: false}\ntraining: {max_steps: 1, activation_checkpointing: false}\n")


@pytest.mark.slow
def test_rendered_config_gives_accelerate_the_parallelism_config_meant(write, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = write("exp.yaml", experiment())
    bundle = tmp_path / "bundle"
    result = run_cli("render", str(config), "--out", str(bundle), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    loaded = load_config_from_file(str(bundle / "accelerate.yaml"))
    assert loaded.parallelism_config["parallelism_config_cp_size"] == 2
    assert loaded.fsdp_config["fsdp_version"] == 2
    probe = write("probe.py", PROBE)  # one process: the sizes come from the file
    result = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                             str(bundle / "accelerate.yaml"), "--num_processes", "1",
                             str(probe)], cwd=tmp_path, text=True, capture_output=True,
                            timeout=300)
    line = next((l for l in result.stdout.splitlines() if l.startswith("PROBE ")), None)
    assert line, result.stderr[-3000:]
    out = json.loads(line[len("PROBE "):])
    assert out["use"] == "true" and out["fsdp"] == "true" and out["version"] == "2"
    assert out["sizes"] == [1, 2, 1, 2, 1] and out["backend"] == "torch"
    assert out["comm"] == "allgather"
    assert out["mesh"] == [["dp_shard", "cp"], [2, 2]]


def test_a_rank_launched_without_the_file_is_refused(write):
    from finetune.config import load_experiment
    from finetune.run.launched import launch_problems

    exp = load_experiment(write("exp.yaml", experiment()))
    found = launch_problems(exp, {"WORLD_SIZE": "4"}, "bf16")
    assert any("context_parallel 2 is carried by the generated Accelerate file" in p
               for p in found), found
    env = {"WORLD_SIZE": "4", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
           "PARALLELISM_CONFIG_CP_SIZE": "2", "ACCELERATE_USE_FSDP": "true"}
    assert launch_problems(exp, env, "bf16") == []
    found = launch_problems(exp, {**env, "PARALLELISM_CONFIG_CP_SIZE": "4"}, "bf16")
    assert any("parallelism_config_cp_size 4, but the experiment's is 2" in p for p in found)

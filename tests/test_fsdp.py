"""FSDP without CUDA: what can be checked on a CPU machine.

accelerate 1.15 turns FSDP on only for accelerator devices (AcceleratorState keeps
MULTI_CPU as it is), so FSDP does not train on CPU: FSDP2 silently runs as DDP, FSDP1
stops. Checked here, so that this file says when that changes: the accelerate.yaml that
`finetune render` writes is what accelerate's launcher and plugin read, for versions 1 and
2; what accelerate does on CPU; a run that asks for FSDP without CUDA stops with one line;
and the evaluation before training that FSDP runs as training begins sees the untrained
model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import DATA, TINY_MODEL, free_port, run_cli

# Run by `accelerate launch` with a rendered config, on CPU: which FSDP_* variables the
# launcher set, what Accelerator() makes of them, and the plugin built from them.
PROBE = f"""
import json, os
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from transformers import AutoConfig, AutoModelForCausalLM
env = {{k: v for k, v in os.environ.items() if k.startswith("FSDP_") or k == "ACCELERATE_USE_FSDP"}}
out = {{"env": env}}
try:
    accelerator = Accelerator(cpu=True)  # what use_cpu=True in the training arguments does
    out["distributed_type"] = str(accelerator.distributed_type)
    out["fsdp_plugin"] = getattr(accelerator.state, "fsdp_plugin", None) is not None  # as the Trainer reads it
except RuntimeError as exc:
    out["error"] = str(exc)
# FSDP1 broadcasts rank 0's weights to a device, which a CPU machine has not.
device_free = {{"sync_module_states": False, "cpu_ram_efficient_loading": False}}
plugin = FullyShardedDataParallelPlugin(**(device_free if env["FSDP_VERSION"] == "1" else {{}}))
plugin.set_auto_wrap_policy(AutoModelForCausalLM.from_config(
    AutoConfig.from_pretrained("{TINY_MODEL}")))
out["plugin"] = {{"version": plugin.fsdp_version, "reshard": str(plugin.reshard_after_forward),
                 "sharding": str(plugin.sharding_strategy), "wrap": plugin.transformer_cls_names_to_wrap,
                 "state_dict_type": str(plugin.state_dict_type), "offload": type(plugin.cpu_offload).__name__ + str(getattr(plugin.cpu_offload, "offload_params", ""))}}
print("PROBE " + json.dumps(out))
"""


def experiment(fsdp: str, device: str, port: int) -> str:
    return (f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
            f"data:\n  train: {{path: {DATA}/sft_train.jsonl, max_samples: 4}}\n"
            f"distributed: {{strategy: fsdp, num_processes: 1, device: {device}, "
            f"main_process_port: {port}, fsdp: {fsdp}}}\n"
            "output: {plot: false}\ntraining: {max_steps: 1, activation_checkpointing: false}\n")


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_rendered_config_is_what_accelerate_reads(version, write, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = write("exp.yaml", experiment(
        f"{{version: {version}, sharding_strategy: SHARD_GRAD_OP, state_dict_type: "
        f"{'FULL' if version == 1 else 'SHARDED'}_STATE_DICT}}", "cuda", free_port()))
    bundle = tmp_path / "bundle"
    result = run_cli("render", str(config), "--out", str(bundle), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    load_config_from_file(str(bundle / "accelerate.yaml"))
    probe = write("probe.py", PROBE)
    result = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                             str(bundle / "accelerate.yaml"), str(probe)], cwd=tmp_path,
                            text=True, capture_output=True, timeout=300)
    line = next((l for l in result.stdout.splitlines() if l.startswith("PROBE ")), None)
    assert line, result.stderr[-3000:]
    out = json.loads(line[len("PROBE "):])
    env, plugin = out["env"], out["plugin"]
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == str(version)
    assert plugin["version"] == version and plugin["wrap"] == ["LlamaDecoderLayer"]
    assert plugin["offload"] in ("CPUOffloadFalse", "OffloadPolicy")  # not CPUOffloadPolicy
    if version == 2:
        assert plugin["reshard"] == "False"  # SHARD_GRAD_OP: parameters kept after forward
        assert plugin["state_dict_type"] == "StateDictType.SHARDED_STATE_DICT"
        # Why the rules refuse FSDP on CPU: accelerate keeps MULTI_CPU and drops FSDP.
        assert out["distributed_type"] == "DistributedType.MULTI_CPU"
        assert out["fsdp_plugin"] is False
        assert "FSDP_SYNC_MODULE_STATES" in env  # the launcher's default; FSDP2 ignores it
    else:
        assert plugin["sharding"] == "ShardingStrategy.SHARD_GRAD_OP"
        assert plugin["state_dict_type"] == "StateDictType.FULL_STATE_DICT"
        assert env["FSDP_SYNC_MODULE_STATES"] == "true" and env["FSDP_USE_ORIG_PARAMS"] == "true"
        assert "no available devices found" in out["error"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_fsdp_without_cuda_stops_with_one_line(write, tmp_path):
    """device auto: launch resolves it on this machine (cpu) and the config rule refuses
    fsdp there; a training process that finds no CUDA itself says so in one line."""
    config = write("auto.yaml", experiment("{}", "auto", free_port()))
    result = run_cli("launch", str(config), cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == \
        [line for line in result.stderr.splitlines() if line.strip()]
    assert "distributed.strategy: fsdp needs CUDA devices" in result.stderr
    assert not (tmp_path / "runs" / "auto" / "final").exists()

    process = run_cli("train", str(config), cwd=tmp_path)  # the worker's own check
    assert process.returncode == 2, process.stderr[-3000:]
    assert "distributed.strategy fsdp needs CUDA devices and this run is on the CPU" \
           in process.stderr
    assert not (tmp_path / "runs" / "auto" / "final").exists()


def test_evaluation_as_training_begins_sees_the_untrained_model(tmp_path):
    """Under FSDP the evaluation before training runs in on_train_begin: the Trainer has
    prepared model and optimizer, and no step has been taken. Same numbers as an
    evaluate() before train(), on a plain CPU Trainer."""
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    from finetune.run.worker import EvaluateAsTrainingBegins

    rows = [{"input_ids": [(7 * i + j) % 50 + 3 for j in range(12)]} for i in range(8)]
    rows = [{**r, "labels": r["input_ids"]} for r in rows]
    torch.manual_seed(0)
    init = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL)).state_dict()

    def trainer() -> Trainer:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL))
        model.load_state_dict(init)
        args = TrainingArguments(str(tmp_path / "out"), use_cpu=True, max_steps=2, optim="sgd",
                                 learning_rate=0.5, per_device_train_batch_size=4,
                                 per_device_eval_batch_size=8, report_to="none",
                                 save_strategy="no", seed=0)
        return Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows)

    before = trainer().evaluate()["eval_loss"]
    deferred = trainer()
    steps_then = []

    def evaluate():
        steps_then.append(deferred.state.global_step)
        return dict(deferred.evaluate())

    first = EvaluateAsTrainingBegins(evaluate)
    deferred.add_callback(first)
    assert first.results == {}
    deferred.train()
    assert steps_then == [0] and deferred.state.global_step == 2
    assert first.results["eval_loss"] == before
    assert deferred.evaluate()["eval_loss"] < before  # and training went on from there


@pytest.mark.slow  # builds the tiny LLaVA (and imports torch.distributed.fsdp)
@pytest.mark.parametrize("version", [1, 2])
def test_fsdp_wraps_the_layers_a_vision_language_model_has(version):
    """transformers gathers a model's _no_split_modules from every class it is built from:
    the tiny LLaVA's name CLIPTextEmbeddings, which it lacks, and accelerate's
    transformer-based wrap stops on it ("Could not find the transformer layer class"), as
    does peft's, which the Trainer takes under LoRA (also for Gemma 3 and PaliGemma:
    SigLIP's text embeddings). The model training starts from names only the classes it
    has: each decoder layer and tower layer is then a unit, under LoRA too."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from peft import LoraConfig, get_peft_model
    from peft.utils.other import fsdp_auto_wrap_policy
    from transformers import AutoConfig, AutoModelForImageTextToText

    from conftest import QUICKSTART
    from finetune.model.load import name_only_layers_it_has

    def units(model) -> list[str]:
        """The modules FSDP makes units of, as accelerate's prepare() wraps them."""
        device_free = {"sync_module_states": False, "cpu_ram_efficient_loading": False}
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=version, auto_wrap_policy="TRANSFORMER_BASED_WRAP",
            **(device_free if version == 1 else {}))
        if version == 2:
            policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
        else:
            plugin.set_auto_wrap_policy(model)
            policy = lambda module: plugin.auto_wrap_policy(module, False, 0)
        return sorted({type(m).__name__ for m in model.modules() if policy(m)})

    def peft_units(model) -> list[str]:
        """The modules peft's policy (the Trainer's under LoRA) makes units of."""
        policy = fsdp_auto_wrap_policy(model)
        return sorted({type(m).__name__ for m in model.modules() if policy(m, False, 0)})

    def tiny_llava():
        return AutoModelForImageTextToText.from_config(
            AutoConfig.from_pretrained(QUICKSTART / "tiny-vlm"))

    lora = LoraConfig(target_modules=["q_proj", "v_proj"])
    model = tiny_llava()
    assert "CLIPTextEmbeddings" in model._no_split_modules
    with pytest.raises(ValueError, match="Could not find the transformer layer class "
                                         "CLIPTextEmbeddings"):
        units(model)  # the library's own names: the failure this guards against
    with pytest.raises(TypeError, match="Could not find the transformer layer class"):
        peft_units(get_peft_model(tiny_llava(), lora))
    layers = ["CLIPEncoderLayer", "CLIPVisionEmbeddings", "LlamaDecoderLayer"]
    name_only_layers_it_has(model)
    assert units(model) == layers
    adapted = tiny_llava()
    name_only_layers_it_has(adapted)  # starting_model does it before the adapters
    adapted = get_peft_model(adapted, lora)
    assert units(adapted) == layers
    assert peft_units(adapted) == sorted({*layers, "Linear"})  # and each trained LoRA matrix

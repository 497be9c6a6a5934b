"""LoRA and QLoRA on CUDA, a few steps each: finite losses, the adapter saved and trained,
and what the base layers really were as training started (read inside the training
process, helpers.OBSERVE): QLoRA's are bitsandbytes 4-bit layers on the GPU, LoRA's plain
layers in the compute dtype."""

from __future__ import annotations

import pytest

from .helpers import CUDA, SFT, TINY_CONFIG, finite, losses, observed, read_json

STEPS = 5
DTYPES = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}
# Every Linear of a Llama decoder layer (peft's all-linear leaves the LM head out).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("peft", ["lora", "qlora"])
def test_adapter_trains_on_cuda(peft, gpu, tmp_path, figures):
    if peft == "qlora" and not gpu["bitsandbytes"]:
        pytest.skip("bitsandbytes is not installed (tools/gpu/prepare.sh carries it)")
    run = tmp_path / "run"
    result, record = observed("train", SFT, CUDA, f"peft.type={peft}",
                              f"training.max_steps={STEPS}", "training.logging_steps=1",
                              "training.save_steps=1000", f"output.dir={run}",
                              cwd=tmp_path, timeout=240)
    summary = read_json(run / "summary.json")
    environment = read_json(run / "environment.json")
    step_losses = losses(run)
    figures(losses=step_losses, seconds=summary["seconds"],
            max_memory_allocated=record["max_memory_allocated"])
    assert environment["device"] == "cuda" and f"peft {peft}" in result.stdout
    if tuple(gpu["capability"]) >= (8, 0):
        assert environment["precision"] == "bf16"
    assert summary["global_step"] == STEPS
    assert len(step_losses) == STEPS and finite(step_losses)
    assert finite([summary["train"]["train_loss"], summary["after"]["eval_loss"]])

    # The adapter: final/ holds it, every decoder Linear adapted, B trained off its zeros.
    from safetensors.torch import load_file

    adapter = load_file(str(run / "final" / "adapter_model.safetensors"))
    layers = TINY_CONFIG["num_hidden_layers"]
    b = {k: v for k, v in adapter.items() if ".lora_B." in k}
    assert len(b) == len([k for k in adapter if ".lora_A." in k]) == len(TARGETS) * layers
    assert all(v.float().isfinite().all() for v in adapter.values())
    assert all(v.abs().max() > 0 for v in b.values())
    assert read_json(run / "final" / "adapter_config.json")["peft_type"] == "LORA"

    # What trained: base layers as Trainer.train saw them.
    bases = [m for m in record["linear"] if m["name"].endswith(".base_layer")]
    assert sorted(m["name"].split(".")[-2] for m in bases) == sorted(TARGETS * layers)
    adapters = [m for m in record["linear"] if ".lora_" in m["name"]]
    assert adapters and all(m["device"] == "cuda" for m in adapters)
    others = [m["name"] for m in record["linear"] if m not in bases and m not in adapters]
    assert all(name.endswith("lm_head") for name in others), others
    assert all(m["device"] == "cuda" for m in bases)
    if peft == "qlora":  # nf4: two 4-bit values per uint8, quant_state beside
        assert {(m["class"], m["weight"], m["dtype"]) for m in bases} == {
            ("bitsandbytes.nn.modules.Linear4bit", "Params4bit", "torch.uint8")}
    else:  # the frozen base in the compute dtype (bf16 on an Ampere or newer GPU)
        assert {(m["class"], m["dtype"]) for m in bases} == {
            ("torch.nn.modules.linear.Linear", DTYPES[environment["precision"]])}

"""LoRA on a mixture-of-experts model whose experts transformers 5 fuses into 3-D
parameters (config/fused_experts.py): peft's all-linear adapts them (and the router) as
parameters, which takes no dropout, so finetune's default dropout is one error naming the
ways out at validate (training's own check, for a hub model: tests/test_estimate_moe.py);
with dropout 0 the experts train and the adapter saves."""

from __future__ import annotations

import json

import pytest

from conftest import QUICKSTART, run_cli


def tiny_qwen3_moe(directory):
    from transformers import AutoTokenizer, Qwen3MoeConfig

    tokenizer = AutoTokenizer.from_pretrained(QUICKSTART / "tiny-llama")
    tokenizer.save_pretrained(directory)
    Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                   moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                   max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                   architectures=["Qwen3MoeForCausalLM"]).save_pretrained(directory)
    return directory


@pytest.mark.slow  # a CLI validate and a CLI training process
def test_lora_on_fused_experts_needs_no_dropout(write, tmp_path):
    model = tiny_qwen3_moe(tmp_path / "tiny-moe")
    config = write("exp.yaml", f"extends: {QUICKSTART / 'sft.yaml'}\n"
                               f"model: {{name_or_path: {model}, init: random}}\n"
                               "peft: {type: lora}\ntraining: {max_steps: 2}\n"
                               "evaluation: {exact_match: false}\n"
                               f"output: {{dir: {tmp_path / 'run'}}}\n")
    refused = run_cli("train", str(config), cwd=tmp_path)
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: {config}:3: peft.dropout: 0.05 cannot go with LoRA on qwen3_moe's experts, "
        "which peft adapts as fused parameters (peft.target_modules 'all-linear' reaches "
        "them) and without dropout: set "
        "peft.dropout: 0 to adapt the experts, or peft.target_modules: [q_proj, k_proj, "
        "v_proj, o_proj] to adapt the attention and leave the experts whole")

    trained = run_cli("train", str(config), "peft.dropout=0", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    adapter = json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == ["down_proj", "gate.weight", "gate_up_proj"]

"""Models with a recurrent state along the sequence (transformers' `_is_stateful`: Mamba,
Gated DeltaNet, ...) train on padded rows (config/stateful.py): in a flattened batch,
transformers' PyTorch code for their recurrent layers passes the state from one row to
the next, which the attention's varlen route cannot stop. Shown here on tiny models,
refused at validate when asked for, and kept off by the speed defaults, at validate for a
local model and once loaded for any."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from conftest import QUICKSTART, TINY_MODEL, run_cli

TOKENIZER = ("tokenizer.json", "tokenizer_config.json")


def tiny_qwen3_5_text(directory):
    """A tiny Qwen3.5 language model (Qwen3_5ForCausalLM: one Gated DeltaNet layer, one
    gated attention layer) on the quickstart's tokenizer, for `model.init: random`."""
    from transformers import Qwen3_5TextConfig

    vocab = json.loads((TINY_MODEL / "config.json").read_text())["vocab_size"]
    Qwen3_5TextConfig(
        architectures=["Qwen3_5ForCausalLM"], vocab_size=vocab, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"],
    ).save_pretrained(directory)
    for name in TOKENIZER:
        shutil.copy(TINY_MODEL / name, directory / name)
    return directory


def test_the_stateful_types_are_transformers_own():
    from finetune.config.stateful import stateful_model_types

    found = stateful_model_types()
    assert {"qwen3_5", "qwen3_5_text", "qwen3_next", "falcon_h1", "mamba", "mamba2",
            "jamba"} <= found
    assert not {"llama", "qwen3", "gemma3_text", "llava"} & found


@pytest.mark.slow  # builds three tiny models (and imports torch)
def test_a_flattened_batch_passes_the_state_between_rows():
    """Why: two rows flattened into one (restarting position_ids, finetune's varlen
    attention, as padding-free training runs them) against each row alone. A Llama's
    second row is itself; a Qwen3.5's and a Falcon-H1's are not, through their recurrent
    layers. When transformers stops this, padding-free could come back for them."""
    import torch
    from transformers import (AutoModelForCausalLM, FalconH1Config, LlamaConfig,
                              Qwen3_5TextConfig)

    from finetune.model.varlen import register

    register()
    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    configs = {"llama": LlamaConfig(**sizes),
               "qwen3_5_text": Qwen3_5TextConfig(
                   **sizes, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=16, linear_value_head_dim=16,
                   layer_types=["linear_attention", "full_attention"]),
               "falcon_h1": FalconH1Config(**sizes)}
    first, second = torch.randint(3, 128, (1, 12)), torch.randint(3, 128, (1, 9))
    positions = torch.cat([torch.arange(12), torch.arange(9)])[None]
    moved = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="finetune_varlen")
        with torch.no_grad():
            alone = model(input_ids=second, use_cache=False).logits
            flat = model(input_ids=torch.cat([first, second], 1), position_ids=positions,
                         use_cache=False).logits
        moved[name] = (flat[:, 12:] - alone).abs().max().item()
    assert moved["llama"] < 1e-5, moved
    assert moved["qwen3_5_text"] > 1e-3 and moved["falcon_h1"] > 1e-4, moved


@pytest.mark.slow  # trains (a few seconds)
def test_a_stateful_model_trains_padded_and_refuses_flattened_rows(write, tmp_path):
    model = tiny_qwen3_5_text(tmp_path / "qwen3_5")
    base = (f"method: sft\nmodel: {{name_or_path: {model}, init: random}}\n"
            f"data: {{train: {QUICKSTART / 'data' / 'sft_train.jsonl'}}}\n"
            "training: {max_steps: 2, per_device_train_batch_size: 4, max_length: 64}\n")
    config = write("sft.yaml", base)
    result = run_cli("train", config, "output.dir=run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [speed] = [line for line in result.stdout.splitlines() if line.startswith("  speed")]
    assert "padding_free" not in speed and "finetune_varlen" not in speed, speed
    for key in ("padding_free", "packing"):
        refused = run_cli("validate", config, f"training.{key}=true", cwd=tmp_path)
        assert refused.returncode == 2
        assert (f"training.{key}: not for model type qwen3_5_text: it carries a recurrent "
                "state along the sequence") in refused.stderr, refused.stderr


@pytest.mark.slow  # builds a tiny model (and imports torch, TRL)
def test_a_hub_model_found_stateful_once_loaded_is_padded_or_refused(tmp_path):
    """A hub model's config is not read at validate: the trainer's build looks at the
    loaded model, drops the padding-free speed default, and refuses a setting of it."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl import SFTConfig

    from finetune.config import load_experiment
    from finetune.errors import ConfigError
    from finetune.methods.sft import _padded_if_stateful

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(
        tiny_qwen3_5_text(tmp_path / "qwen3_5")))
    experiment = load_experiment(QUICKSTART / "sft.yaml")
    job = SimpleNamespace(model=model, experiment=experiment,
                          args=SFTConfig(str(tmp_path / "out"), padding_free=True, use_cpu=True,
                                        bf16=False))
    _padded_if_stateful(job)
    assert job.args.padding_free is False
    job.experiment = load_experiment(QUICKSTART / "sft.yaml", ["training.padding_free=true"])
    with pytest.raises(ConfigError) as caught:
        _padded_if_stateful(job)
    assert caught.value.problems[0].startswith(
        "training.padding_free: not for model type qwen3_5_text: it carries")

"""`finetune estimate` against the memory the same run really allocates on the GPU: a 0.2B
Llama (random weights, config written here), 4 rows x 1024 tokens, full fine-tuning without
activation checkpointing. The run is the real CLI in a process that reads
torch.cuda.max_memory_allocated() as it exits (helpers.OBSERVE); the estimate's tensor bytes
(its total less the CUDA context and the allocator's fragmentation, which the allocator's
count does not see) must be within -30 % / +15 % of that peak: an estimate may err high
more than low, since a low one lets a run start that then runs out of memory."""

from __future__ import annotations

import json
import random
import shutil

from conftest import QUICKSTART

from .helpers import CUDA, finetune, observed

GiB = 2 ** 30
MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
         "intermediate_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 16,
         "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048,
         "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
WORDS = "apple rose yak tree goat sun van".split()  # words of the tiny tokenizer


def experiment(tmp_path, model: dict, steps: int = 3, batch: int = 4, length: int = 1024):
    """The model directory (config + the quickstart tokenizer), 64 rows far longer than
    `length` (every row truncated to it), and the experiment file."""
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(model))
    for tokenizer_file in (QUICKSTART / "tiny-llama").glob("tokenizer*"):
        shutil.copy(tokenizer_file, directory)
    rng = random.Random(0)
    rows = [{"prompt": "sort: apple",
             "completion": " ".join(rng.choice(WORDS) for _ in range(2 * length))}
            for _ in range(64)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "exp.yaml"
    config.write_text(f"""name: est
method: sft
model: {{name_or_path: {directory}, init: random}}
data: {{train: {tmp_path / 'train.jsonl'}}}
output: {{dir: {tmp_path / 'run'}, plot: false}}
training: {{max_steps: {steps}, per_device_train_batch_size: {batch}, max_length: {length},
  save_steps: 1000, activation_checkpointing: false, logging_steps: 1}}
""")
    return config


def test_estimate_is_within_the_measured_peak(tmp_path, figures):
    config = experiment(tmp_path, MODEL)
    found = json.loads(finetune("estimate", config, CUDA, "--gpus", "1", "--json",
                                cwd=tmp_path, timeout=120).stdout)
    assert (found["settings"]["micro_batch"], found["settings"]["seq_len"]) == (4, 1024)
    estimate = found["configured"]
    _, record = observed("train", config, CUDA, cwd=tmp_path, timeout=300)
    peak = record["max_memory_allocated"]
    tensors = estimate["total_bytes"] - estimate["cuda_context_bytes"] - \
        estimate["fragmentation_bytes"]
    figures(estimate_tensors_gib=round(tensors / GiB, 2), measured_peak_gib=round(peak / GiB, 2),
            ratio=round(peak / tensors, 3),
            parts_gib={k: round(v / GiB, 2) for k, v in estimate["bytes"].items() if v})
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["global_step"] == 3 and estimate["activation_checkpointing"] is False
    assert 0.70 * tensors <= peak <= 1.15 * tensors, \
        f"estimate {tensors / GiB:.2f} GiB of tensors, measured peak {peak / GiB:.2f} GiB"

"""Data-parallel equivalence, measured: 2 processes x batch b (gloo, launched by
`finetune launch`) end with the same weights as 1 process x batch 2b and as 1 process x
batch b x accumulation 2 (fp32, SGD), for sft (through finetune_varlen), reward, dpo,
simpo, distill (greedy generation) and gkd (lmbda 0: on the data's completions). (orpo and cpo add an NLL term that TRL averages over each micro-batch's tokens, so
theirs is a mean of per-process means: equal only where the processes' token counts are;
their 2-process runs are checked by test_resume.py.)

The training set is exactly one global batch, so every step sees the same rows in every
layout whatever order the samplers draw them in; only the split across processes or
micro-batches differs."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import DATA, QUICKSTART, TINY_MODEL, free_port, run_cli
from teachers import tiny_teacher

pytestmark = pytest.mark.slow  # training runs on several processes

DATASETS = {"sft": "sft_train", "sft-vlm": "vlm_train", "reward": "pref_train", "dpo": "pref_train",
            "simpo": "pref_train", "distill": "sft_train", "gkd": "sft_train"}
# distill generates greedily here: sampled completions come from each process's own RNG
# stream (TRL seeds them apart), so only greedy ones are the same in every layout.
DISTILL = ("  max_completion_length: 8\n  generation_kwargs: {do_sample: false}\n"
           "distill: {teacher: TEACHER}\n")
GKD = "  lmbda: 0.0\n  max_length: 64\ndistill: {teacher: TEACHER}\n"
STEPS = 3
LAYOUTS = {  # name: (processes, per-device batch, accumulation)
    "ddp-2x2": (2, 2, 1),
    "single-1x4": (1, 4, 1),
    "accum-1x2x2": (1, 2, 2),
}


def experiment(method: str, processes: int, batch: int, accumulation: int) -> str:
    """method: a method's name, or sft-vlm: sft of the tiny LLaVA on rows with images
    (TRL's vision collator makes each batch, pixel values included)."""
    distributed = (f"distributed: {{strategy: ddp, num_processes: {processes}, device: cpu, "
                   f"main_process_port: {free_port()}}}\n" if processes > 1 else "")
    # sft runs finetune_varlen (padding-free rows as cu_seqlens, the reference kernel on the
    # CPU); the default sdpa path keeps its equivalences in test_launch and test_resume.
    attention = ", attn_implementation: finetune_varlen" if method == "sft" else ""
    model = QUICKSTART / "tiny-vlm" if method == "sft-vlm" else TINY_MODEL
    return (f"method: {method.removesuffix('-vlm')}\n"
            f"model: {{name_or_path: {model}, init: random{attention}}}\n"
            f"data:\n  train: {{path: {DATA}/{DATASETS[method]}.jsonl, max_samples: 4}}\n"
            f"{distributed}evaluation: {{before_training: false}}\n"
            f"output: {{plot: false}}\n"
            f"training:\n  max_steps: {STEPS}\n  per_device_train_batch_size: {batch}\n"
            f"  gradient_accumulation_steps: {accumulation}\n  optim: sgd\n"
            "  learning_rate: 0.1\n  lr_scheduler_type: constant\n  weight_decay: 0.0\n"
            "  max_grad_norm: 0.0\n  activation_checkpointing: false\n  logging_steps: 1\n"
            "  save_strategy: 'no'\n  seed: 3\n"
            + {"distill": DISTILL, "gkd": GKD}.get(method, ""))


def train(method: str, layout: str, write, tmp_path) -> dict[str, torch.Tensor]:
    processes, batch, accumulation = LAYOUTS[layout]
    text = experiment(method, processes, batch, accumulation)
    if method in ("distill", "gkd"):
        text = text.replace("TEACHER", str(tiny_teacher(tmp_path / "teacher")))
    config = write(f"{method}-{layout}.yaml", text)
    command = "launch" if processes > 1 else "train"
    result = run_cli(command, str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"x {processes} process(es)" in result.stdout
    # flattened rows on the varlen kernel: text sft only (a VLM's rows are padded)
    assert ("attention finetune_varlen" in result.stdout) is (method == "sft")
    run = tmp_path / "runs" / f"{method}-{layout}"
    return load_file(run / "final" / "model.safetensors"), load_file(
        run / "init-model" / "model.safetensors")


# One per loss normalisation: sft's token count (sft-vlm: through TRL's vision collator, and
# DDP with a vision tower part of which, CLIP's unused pooler, gets no gradient), reward's, dpo's pair mean, distill's
# generated completions, gkd's process scaling. simpo shares dpo's pair mean (exhaustive).
@pytest.mark.parametrize("method", ["sft", "sft-vlm", "reward", "dpo",
                                    pytest.param("simpo", marks=pytest.mark.exhaustive),
                                    "distill", "gkd"])
def test_data_parallel_and_accumulation_match_one_big_batch(method, write, tmp_path):
    runs = {layout: train(method, layout, write, tmp_path) for layout in LAYOUTS}
    reference, init = runs["single-1x4"]
    for layout, (weights, start) in runs.items():
        assert weights.keys() == reference.keys()
        worst_weight = worst_update = 0.0
        for name, ref in reference.items():
            assert torch.equal(start[name], init[name])  # same starting point
            if name.endswith("k_proj.bias"):  # sft-vlm: CLIP's (the vision tower's) key
                # biases. A key's bias adds the same to every score of a query, which
                # softmax cancels: its gradient is 0 but for rounding (~1e-11 here), which
                # differs between layouts; relative to it, any two runs differ
                assert (weights[name] - init[name]).abs().max() < 1e-8
                continue
            weight_err = ((weights[name] - ref).norm() / ref.norm()).item()
            update = ref - init[name]
            if update.norm() > 0:
                worst_update = max(worst_update, ((weights[name] - ref).norm()
                                                  / update.norm()).item())
            worst_weight = max(worst_weight, weight_err)
        print(f"{method} {layout}: weights rel. diff {worst_weight:.2e}, "
              f"update rel. diff {worst_update:.2e}")
        assert worst_weight <= 1e-5, (layout, worst_weight)
        assert worst_update <= 1e-3, (layout, worst_update)  # the steps themselves agree
    # the runs did train: the weights moved
    assert any(not torch.equal(reference[n], init[n]) for n in reference)

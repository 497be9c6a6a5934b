"""Weighted losses are exact: one SGD step (lr 1, no clipping) moves the weights by
exactly minus the gradient of sum(w x loss) / sum(w) over the global batch, computed here
by hand, sample by sample and without padding, in each of three layouts: one batch of 8,
4 accumulated micro-batches of 2, and 2 data-parallel processes x 2 x accumulation 2.

Rows differ in length and weight (some weigh 0), so a mean of per-micro-batch means, or a
per-rank normalisation, would be off by far more than the tolerance."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import (AutoModelForCausalLM, AutoModelForImageTextToText,
                          AutoModelForSequenceClassification, AutoProcessor, AutoTokenizer)
from trl.data_utils import prepare_multimodal_messages

from conftest import DATA, QUICKSTART, TINY_MODEL, free_port, run_cli

pytestmark = pytest.mark.slow  # training runs in every layout

TINY_VLM = QUICKSTART / "tiny-vlm"
LAYOUTS = {"single-1x8": (1, 8, 1), "accum-1x2x4": (1, 2, 4), "ddp-2x2x2": (2, 2, 2)}
WORDS = "apple cat dog sun moon tree hat lamp van egg owl pen".split()
LABELS = ["warm", "neutral", "cool"]


def _words(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 5 + k * 3) % len(WORDS)] for k in range(n))


def sft_rows() -> list[dict]:
    rows = []
    for i in range(8):
        turns = [{"role": "user", "content": f"q {_words(i, 2)}"},
                 {"role": "assistant", "content": _words(i + 1, 1 + i % 4),
                  "weight": [1.0, 0.5, 3.0, 0.0][i % 4]},
                 {"role": "user", "content": "again"},
                 {"role": "assistant", "content": _words(i + 2, 1 + (i * 3) % 5)}]
        rows.append({"messages": turns, "w": [1.0, 2.0, 0.0, 0.25][i % 4] + (i == 3)})
    return rows


def vlm_rows() -> list[dict]:
    """The quickstart's rows with images (absolute paths), every other one with a second
    exchange (rows of other lengths), whose first answer weighs its own (a turn weight)."""
    rows = [json.loads(line) for line in
            (DATA / "vlm_train.jsonl").read_text().splitlines()[:8]]
    for i, row in enumerate(rows):
        row["images"] = [str(DATA / path) for path in row["images"]]
        if i % 2:
            row["messages"][1]["weight"] = [0.5, 3.0, 0.0, 2.0][i % 4]
            row["messages"] += [{"role": "user", "content": [{"type": "text", "text": "and?"}]},
                                {"role": "assistant",
                                 "content": [{"type": "text", "text": _words(i, 1 + i % 3)}]}]
        row["w"] = [1.0, 2.0, 0.0, 0.25][i % 4] + (i == 3)
    return rows


def classify_rows() -> list[dict]:
    return [{"text": _words(i, 2 + i % 5), "label": LABELS[i % 3],
             "w": [1.0, 0.5, 2.0, 0.0][i % 4]} for i in range(8)]


def reward_rows() -> list[dict]:
    return [{"prompt": f"sort {_words(i, 3)}:", "chosen": " " + _words(i + 1, 1 + i % 3),
             "rejected": " " + _words(i + 5, 2 + i % 4), "w": [1.0, 3.0, 0.0, 0.5][i % 4]}
            for i in range(8)]


ROWS = {"sft": sft_rows, "sft-vlm": vlm_rows, "classify": classify_rows, "reward": reward_rows,
        "dpo": reward_rows}
EXTRA = {"classify": "classify: {labels: [warm, neutral, cool], class_weights: [1, 2, 3], "
                     "focal_gamma: 2.0, label_smoothing: 0.1}\n"}


def experiment(method: str, data: str, processes: int, batch: int, accumulation: int) -> str:
    distributed = (f"distributed: {{strategy: ddp, num_processes: {processes}, device: cpu, "
                   f"main_process_port: {free_port()}}}\n" if processes > 1 else "")
    model = TINY_VLM if method == "sft-vlm" else TINY_MODEL
    return (f"method: {method.removesuffix('-vlm')}\nmodel: {{name_or_path: {model}, "
            f"init: random}}\n"
            f"data: {{train: {data}, eval: {data}, weight_column: w}}\n{EXTRA.get(method, '')}"
            f"{distributed}evaluation: {{before_training: false}}\noutput: {{plot: false}}\n"
            f"training:\n  max_steps: 1\n  per_device_train_batch_size: {batch}\n"
            f"  gradient_accumulation_steps: {accumulation}\n  optim: sgd\n"
            "  learning_rate: 1.0\n  lr_scheduler_type: constant\n  weight_decay: 0.0\n"
            "  max_grad_norm: 0.0\n  logging_steps: 1\n  save_strategy: 'no'\n  seed: 5\n"
            + ("  assistant_only_loss: true\n" if method.startswith("sft") else ""))


def token_weights(row: dict, mask: list[int]) -> torch.Tensor:
    """Each token's weight: the row's times its assistant turn's (the k-th run of the
    template's {% generation %} mask is the k-th assistant turn), 0 outside the turns."""
    turns = [1.0 if m.get("weight") is None else m["weight"]
             for m in row["messages"] if m["role"] == "assistant"]
    weights, turn = [], -1
    for t, inside in enumerate(mask):
        turn += inside and (t == 0 or not mask[t - 1])
        weights.append(row["w"] * turns[turn] if inside else 0.0)
    return torch.tensor(weights)


def sft_loss(model, tokenizer, rows) -> torch.Tensor:
    """Per-turn weights located through the template's own {% generation %} markers."""
    numerator = denominator = 0
    for row in rows:
        plain = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
        encoded = tokenizer.apply_chat_template(plain, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
        ids = torch.tensor(encoded["input_ids"])
        logits = model(input_ids=ids[None]).logits[0, :-1]
        losses = F.cross_entropy(logits, ids[1:], reduction="none")
        weights = token_weights(row, encoded["assistant_masks"])[1:]
        numerator = numerator + (losses * weights).sum()
        denominator += weights.sum()
    return numerator / denominator


def vlm_loss(model, processor, rows) -> torch.Tensor:
    """Each row through the processor alone (its images, the template's {% generation %}
    markers), the row's weight times its turn's on every assistant token."""
    numerator = denominator = 0
    for row in rows:
        plain = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
        messages = prepare_multimodal_messages(plain, images=row["images"])
        encoded = processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_tensors="pt",
                                                return_assistant_tokens_mask=True)
        ids = encoded["input_ids"][0]
        logits = model(input_ids=ids[None], pixel_values=encoded["pixel_values"]).logits[0, :-1]
        losses = F.cross_entropy(logits, ids[1:], reduction="none")
        weights = token_weights(row, encoded["assistant_masks"][0].tolist())[1:]
        numerator = numerator + (losses * weights).sum()
        denominator += weights.sum()
    return numerator / denominator


def classify_loss(model, tokenizer, rows) -> torch.Tensor:
    class_weights, gamma, smoothing = [1.0, 2.0, 3.0], 2.0, 0.1
    numerator = denominator = 0
    for row in rows:
        ids = torch.tensor(tokenizer(row["text"])["input_ids"])
        log_p = model(input_ids=ids[None]).logits[0].log_softmax(-1)
        y = LABELS.index(row["label"])
        smoothed = (1 - smoothing) * -log_p[y] + smoothing * -log_p.mean()
        loss = (1 - log_p[y].exp()) ** gamma * smoothed
        weight = row["w"] * class_weights[y]
        numerator = numerator + weight * loss
        denominator += weight
    return numerator / denominator


def reward_loss(model, tokenizer, rows) -> torch.Tensor:
    numerator = denominator = 0
    for row in rows:
        score = lambda text: model(input_ids=torch.tensor(
            tokenizer(row["prompt"] + text + tokenizer.eos_token)["input_ids"])[None]).logits[0, 0]
        numerator = numerator - row["w"] * F.logsigmoid(score(row["chosen"]) - score(row["rejected"]))
        denominator += row["w"]
    return numerator / denominator


def _completion_logp(model, tokenizer, prompt: str, completion: str, start: int) -> torch.Tensor:
    ids = torch.tensor(tokenizer(prompt + completion + tokenizer.eos_token)["input_ids"])
    log_p = model(input_ids=ids[None]).logits[0, :-1].log_softmax(-1)
    return log_p.gather(1, ids[1:, None])[start - 1:].sum()


def dpo_loss(model, tokenizer, rows, beta: float = 0.1) -> torch.Tensor:
    """The reference is the starting policy: at the first step its log-probs equal the
    policy's, without gradient."""
    numerator = denominator = 0
    for row in rows:
        ids = lambda text: tokenizer(row["prompt"] + text + tokenizer.eos_token)["input_ids"]
        prompt = tokenizer(row["prompt"])["input_ids"]
        start = min(next((i for i, (a, b) in enumerate(zip(prompt, ids(c))) if a != b),
                         min(len(prompt), len(ids(c)))) for c in (row["chosen"], row["rejected"]))
        chosen, rejected = (_completion_logp(model, tokenizer, row["prompt"], c, start)
                            for c in (row["chosen"], row["rejected"]))
        delta = (chosen - chosen.detach()) - (rejected - rejected.detach())
        numerator = numerator - row["w"] * F.logsigmoid(beta * delta)
        denominator += row["w"]
    return numerator / denominator


HAND = {"dpo": (AutoModelForCausalLM, dpo_loss),"sft": (AutoModelForCausalLM, sft_loss),
        "sft-vlm": (AutoModelForImageTextToText, vlm_loss),
        "classify": (AutoModelForSequenceClassification, classify_loss),
        "reward": (AutoModelForSequenceClassification, reward_loss)}


def hand_gradient(method: str, init_dir, rows) -> dict[str, torch.Tensor]:
    auto_class, loss_fn = HAND[method]
    model = auto_class.from_pretrained(init_dir, dtype=torch.float32)
    tokenizer = AutoProcessor.from_pretrained(TINY_VLM) if method == "sft-vlm" else \
        AutoTokenizer.from_pretrained(TINY_MODEL)
    loss_fn(model, tokenizer, rows).backward()
    # CLIP's key biases (sft-vlm) are left out: a key's bias adds the same to every score
    # of a query, which softmax cancels, so their gradient is 0 but for rounding
    return {name: p.grad for name, p in model.named_parameters()
            if p.grad is not None and not name.endswith("k_proj.bias")}


def saved_weights(method: str, directory) -> dict[str, torch.Tensor]:
    """By the module's parameter names: a VLM's files hold its checkpoint's key names,
    which only from_pretrained maps back."""
    if method != "sft-vlm":
        return load_file(directory / "model.safetensors")
    return AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).state_dict()


# sft-vlm: the tiny LLaVA on rows with images, a weight per row and per turn (TRL's vision
# collator)
@pytest.mark.parametrize("method", ["sft", "sft-vlm", "classify", "reward", "dpo"])
def test_weighted_gradient_matches_hand_computation_in_every_layout(method, write, tmp_path):
    rows = ROWS[method]()
    data = write(f"{method}.jsonl", "\n".join(json.dumps(r) for r in rows))
    expected = None
    for layout, (processes, batch, accumulation) in LAYOUTS.items():
        config = write(f"{method}-{layout}.yaml",
                       experiment(method, str(data), processes, batch, accumulation))
        result = run_cli("launch" if processes > 1 else "train", str(config), cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        run = tmp_path / "runs" / f"{method}-{layout}"
        if expected is None:
            expected = hand_gradient(method, run / "init-model", rows)
        final, start = (saved_weights(method, run / name) for name in ("final", "init-model"))
        errors = {name: (start[name] - final[name]) - grad  # the step is lr x gradient, lr 1
                  for name, grad in expected.items()}
        total = (sum(e.norm() ** 2 for e in errors.values())
                 / sum(g.norm() ** 2 for g in expected.values())).sqrt().item()
        worst = max((errors[n].norm() / g.norm().clamp_min(1e-12)).item()
                    for n, g in expected.items())
        print(f"{method} {layout}: update vs hand gradient, relative error {total:.2e} "
              f"(worst tensor {worst:.2e})")
        assert total < 1e-5 and worst < 1e-3, (layout, total, worst)
        logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        loss = next(r["loss"] for r in logged if "loss" in r)
        assert math.isfinite(loss) and loss > 0
        # evaluation passes no divisor: each eval batch is normalised by its own weights
        after = json.loads((run / "summary.json").read_text())["after"]
        assert math.isfinite(after["eval_loss"]) and after["eval_loss"] > 0

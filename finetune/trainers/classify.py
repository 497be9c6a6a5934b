"""Sequence classification with class weights, focal loss, label smoothing and
per-sample weights, all through one weighted mean (finetune.trainers.weighted).

A sample's weight is its own (data.weight_column, default 1) times its class's weight, so
class weights reduce to PyTorch's weighted cross-entropy (sum w_y l / sum w_y), and stay
exact under gradient accumulation and data parallelism like every weighted loss here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import Trainer

from finetune import compat
from finetune.errors import DataError
from finetune.trainers.weighted import WeightedLoss


def balanced_weights(labels: list[int], classes: list[str]) -> list[float]:
    """sklearn's 'balanced': n_samples / (n_classes x count of the class)."""
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=len(classes))
    empty = [name for name, count in zip(classes, counts) if count == 0]
    if empty:
        raise DataError(f"classify.class_weights: balanced needs every class in the training "
                        f"data; none of {', '.join(empty)}")
    return [len(labels) / (len(classes) * int(count)) for count in counts]


def classification_losses(logits: torch.Tensor, labels: torch.Tensor, gamma: float,
                          smoothing: float) -> torch.Tensor:
    """Per-sample (label-smoothed) cross-entropy, scaled by (1 - p_true)^gamma (focal)."""
    logits = logits.float()
    losses = F.cross_entropy(logits, labels, reduction="none", label_smoothing=smoothing)
    if gamma:
        p_true = logits.softmax(-1).gather(1, labels[:, None]).squeeze(1)
        losses = (1 - p_true).pow(gamma) * losses
    return losses


def classification_metrics(classes: list[str]):
    def compute(prediction) -> dict[str, float]:
        logits, labels = prediction.predictions, prediction.label_ids
        predicted = np.asarray(logits).argmax(-1)
        labels = np.asarray(labels)
        metrics = {"accuracy": float((predicted == labels).mean())}
        f1s = []
        for index, name in enumerate(classes):
            tp = int(((predicted == index) & (labels == index)).sum())
            support = int((labels == index).sum())
            chosen = int((predicted == index).sum())
            recall = tp / support if support else 0.0
            precision = tp / chosen if chosen else 0.0
            f1s.append(2 * precision * recall / (precision + recall) if tp else 0.0)
            metrics[f"recall_{name}"] = recall
        metrics["macro_f1"] = float(np.mean(f1s))
        return metrics

    return compute


class ClassifyTrainer(WeightedLoss, Trainer):
    def __init__(self, *args, class_weights: list[float], focal_gamma: float,
                 label_smoothing: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.class_weights = torch.tensor(class_weights, dtype=torch.float32)
        self.focal_gamma, self.label_smoothing = focal_gamma, label_smoothing

    def _set_signature_columns_if_needed(self):  # compat.OVERRIDES
        if compat.signature_columns(self) is None:
            compat.set_signature_columns(self, ["input_ids", "attention_mask", "labels", "weight"])

    def sample_weights(self, batch: dict[str, Any]) -> torch.Tensor:
        labels = batch["labels"]
        weights = self.class_weights.to(labels.device)[labels]
        return weights * batch["weight"].to(weights.device) if "weight" in batch else weights

    def batch_weight(self, batch):
        return self.sample_weights(batch).sum()

    def weighted_losses(self, model, inputs):
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        losses = classification_losses(outputs.logits, inputs["labels"], self.focal_gamma,
                                       self.label_smoothing)
        return losses, self.sample_weights(inputs), outputs

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = compat.prepared_inputs(self, inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        if prediction_loss_only:
            return loss.detach(), None, None
        return loss.detach(), outputs.logits.detach(), inputs["labels"]

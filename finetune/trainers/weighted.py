"""Loss-weighted Trainer subclasses.

The loss of an optimizer step is sum(w x loss) / sum(w) over the GLOBAL batch: every
micro-batch of the gradient-accumulation window on every data-parallel rank. So one big
batch, accumulated micro-batches and several ranks give the same gradient. The Trainer
collects a step's micro-batches before the first forward (get_batch_samples); there we sum
their weights and all-reduce the sum over ranks, and hand it to compute_loss as
num_items_in_batch, the divisor the Trainer already threads through for this purpose.
Evaluation passes no divisor (None): each eval batch is then normalised by its own weights.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.nn.functional as F
from trl import DPOTrainer, RewardTrainer, SFTTrainer
from trl.trainer.utils import pad

from finetune import compat
from finetune.errors import ConfigError, RunError
from finetune.trainers.vision import VisionDPOTrainer, VisionSFTTrainer


class WeightedLoss:
    """Mixin: a subclass says what a batch's weights sum to and gives per-item losses
    with their weights; this class turns them into the global weighted mean."""

    # compute_loss divides by the whole window's weight, so the Trainer must not also
    # divide by the number of accumulation steps.
    loss_is_scaled_for_ga = True

    def batch_weight(self, batch: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    def weighted_losses(self, model, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(per-item losses, their weights, model outputs), same shapes for the first two."""
        raise NotImplementedError

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: torch.device) -> tuple[list, torch.Tensor]:
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        total = torch.zeros((), dtype=torch.float64, device=device)
        for batch in batches:
            total += self.batch_weight(batch).to(device=device, dtype=torch.float64)
        if self.accelerator.num_processes > 1:
            total = self.accelerator.reduce(total, reduction="sum")
        if batches and not total > 0:
            raise RunError(
                f"every loss weight in the global batch of step {self.state.global_step + 1} is 0 "
                "(or the batch has no trained tokens): the weighted mean is undefined. Check the "
                "weight column, or use a larger batch")
        return batches, total

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> None:
        return None  # evaluation: each batch is normalised by its own weights (compat.OVERRIDES)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        losses, weights, outputs = self.weighted_losses(model, inputs)
        weights = weights.to(losses.dtype)
        numerator = (losses * weights).sum()
        if num_items_in_batch is None:  # an eval batch, or a caller outside the train loop
            denominator = weights.sum()
            loss = numerator / denominator if denominator > 0 else numerator * 0
        else:
            loss = numerator / num_items_in_batch.to(losses.dtype)
            # Data parallelism averages gradients over ranks; the divisor is already global.
            loss = loss * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy per position (0 where the label is -100), in fp32."""
    shifted = logits[:, :-1].float()
    targets = labels[:, 1:]
    return F.cross_entropy(shifted.reshape(-1, shifted.size(-1)), targets.reshape(-1),
                           ignore_index=-100, reduction="none").view_as(targets)


def trained_token_weights(batch: dict[str, Any]) -> torch.Tensor:
    """Each predicted token's weight; 0 where nothing is trained."""
    return batch["token_weights"][:, 1:] * batch["labels"][:, 1:].ne(-100)


class WeightedSFTTrainer(WeightedLoss, SFTTrainer):
    """SFT on rows tokenized by finetune.data.sft_tokens: every trained token carries a
    weight (its row's weight x its turn's weight)."""

    def batch_weight(self, batch):
        return trained_token_weights(batch).sum()

    def weighted_losses(self, model, inputs):
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                        use_cache=False)
        return token_losses(outputs.logits, inputs["labels"]), trained_token_weights(inputs), outputs


class WithWeights:
    """Wraps a TRL collator: the batch also carries each row's weight."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, examples):
        batch = self.collator(examples)
        batch["weight"] = torch.tensor([float(e["weight"]) for e in examples])
        return batch


class KeepWeightColumn:
    """TRL drops dataset columns its collator does not know; keep the weights."""

    def _set_signature_columns_if_needed(self):  # compat.OVERRIDES
        super()._set_signature_columns_if_needed()
        columns = compat.signature_columns(self)
        if "weight" not in columns:
            compat.set_signature_columns(self, [*columns, "weight"])


class WeightedVisionSFTTrainer(KeepWeightColumn, WeightedLoss, VisionSFTTrainer):
    """SFT of a vision-language model with a weight per row (data.weight_column): TRL's
    vision collator makes the batch, RowWeightsOnTokens gives each of a row's tokens its
    row's weight; the loss is WeightedSFTTrainer's over the same trained tokens."""

    def batch_weight(self, batch):
        return trained_token_weights(batch).sum()

    def weighted_losses(self, model, inputs):
        given = {k: v for k, v in inputs.items() if k not in ("labels", "token_weights")}
        outputs = model(**given, use_cache=False)
        return token_losses(outputs.logits, inputs["labels"]), trained_token_weights(inputs), outputs


class RowWeightsOnTokens:
    """Wraps a vision collator: every token of a row carries its row's `weight` (1 without
    one) times, inside an assistant turn, the turn's own `weight` (a message's, 1 without
    one; trained_token_weights keeps the trained tokens). The collator trains the
    assistant turns only (training.assistant_only_loss), so its k-th run of trained
    tokens is the row's k-th assistant turn; a row cut by max_length has fewer."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, rows):
        batch = self.collate(rows)
        weights = torch.tensor([float(row.get("weight", 1.0)) for row in rows])
        tokens = weights[:, None].expand_as(batch["labels"]).clone()
        for i, row in enumerate(rows):
            turns = [1.0 if m.get("weight") is None else float(m["weight"])
                     for m in row.get("messages") or () if m["role"] == "assistant"]
            if any(w != 1.0 for w in turns):
                tokens[i] *= _turn_weights(batch["labels"][i] != -100, turns)
        batch["token_weights"] = tokens
        return batch


def _turn_weights(trained: torch.Tensor, turns: list[float]) -> torch.Tensor:
    """Each run of trained tokens weighed by its turn's weight (1 elsewhere)."""
    starts = (trained & ~torch.cat((trained.new_zeros(1), trained[:-1]))).cumsum(0)
    runs = int(starts.max()) if len(starts) else 0
    if runs > len(turns):
        raise RunError(f"a row's trained tokens form {runs} runs for {len(turns)} assistant "
                       "turns: its per-turn weights cannot be placed (an image inside an "
                       "assistant turn?)")
    out = torch.ones(len(trained))
    for k, weight in enumerate(turns[:runs]):
        out[trained & (starts == k + 1)] = weight
    return out


class WeightedRewardTrainer(KeepWeightColumn, WeightedLoss, RewardTrainer):
    """Reward modeling with a weight per preference pair."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.data_collator = WithWeights(self.data_collator)

    def batch_weight(self, batch):
        return batch["weight"].sum()

    def weighted_losses(self, model, inputs):
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                        use_cache=False)
        chosen, rejected = torch.chunk(outputs.logits.squeeze(-1).float(), chunks=2)
        margin = inputs.get("margin", 0.0)
        losses = -F.logsigmoid(chosen - rejected - margin)
        if self.args.center_rewards_coefficient is not None:
            losses = losses + self.args.center_rewards_coefficient * (chosen + rejected) ** 2
        mode = "train" if model.training else "eval"
        with torch.no_grad():
            accuracy = (chosen > rejected).float().mean()
            compat.log_metric(self, mode, "accuracy",
                              self.accelerator.gather_for_metrics(accuracy).mean().item())
            compat.log_metric(self, mode, "margin", self.accelerator.gather_for_metrics(
                (chosen - rejected).mean()).mean().item())
        return losses, inputs["weight"], outputs


class WeightedDPOTrainer(KeepWeightColumn, WeightedLoss, DPOTrainer):
    """DPO with a weight per preference pair: the standard sigmoid loss (with TRL's
    label smoothing), computed from TRL's own per-token log-probabilities."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        unsupported = [f"{name}={value!r}" for name, value, plain in (
            ("loss_type", self.loss_types, ["sigmoid"]), ("f_divergence_type",
            self.f_divergence_type, "reverse_kl"), ("ld_alpha", self.ld_alpha, None),
            ("use_weighting", self.use_weighting, False)) if value != plain]
        if unsupported or self.aux_loss_enabled:
            raise ConfigError([f"data.weight_column: weighted dpo supports the standard sigmoid "
                               f"loss only; these training settings are not: "
                               f"{', '.join(unsupported) or 'router aux loss'}"])
        self.data_collator = WithWeights(self.data_collator)

    def _sequence_logps(self, model, inputs, labels):
        keep = {k: v for k, v in inputs.items()
                if k not in ("completion_mask", "ref_chosen_logps", "ref_rejected_logps", "weight")}
        outputs = model(**keep, labels=labels, use_cache=False, fused_lm_head=True)
        width = inputs["completion_mask"].size(1) - 1
        return outputs.log_probs[:, -width:].sum(dim=1), outputs

    def batch_weight(self, batch):
        return batch["weight"].sum()

    def weighted_losses(self, model, inputs):
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        logps, outputs = self._sequence_logps(model, inputs, labels)
        chosen, rejected = logps.float().chunk(2, dim=0)
        if self.precompute_ref_logps:
            ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        else:
            ref_chosen, ref_rejected = self.compute_ref_log_probs(
                self.ref_model if self.ref_model is not None else model, inputs)
        delta = self.beta * ((chosen - ref_chosen.float()) - (rejected - ref_rejected.float()))
        smoothing = self.label_smoothing
        losses = -(1 - smoothing) * F.logsigmoid(delta) - smoothing * F.logsigmoid(-delta)
        mode = "train" if model.training else "eval"
        with torch.no_grad():
            gather = self.accelerator.gather_for_metrics
            compat.log_metric(self, mode, "rewards/accuracies",
                              gather((delta > 0).float()).mean().item())
            compat.log_metric(self, mode, "rewards/margins", gather(delta / self.beta).mean().item())
        return losses, inputs["weight"], outputs


class WeightedVisionDPOTrainer(WeightedDPOTrainer, VisionDPOTrainer):
    """Weighted dpo of a vision-language model: TRL's vision preference collator makes the
    batch (its pixel values reach the policy and the reference with the ids), WithWeights
    adds each pair's weight."""


def pad_batch(features: list[dict[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad tokenized rows: input_ids, attention_mask, labels (-100), token_weights (0)."""
    ids = [torch.tensor(f["input_ids"]) for f in features]
    return {
        "input_ids": pad(ids, padding_value=pad_token_id, padding_side="right"),
        "attention_mask": pad([torch.ones_like(i) for i in ids], padding_value=0,
                              padding_side="right"),
        "labels": pad([torch.tensor(f["labels"]) for f in features], padding_value=-100,
                      padding_side="right"),
        "token_weights": pad([torch.tensor(f["token_weights"], dtype=torch.float32)
                              for f in features], padding_value=0.0, padding_side="right"),
    }

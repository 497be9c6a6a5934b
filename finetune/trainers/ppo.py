"""PPO of our own (TRL removed its PPOTrainer in 1.13), as a transformers Trainer so run
directory, checkpoints, signals, resume, DDP and our callbacks work as for every method.

One optimizer step is one PPO mini-batch update. Per process a rollout samples
P = rollout_batches x per_device_train_batch_size x gradient_accumulation_steps prompts;
then ppo_epochs passes over it, each split into rollout_batches mini-batches of
gradient_accumulation_steps micro-batches. A rollout is one "cycle" of
R = ppo_epochs x rollout_batches x gradient_accumulation_steps micro-steps, and gives
ppo_epochs x rollout_batches optimizer steps. As in TRL's GRPOTrainer, every dataloader
batch is the whole per-process rollout batch, repeated R times by the sampler
(ppo_rollout.RolloutSampler); the first micro-step of a cycle generates and scores, the
others take their slice of the buffered rollout.

Every checkpoint keeps, per rank, the rollout buffer, the KL coefficient and the open
window of logged statistics (the "ppo" part of finetune's state record,
checkpoint_state.py), so a run stopped at any optimizer step, mid-cycle too, resumes
bitwise (the Trainer restores weights, optimizer, scheduler, RNG and the data position).

evaluate() samples responses for the eval prompts with the rollout's sampler
(temperature, top_k, top_p) from a fixed seed, in a forked RNG so training's random
stream is untouched, and reports the mean reward (score) and KL to the reference.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from finetune import compat
from finetune.errors import RunError
from finetune.trainers import ppo_math
from finetune.trainers.ppo_model import PolicyAndValue
from finetune.trainers.ppo_rollout import (Rewards, RolloutSampler, eos_ids, finish, sample,
                                           sequences, token_entropy, token_logprobs,
                                           tokenize_prompts)

TRAIN_STATS = ("ppo/policy_loss", "ppo/value_loss", "ppo/clipfrac_policy",
               "ppo/clipfrac_value", "ppo/approx_kl")
ROLLOUT_TENSORS = ("input_ids", "attention_mask", "position_ids", "response_mask",
                   "logprobs", "values", "advantages", "returns", "perms", "norms")


def _identity(rows: list[dict]) -> list[dict]:
    return rows


class _SamplerEpoch(TrainerCallback):
    """Sets the rollout sampler's epoch before each epoch's data is drawn. The Trainer's
    own set_epoch does not reach a sampler under a resumed (batch-skipping) data loader
    with several processes; state.epoch is epoch + fraction done, also after a resume."""

    def __init__(self, trainer: "PPOTrainer"):
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.trainer.rollout_sampler is not None:
            self.trainer.rollout_sampler.set_epoch(int(state.epoch or 0))


class PPOTrainer(Trainer):
    # compute_loss divides by the mini-batch's token count (over all ranks) itself.
    loss_is_scaled_for_ga = True
    state_part = "ppo"  # in finetune's state record (callbacks.ResumeState)

    def __init__(self, model: PolicyAndValue, ref_model, spec, rewards: Rewards, args,
                 train_dataset, eval_dataset, tokenizer, callbacks):
        args.remove_unused_columns = False  # prompts and the reward functions' columns stay
        super().__init__(model=model, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=tokenizer,
                         data_collator=_identity, callbacks=callbacks)
        self.spec, self.rewards = spec, rewards
        self.ref_model = ref_model.to(args.device) if ref_model is not None else None
        if rewards.model is not None:
            rewards.model.to(args.device)
        self.eos = eos_ids(tokenizer, model.policy)
        if not self.eos:
            raise RunError("ppo: the tokenizer has no EOS token; responses could never end")
        ga = args.gradient_accumulation_steps
        self.micro_size = args.per_device_train_batch_size
        self.mini_size = self.micro_size * ga
        self.rollout_size = spec.rollout_batches * self.mini_size  # P, per process
        self.cycle = spec.ppo_epochs * spec.rollout_batches * ga  # micro-steps per rollout
        self.steps_per_rollout = spec.ppo_epochs * spec.rollout_batches
        needed = self.rollout_size * args.world_size
        if len(train_dataset) < needed:
            raise RunError(
                f"ppo: a rollout takes rollout_batches x per_device_train_batch_size x "
                f"gradient_accumulation_steps x processes = {needed} prompts; the training "
                f"data has {len(train_dataset)}")
        self.kl_coef = float(spec.kl_coef)
        self.rollout: dict[str, Any] | None = None
        self._micro: int | None = None
        self._position = 0
        self._stats = torch.zeros(len(TRAIN_STATS), dtype=torch.float64)
        self._stat_steps = 0
        self.rollout_sampler: RolloutSampler | None = None
        self.add_callback(_SamplerEpoch(self))

    # ---- data: the whole per-process rollout batch, repeated once per micro-step ----

    def get_train_dataloader(self):
        return compat.dataloader(self, self.train_dataset, "Training", self.rollout_size,
                                 self._new_rollout_sampler, is_training=True)

    def _new_rollout_sampler(self, dataset) -> RolloutSampler:
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        self.rollout_sampler = RolloutSampler(
            len(dataset), self.rollout_size * self.args.world_size, self.cycle, seed)
        return self.rollout_sampler

    # ---- rollouts ----

    def train(self, *args, **kwargs):
        self._micro = None  # set from the (possibly resumed) global step
        return super().train(*args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._micro is None:
            self._micro = self.state.global_step * self.args.gradient_accumulation_steps
        self._position = self._micro % self.cycle
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._micro += 1
        if (self._position + 1) % self.args.gradient_accumulation_steps == 0:
            self._stat_steps += 1
        return loss

    def _prepare_inputs(self, inputs):
        prompts = [row["prompt"] for row in inputs]
        if self._position == 0 or self.rollout is None:
            if self.rollout is None and self._position != 0:
                warnings.warn("ppo: no rollout buffer for this rank in the checkpoint (another "
                              "number of processes?): generating a new rollout mid-cycle")
            self.rollout = self._make_rollout(inputs)
        elif prompts != self.rollout["prompts"]:
            raise RunError("ppo: the dataloader's batch is not the buffered rollout's prompts "
                           "(the data order changed since the rollout was made)")
        return self._micro_batch(self._position)

    def _micro_batch(self, position: int) -> dict[str, Any]:
        ga = self.args.gradient_accumulation_steps
        epoch = position // (self.spec.rollout_batches * ga)
        mini = (position // ga) % self.spec.rollout_batches
        micro = position % ga
        start = mini * self.mini_size + micro * self.micro_size
        rows = self.rollout["perms"][epoch, start:start + self.micro_size]
        batch = {name: self.rollout[name][rows] for name in
                 ("input_ids", "attention_mask", "position_ids", "response_mask", "logprobs",
                  "values", "advantages", "returns")}
        batch["norm"] = self.rollout["norms"][epoch, mini]
        return batch

    def _forward_logits(self, policy, ids, mask, positions, length: int) -> torch.Tensor:
        keep = length + 1
        out = policy(input_ids=ids, attention_mask=mask, position_ids=positions,
                     use_cache=False, logits_to_keep=keep)
        return out.logits[:, -keep:-1]

    @torch.no_grad()
    def _sample_and_score(self, rows: list[dict], with_values: bool) -> dict[str, Any]:
        """Generate for `rows`, then old and reference logprobs, values and scores."""
        tokenizer, spec, device = self.processing_class, self.spec, self.args.device
        model = self.model
        policy = model.policy
        prompts = [row["prompt"] for row in rows]
        columns = {k: [row[k] for row in rows] for k in rows[0] if k != "prompt"}
        with self.accelerator.autocast():
            prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, device)
            tokens = sample(policy, tokenizer, prompt_ids, prompt_mask, spec, self.eos)
        responses = finish(tokenizer, tokens, self.eos, list(spec.stop_strings))
        ids, mask, positions = sequences(prompt_ids, prompt_mask, responses)
        length = responses.ids.shape[1]
        logprobs, ref_logprobs, values, entropy = [], [], [], []
        for start in range(0, len(rows), self.micro_size):
            part = slice(start, start + self.micro_size)
            args = (ids[part], mask[part], positions[part])
            response = responses.ids[part]
            with self.accelerator.autocast():
                if with_values:
                    logits, value = model(*args, response_length=length)
                    values.append(value.float())
                else:
                    logits = self._forward_logits(policy, *args, length)
                logprobs.append(token_logprobs(logits, response, spec.temperature))
                entropy.append(token_entropy(logits, spec.temperature))
                del logits
                if self.ref_model is not None:
                    ref_logits = self._forward_logits(self.ref_model, *args, length)
                else:
                    with policy.disable_adapter():
                        ref_logits = self._forward_logits(policy, *args, length)
                ref_logprobs.append(token_logprobs(ref_logits, response, spec.temperature))
                del ref_logits
        completion_ids = [row[:int(n)] for row, n in
                          zip(responses.ids.tolist(), responses.mask.sum(1).tolist())]
        scores, totals = self.rewards(prompts, responses.texts, completion_ids, columns,
                                      device, self.micro_size, trainer_state=self.state)
        if spec.missing_eos_penalty is not None:
            missing = torch.tensor([not e for e in responses.ended], device=device)
            scores = scores - spec.missing_eos_penalty * missing.float()
        return {"prompts": prompts, "input_ids": ids, "attention_mask": mask,
                "position_ids": positions, "response_mask": responses.mask,
                "logprobs": torch.cat(logprobs), "ref_logprobs": torch.cat(ref_logprobs),
                "values": torch.cat(values) if values else None,
                "entropy": torch.cat(entropy), "scores": scores,
                "ended": torch.tensor(responses.ended, dtype=torch.float64),
                "source_totals": totals}

    def _make_rollout(self, rows: list[dict]) -> dict[str, Any]:
        spec, device = self.spec, self.args.device
        was_training = self.model.training
        self.model.eval()
        try:
            got = self._sample_and_score(rows, with_values=True)
        finally:
            self.model.train(was_training)
        mask = got["response_mask"].float()
        kl_tokens = (got["logprobs"] - got["ref_logprobs"]) * mask
        rewards = -self.kl_coef * kl_tokens
        last = mask.sum(1).long() - 1
        rewards[torch.arange(len(rows), device=mask.device), last] += got["scores"]
        values = got["values"] * mask
        advantages, returns = ppo_math.gae(rewards, values, mask, spec.gamma, spec.lam)
        if spec.whiten_advantages:
            advantages = ppo_math.whiten(advantages, mask, device=device)

        # Statistics of the global rollout.
        totals = got["source_totals"]
        sums = ppo_math.global_sum(
            len(rows), float(got["scores"].sum()), float(kl_tokens.sum()),
            float((got["entropy"] * mask).sum()), float(mask.sum()), float(got["ended"].sum()),
            *totals.values(), device=device)
        n, score, kl, entropy, tokens, ended = sums[:6]
        metrics = {"ppo/reward_mean": score / n, "ppo/kl": kl / n, "ppo/entropy": entropy / tokens,
                   "ppo/kl_coef": self.kl_coef, "ppo/response_length": tokens / n,
                   "ppo/eos_fraction": ended / n,
                   "ppo/explained_variance": ppo_math.explained_variance(values, returns, mask,
                                                                         device=device)}
        metrics.update({name: s / n for name, s in zip(totals, sums[6:])})
        if spec.kl_target is not None:
            self.kl_coef = ppo_math.adaptive_kl(self.kl_coef, kl / n, spec.kl_target,
                                                spec.kl_horizon, int(n))

        # Mini-batch order per PPO epoch (own generator: the global RNG is left alone) and
        # each mini-batch's token count over all ranks, the loss's normaliser.
        index = self.state.global_step // self.steps_per_rollout
        generator = torch.Generator().manual_seed(
            (self.args.seed * 1_000_003 + index) * 1009 + self.args.process_index)
        perms = torch.stack([torch.randperm(len(rows), generator=generator)
                             for _ in range(spec.ppo_epochs)])
        lengths = mask.sum(1).cpu()
        local = torch.tensor([[float(lengths[p[m * self.mini_size:(m + 1) * self.mini_size]].sum())
                               for m in range(spec.rollout_batches)] for p in perms])
        norms = torch.tensor(ppo_math.global_sum(*local.flatten().tolist(), device=device),
                             dtype=torch.float32).view_as(local) / self.args.world_size
        return {"prompts": got["prompts"], "input_ids": got["input_ids"],
                "attention_mask": got["attention_mask"], "position_ids": got["position_ids"],
                "response_mask": got["response_mask"], "logprobs": got["logprobs"],
                "values": values, "advantages": advantages, "returns": returns,
                "perms": perms.to(device), "norms": norms.to(device), "metrics": metrics}

    # ---- the loss ----

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        spec = self.spec
        mask = inputs["response_mask"]
        length = mask.shape[1]
        logits, values = model(input_ids=inputs["input_ids"],
                               attention_mask=inputs["attention_mask"],
                               position_ids=inputs["position_ids"], response_length=length)
        response = inputs["input_ids"][:, -length:]
        logprobs = token_logprobs(logits, response, spec.temperature)
        policy, policy_clipped = ppo_math.clipped_policy_loss(
            logprobs, inputs["logprobs"], inputs["advantages"], mask, spec.cliprange)
        value, value_clipped = ppo_math.clipped_value_loss(
            values.float(), inputs["values"], inputs["returns"], mask, spec.cliprange_value)
        norm = inputs["norm"]
        loss = (policy.sum() + spec.vf_coef * value.sum()) / norm
        with torch.no_grad():
            approx_kl = 0.5 * ((logprobs - inputs["logprobs"]) ** 2 * mask).sum()
            step = torch.stack([policy.sum(), value.sum(), policy_clipped.sum(),
                                value_clipped.sum(), approx_kl]) / norm
            self._stats += step.double().cpu()
        return (loss, (logits, values)) if return_outputs else loss

    # ---- logging ----

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.rollout is not None:
            # Every rank logs at the same step: the statistics are averaged over ranks.
            steps = max(self._stat_steps, 1)
            means = ppo_math.global_sum(*(self._stats / steps).tolist(), device=self.args.device)
            logs.update({name: value / self.args.world_size
                         for name, value in zip(TRAIN_STATS, means)})
            logs.update(self.rollout["metrics"])
            self._stats.zero_()
            self._stat_steps = 0
        super().log(logs, start_time)

    # ---- evaluation ----

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        rank, world = self.args.process_index, self.args.world_size
        indices = list(range(rank, len(dataset), world))
        batch = self.args.per_device_eval_batch_size
        device = self.args.device
        n = score = kl = tokens = ended = 0.0
        was_training = self.model.training
        self.model.eval()
        devices = [device] if torch.device(device).type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(self.args.seed)
                for start in range(0, len(indices), batch):
                    rows = [dataset[i] for i in indices[start:start + batch]]
                    got = self._sample_and_score(rows, with_values=False)
                    mask = got["response_mask"].float()
                    n += len(rows)
                    score += float(got["scores"].sum())
                    kl += float(((got["logprobs"] - got["ref_logprobs"]) * mask).sum())
                    tokens += float(mask.sum())
                    ended += float(got["ended"].sum())
        finally:
            self.model.train(was_training)
        n, score, kl, tokens, ended = ppo_math.global_sum(n, score, kl, tokens, ended,
                                                          device=device)
        n = max(n, 1.0)
        metrics = {f"{metric_key_prefix}_reward_mean": score / n,
                   f"{metric_key_prefix}_kl": kl / n,
                   f"{metric_key_prefix}_response_length": tokens / n,
                   f"{metric_key_prefix}_eos_fraction": ended / n,
                   f"{metric_key_prefix}_samples": int(n)}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control,
                                                         metrics)
        return metrics

    # ---- saving and resuming ----

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.model.save(output_dir, main=True)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _load_best_model(self) -> None:  # load_best_model_at_end: our checkpoint format
        self.model.load(self.state.best_model_checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        self.model.load(resume_from_checkpoint)

    def state_to_save(self) -> dict[str, Any]:
        rollout = None
        if self.rollout is not None:
            rollout = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in self.rollout.items()}
        return {"kl_coef": self.kl_coef, "world_size": self.args.world_size,
                "rollout_size": self.rollout_size, "cycle": self.cycle,
                "rollout": rollout, "stats": self._stats.clone(),
                "stat_steps": self._stat_steps}

    def restore_state(self, saved: dict[str, Any] | None, own: bool) -> None:
        """`own`: saved by this rank; else by rank 0 (more processes now), whose KL
        coefficient (the same on every rank) goes on, but not its rollout."""
        if saved is None:
            warnings.warn("ppo: the checkpoint has no PPO state; the KL coefficient starts "
                          "from ppo.kl_coef again")
            return
        self.kl_coef = float(saved["kl_coef"])
        same = (own and saved["world_size"] == self.args.world_size
                and saved["rollout_size"] == self.rollout_size and saved["cycle"] == self.cycle)
        if same and saved["rollout"] is not None:
            device = self.args.device
            self.rollout = {k: (v.to(device) if torch.is_tensor(v) and k in ROLLOUT_TENSORS
                                else v) for k, v in saved["rollout"].items()}
            self._stats = saved["stats"].clone()
            self._stat_steps = int(saved["stat_steps"])
        else:
            self.rollout = None

"""A frozen vision tower runs without autograd: nothing of it is kept for a backward, and
no backward runs through it.

Left alone it would: with activation checkpointing on, transformers'
enable_input_require_grads hooks the input embeddings of every PreTrainedModel inside the
model, the tower's patch embedding too, so a frozen tower's output requires grad and the
backward recomputes its checkpointed layers and runs through them for no gradient. The
Trainer calls it as it turns checkpointing on, TRL's trainers under PEFT in __init__,
peft's prepare_model_for_kbit_training under QLoRA, and TRL's dpo and grpo again after
every reference forward and generation (each time checkpointing comes back on), each
time adding hooks and dropping the previous ones out of reach of
disable_input_require_grads. So instead of undoing those hooks, the tower's forward runs
with autograd off (its own forward pre-hook and forward hook), whatever is hooked inside
it: the language model's input embeddings stay hooked as the library hooks them, and a
trained projector still gets its gradient (it needs none from the tower).

A tower with anything to train (LoRA on it, freeze_tower false) is left as it is."""

from __future__ import annotations

import torch


def frozen_tower(model) -> torch.nn.Module | None:
    """The model's vision tower when none of its parameters trains; None where it trains
    or transformers' get_encoder(modality="image") finds none."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT's
    tower = base.get_encoder(modality="image")
    if tower is base or tower is getattr(base, "base_model", None):
        return None
    return None if any(p.requires_grad for p in tower.parameters()) else tower


class WithoutAutograd:
    """Hooks on a module that run its forward with autograd off and restore the mode
    after (even when the forward raises)."""

    def __init__(self, module: torch.nn.Module):
        self.modes: list[bool] = []
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._leave, always_call=True)

    def _enter(self, module, args) -> None:
        self.modes.append(torch.is_grad_enabled())
        torch.set_grad_enabled(False)

    def _leave(self, module, args, output) -> None:
        if self.modes:
            torch.set_grad_enabled(self.modes.pop())


def keep_frozen_tower_out_of_autograd(model) -> None:
    """For a vision-language model whose trainable parameters are decided (after freezing
    or PEFT): a frozen tower runs without autograd."""
    tower = frozen_tower(model)
    if tower is not None:
        WithoutAutograd(tower)

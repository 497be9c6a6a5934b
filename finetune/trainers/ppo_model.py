"""The one module PPO trains: the policy plus its value estimate, so one optimizer, one
scheduler and one checkpoint cover every trainable parameter.

value_model separate: a backbone of its own (AutoModel of the policy's base, or of
ppo.value_model_path) with a linear head giving one value per token. shared: a linear head
on the policy's last hidden states. Saved as the policy the usual way (full model, or the
peft adapter and its config) with the value part in value/: the separate backbone as an
AutoModel directory plus value/value_head.safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from finetune.model.load import load_full_weights, load_weights

VALUE_DIR = "value"
HEAD_FILE = "value_head.safetensors"
KIND_FILE = "value.json"


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def new_head(hidden: int, seed: int) -> nn.Linear:
    """A value head initialised from its own generator: the global RNG stays untouched."""
    head = nn.Linear(hidden, 1)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0 / (hidden + 1) ** 0.5, generator=generator)
        head.bias.zero_()
    return head


class PolicyAndValue(nn.Module):
    """forward -> (logits, values) at the positions that predict the last
    `response_length` tokens of each row (prompts left-padded, responses right-padded)."""

    def __init__(self, policy: nn.Module, head: nn.Linear, backbone: nn.Module | None = None):
        super().__init__()
        self.policy = policy
        self.value_head = head
        self.value_backbone = backbone  # None: shared, the head reads the policy's states
        quantization = getattr(getattr(policy, "base_model", policy), "quantization_method", None) \
            or getattr(policy, "quantization_method", None)
        if quantization is not None:  # bitsandbytes models refuse .to(); the Trainer asks
            self.quantization_method = quantization

    @property
    def shared(self) -> bool:
        return self.value_backbone is None

    def forward(self, input_ids, attention_mask, position_ids, response_length: int):
        keep = response_length + 1
        out = self.policy(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=False,
                          output_hidden_states=self.shared, logits_to_keep=keep)
        logits = out.logits[:, -keep:-1]
        if self.shared:
            hidden = out.hidden_states[-1][:, -keep:-1]
        else:
            hidden = self.value_backbone(input_ids=input_ids, attention_mask=attention_mask,
                                         position_ids=position_ids, use_cache=False
                                         ).last_hidden_state[:, -keep:-1]
        values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)
        return logits, values

    # The Trainer switches activation checkpointing on through the model it trains.
    def activation_checkpointing_enable(self, **kwargs):
        for part in (self.policy, self.value_backbone):
            if part is not None:
                if hasattr(part, "activation_checkpointing_enable"):
                    part.activation_checkpointing_enable(**kwargs)
                else:
                    part.gradient_checkpointing_enable()
        if _is_peft(self.policy) and hasattr(self.policy, "enable_input_require_grads"):
            self.policy.enable_input_require_grads()

    gradient_checkpointing_enable = activation_checkpointing_enable

    # ---- saving and loading ----

    def save(self, directory: str | Path, main: bool) -> None:
        directory = Path(directory)
        self.policy.save_pretrained(str(directory), is_main_process=main)
        if not main:
            return
        value_dir = directory / VALUE_DIR
        value_dir.mkdir(parents=True, exist_ok=True)
        if not self.shared:
            self.value_backbone.save_pretrained(str(value_dir))
        save_file({k: v.detach().contiguous() for k, v in self.value_head.state_dict().items()},
                  str(value_dir / HEAD_FILE), metadata={"format": "pt"})
        (value_dir / KIND_FILE).write_text(json.dumps(
            {"value_model": "shared" if self.shared else "separate",
             "hidden_size": self.value_head.in_features}) + "\n")

    def load(self, directory: str | Path) -> None:
        """Load weights written by save() (a checkpoint) into this module, in place."""
        directory = Path(directory)
        load_weights(self.policy, directory)
        value_dir = directory / VALUE_DIR
        kind = json.loads((value_dir / KIND_FILE).read_text())["value_model"]
        if kind != ("shared" if self.shared else "separate"):
            raise ValueError(f"{directory} holds a {kind} value model; this run has "
                             f"{'shared' if self.shared else 'separate'}")
        self.value_head.load_state_dict(load_file(str(value_dir / HEAD_FILE)))
        if not self.shared:
            load_full_weights(self.value_backbone, value_dir)


def value_backbone(source: str, dtype: torch.dtype, trust_remote_code: bool, revision=None):
    from transformers import AutoModel

    kwargs = {"revision": revision} if revision else {}
    return AutoModel.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code,
                                     **kwargs)


def hidden_size(config) -> int:
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None)
        if value is None and hasattr(config, "get_text_config"):
            value = getattr(config.get_text_config(), name, None)
        if value is not None:
            return int(value)
    raise ValueError(f"cannot tell the hidden size of {type(config).__name__}")


"""A frozen vision tower runs without autograd (model/frozen_tower.py). Under activation
checkpointing the library hooks every part's input embeddings, the tower's patch embedding
too, so its checkpointed layers ran again in the backward for no gradient. Two training
steps of the tiny VLM, built as `finetune train` builds it (run/build.py), against the
same steps with autograd in the tower as before: every trainable parameter's gradient
equal at each step, the tower's layers run without autograd instead of twice with it (the
forward and the backward's recomputation), its output requiring no grad; where the tower
trains, it keeps autograd. sft in each layout; dpo, kto, grpo
and rloo, whose trainers turn checkpointing (and the hooks) off and on again within a step
(rloo's and kto's layouts are also the one tests of them with LoRA on a VLM, grpo-qlora
and rloo-qlora the ones with QLoRA on one)."""

from __future__ import annotations

import pytest

from conftest import QUICKSTART
from finetune.config import load_experiment

TINY_VLM = QUICKSTART / "tiny-vlm"
DATA = QUICKSTART / "data"
LORA = ["peft.type=lora", "peft.r=4"]

LAYOUTS = {  # id: (method, overrides, the tower frozen)
    "sft-lora": ("sft", LORA, True),
    "sft-lora-projector": ("sft", [*LORA, "vision.train_projector=true"], True),
    "sft-qlora": ("sft", ["peft.type=qlora", "peft.r=4"], True),
    "sft-full-frozen-tower": ("sft", ["vision.freeze_tower=true"], True),
    "sft-lora-on-the-tower": ("sft", [*LORA, "vision.freeze_tower=false"], False),
    "dpo-lora": ("dpo", LORA, True),
    "kto-lora": ("kto", LORA, True),
    "grpo-lora": ("grpo", LORA, True),
    "grpo-qlora": ("grpo", ["peft.type=qlora", "peft.r=4"], True),
    "rloo-lora": ("rloo", LORA, True),
    "rloo-qlora": ("rloo", ["peft.type=qlora", "peft.r=4"], True),
}
SETTINGS = {  # each method's data and batch
    "sft": ("vlm_train.jsonl", "per_device_train_batch_size: 2\n  max_length: 64"),
    "dpo": ("vlm_pref_train.jsonl", "per_device_train_batch_size: 2\n  max_length: 64"),
    "kto": ("vlm_pref_train.jsonl", "per_device_train_batch_size: 2\n  max_length: 64"),
    "grpo": ("vlm_pref_train.jsonl", "per_device_train_batch_size: 4\n  num_generations: 4\n"
             "  max_completion_length: 4"),
    "rloo": ("vlm_pref_train.jsonl", "per_device_train_batch_size: 4\n  num_generations: 4\n"
             "  max_completion_length: 4"),
}
STEPS = 2
# grpo, rloo: completions of different lengths score differently, so the step has a gradient
REWARDS = "def length(completions, **kwargs):\n" \
          "    return [float(len(str(c))) for c in completions]\n"


def _experiment(root, method: str, overrides: list[str]):
    data, extra = SETTINGS[method]
    (root / "rewards.py").write_text(REWARDS)
    config = root / f"{method}.yaml"
    config.write_text(f"""name: tower
method: {method}
model: {{name_or_path: {TINY_VLM}, init: random}}
data: {{train: {{path: {DATA / data}, max_samples: 4}}}}
evaluation: {{exact_match: false}}
output: {{plot: false}}
{"rewards: {functions: [rewards.py:length]}" if method in ("grpo", "rloo") else ""}
training:
  max_steps: {STEPS}
  save_steps: 100
  optim: adamw_torch
  activation_checkpointing: true
  seed: 0
  {extra}
""")
    return load_experiment(config, overrides)


class Recorder:
    """Counts the tower's layers run with autograd on (the backward's recomputation
    included; not generation's or the reference's); notes whether the tower's output
    requires grad; keeps every trainable parameter's gradient before each optimizer step."""

    def __init__(self, model):
        from transformers import TrainerCallback
        from transformers.modeling_layers import GradientCheckpointingLayer

        self.calls, self.tower_out_grad, self.grads = 0, set(), []
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        tower = base.get_encoder(modality="image")
        # A checkpointed layer's forward (not its own hooks) runs again in the backward, up
        # to the last tensor it saves (torch stops there): its MLP's start is counted.
        for layer in tower.modules():
            if isinstance(layer, GradientCheckpointingLayer):
                layer.mlp.register_forward_pre_hook(self._count)
        tower.register_forward_hook(self._output)
        recorder = self

        class Grads(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                recorder.grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                                       if p.requires_grad})

        self.callback = Grads()

    def _count(self, module, inputs):
        import torch

        self.calls += torch.is_grad_enabled()

    def _output(self, module, inputs, output):
        import torch

        if torch.is_grad_enabled():
            self.tower_out_grad.add(output.last_hidden_state.requires_grad)


def _steps(experiment, root, name: str, autograd_in_tower: bool) -> Recorder:
    """The steps of the trainer finetune builds; autograd_in_tower: with the autograd mode
    inside the tower as outside it, as before it ran without."""
    import os

    from finetune.methods import Job
    from finetune.model.hardware import resolve_hardware
    from finetune.run.build import method_trainer, starting_model, tokenizer_and_data
    from finetune.model.frozen_tower import frozen_tower

    run_dir = root / name  # beside the others: the prepared data are shared (.data-cache)
    run_dir.mkdir()
    hw = resolve_hardware(experiment)
    processor, data = tokenizer_and_data(experiment, run_dir)
    args, model = starting_model(experiment, hw, processor, run_dir, 0, run_dir, None)
    cwd = os.getcwd()
    os.chdir(root)  # rewards.py:length is found from where the run starts
    try:
        trainer = method_trainer(Job(experiment=experiment, run_dir=run_dir, hardware=hw,
                                     tokenizer=processor, model=model, data=data, args=args))
    finally:
        os.chdir(cwd)
    record = Recorder(trainer.model)
    record.frozen = frozen_tower(trainer.model) is not None
    if autograd_in_tower and record.frozen:
        AutogradAsOutside(frozen_tower(trainer.model))
    trainer.add_callback(record.callback)
    trainer.train()
    return record


class AutogradAsOutside:
    """Hooks around finetune's on the tower: the autograd mode outside it, put back
    inside it (as before the tower ran without autograd)."""

    def __init__(self, tower):
        tower.register_forward_pre_hook(self._note, prepend=True)
        tower.register_forward_pre_hook(self._put_back)

    def _note(self, module, args) -> None:
        import torch

        self.mode = torch.is_grad_enabled()

    def _put_back(self, module, args) -> None:
        import torch

        torch.set_grad_enabled(self.mode)  # finetune's hook restores it after the tower


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("frozen-tower")


@pytest.mark.slow  # two two-step runs of the tiny VLM per layout
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_frozen_tower_runs_no_backward_and_the_gradients_stay(layout, root):
    import torch

    method, overrides, frozen = LAYOUTS[layout]
    experiment = _experiment(root, method, overrides)
    before = _steps(experiment, root, f"{layout}-before", autograd_in_tower=True)
    ours = _steps(experiment, root, layout, autograd_in_tower=False)
    assert ours.frozen == frozen
    layers = 2  # the tiny tower's encoder layers, each run once in the forward
    assert before.calls == STEPS * 2 * layers  # and again in the backward
    assert ours.calls == (0 if frozen else before.calls)  # (with autograd on)
    assert ours.tower_out_grad == {not frozen} and before.tower_out_grad == {True}
    assert len(ours.grads) == len(before.grads) == STEPS
    for step, grads in enumerate(ours.grads):
        assert grads.keys() == before.grads[step].keys()
        assert any("vision_tower" in n for n in grads) == (not frozen)
        for name, grad in grads.items():
            assert torch.equal(grad, before.grads[step][name]), (step, name)
        assert any(g.abs().sum() > 0 for g in grads.values())

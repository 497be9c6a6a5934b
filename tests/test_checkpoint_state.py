"""finetune's per-rank state record (checkpoint_state.py) and the callback that writes and
restores it (callbacks.ResumeState), in-process: named parts round-trip through one
weights_only file the manifest seals; a newer or foreign record is refused by name; the
per-part files finetune 0.1.0 wrote are read when a checkpoint has no record; a rank
that wrote nothing gets rank 0's parts, marked as not its own."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from finetune.rundir import checkpoint_state, checkpoints
from finetune.run.callbacks import ResumeState, TrainingTime
from finetune.errors import RunError

GRPO = {"layout": {"world_size": 1}, "step": 5, "global_step": 5,
        "buffer": [{"ids": torch.arange(3), "n": 2}], "metrics": {"reward": [0.5]}}


def test_parts_round_trip_and_the_manifest_seals_the_record(tmp_path):
    checkpoint = tmp_path / "checkpoint-4"
    parts = {"loss_window": {"sum": torch.tensor(1.5), "since": 2}, "grpo": GRPO}
    written = checkpoint_state.save(checkpoint, 1, parts)
    assert written == checkpoint / "finetune_state-1.pt"
    loaded = checkpoint_state.load(checkpoint, 1)
    assert loaded.keys() == parts.keys() and loaded["loss_window"]["since"] == 2
    assert torch.equal(loaded["grpo"]["buffer"][0]["ids"], torch.arange(3))
    assert checkpoint_state.load(checkpoint, 0) is None  # rank 0 wrote nothing here
    (checkpoint / checkpoints.TRAINER_STATE).write_text(json.dumps({"global_step": 4}))
    manifest = checkpoints.write_manifest(checkpoint, 4, {"fingerprint": {}})
    assert "finetune_state-1.pt" in manifest["files"]
    assert checkpoints.problem(checkpoint) is None


def test_a_newer_foreign_or_code_carrying_record_is_refused(tmp_path):
    file = checkpoint_state.path(tmp_path, 0)
    torch.save({"format": checkpoint_state.FORMAT, "version": 2, "rank": 0, "parts": {}}, file)
    with pytest.raises(RunError, match=r"record version 2; this finetune reads version 1"):
        checkpoint_state.load(tmp_path, 0)
    torch.save({"sum": torch.tensor(0.0)}, file)
    with pytest.raises(RunError, match="is not a finetune state record"):
        checkpoint_state.load(tmp_path, 0)
    checkpoint_state.save(tmp_path, 0, {"ppo": {"spec": SimpleNamespace(kl=1)}})
    with pytest.raises(RunError, match="cannot read .*finetune_state-0.pt"):
        checkpoint_state.load(tmp_path, 0)  # weights_only: no objects of other classes


def test_finetune_0_1_0_per_part_files_are_read_without_a_record(tmp_path):
    torch.save({"sum": torch.tensor(2.0), "since": 3}, tmp_path / "loss_window_0.pt")
    torch.save({"version": 1, **GRPO}, tmp_path / "grpo_state_0.pt")
    torch.save({"kl_coef": 0.1, "rollout": None}, tmp_path / "ppo_state_0.pt")
    parts = checkpoint_state.load(tmp_path, 0)
    assert parts["loss_window"]["since"] == 3 and parts["ppo"]["kl_coef"] == 0.1
    assert parts["grpo"].keys() == GRPO.keys()  # its own version field dropped
    torch.save({"version": 7, **GRPO}, tmp_path / "grpo_state_0.pt")
    assert checkpoint_state.load(tmp_path, 0)["grpo"] is None  # unknown: regenerate
    assert checkpoint_state.load(tmp_path, 1) is None
    checkpoint_state.save(tmp_path, 0, {"loss_window": {"sum": torch.tensor(9.0), "since": 8}})
    assert checkpoint_state.load(tmp_path, 0).keys() == {"loss_window"}  # the record wins


class _Trainer:
    """The trainer side of ResumeState: a loss window and a part of its own."""

    state_part = "demo"

    def __init__(self, value: int):
        self._tr_loss, self._globalstep_last_logged = torch.tensor(float(value)), value
        self.value, self.restored = value, None

    def state_to_save(self):
        return {"value": self.value}

    def restore_state(self, saved, own):
        self.restored = (saved, own)


def _args(tmp_path, rank):
    return SimpleNamespace(output_dir=str(tmp_path), process_index=rank)


def test_resume_state_saves_every_part_and_restores_each_rank(tmp_path):
    saver = ResumeState(None, TrainingTime(time.time() - 5))  # 5 s into the first attempt
    for rank in (0, 1):
        saver.trainer = _Trainer(rank + 1)
        saver.on_save(_args(tmp_path, rank), SimpleNamespace(global_step=6), None)
    checkpoint = checkpoints.directory(tmp_path, 6)
    assert sorted(p.name for p in checkpoint.iterdir()) == ["finetune_state-0.pt",
                                                             "finetune_state-1.pt"]
    for rank, own in ((1, True), (2, False)):  # rank 2 of a larger run: rank 0's, not own
        resumed = ResumeState(checkpoint, TrainingTime(time.time()))
        resumed.trainer = _Trainer(0)
        resumed.on_train_begin(_args(tmp_path, rank), None, None)
        expected = rank + 1 if own else 1
        assert resumed.trainer.restored == ({"value": expected}, own)
        # the run's time goes on from the checkpoint's (a larger run: rank 0's)
        assert resumed.elapsed.earlier >= 5 and resumed.elapsed.seconds() >= 5
        # The loss window is reopened from this rank's own record only.
        window = float(resumed.trainer._tr_loss), resumed.trainer._globalstep_last_logged
        assert window == ((2.0, 2) if own else (0.0, 0))


def test_a_resume_hides_only_the_missing_keys_that_are_tied(caplog):
    """transformers' Trainer names the output layer tied to the embeddings as a missing key
    on every resume (a checkpoint stores a shared tensor once); run/noise.py drops that
    line, and only where every key named shares a tensor: a truly missing weight is said."""
    import logging

    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import TINY_MODEL
    from finetune.model.load import tied_parameters
    from finetune.run.noise import hide_tied_keys_on_resume

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL))
    tied = tied_parameters(model)
    assert tied == {"model.embed_tokens.weight", "lm_head.weight"}
    logger = logging.getLogger("transformers.trainer")
    before = list(logger.filters)
    hide_tied_keys_on_resume(tied)
    try:
        prefix = "There were missing keys in the checkpoint model loaded: "
        with caplog.at_level(logging.WARNING, logger="transformers.trainer"):
            logger.warning(f"{prefix}{['lm_head.weight']}.")
            logger.warning(f"{prefix}{['lm_head.weight', 'model.norm.weight']}.")
            logger.warning(f"{prefix}{['base_model.model.lm_head.weight']}.")
        assert [r.getMessage() for r in caplog.records] == \
            [f"{prefix}{['lm_head.weight', 'model.norm.weight']}."]
    finally:
        logger.filters[:] = before

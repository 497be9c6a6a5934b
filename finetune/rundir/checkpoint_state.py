"""finetune's own state in a checkpoint: one versioned record per rank,
checkpoint-<step>/finetune_state-<rank>.pt, of named parts.

The Trainer's files hold weights, optimizer, scheduler, RNG and data position; what a
resumed run also needs to continue bitwise is kept per rank in this record (the
checkpoint manifest seals it with every other file):

  loss_window  the Trainer's open logging window (callbacks.LossWindow), every method
  elapsed      the run's wall time so far, over its attempts (callbacks.TrainingTime)
  grpo         GRPO's generation window: buffer, micro-step, open metrics (methods/online.py)
  rloo         RLOO's generation window, as grpo's (methods/online.py)
  ppo          PPO's rollout buffer, KL coefficient, statistics window (trainers/ppo.py)

A part is a dict of tensors and plain Python values: loaded with weights_only=True, so
a record can carry no code. callbacks.ResumeState writes the record when the Trainer
saves and hands each part back as training begins.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from finetune.errors import RunError

FILE = "finetune_state-{rank}.pt"
FORMAT = "finetune-state"
VERSION = 1
# Written by finetune 0.1.0 before this record existed, one file per part (the grpo file
# carried its own "version": 1). Read when a checkpoint has no record, so a run saved
# before the upgrade still resumes exactly.
LEGACY_FILES = {"loss_window": "loss_window_{rank}.pt", "grpo": "grpo_state_{rank}.pt",
                "ppo": "ppo_state_{rank}.pt"}


def path(checkpoint: Path, rank: int) -> Path:
    return Path(checkpoint) / FILE.format(rank=rank)


def save(checkpoint: Path, rank: int, parts: dict[str, Any]) -> Path:
    """Write this rank's record. Not atomic by itself: the manifest, written once every
    rank is done, is what makes a checkpoint complete."""
    import torch

    target = path(checkpoint, rank)
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": FORMAT, "version": VERSION, "rank": rank, "parts": parts}, target)
    return target


def _read(file: Path) -> Any:
    import torch

    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except Exception as exc:  # damaged after sealing beyond its size and hash checks
        raise RunError(f"cannot read {file} ({type(exc).__name__}: {exc}); move the checkpoint "
                       "aside to resume from an earlier one") from None


def load(checkpoint: Path, rank: int) -> dict[str, Any] | None:
    """The parts `rank` saved in `checkpoint`, or None if it saved none (another number
    of processes wrote it). A record of a newer format is refused: its parts may not
    mean what this finetune reads them as."""
    file = path(checkpoint, rank)
    if file.is_file():
        record = _read(file)
        if not isinstance(record, dict) or record.get("format") != FORMAT or \
                not isinstance(record.get("parts"), dict):
            raise RunError(f"{file} is not a finetune state record; move the checkpoint aside "
                           "to resume from an earlier one")
        if record.get("version") != VERSION:
            raise RunError(f"{file} is finetune state record version {record.get('version')!r}; "
                           f"this finetune reads version {VERSION}. Resume with the finetune "
                           "version that wrote it")
        return record["parts"]
    return _legacy(Path(checkpoint), rank)


def _legacy(checkpoint: Path, rank: int) -> dict[str, Any] | None:
    parts = {}
    for name, pattern in LEGACY_FILES.items():
        file = checkpoint / pattern.format(rank=rank)
        if file.is_file():
            parts[name] = _read(file)
    grpo = parts.get("grpo")
    if grpo is not None:  # its own version field became the record's
        parts["grpo"] = {k: v for k, v in grpo.items() if k != "version"} \
            if grpo.get("version") == 1 else None
    return parts or None

"""Where a run starts: from scratch, or from which checkpoint, and whether that is safe.
Torch-free: `finetune launch` and `finetune slurm` decide before anything is started, and
every rank decides the same from the same files."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from finetune.rundir import checkpoints
from finetune.config.derived.effective import value
from finetune.config.schema import Experiment
from finetune.errors import RunError, RunFinished
from finetune.rundir.fingerprint import differences, fingerprint, layout, layout_note


@dataclass
class ResumePlan:
    checkpoint: Path | None  # None: start from scratch
    step: int = 0
    notes: list[str] = field(default_factory=list)  # rank 0 prints these
    incomplete: list[Path] = field(default_factory=list)  # rank 0 removes these
    damaged: list[tuple[Path, Path]] = field(default_factory=list)  # rank 0 moves these aside


def holds_a_run(run_dir: Path) -> list[str]:
    """What in run_dir a fresh run would overwrite."""
    found = []
    if (run_dir / "final").exists():
        found.append("a final model (final/)")
    if (run_dir / "summary.json").exists():
        found.append("a finished run (summary.json)")
    saved = list((run_dir / "checkpoints").glob("checkpoint-*"))
    if saved:
        found.append(f"{len(saved)} checkpoint(s) (checkpoints/)")
    return found


def _finished_step(run_dir: Path) -> int | None:
    """The last step of a finished run (its summary.json), None if it has not finished."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except OSError as exc:
        cause = exc.strerror or str(exc)
    except ValueError as exc:  # not JSON, not UTF-8
        cause = str(exc)
    except RecursionError:
        cause = "nested too deeply"
    else:
        step = summary.get("global_step") if isinstance(summary, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            return step
        cause = "no global_step number in it"
    raise RunError(f"{path}: damaged ({cause}); it marks the run finished but is not what "
                   "finetune wrote. Nothing was changed. Restore it; or move it away to run "
                   "again from the newest complete checkpoint.")


def _finished(experiment: Experiment, run_dir: Path, step: int) -> Exception:
    """Done when it ran what is asked; an error when more steps are asked for."""
    asked = value(experiment, "max_steps")
    if isinstance(asked, int) and asked > step:
        return RunError(f"{run_dir} holds a finished run (summary.json, step {step}) and "
                        f"training.max_steps is {asked}; nothing was changed. To train it "
                        "further, set resume to one of its checkpoints; to start over, choose "
                        "another name or output.dir.")
    return RunFinished(f"{run_dir} holds this run, finished (summary.json, step {step}); "
                       "nothing to do, nothing was changed. To train it further, raise "
                       "max_steps and set resume to one of its checkpoints; to start over, "
                       "choose another name or output.dir.")


def _check_compatible(experiment: Experiment, checkpoint: Path, manifest: dict,
                      notes: list[str]) -> None:
    changed = differences(manifest.get("fingerprint", {}), fingerprint(experiment))
    if changed:
        listing = "\n".join(f"  {line}" for line in changed)
        if not experiment.force_resume:
            raise RunError(
                f"cannot resume from {checkpoint}: the experiment differs from the one that "
                f"wrote it in what it trains:\n{listing}\nNothing was changed. Undo those "
                "changes; or start a new run (another name, or resume: never in a new "
                "output.dir); or set force_resume: true to continue anyway.")
        notes.append(f"force_resume: continuing although these changed:\n{listing}")
    note = layout_note(manifest.get("layout", {}), layout(experiment))
    if note and manifest.get("layout"):
        notes.append(f"warning: {note}")


def plan_resume(experiment: Experiment, run_dir: Path) -> ResumePlan:
    mode = experiment.resume
    if mode == "never":
        existing = holds_a_run(run_dir)
        if existing:
            raise RunError(f"{run_dir} already holds {' and '.join(existing)}; nothing was "
                           "changed (resume: never). Choose another run name (name=...) or "
                           "output.dir, move that directory away, or use resume: auto.")
        return ResumePlan(None)
    if mode == "auto":
        finished = _finished_step(run_dir)
        if finished is not None:
            raise _finished(experiment, run_dir, finished)
    found = checkpoints.scan(run_dir / "checkpoints")
    notes = [f"ignoring incomplete {path.name} ({why}); it will be removed"
             for path, why in found.incomplete]
    incomplete = [path for path, _ in found.incomplete]
    damaged = []
    for path, why in found.damaged:
        damaged.append((path, checkpoints.aside(path)))
        notes.append(f"{path.name} is damaged ({why}); moving it aside to "
                     f"{path.parent.name}/{damaged[-1][1].name}: kept, never resumed from")
    if mode == "auto":
        checkpoint = found.newest
        if checkpoint is None:
            if found.incomplete or found.damaged:
                notes.append("no intact checkpoint left: training starts from scratch (step 0)")
            return ResumePlan(None, notes=notes, incomplete=incomplete, damaged=damaged)
        notes.append(f"resuming from {checkpoint} (resume: auto, newest complete checkpoint)")
    else:
        checkpoint = Path(mode).absolute()
        why = checkpoints.problem(checkpoint)
        if why is not None:
            raise RunError(f"resume: {checkpoint} cannot be resumed from: {why}")
        incomplete = [p for p in incomplete if p.resolve() != checkpoint.resolve()]
        newest = found.newest
        if newest is not None and checkpoints.step_of(newest) > \
                checkpoints.read_manifest(checkpoint)["step"]:
            # The run went on from the given checkpoint (a requeued job, say): its own
            # newer checkpoints win, and nothing it saved is thrown away.
            notes.append(f"resuming from {newest}, this run's newest complete checkpoint, "
                         f"which is newer than resume: {checkpoint} (to go back to that one, "
                         "move the newer checkpoints away)")
            checkpoint = newest
        else:
            notes.append(f"resuming from {checkpoint} (resume: path)")
    manifest = checkpoints.read_manifest(checkpoint)
    _check_compatible(experiment, checkpoint, manifest, notes)
    return ResumePlan(checkpoint, manifest["step"], notes, incomplete, damaged)

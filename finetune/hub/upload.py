"""Sharing a run on the Hugging Face hub: its final model or adapter (final/, never a
checkpoint) with a model card (modelcard.py), to output.hub_model_id or the run name.

`plan` decides the exact upload (files and card) from the run directory alone and touches
no network; `upload` sends it through huggingface_hub (create_repo, one create_commit).
The worker pushes after training when training.push_to_hub is set; `finetune push RUN_DIR`
pushes a finished run later (from a machine with network, or to retry). The token is
never handled here: huggingface_hub finds it itself (HF_TOKEN, or `hf auth login`'s
stored token), so it reaches no file, argument or message of finetune's. Torch-free.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.config.secrets import scrub
from finetune.errors import RunError, first_line

# In final/ but not shared: the pickled training arguments (the card lists the settings,
# and a pickle is code to whoever loads it), and the card PEFT writes (ours replaces it).
LEFT_OUT = ("training_args.bin", "README.md")


@dataclass(frozen=True)
class Upload:
    repo_id: str
    folder: Path  # final/
    files: tuple[str, ...]  # relative to folder, uploaded under the same names
    card: str  # README.md
    private: bool | None
    revision: str | None

    def describe(self) -> str:
        where = self.repo_id + (f" (branch {self.revision})" if self.revision else "")
        return "\n".join([f"finetune: upload to {where}: README.md (model card) and "
                          f"{len(self.files)} file(s) of {self.folder}",
                          *(f"  {name}" for name in self.files)])


def _read(path: Path, what: str) -> dict[str, Any]:
    import yaml

    try:
        text = path.read_text()
        data = yaml.safe_load(text) if path.suffix == ".yaml" else json.loads(text)
    except FileNotFoundError:
        raise RunError(f"{path} is missing: {what}") from None
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise RunError(f"{path}: cannot read it ({first_line(exc)}): {what}") from None
    if not isinstance(data, dict):
        raise RunError(f"{path}: not what finetune wrote: {what}")
    return data


def _optional(path: Path) -> dict[str, Any]:
    """A record the card is richer for (the run's precision, its training arguments)."""
    try:
        return _read(path, "")
    except RunError:
        return {}


def plan(run_dir: Path, repo_id: str | None = None) -> Upload:
    """The upload of a finished run: final/'s files and the card."""
    from finetune.hub.modelcard import model_card  # the schema's weight, not for `--help`

    exp = _read(run_dir / "experiment.yaml", "the resolved experiment of the run")
    summary = _read(run_dir / "summary.json", "a run is shared once it has finished")
    final = run_dir / "final"
    if not final.is_dir():
        raise RunError(f"{final} is missing: only the final model is shared (the run had "
                       "output.save_final: false, or final/ was moved)")
    files = tuple(sorted(p.relative_to(final).as_posix() for p in final.rglob("*")
                         if p.is_file() and p.relative_to(final).as_posix() not in LEFT_OUT))
    training = exp.get("training") or {}
    repo_id = repo_id or (exp.get("output") or {}).get("hub_model_id") or exp["name"]
    ran = {"precision": _optional(run_dir / "environment.json").get("precision"),
           "training_args": _optional(run_dir / "training_args.json")}
    return Upload(repo_id=repo_id, folder=final, files=files,
                  card=model_card(exp, summary, repo_id, ran),
                  private=training.get("hub_private_repo"),
                  revision=training.get("hub_revision"))


def upload(job: Upload) -> str:
    """Create the repository if needed and commit the files and the card at once.
    Returns the commit's URL."""
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi()
    repo = api.create_repo(job.repo_id, private=job.private, exist_ok=True)
    if job.revision:
        api.create_branch(repo.repo_id, branch=job.revision, exist_ok=True)
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(job.folder / name))
                  for name in job.files]
    operations.append(CommitOperationAdd(path_in_repo="README.md",
                                         path_or_fileobj=job.card.encode()))
    commit = api.create_commit(repo.repo_id, operations, revision=job.revision,
                               commit_message="Upload the final model trained by finetune")
    return commit.commit_url


def push(run_dir: Path, repo_id: str | None = None) -> str:
    """Plan and upload; an upload that fails is one error line saying how to retry."""
    job = plan(run_dir, repo_id)
    print(job.describe(), flush=True)
    try:
        url = upload(job)
    except Exception as exc:  # network, permissions, a name taken: huggingface_hub's words
        raise RunError(f"uploading {run_dir / 'final'} to {job.repo_id} failed: "
                       f"{scrub(first_line(exc))}. The run itself is complete; upload it "
                       f"again with `finetune push {run_dir}`") from None
    print(f"finetune: uploaded to {url}", flush=True)
    return url


def add_commands(commands: Any) -> None:
    parser = commands.add_parser(
        "push", help="upload a finished run's final model and model card to the hub",
        description="Upload RUN_DIR/final (never checkpoints) with a model card naming the "
                    "base model, data, method, settings and metrics. The token comes from "
                    "HF_TOKEN or `hf auth login`.")
    parser.add_argument("run_dir", type=Path, help="the run directory (runs/<name>)")
    parser.add_argument("--repo", help="repository id (default: output.hub_model_id, else "
                                       "the run name)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the files and the card; upload nothing")
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    from finetune.config.section import REPO_ID_RE

    if args.repo is not None and not REPO_ID_RE.fullmatch(args.repo):
        raise RunError(f"--repo {args.repo!r}: not a hub repository id ([namespace/]name)")
    run_dir = args.run_dir.absolute()
    if args.dry_run:
        job = plan(run_dir, args.repo)
        print(job.describe())
        print("--- README.md ---")
        print(job.card, end="")
        return 0
    push(run_dir, args.repo)
    return 0

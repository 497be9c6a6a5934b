"""What `training.report_to` and `training.push_to_hub` need from this machine, checked at
validate instead of after the model has loaded (or, for the upload, after training): the
package of each tracker, what each tracker needs configured, and a hub token. Reads the
environment variables the libraries themselves document, and imports none of them."""

from __future__ import annotations

import difflib
import netrc
import os
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import unquote, urlsplit

from finetune.config.schema import Experiment
from finetune.errors import shown

Problem = tuple[tuple, str]
_TRUE = ("1", "on", "yes", "true")

# report_to name -> (the module transformers imports for it, how to install it): the names
# transformers' Trainer knows (INTEGRATION_TO_CALLBACK); it refuses any other at start.
INTEGRATIONS = {
    "wandb": ("wandb", 'pip install "finetune[wandb]"'),
    "tensorboard": ("tensorboard", 'pip install "finetune[tensorboard]"'),
    "mlflow": ("mlflow", 'pip install "finetune[mlflow]"'),
    "comet_ml": ("comet_ml", "pip install comet_ml"),
    "neptune": ("neptune", "pip install neptune"),
    "clearml": ("clearml", "pip install clearml"),
    "dvclive": ("dvclive", "pip install dvclive"),
    "codecarbon": ("codecarbon", "pip install codecarbon"),
    "swanlab": ("swanlab", "pip install swanlab"),
    "trackio": ("trackio", "pip install trackio"),
    "azure_ml": ("azureml", "pip install azureml-core"),
    "flyte": ("flytekit", "pip install flytekit"),
    "dagshub": ("dagshub", "pip install dagshub"),
    "kubeflow": (None, ""),  # no package: transformers reads KUBEFLOW_TRAINER_SERVER_URL
}
# Trackers finetune keeps to one run per experiment and gives the summary
# (finetune/report/trackers.py).
TRACKED = ("tensorboard", "mlflow", "wandb")
# Uploads are finetune's, of the final model (finetune/hub/upload.py): these steer the Trainer's
# own pushes of checkpoints, which never happen.
CHECKPOINT_PUSH_KEYS = ("hub_strategy", "hub_always_push")


def installed(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def reported(training: dict[str, Any]) -> list[str]:
    """The trackers report_to names ("all": those of TRACKED that are installed, as
    transformers picks every installed integration)."""
    value = training.get("report_to")
    names = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    if "all" in names:
        return [name for name in TRACKED if installed(INTEGRATIONS[name][0])]
    return [name for name in names if isinstance(name, str) and name != "none"]


def _report_to(training: dict[str, Any]) -> Iterator[Problem]:
    value = training.get("report_to")
    names = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    for i, name in enumerate(names):
        loc = ("training", "report_to") + ((i,) if isinstance(value, list) else ())
        if name == "all":  # every installed integration: those of ours must be configured
            for found in reported({"report_to": "all"}):
                yield from ((loc, f"(all) {problem}") for problem in _configured(found))
            continue
        if not isinstance(name, str) or name == "none":
            continue
        if name not in INTEGRATIONS:
            close = difflib.get_close_matches(name, INTEGRATIONS, n=1)
            yield loc, (f"{shown(name)} is not a tracker the Trainer knows" +
                        (f"; did you mean {close[0]}?" if close else "") +
                        f" (one of {', '.join(sorted(INTEGRATIONS))}, all or none)")
            continue
        module, fix = INTEGRATIONS[name]
        if module is None:
            continue
        if name == "tensorboard" and installed("tensorboardX"):
            continue
        if not installed(module):
            yield loc, f"{name} needs the {module} package, which is not installed: {fix}"
        else:
            yield from ((loc, problem) for problem in _configured(name))


def _configured(name: str) -> Iterator[str]:
    if name == "mlflow":
        yield from mlflow_problems()
    elif name == "wandb":
        yield from wandb_problems()


def _writable_place(path: Path) -> str | None:
    """Why a store at `path` (made on first use, parents included) cannot be written."""
    existing = next((p for p in (path, *path.parents) if os.path.lexists(p)), None)
    if existing is None:
        return None
    if existing != path and not existing.is_dir():
        return f"{existing} is a file, not a directory"
    if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def mlflow_problems() -> Iterator[str]:
    """MLflow's store, by MLFLOW_TRACKING_URI: unset, mlflow 3 keeps runs in
    sqlite:///mlflow.db (the current directory), which needs SQLAlchemy; a file store
    needs MLFLOW_ALLOW_FILE_STORE=true; a server (http, https, databricks) is only known
    once reached."""
    for name in ("MLFLOW_RUN_ID", "MLFLOW_NESTED_RUN"):
        if os.environ.get(name):
            yield (f"{name} is set: finetune starts the experiment's MLflow run itself and "
                   "resumes it by the id in RUN_DIR/trackers.json; unset it")
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    scheme = urlsplit(uri).scheme if "://" in uri or uri.startswith("file:") else ""
    if scheme in ("http", "https", "databricks", "databricks-uc", "uc"):
        return
    if not uri or scheme == "sqlite":
        database = Path(unquote(uri[len("sqlite:///"):]) if uri else "mlflow.db")
        if not (installed("sqlalchemy") and installed("alembic")):
            yield ("mlflow keeps its runs in a SQLite database (MLFLOW_TRACKING_URI " +
                   (f"{uri})" if uri else "unset: sqlite:///mlflow.db here)") +
                   ", which needs sqlalchemy and alembic: pip install \"finetune[mlflow]\"; "
                   "or set MLFLOW_TRACKING_URI to a tracking server (http://...)")
        elif database.parent != Path("") and not database.parent.is_dir():
            yield f"MLFLOW_TRACKING_URI {uri}: no directory {database.parent} for the database"
        return
    if scheme not in ("", "file"):
        return  # a store of a plugin: mlflow's to check
    path = Path(unquote(urlsplit(uri).path) if scheme == "file" else uri).expanduser()
    why = _writable_place(path)
    if why:
        yield f"MLFLOW_TRACKING_URI {uri}: cannot keep runs there ({why})"
    elif not _flag("MLFLOW_ALLOW_FILE_STORE"):
        yield (f"MLFLOW_TRACKING_URI {uri} is a file store, which mlflow 3 refuses unless "
               "MLFLOW_ALLOW_FILE_STORE=true is set; set it, or use sqlite:///PATH/mlflow.db "
               "or a tracking server")


def _netrc_key(host: str) -> bool:
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc").expanduser()
    try:
        return bool((netrc.netrc(path).authenticators(host) or (None, None, None))[2])
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_problems() -> Iterator[str]:
    """W&B online needs an API key (WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc):
    without one, wandb.init stops the run once the model has loaded (or waits for a key
    typed at a terminal)."""
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode in ("offline", "disabled", "dryrun") or _flag("WANDB_DISABLED"):
        return
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    if not _netrc_key(host):
        yield (f"W&B has no API key for {host}: set WANDB_API_KEY, or run `wandb login`; "
               "or set WANDB_MODE=offline to keep the run on disk (`wandb sync` uploads it)")


def hf_token_available(training: dict[str, Any]) -> bool:
    """A token huggingface_hub would find: training.hub_token (handed over as HF_TOKEN),
    HF_TOKEN, or `hf auth login`'s stored token (HF_TOKEN_PATH, else HF_HOME/token)."""
    if training.get("hub_token") not in (None, "", "<redacted>") or os.environ.get("HF_TOKEN"):
        return True
    home = os.environ.get("HF_HOME") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface")
    stored = Path(os.environ.get("HF_TOKEN_PATH") or Path(home) / "token").expanduser()
    try:
        return bool(stored.read_text().strip())
    except (OSError, UnicodeDecodeError):
        return False


def _hub(exp: Experiment) -> Iterator[Problem]:
    training = exp.training
    for key in CHECKPOINT_PUSH_KEYS:
        if key in training:
            yield ("training", key), ("finetune uploads only the final model, once trained "
                                      "(never checkpoints): remove it")
    if "hub_model_id" in training:
        yield ("training", "hub_model_id"), "the repository is output.hub_model_id: move it there"
    if exp.output.hub_model_id and not training.get("push_to_hub"):
        yield ("output", "hub_model_id"), "names where to upload: set training.push_to_hub: true"
    if not training.get("push_to_hub"):
        return
    loc = ("training", "push_to_hub")
    if not exp.output.save_final:
        yield loc, "uploads the final model: needs output.save_final: true"
    if _flag("HF_HUB_OFFLINE"):
        yield loc, ("cannot upload with HF_HUB_OFFLINE set: unset it, or set push_to_hub: "
                    "false and upload later with `finetune push RUN_DIR`")
    elif not hf_token_available(training):
        yield loc, ("no Hugging Face token: set HF_TOKEN (a token with write access) or run "
                    "`hf auth login` before training")


def check(exp: Experiment) -> list[Problem]:
    return [*_report_to(exp.training), *_hub(exp)]

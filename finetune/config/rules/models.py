"""What validate can tell about a model without loading it: a local directory that ships
its own modelling code, a hub id that cannot be fetched (the hub is off, does not
answer, or has no such model), and flattened rows for a model with a recurrent state."""

from __future__ import annotations

import difflib
import functools
import json
import os
from pathlib import Path
from typing import Iterator

from finetune.config import paths, stateful
from finetune.errors import shown

Problem = tuple[tuple, str]
_TRUE = ("1", "on", "yes", "true")
# One question to the hub, no retries: validate exists to fail fast, and transformers'
# own retries (~30-60 s here) would come before the first error line.
HUB_TIMEOUT_S = 5.0


def remote_code(loc: tuple, directory: str, trusted: bool) -> Iterator[Problem]:
    """A config.json with auto_map names classes in .py files of the model itself;
    transformers refuses to load them unless trust_remote_code is on."""
    if trusted:
        return
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        yield loc, f"{directory}/config.json is not a readable JSON file"
        return
    if isinstance(config, dict) and config.get("auto_map"):
        yield loc, (f"{directory} ships its own modelling code (auto_map in config.json); "
                    "read it, then set model.trust_remote_code: true to run it")


def flattened_state(exp) -> Iterator[Problem]:
    """packing or padding_free set for a local model with a recurrent state
    (config/stateful.py; a hub model's is refused at training, methods/sft.py)."""
    found = stateful.stateful_type(exp.model.name_or_path)
    for name in ("packing", "padding_free"):
        if found and exp.training.get(name):
            yield ("training", name), stateful.refusal(found)


def hub_cache() -> Path:
    """huggingface_hub's cache directory, by its documented variables."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface")
    return Path(home) / "hub"


def _datasets_cache() -> Path:
    """datasets' own cache of prepared hub datasets, by its documented variables."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"])
    home = os.environ.get("HF_HOME") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface")
    return Path(home) / "datasets"


def offline(loc: tuple, hub_id: str, kind: str = "model") -> Iterator[Problem]:
    """With HF_HUB_OFFLINE (or, for data, HF_DATASETS_OFFLINE) set, a hub id must be in the
    local caches: training would otherwise stop on a connection error after its imports.
    A bare name (no org/, the way a directory next to the YAML file is written) is most
    likely a mistyped directory, and said so."""
    flags = [flag for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
             if os.environ.get(flag, "").lower() in _TRUE
             and (kind == "dataset" or flag == "HF_HUB_OFFLINE")]
    if not flags:
        return
    folder = f"{kind}s--" + hub_id.replace("/", "--")
    cached = [hub_cache() / folder]
    if kind == "dataset":
        cached.append(_datasets_cache() / hub_id.replace("/", "___"))
    if any(paths.is_dir(path) for path in cached):
        return
    where = " or ".join(str(path.parent) for path in cached)
    hint = "; for a directory next to the YAML file, check the spelling" if "/" not in hub_id \
        else ""
    yield loc, (f"{shown(hub_id)} is not a local {'directory' if kind == 'model' else 'path'}, "
                f"and cannot be fetched from the hub offline ({' and '.join(flags)} set; it is "
                f"not in {where}){hint}")


def hub_endpoint() -> str:
    """The hub huggingface_hub talks to, by its documented variable."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def on_hub(loc: tuple, hub_id: str, revision: str | None = None) -> Iterator[Problem]:
    """A model id that is not a local directory: offline, it must be cached (offline());
    online and not cached, the hub is asked once whether it has it. A bare name the hub
    does not know is most often a directory written wrong, and said so."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE:
        yield from offline(loc, hub_id)
        return
    if paths.is_dir(hub_cache() / ("models--" + hub_id.replace("/", "--"))):
        return  # transformers falls back on the cache when the hub does not answer
    answer = _ask_hub(hub_endpoint(), hub_id, revision)
    if answer is None:
        return
    local = " nor a local directory (paths in an experiment are relative to the YAML " \
            "file that names them)"
    if answer == "not found":
        yield loc, (f"{shown(hub_id)} is neither a model on the hub ({hub_endpoint()} has none "
                    "by that name; a private one needs `hf auth login` or HF_TOKEN)" + local)
    elif answer == "no revision":
        yield loc, f"{shown(hub_id)} has no revision {shown(revision)} on the hub ({hub_endpoint()})"
    else:
        yield loc, (f"{shown(hub_id)} is not in the local cache ({hub_cache()}){local}, and the "
                    f"hub ({hub_endpoint()}) {answer}: connect, or name a local directory")


@functools.lru_cache(maxsize=64)
def _ask_hub(endpoint: str, hub_id: str, revision: str | None) -> str | None:
    """None where the hub has the model (or answered something training will report
    itself); else 'not found', 'no revision', or what went wrong reaching it. Asked once
    a process: launches load an experiment twice where the device is probed."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        HfApi(endpoint=endpoint).model_info(hub_id, revision=revision, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return None  # it exists; training says how to get access
    except RepositoryNotFoundError:  # also 401 for a private model without a token
        return "not found"
    except RevisionNotFoundError:
        return "no revision"
    except HfHubHTTPError:
        return None  # rate limits, 5xx: training asks again and says what the hub says
    except Exception as exc:  # the transport errors of whichever httpx huggingface_hub uses
        if "timeout" in type(exc).__name__.lower():
            return f"did not answer within {HUB_TIMEOUT_S:g} s"
        return f"could not be reached ({type(exc).__name__}: {exc})"
    return None


def near_miss(name: str, base: Path) -> str | None:
    """A relative model path that is not a directory next to the YAML file, where the
    hub would answer with a network error at train time: one written relative to the
    current directory instead (a model directory is there), or a bare name (the
    quickstart's style) one letter or two from a model directory next to the file."""
    if paths.problem(name) or Path(name).is_absolute() or paths.exists(base / name):
        return None
    here = Path.cwd() / name
    if paths.is_file(here / "config.json"):
        return (f"{shown(name)} is not a directory next to the YAML file ({base}): paths in an "
                "experiment are relative to the file that names them, and this one is "
                f"relative to the current directory; write {os.path.relpath(here, base)} "
                "(or the absolute path)")
    if "/" in name:
        return None
    try:
        models = [p.name for p in base.iterdir() if paths.is_file(p / "config.json")]
    except OSError:
        return None
    close = difflib.get_close_matches(name, models, n=1, cutoff=0.8)
    if not close:
        return None
    return (f"{shown(name)} is not a local directory (none next to {base}); did you mean "
            f"{close[0]}?")


def pad_token(loc: tuple, directory: str, token: str) -> Iterator[Problem]:
    """A pad token the local tokenizer does not have gets no id: training stops at the
    first batch. Checked where a tokenizer.json says what the vocabulary is."""
    file = Path(directory) / "tokenizer.json"
    if not paths.is_file(file):
        return
    try:
        spec = json.loads(file.read_text())
        vocab = spec["model"].get("vocab") or {}
        known = set(vocab) if isinstance(vocab, dict) else {entry[0] for entry in vocab}
        known |= {added["content"] for added in spec.get("added_tokens") or []}
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return  # a tokenizer.json this check does not understand: transformers decides
    if token not in known:
        special = sorted(added["content"] for added in spec.get("added_tokens") or []
                         if added.get("special"))[:8]
        yield loc, (f"{shown(token)} is not a token of the tokenizer in {directory}"
                    + (f" (its special tokens: {', '.join(special)})" if special else ""))

"""The model of a run directory, for using it after training: final/ (a full model or a
(Q)LoRA adapter), a checkpoint, or the output of `finetune merge`, with its tokenizer.

An adapter's base is found from the run, not from the adapter's own record: the run's
init-model/ for a random-init run (so a moved run directory still loads), else the
experiment's model.name_or_path at its revision. A QLoRA base is loaded unquantized, in
the dtype asked for.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from pydantic import ValidationError

from finetune.rundir import checkpoints
from finetune.config.methods import method
from finetune.config.schema import Experiment
from finetune.errors import RunError, first_line
from finetune.config import vision as vision_config
from finetune.model import vision
from finetune.model.load import HEADS, head_labels
from finetune.model.peft import ADAPTER_CONFIG
from finetune.model.tokenizer import processor_from

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


@dataclass(frozen=True)
class RunModel:
    run_dir: Path
    experiment: Experiment
    directory: Path  # final/, a checkpoint, or a merged model
    adapter: bool    # directory holds a (Q)LoRA adapter, to be put on base()

    @property
    def head(self) -> str:
        """'lm' (a causal LM) or 'score' (a sequence classifier): the method's head."""
        return method(self.experiment.method).head

    @property
    def vision(self) -> bool:
        """A vision-language model: the directory's own, or an adapter's base."""
        if self.head != "lm":
            return False
        if not self.adapter:
            return vision_config.is_vision_language(str(self.directory))
        source, revision = self.base()
        return vision.is_vision_source(source, revision, self.experiment.model.trust_remote_code)

    def base(self) -> tuple[str, str | None]:
        """(source, revision) of the adapter's base model."""
        spec = self.experiment.model
        if spec.init == "random":
            return str(self.run_dir / "init-model"), None
        return spec.name_or_path, spec.revision


def read_experiment(run_dir: Path) -> Experiment:
    """The resolved experiment a run directory holds (schema only: its data files need
    not exist any more)."""
    if not run_dir.is_dir():
        raise RunError(f"{run_dir}: no such run directory")
    path = run_dir / "experiment.yaml"
    if not path.is_file():
        raise RunError(f"{run_dir} is not a finetune run directory: it has no "
                       "experiment.yaml (give the directory `finetune train` wrote)")
    try:
        return Experiment.model_validate(yaml.safe_load(path.read_text()))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise RunError(f"{path}: cannot read it: {first_line(exc)}") from None
    except ValidationError as exc:
        raise RunError(f"{path}: not an experiment this finetune reads "
                       f"({exc.error_count()} problem(s), first: {first_line(exc)})") from None


def _kind(directory: Path) -> str | None:
    if (directory / ADAPTER_CONFIG).is_file():
        return "adapter"
    if (directory / "config.json").is_file():
        return "full"
    return None


def model_directory(run_dir: Path, choice: str | None) -> Path:
    """final/ (choice None), else `choice`: a path, a directory of the run (merged), or a
    checkpoint name (checkpoint-200)."""
    if choice is None:
        final = run_dir / "final"
        if _kind(final) is None:
            raise RunError(f"{run_dir} has no final model (final/): the run has not finished, "
                           "or output.save_final is false; name one of its checkpoints "
                           "instead (checkpoint-N: --checkpoint for merge, --model for "
                           "generate and chat)")
        return final
    candidates = [Path(choice), run_dir / choice, run_dir / "checkpoints" / choice]
    found = next((p for p in candidates if p.is_dir()), None)
    if found is None:
        raise RunError(f"{choice}: no such directory (looked at {choice}, in {run_dir} and in "
                       f"{run_dir / 'checkpoints'})")
    if checkpoints.step_of(found) is not None and not (found / checkpoints.MANIFEST).is_file():
        raise RunError(f"{found}: an incomplete checkpoint ({checkpoints.NO_MANIFEST}); "
                       "choose a complete one")
    if _kind(found) is None:
        raise RunError(f"{found} holds no model (neither config.json nor {ADAPTER_CONFIG})")
    return found


def locate(run_dir: str | Path, choice: str | None = None) -> RunModel:
    run_dir = Path(run_dir).absolute()
    experiment = read_experiment(run_dir)
    directory = model_directory(run_dir, choice)
    return RunModel(run_dir, experiment, directory, _kind(directory) == "adapter")


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def dtype_of(name: str, on: str) -> torch.dtype:
    """--dtype: fp32, bf16, fp16, or auto (bf16 on a GPU that has it, fp16 on an older
    one, fp32 on the CPU)."""
    if name != "auto":
        if name == "fp16" and on == "cpu":
            raise RunError("--dtype fp16 on the CPU: use fp32 or bf16 (no CUDA device here)")
        return DTYPES[name]
    if on == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_tokenizer(run: RunModel):
    """The tokenizer saved with the model (chat template and padding token included),
    else final/'s."""
    from transformers import AutoTokenizer

    for source in (run.directory, run.run_dir / "final"):
        if any((source / name).is_file() for name in TOKENIZER_FILES):
            break
    else:
        raise RunError(f"{run.directory} has no tokenizer, and neither has {run.run_dir / 'final'}")
    if run.vision:  # its processor: the tokenizer and the images, loaded as training loads it
        processor = processor_from(str(source), None, run.experiment.model.trust_remote_code,
                                   str(source))
        if processor.tokenizer.pad_token is None:
            processor.tokenizer.pad_token = processor.tokenizer.eos_token
        return processor
    tokenizer = AutoTokenizer.from_pretrained(
        str(source), trust_remote_code=run.experiment.model.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _base_config(run: RunModel, tokenizer):
    """The base's config as training built it: a score head's labels and padding token
    (the head reads the last token that is not padding)."""
    from transformers import AutoConfig

    source, revision = run.base()
    extra = head_labels(run.experiment) if run.experiment.model.init == "pretrained" else {}
    try:
        config = AutoConfig.from_pretrained(
            source, revision=revision, trust_remote_code=run.experiment.model.trust_remote_code,
            **extra)
    except OSError as exc:
        raise RunError(f"the adapter's base {source!r} cannot be loaded: {first_line(exc)}"
                       + (" (the run's init-model/ is gone)" if run.experiment.model.init ==
                          "random" else "")) from None
    pad = vision.text_tokenizer(tokenizer).pad_token_id  # a VLM's processor holds it
    if pad is not None:
        config.pad_token_id = pad
        config.get_text_config().pad_token_id = pad
    return config


def load_model(run: RunModel, tokenizer, dtype: torch.dtype, on: str, merge: bool = False):
    """The model in eval mode on `on` ("cpu" or "cuda"): the full model of the directory,
    or the base with the adapter applied (merged into it when `merge`)."""
    from transformers.utils import logging

    logging.disable_progress_bar()  # loading and writing shards: bars on every use
    auto_class = vision.MODEL_CLASS if run.vision else HEADS[run.head][0]
    trust = run.experiment.model.trust_remote_code
    placement = {"device_map": {"": 0}} if on == "cuda" else {}
    if not run.adapter:
        model = auto_class.from_pretrained(str(run.directory), dtype=dtype,
                                           trust_remote_code=trust, **placement)
        return model.eval()
    from peft import PeftModel

    source, revision = run.base()
    config = _base_config(run, tokenizer)
    try:
        base = auto_class.from_pretrained(source, config=config, revision=revision, dtype=dtype,
                                          trust_remote_code=trust, **placement)
    except OSError as exc:
        raise RunError(f"cannot load the adapter's base {source!r}: {first_line(exc)}") from None
    with warnings.catch_warnings():  # PEFT reads a property transformers deprecates
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing",
                                category=FutureWarning)
        model = PeftModel.from_pretrained(base, str(run.directory))
    if merge:
        model = model.merge_and_unload()
    return model.eval()


def require_lm(run: RunModel, command: str) -> None:
    if run.head != "lm":
        raise RunError(f"{run.run_dir} is a {run.experiment.method} run: its model scores "
                       f"text (a sequence-classification head) and generates nothing; "
                       f"`finetune {command}` needs a causal LM (sft, dpo, grpo or ppo). Load "
                       "it with AutoModelForSequenceClassification (see "
                       "docs/after-training.md)")



"""The frozen teacher of the distillation methods (distill, gkd): distill.teacher loaded
in the reference model's dtype (config/derived/effective.py model_precision, role teacher): a
model directory or hub id, or a finetune run directory whose final/ model or adapter
model/saved.py loads as generate and chat do. Its vocabulary must be the student's:
checked as it loads.

A vision-language student (distill) has a vision-language teacher, loaded as one
(AutoModelForImageTextToText): TRL's DistillationTrainer gives the teacher's forward the
pixel values the student's processor made of the prompt's pictures, so the teacher's
processor must be the student's (same image processing, image token and count); a text
teacher, which cannot see the pictures, is refused (config/rules/vision.teacher_refused,
which validate says for local models)."""

from __future__ import annotations

import json
from pathlib import Path

from finetune.config.rules.vision import teacher_refused
from finetune.errors import ConfigError, first_line
from finetune.config.schema import Experiment
from finetune.methods import Job

WHERE = "distill.teacher"


def _refuse(problem: str | None) -> None:
    if problem:
        raise ConfigError([f"{WHERE}: {problem}"])


def _sees_pictures(source: str, trust: bool) -> bool:
    """A vision-language model directory or hub id (an adapter directory: its base)."""
    from finetune.model.vision import is_vision_source

    adapter = Path(source) / "adapter_config.json"
    if not (Path(source) / "config.json").is_file() and adapter.is_file():
        base = json.loads(adapter.read_text()).get("base_model_name_or_path")
        return bool(base) and is_vision_source(base, None, trust)
    return is_vision_source(source, None, trust)


def _load(experiment: Experiment, dtype, student_sees: bool):
    """(model, its tokenizer, or processor for a vision-language one, or None) of
    distill.teacher."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.model.load import name_only_layers_it_has
    from finetune.model.tokenizer import processor_from
    from finetune.model.vision import MODEL_CLASS

    source = experiment.distill.teacher
    trust = experiment.model.trust_remote_code
    if (Path(source) / "experiment.yaml").is_file():  # a finetune run: its final/
        from finetune.model.saved import load_model, load_tokenizer, locate

        run = locate(source)
        if run.head != "lm":
            raise ConfigError([f"{WHERE}: {source} is a {run.experiment.method} run: its "
                               "model scores text and has no next-token distribution"])
        _refuse(teacher_refused(student_sees, run.vision, source))
        tokenizer = load_tokenizer(run)  # a vision-language run's: its processor
        model = load_model(run, tokenizer, dtype, "cpu")
        name_only_layers_it_has(model)  # as the student's: FSDP wraps it too
        return model, tokenizer
    sees = _sees_pictures(source, trust)
    _refuse(teacher_refused(student_sees, sees, source))
    kind = "vision-language model" if sees else "causal LM"
    try:
        model = (MODEL_CLASS if sees else AutoModelForCausalLM).from_pretrained(
            source, dtype=dtype, trust_remote_code=trust)
    except (OSError, ValueError) as exc:
        raise ConfigError([f"{WHERE}: cannot load {source!r} as a {kind}: "
                           f"{first_line(exc)}"]) from None
    name_only_layers_it_has(model)
    try:
        tokenizer = processor_from(source, None, trust, WHERE) if sees else \
            AutoTokenizer.from_pretrained(source, trust_remote_code=trust)
    except (OSError, ValueError):
        tokenizer = None  # a model without its tokenizer: the vocabulary size still checks
    return model, tokenizer


def _vocabulary_problem(student, student_tokenizer, teacher, teacher_tokenizer) -> str | None:
    """Why the teacher's next-token distribution is not over the student's tokens."""
    from finetune.model.vision import text_tokenizer

    ours = student.config.get_text_config().vocab_size
    theirs = teacher.config.get_text_config().vocab_size
    if ours != theirs:
        return (f"the teacher's vocabulary has {theirs} entries (vocab_size), the student's "
                f"{ours}")
    if teacher_tokenizer is not None:
        mine = text_tokenizer(student_tokenizer).get_vocab()
        other = text_tokenizer(teacher_tokenizer).get_vocab()
        differ = sorted(t for t in mine.keys() | other.keys() if mine.get(t) != other.get(t))
        if differ:
            return (f"the teacher's tokenizer maps {len(differ)} token(s) differently from "
                    f"the student's (first: {differ[0]!r})")
    return None


def _processor_problem(student_processor, teacher_processor) -> str | None:
    """Why the pictures the student's processor prepares are not what the teacher's
    would (its image processing, image token, tokens per picture), or None."""
    from finetune.model.vision import is_processor

    if not is_processor(teacher_processor):
        return None  # none saved with it: the vocabulary still checks
    mine, other = student_processor.to_dict(), teacher_processor.to_dict()
    differ = sorted(k for k in mine.keys() | other.keys() if mine.get(k) != other.get(k))
    if differ:
        return (f"the teacher's processor differs from the student's in {', '.join(differ)}; "
                "the teacher sees the pictures as the student's processor prepares them")
    return None


def teacher_model(job: Job):
    from finetune.model.vision import is_processor

    spec = job.experiment
    student_sees = is_processor(job.tokenizer)
    teacher, tokenizer = _load(spec, job.hardware.model_dtype(spec, "teacher"), student_sees)
    problem = _vocabulary_problem(job.model, job.tokenizer, teacher, tokenizer)
    if problem:
        raise ConfigError([f"{WHERE}: {problem}; distillation compares the two next-token "
                           "distributions, so the teacher must share the student's "
                           "tokenizer (same family of models)"])
    if student_sees:
        _refuse(_processor_problem(job.tokenizer, tokenizer))
    teacher.requires_grad_(False)
    return teacher.eval()
